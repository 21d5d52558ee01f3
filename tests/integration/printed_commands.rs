//! The commands and errors the relay prints, copied as an operator would: every command carries the
//! `--config` it was run with and names the `OUTBOX_RELAY_*` variables that set keys (47#11);
//! nothing read from stream metadata reaches the terminal unescaped, and the backfill marker's
//! `--where` is never offered as a command to run (48#7); errors say how to fix (47#12: a missing
//! SELECT grant for `backfill`, a `/wait` for an LSN past the server's WAL end); a warning an
//! operator accepts can be acknowledged by its name (47#13); and the commands a parked key's
//! problem offers (`parked`, `requeue --key`), run as printed, act on the same relay (issue 50).

use std::time::Duration;

use async_nats::jetstream;
use tokio_postgres::Client;

use crate::hostile::wait_for_active_slot;
use crate::message_default::{helper_warning, sql_06};
use crate::ops::{free_addr, try_get, wait_for_status};
use crate::status_truth::servers;
use crate::support::{
    Finished, NatsServer, PgServer, RelayProcess, TestDb, default_outbox_sql, relay_config,
    relay_env, run_command, unique,
};
use outbox_relay::config::Config;

const LIMIT: Duration = Duration::from_secs(90);

/// `config` as a TOML file in `dir`: the names, the servers, no listener.
fn config_file(dir: &tempfile::TempDir, config: &Config) -> String {
    let path = dir.path().join("relay.toml");
    std::fs::write(
        &path,
        format!(
            "[postgres]\nurl = {:?}\nslot = {:?}\npublication = {:?}\n\
             [nats]\nurl = {:?}\nstream = {:?}\n[http]\nlisten = \"\"\n",
            config.postgres.url,
            config.postgres.slot,
            config.postgres.publication,
            config.nats.url,
            config.nats.stream
        ),
    )
    .unwrap();
    path.display().to_string()
}

/// The binary with `--config file` and no `OUTBOX_RELAY_*` variable.
fn with_file(args: &[&str], file: &str) -> Finished {
    let mut all = vec!["--config", file];
    all.extend_from_slice(args);
    run_command(&all, &[], LIMIT)
}

/// 47#11: with the slot missing, `status` said `run outbox-relay setup`, which would set up the
/// default slot and stream, not this configuration's. Now the command carries `--config`; run from
/// variables, it names them.
#[tokio::test]
async fn printed_commands_carry_the_config_and_name_the_variables() {
    let (_db, _nats, config) = servers().await;
    let dir = tempfile::tempdir().unwrap();
    let file = config_file(&dir, &config);
    let f = with_file(&["status"], &file);
    assert_eq!(f.status.code(), Some(1), "{}", f.stdout);
    let wanted = format!("run `outbox-relay --config {file} setup`");
    assert!(
        f.stdout.lines().any(
            |l| l.starts_with(&format!("problem: slot {}", config.postgres.slot))
                && l.contains(&wanted)
        ),
        "{wanted}\n{}",
        f.stdout
    );
    let f = run_command(&["status"], &relay_env(&config), LIMIT);
    let line = f
        .stdout
        .lines()
        .find(|l| l.starts_with(&format!("problem: slot {}", config.postgres.slot)))
        .unwrap_or_else(|| panic!("{}", f.stdout));
    let (_, after) = line
        .split_once("run `outbox-relay setup` (with ")
        .unwrap_or_else(|| panic!("{line}"));
    let (vars, _) = after.split_once(" set as for this command)").unwrap();
    for var in [
        "OUTBOX_RELAY_POSTGRES_URL",
        "OUTBOX_RELAY_POSTGRES_SLOT",
        "OUTBOX_RELAY_NATS_STREAM",
    ] {
        assert!(vars.contains(var), "{var}: {line}");
    }
    assert!(
        !line.contains(&config.postgres.url),
        "names, never values: {line}"
    );
}

/// 48#7 and 47#11: a backfill marker planted in the stream's metadata, with a terminal escape and a
/// line break in its host and a predicate that closes its parenthesis. `status`, `setup` and `run`
/// print it escaped on their own lines, never offer its `--where` as a command, and offer the
/// backfill with this `--config`.
#[tokio::test]
async fn a_planted_backfill_marker_is_printed_escaped_and_its_sql_is_never_offered() {
    let (db, nats, config) = servers().await;
    let dir = tempfile::tempdir().unwrap();
    let file = config_file(&dir, &config);
    let setup = with_file(&["setup"], &file);
    assert_eq!(setup.status.code(), Some(0), "{}", setup.stderr);
    let js = nats.jetstream().await;
    let mut stream = js.get_stream(&config.nats.stream).await.unwrap();
    let mut cfg: jetstream::stream::Config = stream.info().await.unwrap().config.clone();
    let planted = serde_json::json!({
        "slot": config.postgres.slot,
        "pid": 1,
        "host": "h\u{1b}[2K\nrelay: streaming (pid 1)",
        "started": "now",
        "where": "true) OR (1=1",
    });
    cfg.metadata
        .insert("outbox-relay.backfill".into(), planted.to_string());
    js.update_stream(cfg).await.unwrap();
    // A stopped backfill drops its slot and leaves its marker: setup refuses then, so status must
    // not offer it for the missing slot.
    db.client()
        .await
        .execute(
            "SELECT pg_drop_replication_slot($1)",
            &[&config.postgres.slot],
        )
        .await
        .unwrap();

    let command = format!("`outbox-relay --config {file} backfill`");
    for (what, out) in [
        ("status", with_file(&["status"], &file).stdout),
        ("setup", with_file(&["setup"], &file).stderr),
        ("run", with_file(&["run"], &file).stderr),
    ] {
        assert!(
            !out.contains('\u{1b}'),
            "{what}: an escape reached the terminal: {out:?}"
        );
        assert!(
            !out.lines().any(|l| l.starts_with("relay: streaming")),
            "{what}: a line of the marker's own: {out}"
        );
        assert!(
            !out.contains("backfill --where 'true) OR (1=1"),
            "{what}: the marker's SQL offered as a command: {out}"
        );
        assert!(out.contains(&command), "{what}: {command}\n{out}");
        assert!(
            out.contains(r"h\u{1b}[2K\u{a}relay: streaming (pid 1)"),
            "{what}: the host, escaped: {out}"
        );
        assert!(
            out.contains(r#"records --where "true) OR (1=1""#),
            "{what}: the recorded predicate shown as data: {out}"
        );
    }
    let status = with_file(&["status"], &file).stdout;
    assert!(
        !status.contains(&format!("run `outbox-relay --config {file} setup`")),
        "setup refuses under the marker, so status does not offer it: {status}"
    );
}

/// 47#12: `backfill` as a role without SELECT on the polled table blamed `--where / --order-by`.
/// Now it names the grant (and sql/03, which makes it).
#[tokio::test]
async fn backfill_without_select_on_the_table_names_the_grant() {
    let (db, _nats, config) = servers().await;
    let server = PgServer::shared();
    let role = unique("nosel");
    let password = "No-Select-1";
    db.psql(&format!(
        "CREATE ROLE {role} LOGIN REPLICATION PASSWORD '{password}'; \
         CREATE PUBLICATION {} FOR TABLE public.outbox WITH (publish = 'insert');",
        config.postgres.publication
    ));
    let mut env = relay_env(&config);
    env.retain(|(k, _)| k != "OUTBOX_RELAY_POSTGRES_URL");
    env.push((
        "OUTBOX_RELAY_POSTGRES_URL".into(),
        format!(
            "postgres://{role}:{password}@{}:{}/{}?sslmode=disable",
            server.host(),
            server.port(),
            db.name()
        ),
    ));
    let f = run_command(&["backfill"], &env, LIMIT);
    assert_eq!(f.status.code(), Some(1), "{}", f.stderr);
    let last = f.stderr.trim().lines().last().unwrap_or("");
    assert!(
        last.contains(&format!("GRANT SELECT ON public.outbox TO {role}"))
            && last.contains("sql/03_relay_role.sql"),
        "{last}"
    );
    assert!(!last.contains("--where / --order-by"), "{last}");
}

/// 47#12: `/wait` for an LSN past the server's WAL end answered only `timeout`. Now, once the
/// relay's slot sampler has read the WAL position after the wait began, the answer says the LSN is
/// past it, with the WAL end.
#[tokio::test]
async fn a_wait_past_the_servers_wal_end_says_so() {
    let (db, _nats, mut config) = servers().await;
    let addr = free_addr();
    config.http.listen = addr.clone();
    let client: Client = db.client().await;
    let mut p = RelayProcess::run(&config);
    wait_for_active_slot(&client, &config.postgres.slot).await;
    wait_for_status(&addr, "/readyz", 200, 30).await;
    // The sampler reads the WAL every 5 s; 9 s leaves room for one reading after the wait began
    // (and stays below the 10 s this GET waits).
    let (code, body) = try_get(&addr, "/wait?lsn=FFFF/0&timeout_ms=9000")
        .await
        .expect("an answer");
    p.signal("TERM");
    let _ = p.wait(LIMIT);
    assert_eq!(code, 504, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"], "timeout", "{v}");
    assert!(v["wal_end"].as_str().is_some(), "{v}");
    assert!(
        v["reason"]
            .as_str()
            .is_some_and(|r| r.contains("past the end of the server's WAL")),
        "{v}"
    );
}

/// 47#13: the sql/06 prefix warning came on every `setup`, `status` and `run` of a relay that
/// deliberately does not relay that prefix. Now each warning has a stable name, and
/// `warnings.acknowledged` leaves the named ones out (saying which); the others stay.
#[tokio::test]
async fn an_acknowledged_warning_is_left_out_by_name() {
    let db = TestDb::create(PgServer::shared()).await;
    db.psql(&default_outbox_sql());
    db.psql(&sql_06(&[]));
    let nats = NatsServer::start();
    let config = relay_config(&db, &nats);
    let mut off = relay_env(&config);
    off.push(("OUTBOX_RELAY_OUTBOX_MESSAGE_PREFIX".into(), String::new()));
    let setup = run_command(&["setup"], &off, LIMIT);
    assert!(setup.status.success(), "{}", setup.stderr);
    assert!(helper_warning(&setup.stdout).is_some(), "{}", setup.stdout);
    let mut acked = off.clone();
    acked.push((
        "OUTBOX_RELAY_WARNINGS_ACKNOWLEDGED".into(),
        "unrelayed-message-helper".into(),
    ));
    for args in [&["setup"][..], &["status"]] {
        let f = run_command(args, &acked, LIMIT);
        assert_eq!(helper_warning(&f.stdout), None, "{args:?}: {}", f.stdout);
        assert!(
            f.stdout.contains(
                "acknowledged warnings (warnings.acknowledged): unrelayed-message-helper"
            ),
            "{args:?}: {}",
            f.stdout
        );
        assert!(
            f.stdout.contains("warning[wal-keep-unbounded]"),
            "{args:?}: the others stay: {}",
            f.stdout
        );
    }
    let client = db.client().await;
    let mut p = RelayProcess::spawn(&["run"], &acked);
    wait_for_active_slot(&client, &config.postgres.slot).await;
    p.signal("TERM");
    let _ = p.wait(LIMIT);
    assert!(
        !p.stderr()
            .contains("sql/06_outbox_message.sql) writes events"),
        "{}",
        p.stderr()
    );
    let typo = [(
        "OUTBOX_RELAY_WARNINGS_ACKNOWLEDGED".to_owned(),
        "unrelayed-helper".to_owned(),
    )];
    let f = run_command(&["status"], &typo, LIMIT);
    assert_eq!(f.status.code(), Some(1));
    assert!(
        f.stderr.contains("warnings.acknowledged") && f.stderr.contains("unrelayed-helper"),
        "{}",
        f.stderr
    );
}

/// The commands a parked key's problem offers, run as printed: `status --config FILE` used to offer
/// `outbox-relay parked` and `outbox-relay requeue --key TYPE/ID` without the file, which read the
/// default stream and call the default database. Each command `status`, `verify`, `parked` and
/// `requeue` print carries the file; run with it and nothing else, they act on this relay's key.
#[tokio::test]
async fn the_commands_a_parked_key_offers_carry_the_config_and_act_on_its_relay() {
    use crate::parking::{STRICT, insert, stored, world};
    let mut s = world(STRICT).await;
    s.install_operator_role(&[]);
    let (nats, config) = (&s.nats, &s.config);
    let relay = s.relay().await;
    insert(
        &s.client,
        "a-4711",
        "4711",
        "ClaimApproved",
        r#"{"claim": "x"}"#,
    )
    .await;
    stored(nats, config, 1).await;
    relay.stop().await.expect("clean stop");
    let dir = tempfile::tempdir().unwrap();
    let file = park_file(&dir, config, "");

    let status = with_file(&["status"], &file);
    let line = status
        .stdout
        .lines()
        .find(|l| l.starts_with("problem: ") && l.contains("parked key"))
        .unwrap_or_else(|| panic!("{}", status.stdout));
    let offered = commands_in(line);
    assert_eq!(offered.len(), 2, "{line}");
    for c in &offered {
        assert!(
            c.starts_with(&format!("outbox-relay --config {file} ")),
            "printed without the file: {c}"
        );
    }
    // `verify` names the same two in what to do about the parked events.
    let verify = with_file(&["verify"], &file);
    let what = verify
        .stdout
        .lines()
        .find(|l| l.contains("what to do:") && l.contains("requeue --key"))
        .unwrap_or_else(|| panic!("{}{}", verify.stdout, verify.stderr));
    let mut named = commands_in(what);
    named.reverse();
    assert_eq!(named, offered, "{what}");
    // As printed, with no variable: this relay's stream.
    let parked = run_printed(&offered[0], &[]);
    assert_eq!(
        parked.status.code(),
        Some(1),
        "{}{}",
        parked.stdout,
        parked.stderr
    );
    assert!(parked.stdout.contains("Claim/4711"), "{}", parked.stdout);
    let summary = parked.stdout.lines().last().unwrap_or("");
    assert_eq!(commands_in(summary), [offered[1].clone()], "{summary}");
    // This relay's database: the key is parked there, and the request is committed.
    let key = offered[1].replace("TYPE/ID", "Claim/4711");
    let sent = run_printed(&key, &["--no-wait"]);
    assert_eq!(sent.status.code(), Some(0), "{}", sent.stderr);
    assert!(
        sent.stdout.starts_with("requeue Claim/4711: request "),
        "{}",
        sent.stdout
    );
    // A key that is not parked: the command it offers carries the file too.
    let not = run_printed(&offered[1].replace("TYPE/ID", "Claim/4712"), &[]);
    assert_eq!(not.status.code(), Some(1), "{}", not.stdout);
    let listed = commands_in(&not.stderr);
    assert_eq!(
        listed,
        [format!("outbox-relay --config {file} parked")],
        "{}",
        not.stderr
    );
    assert_eq!(run_printed(&listed[0], &[]).status.code(), Some(1));
}

/// The stops past `outbox.max_parked_keys` (a new key while the set is full; a start that finds
/// more parked keys in the stream than the bound) told the operator to run `outbox-relay parked`
/// without the `--config` the relay ran with: copied, it read the default stream. They print the
/// command as the relay was started; run as printed, it lists this relay's parked keys.
#[tokio::test]
async fn the_stops_past_max_parked_keys_print_a_parked_command_that_lists_this_relays_keys() {
    use crate::parking::{STRICT, insert, stored, world};
    let s = world(STRICT).await;
    let (nats, config) = (&s.nats, &s.config);
    let dir = tempfile::tempdir().unwrap();
    let file = park_file(&dir, config, "max_parked_keys = 1\n");
    let wanted = [format!("outbox-relay --config {file} parked")];

    // Full: claim 4711 parked, claim 4712 would be the second key.
    let mut relay = RelayProcess::spawn(&["--config", &file, "run"], &[]);
    s.wait_slot_made().await;
    let poison = r#"{"claim": "x"}"#;
    insert(&s.client, "a-4711", "4711", "ClaimApproved", poison).await;
    stored(nats, config, 1).await;
    insert(&s.client, "a-4712", "4712", "ClaimApproved", poison).await;
    let stop = stop_line(&mut relay, "would park key Claim/4712");
    assert_eq!(commands_in(&stop), wanted, "{stop}");
    let listed = run_printed(&wanted[0], &[]);
    assert_eq!(
        listed.status.code(),
        Some(1),
        "{}{}",
        listed.stdout,
        listed.stderr
    );
    assert!(listed.stdout.contains("Claim/4711"), "{}", listed.stdout);

    // Raised to 2, claim 4712 parks; lowered to 1 again, the start finds two parked keys.
    park_file(&dir, config, "max_parked_keys = 2\n");
    let mut relay = RelayProcess::spawn(&["--config", &file, "run"], &[]);
    stored(nats, config, 2).await;
    relay.signal("TERM");
    relay.wait(LIMIT).expect("a clean stop");
    park_file(&dir, config, "max_parked_keys = 1\n");
    let mut relay = RelayProcess::spawn(&["--config", &file, "run"], &[]);
    let stop = stop_line(&mut relay, "holds more than 1 parked keys");
    assert_eq!(commands_in(&stop), wanted, "{stop}");
    let listed = run_printed(&wanted[0], &[]);
    assert_eq!(listed.status.code(), Some(1), "{}", listed.stdout);
    // Listed up to the same bound, and the rest counted: this relay's stream, not the default's.
    assert!(
        (listed.stdout.contains("Claim/4711") || listed.stdout.contains("Claim/4712"))
            && listed.stdout.contains("more past outbox.max_parked_keys"),
        "{}",
        listed.stdout
    );
}

/// `config`'s servers and names in `dir`'s relay.toml, in park mode with `config`'s schemas and
/// `outbox` (more `[outbox]` lines); its path.
fn park_file(dir: &tempfile::TempDir, config: &Config, outbox: &str) -> String {
    let file = dir.path().join("relay.toml");
    std::fs::write(
        &file,
        format!(
            "[postgres]\nurl = {:?}\nslot = {:?}\npublication = {:?}\n\
             [nats]\nurl = {:?}\nstream = {:?}\n[http]\nlisten = \"\"\n\
             [outbox]\non_invalid = \"park\"\nschemas = {:?}\n{outbox}",
            config.postgres.url,
            config.postgres.slot,
            config.postgres.publication,
            config.nats.url,
            config.nats.stream,
            config.outbox.schemas,
        ),
    )
    .unwrap();
    file.display().to_string()
}

/// Waits for `relay` to stop (a failure), and returns its stderr line holding `words`.
fn stop_line(relay: &mut RelayProcess, words: &str) -> String {
    let status = relay.wait(LIMIT).expect("the relay stops");
    let stderr = relay.stderr();
    assert!(!status.success(), "{stderr}");
    stderr
        .lines()
        .find(|l| l.contains(words))
        .unwrap_or_else(|| panic!("no line with {words:?}: {stderr}"))
        .to_owned()
}

/// The backquoted commands in `line`.
fn commands_in(line: &str) -> Vec<String> {
    line.split('`')
        .skip(1)
        .step_by(2)
        .filter(|c| c.starts_with("outbox-relay "))
        .map(str::to_owned)
        .collect()
}

/// `command` as printed (`outbox-relay` and plain words, as the test's paths are), plus `extra`.
fn run_printed(command: &str, extra: &[&str]) -> Finished {
    let mut args: Vec<&str> = command.split_whitespace().skip(1).collect();
    args.extend_from_slice(extra);
    run_command(&args, &[], LIMIT)
}
