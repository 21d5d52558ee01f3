//! docs/migrating.md, run as the page says: its poller's table, its `psql` commands (sql/03 for the
//! relay's role, sql/02 for the publication, with the page's `-v` variables), its `relay.toml`, and
//! its `backfill` as the relay's role. The backfill publishes the rows the poller had not sent, so
//! the role the page makes may read the polled table.
//!
//! What the test changes, because the Postgres server is shared: the role's name (`-v relay_role=`
//! added) and the slot's; the servers' addresses.

use std::time::Duration;

use crate::support::{NatsServer, PgServer, TestDb, read_all, run_command, unique};

const PAGE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/migrating.md");

/// The fenced blocks of `lang` on the page, in order, each line trimmed (a block inside a list item
/// is indented).
fn blocks(page: &str, lang: &str) -> Vec<String> {
    let fence = format!("```{lang}\n");
    page.split(fence.as_str())
        .skip(1)
        .filter_map(|rest| rest.split_once("```").map(|(block, _)| block))
        .map(|b| b.lines().map(str::trim).collect::<Vec<_>>().join("\n"))
        .collect()
}

/// The first command of the page's shell blocks that starts with `start` and contains `with`
/// (lines continued with `\` joined), split into words as a shell would (double quotes only).
fn command(page: &str, start: &str, with: &str) -> Vec<String> {
    let line = blocks(page, "sh")
        .iter()
        .map(|b| b.replace("\\\n", " "))
        .flat_map(|b| b.lines().map(str::to_owned).collect::<Vec<_>>())
        .find(|l| l.starts_with(start) && l.contains(with))
        .unwrap_or_else(|| panic!("docs/migrating.md has no `{start} … {with}`"));
    let mut words = Vec::new();
    for (i, part) in line.split('"').enumerate() {
        if i % 2 == 1 {
            words.push(part.to_owned());
        } else {
            words.extend(part.split_whitespace().map(str::to_owned));
        }
    }
    words
}

/// The page's `psql … -f sql/<file>` command for `file`: its `-v name=value` pairs.
fn psql_variables(page: &str, file: &str) -> Vec<(String, String)> {
    command(page, "psql ", &format!("-f sql/{file}"))
        .windows(2)
        .filter(|w| w[0] == "-v")
        .filter_map(|w| w[1].split_once('='))
        .filter(|(k, _)| *k != "ON_ERROR_STOP")
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// `sql/<file>` as psql runs it with `-v` variables: each a `\set` before the file.
fn sql_with(file: &str, variables: &[(String, String)]) -> String {
    let path = format!("{}/sql/{file}", env!("CARGO_MANIFEST_DIR"));
    let sql = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    let sets: String = variables
        .iter()
        .map(|(k, v)| format!("\\set {k} {v}\n"))
        .collect();
    sets + &sql
}

#[tokio::test]
async fn the_pages_steps_let_the_relays_role_backfill_the_polled_table() {
    let page = std::fs::read_to_string(PAGE).expect("read docs/migrating.md");
    let sql = blocks(&page, "sql");
    let table = sql
        .iter()
        .find(|b| b.starts_with("create table outbox_event"))
        .expect("the page shows the poller's table");
    let toml = blocks(&page, "toml");
    let toml = toml.first().expect("the page's relay.toml");

    let server = PgServer::shared();
    let db = TestDb::create(server).await;
    db.psql(table);
    db.psql(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
         created_at, published_at) VALUES \
         (gen_random_uuid(), 'Order', '1', 'OrderPlaced', '{}', now(), now()), \
         (gen_random_uuid(), 'Order', '2', 'OrderPlaced', '{}', now() - interval '2 min', NULL), \
         (gen_random_uuid(), 'Order', '3', 'OrderPlaced', '{}', now() - interval '1 min', NULL)",
    );

    // Step 1: the relay's role, with the page's variables (and a name of this test's own).
    let role = unique("migrating_relay");
    let mut role_vars = psql_variables(&page, "03_relay_role.sql");
    role_vars.push(("relay_role".into(), role.clone()));
    db.psql(&sql_with("03_relay_role.sql", &role_vars));
    db.psql(&format!("ALTER ROLE {role} PASSWORD 'migrating-pw'"));
    // Step 2: the publication, as the table's owner.
    let publication_vars = psql_variables(&page, "02_publication.sql");
    db.psql(&sql_with("02_publication.sql", &publication_vars));
    let publication = publication_vars
        .iter()
        .find(|(k, _)| k == "publication")
        .map(|(_, v)| v.clone())
        .expect("the page names the publication");

    // The switch, step 2: the page's backfill, as the relay's role, with the page's relay.toml.
    let nats = NatsServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("relay.toml");
    std::fs::write(&config, toml).expect("write relay.toml");
    let env = vec![
        (
            "OUTBOX_RELAY_POSTGRES_URL".to_owned(),
            server.url_as(&role, "migrating-pw", db.name()),
        ),
        ("OUTBOX_RELAY_POSTGRES_SLOT".to_owned(), db.slot_name()),
        ("OUTBOX_RELAY_POSTGRES_PUBLICATION".to_owned(), publication),
        ("OUTBOX_RELAY_NATS_URL".to_owned(), nats.url()),
        ("OUTBOX_RELAY_HTTP_LISTEN".to_owned(), String::new()),
    ];
    // The page's command, its relay.toml being the file written above.
    let mut args = command(&page, "outbox-relay backfill", "--where");
    assert_eq!(args.remove(0), "outbox-relay");
    for arg in args.iter_mut().filter(|a| *a == "relay.toml") {
        *arg = config.display().to_string();
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let backfill = run_command(&args, &env, Duration::from_secs(120));
    assert!(
        backfill.status.success(),
        "the page's backfill as the role it makes:\n{}\n{}",
        backfill.stdout,
        backfill.stderr
    );
    assert!(
        backfill.stdout.contains(": 2 stored,"),
        "the two rows the poller had not sent: {}",
        backfill.stdout
    );
    let stream = "OUTBOX_ORDERS";
    let stored = read_all(&nats.jetstream().await, stream).await;
    let ids: Vec<&str> = stored
        .iter()
        .map(|m| m.header("Outbox-Aggregate-Id"))
        .collect();
    assert_eq!(ids, ["2", "3"], "{stored:?}");

    db.psql(&format!(
        "REASSIGN OWNED BY {role} TO postgres; DROP OWNED BY {role};"
    ));
    drop(db);
    server.psql("postgres", &format!("DROP ROLE IF EXISTS {role}"));
}
