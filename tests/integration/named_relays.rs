//! The top-level `name` key. Two relays on one Postgres server and one NATS differ by `name` alone
//! ("orders" and "claims", every other key at its default but the servers' URLs and the HTTP
//! listener, which is off because the machine is shared): both set up, each streams its own
//! database's events to its own stream and subjects, nothing collides. And `setup` refuses, one
//! line naming the key, a configuration that keeps one of another relay's names: its slot, its
//! stream or its subjects; having refused, it created nothing.

use std::time::Duration;

use tokio_postgres::Client;

use crate::support::{
    NatsServer, PgServer, RelayProcess, TEXT_ID_OUTBOX_SQL, TestDb, read_all, run_command,
    slot_exists, wait_for,
};

const LIMIT: Duration = Duration::from_secs(60);

/// The binary's whole environment for a relay of `db` named `name`.
fn named_env(db: &TestDb, nats: &NatsServer, name: &str) -> Vec<(String, String)> {
    vec![
        ("OUTBOX_RELAY_NAME".into(), name.into()),
        ("OUTBOX_RELAY_POSTGRES_URL".into(), db.url()),
        ("OUTBOX_RELAY_NATS_URL".into(), nats.url()),
        ("OUTBOX_RELAY_HTTP_LISTEN".into(), String::new()),
    ]
}

fn with(mut env: Vec<(String, String)>, key: &str, value: &str) -> Vec<(String, String)> {
    env.push((key.into(), value.into()));
    env
}

async fn db_with_outbox() -> TestDb {
    let db = TestDb::create(PgServer::shared()).await;
    db.psql(TEXT_ID_OUTBOX_SQL);
    db
}

async fn slot_active(client: &Client, slot: &str) -> bool {
    client
        .query_one(
            "SELECT coalesce((SELECT active FROM pg_replication_slots WHERE slot_name = $1), false)",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0)
}

pub(crate) async fn write(client: &Client, id: &str, aggregate_type: &str) {
    client
        .execute(
            "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1, $2, '1', 'Happened', '{}')",
            &[&id, &aggregate_type],
        )
        .await
        .unwrap();
}

/// Two relays, `name = "orders"` and `name = "claims"`, on two databases of one Postgres and one NATS:
/// setup derives each one's slot, stream and subjects from the name, and each stream holds exactly its
/// own database's events, under its own subjects. With today's names for both, the second setup found
/// the first relay's slot `outbox_relay` (slot names are per server) and refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_differing_only_by_name_stream_their_own_events() {
    let (orders_db, claims_db) = (db_with_outbox().await, db_with_outbox().await);
    let nats = NatsServer::start();
    let relays = [
        ("orders", &orders_db, "Order", "OUTBOX_ORDERS"),
        ("claims", &claims_db, "Claim", "OUTBOX_CLAIMS"),
    ];
    for (name, db, _, stream) in relays {
        let setup = run_command(&["setup"], &named_env(db, &nats, name), LIMIT);
        assert!(setup.status.success(), "setup {name}: {}", setup.stderr);
        for line in [
            format!("slot outbox_relay_{name}: created"),
            format!(
                "stream {stream}: created (file storage, subjects {name}.*, {name}_dead_letter"
            ),
            format!("publication outbox_relay_{name}: created"),
        ] {
            assert!(
                setup.stdout.contains(&line),
                "{name}: {line}\n{}",
                setup.stdout
            );
        }
    }
    let mut running = Vec::new();
    for (name, db, _, _) in relays {
        let p = RelayProcess::spawn(&["run"], &named_env(db, &nats, name));
        let client = db.client().await;
        let slot = format!("outbox_relay_{name}");
        wait_for(&format!("relay {name} streaming"), LIMIT, || async {
            slot_active(&client, &slot).await
        })
        .await;
        running.push((p, client));
    }
    for ((name, _, aggregate, _), (_, client)) in relays.iter().zip(&running) {
        for i in 0..3 {
            write(client, &format!("{name}-{i}"), aggregate).await;
        }
    }
    let js = nats.jetstream().await;
    for (name, _, aggregate, stream) in relays {
        let mut stored = Vec::new();
        for _ in 0..150 {
            stored = read_all(&js, stream).await;
            if stored.len() >= 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Anything wrongly routed here would arrive with the others.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let stored_again = read_all(&js, stream).await;
        let seen: Vec<(String, String)> = stored_again
            .iter()
            .map(|m| (m.subject.clone(), m.header("Nats-Msg-Id").to_owned()))
            .collect();
        let expected: Vec<(String, String)> = (0..3)
            .map(|i| (format!("{name}.{aggregate}"), format!("{name}-{i}")))
            .collect();
        assert_eq!(seen, expected, "stream {stream}");
        assert_eq!(stored.len(), 3, "stream {stream}");
    }
    for (mut p, _) in running {
        p.signal("TERM");
        let code = p.wait(LIMIT).and_then(|s| s.code());
        assert_eq!(code, Some(0), "{}", p.stderr());
    }
}

/// `setup` refuses a configuration that keeps one of a running relay's names, with one line naming
/// the key, and creates nothing: the slot of relay "sales" (`postgres.slot` set explicitly), its
/// stream (`nats.stream`), or subjects its stream holds (`nats.subject`).
#[tokio::test]
async fn setup_refuses_another_relays_slot_stream_or_subjects() {
    let (sales_db, support_db) = (db_with_outbox().await, db_with_outbox().await);
    let nats = NatsServer::start();
    let sales = named_env(&sales_db, &nats, "sales");
    let setup = run_command(&["setup"], &sales, LIMIT);
    assert!(setup.status.success(), "setup sales: {}", setup.stderr);
    let support = named_env(&support_db, &nats, "support");
    let cases = [
        (
            "the slot",
            // The sales database, today's stream and subjects, but the sales relay's slot.
            with(
                named_env(&sales_db, &nats, ""),
                "OUTBOX_RELAY_POSTGRES_SLOT",
                "outbox_relay_sales",
            ),
            vec![
                "replication slot outbox_relay_sales: is another relay's",
                "stream OUTBOX_SALES's metadata outbox-relay.slot names it",
                "with name (or set postgres.slot)",
            ],
        ),
        (
            "the stream",
            with(support.clone(), "OUTBOX_RELAY_NATS_STREAM", "OUTBOX_SALES"),
            vec![
                "JetStream stream OUTBOX_SALES: belongs to another relay",
                "names slot outbox_relay_sales, not postgres.slot outbox_relay_support",
                "with name (or set nats.stream)",
            ],
        ),
        (
            "the subjects",
            with(
                support.clone(),
                "OUTBOX_RELAY_NATS_SUBJECT",
                "sales.{event_type}",
            ),
            vec![
                "JetStream stream OUTBOX_SUPPORT: cannot be created: nats.subject sales.* overlaps subject sales.* of stream OUTBOX_SALES",
                "with name (or set nats.subject)",
            ],
        ),
    ];
    for (what, env, wanted) in cases {
        let setup = run_command(&["setup"], &env, LIMIT);
        assert_eq!(setup.status.code(), Some(1), "{what}: {}", setup.stdout);
        let errors: Vec<&str> = setup
            .stderr
            .lines()
            .filter(|l| l.starts_with("outbox-relay: "))
            .collect();
        assert_eq!(errors.len(), 1, "{what}: one line\n{}", setup.stderr);
        for w in wanted {
            assert!(errors[0].contains(w), "{what}: {w:?} in\n{}", errors[0]);
        }
    }
    // Nothing was created by the refused runs.
    let js = nats.jetstream().await;
    let mut names = Vec::new();
    let mut list = js.stream_names();
    use futures_util::StreamExt;
    while let Some(n) = list.next().await {
        names.push(n.unwrap());
    }
    assert_eq!(names, ["OUTBOX_SALES"], "streams");
    let client = support_db.client().await;
    assert!(!slot_exists(&client, "outbox_relay_support").await);
    assert!(!slot_exists(&client, "outbox_relay").await);
    let s = run_command(&["setup"], &support, LIMIT);
    assert!(
        s.status.success(),
        "the support relay with its own names: {}",
        s.stderr
    );
}

/// The streams NATS holds now, by name.
async fn stream_names(nats: &NatsServer) -> Vec<String> {
    use futures_util::StreamExt;
    let js = nats.jetstream().await;
    let mut names = Vec::new();
    let mut list = js.stream_names();
    while let Some(n) = list.next().await {
        names.push(n.unwrap());
    }
    names.sort();
    names
}

async fn publication_exists(client: &Client, name: &str) -> bool {
    client
        .query_opt("SELECT 1 FROM pg_publication WHERE pubname = $1", &[&name])
        .await
        .unwrap()
        .is_some()
}

/// 47#9: README.md said a second relay differs from the first by `name` alone; with only the name
/// changed, `setup` created a second publication of the same table and both relays published every
/// row. Now `setup` and `run` refuse, one line naming the first relay's slot and the key to set
/// (`outbox.table`), and create nothing.
#[tokio::test]
async fn a_second_relay_on_the_same_table_is_refused_naming_the_first_relays_slot() {
    let db = db_with_outbox().await;
    let nats = NatsServer::start();
    let first = named_env(&db, &nats, "ledger");
    let setup = run_command(&["setup"], &first, LIMIT);
    assert!(setup.status.success(), "setup ledger: {}", setup.stderr);
    let second = named_env(&db, &nats, "billing");
    for args in [&["setup"][..], &["run"]] {
        let f = run_command(args, &second, LIMIT);
        assert_eq!(f.status.code(), Some(1), "{args:?}: {}", f.stdout);
        let errors: Vec<&str> = f
            .stderr
            .lines()
            .filter(|l| l.starts_with("outbox-relay: "))
            .collect();
        assert_eq!(errors.len(), 1, "{args:?}: one line\n{}", f.stderr);
        for part in [
            "outbox.table \"public.outbox\" is already relayed by the relay of slot outbox_relay_ledger",
            "give this relay its own with outbox.table",
        ] {
            assert!(
                errors[0].contains(part),
                "{args:?}: {part:?} in\n{}",
                errors[0]
            );
        }
    }
    let client = db.client().await;
    assert!(!slot_exists(&client, "outbox_relay_billing").await);
    assert!(!publication_exists(&client, "outbox_relay_billing").await);
    assert_eq!(stream_names(&nats).await, ["OUTBOX_LEDGER"]);
}

/// 47#9, the message prefix: every slot receives every logical message, so a second relay with a
/// table of its own but the default `outbox.message_prefix` would publish every `outbox_message()`
/// event twice. Its `setup` is refused, naming the first relay's slot and `outbox.message_prefix`;
/// with a prefix of its own it goes ahead.
#[tokio::test]
async fn a_second_relay_on_the_same_message_prefix_is_refused() {
    let db = db_with_outbox().await;
    db.psql(
        &TEXT_ID_OUTBOX_SQL
            .replace("public.outbox", "berry.outbox")
            .replace(
                "CREATE TABLE",
                "CREATE SCHEMA IF NOT EXISTS berry; CREATE TABLE",
            ),
    );
    let nats = NatsServer::start();
    let apple = named_env(&db, &nats, "apple");
    let setup = run_command(&["setup"], &apple, LIMIT);
    assert!(setup.status.success(), "setup apple: {}", setup.stderr);
    let berry = with(
        named_env(&db, &nats, "berry"),
        "OUTBOX_RELAY_OUTBOX_TABLE",
        "berry.outbox",
    );
    let f = run_command(&["setup"], &berry, LIMIT);
    assert_eq!(f.status.code(), Some(1), "{}", f.stdout);
    assert!(
        f.stderr.contains(
            "outbox.message_prefix \"outbox\" is already relayed by the relay of slot outbox_relay_apple"
        ),
        "{}",
        f.stderr
    );
    let own = with(berry, "OUTBOX_RELAY_OUTBOX_MESSAGE_PREFIX", "berry");
    let f = run_command(&["setup"], &own, LIMIT);
    assert!(f.status.success(), "a prefix of its own: {}", f.stderr);
}

/// 47#10: the quickstart says running `setup` first lets you see and approve what it does, but it
/// created at once. `setup --check` makes every check and prints what it would create, exit 0, and
/// creates nothing; after `setup`, it has nothing to do; a configuration `setup` refuses is refused
/// (exit 1) with the same line.
#[tokio::test]
async fn setup_check_says_what_setup_would_do_and_changes_nothing() {
    let db = db_with_outbox().await;
    let nats = NatsServer::start();
    let env = named_env(&db, &nats, "plum");
    let client = db.client().await;
    let f = run_command(&["setup", "--check"], &env, LIMIT);
    assert_eq!(f.status.code(), Some(0), "{}\n{}", f.stdout, f.stderr);
    for line in [
        "stream OUTBOX_PLUM: would be created (file storage, subjects plum.*, plum_dead_letter",
        "publication outbox_relay_plum: would be created (FOR TABLE public.outbox",
        "slot outbox_relay_plum: would be created (pgoutput",
        "setup --check: setup would make the 3 change(s) above and refuses nothing; nothing was changed",
    ] {
        assert!(f.stdout.contains(line), "{line}\n{}", f.stdout);
    }
    assert!(!slot_exists(&client, "outbox_relay_plum").await);
    assert!(!publication_exists(&client, "outbox_relay_plum").await);
    assert!(stream_names(&nats).await.is_empty());

    let setup = run_command(&["setup"], &env, LIMIT);
    assert!(setup.status.success(), "{}", setup.stderr);
    let f = run_command(&["setup", "--check"], &env, LIMIT);
    assert_eq!(f.status.code(), Some(0), "{}", f.stderr);
    assert!(
        f.stdout
            .contains("setup --check: nothing to create or change"),
        "{}",
        f.stdout
    );

    let refused = named_env(&db, &nats, "damson");
    let f = run_command(&["setup", "--check"], &refused, LIMIT);
    assert_eq!(f.status.code(), Some(1), "{}", f.stdout);
    assert!(
        f.stderr
            .contains("is already relayed by the relay of slot outbox_relay_plum"),
        "{}",
        f.stderr
    );
    assert!(
        f.stdout.contains("setup --check: setup would refuse"),
        "{}",
        f.stdout
    );
    assert!(!slot_exists(&client, "outbox_relay_damson").await);
}
