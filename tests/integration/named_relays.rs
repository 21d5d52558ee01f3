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

async fn write(client: &Client, id: &str, aggregate_type: &str) {
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
