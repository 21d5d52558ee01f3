//! The consumer recipes of docs/consumer-dedup.md in Python (`examples/consumers/python`, nats-py
//! and psycopg) and Node.js (`examples/consumers/node`, `@nats-io/jetstream` and `pg`), run as
//! their own programs against real Postgres and nats-server: e-5531 reaches the payment service
//! three times and is paid once, a restart resumes after what the service acknowledged, and an
//! unreadable payload is parked instead of redelivered forever.
//!
//! The relay stores e-5531; the test then republishes that stored message as it can reach a
//! consumer again: under the same `Nats-Msg-Id` once the duplicate window has passed (an outage
//! longer than the window), and in the form of an atomic batch (`Outbox-Event-Id`, no
//! `Nats-Msg-Id`). The later events are the same message with another id and payload. The
//! recipes' packages come from `scripts/install-deps.sh`; without them the test fails saying so.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;

use crate::support::{
    InProcessRelay, NatsServer, PgServer, Stored, TEXT_ID_OUTBOX_SQL, TestDb, process, read_all,
    relay_config, stream_count, wait_for,
};

const LIMIT: Duration = Duration::from_secs(60);
const SUBJECT: &str = "outbox.Claim";
const DURABLE: &str = "payment";

/// One recipe: how to run it, and what must be installed first.
struct Recipe {
    program: &'static str,
    script: &'static str,
    /// A command that exits 0 when the recipe's packages are installed.
    check: &'static [&'static str],
    install: &'static str,
}

const PYTHON: Recipe = Recipe {
    program: "python3",
    script: "examples/consumers/python/payment_service.py",
    check: &["python3", "-c", "import nats, psycopg"],
    install: "pip install -r examples/consumers/python/requirements.txt",
};

const NODE: Recipe = Recipe {
    program: "node",
    script: "examples/consumers/node/payment_service.mjs",
    check: &["npm", "ls", "--prefix", "examples/consumers/node"],
    install: "npm ci --prefix examples/consumers/node",
};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

impl Recipe {
    fn require_installed(&self) {
        let ok = Command::new(self.check[0])
            .args(&self.check[1..])
            .current_dir(root())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            ok,
            "{}: its packages are not installed: run `bash scripts/install-deps.sh` (it runs `{}`)",
            self.script, self.install
        );
    }

    /// Runs the recipe until its consumer has caught up; its stdout lines.
    async fn run_until_caught_up(
        &self,
        payments: &TestDb,
        nats: &NatsServer,
        stream: &str,
    ) -> Vec<String> {
        let dir = tempfile::tempdir().expect("tempdir for the recipe's output");
        let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
        let mut child = Command::new(self.program)
            .arg(root().join(self.script))
            .args(["--postgres", &payments.url(), "--nats", &nats.url()])
            .args([
                "--stream",
                stream,
                "--subject",
                SUBJECT,
                "--durable",
                DURABLE,
            ])
            .arg("--until-caught-up")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).expect("stdout file"))
            .stderr(std::fs::File::create(&err).expect("stderr file"))
            .spawn()
            .unwrap_or_else(|e| panic!("start {} {}: {e}", self.program, self.script));
        let exited = tokio::task::spawn_blocking(move || {
            let exited = process::wait_exit(&mut child, LIMIT);
            if !exited {
                let _ = child.kill();
            }
            (exited, child.wait())
        })
        .await
        .expect("wait for the recipe");
        let read = |p: &PathBuf| std::fs::read_to_string(p).unwrap_or_default();
        let (stdout, stderr) = (read(&out), read(&err));
        match exited {
            (true, Ok(status)) if status.success() => {}
            (true, status) => panic!("{}: {status:?}\n{stdout}\n{stderr}", self.script),
            (false, _) => panic!(
                "{}: not caught up within {LIMIT:?}\n{stdout}\n{stderr}",
                self.script
            ),
        }
        stdout.lines().map(str::to_owned).collect()
    }
}

/// `stored`'s headers without those that tie a publish to one stream position, with `set` applied
/// (a value of `None` removes the header).
fn headers_like(stored: &Stored, set: &[(&str, Option<&str>)]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (k, v) in &stored.headers {
        if !k.starts_with("Nats-Expected-") && !set.iter().any(|(s, _)| s == k) {
            headers.insert(k.as_str(), v.as_str());
        }
    }
    for (k, v) in set {
        if let Some(v) = v {
            headers.insert(*k, *v);
        }
    }
    headers
}

/// Publishes and returns whether JetStream stored it (false: dropped as a duplicate).
async fn publish(js: &jetstream::Context, headers: HeaderMap, payload: &str) -> bool {
    let ack = js
        .publish_with_headers(SUBJECT, headers, payload.to_owned().into())
        .await
        .expect("publish")
        .await
        .expect("stored");
    !ack.duplicate
}

/// The payments the recipe made: (event id, claim id, amount as Postgres prints it).
async fn payments_made(payments: &TestDb) -> Vec<(String, i64, String)> {
    let rows = payments
        .client()
        .await
        .query(
            "SELECT event_id, claim_id, amount::text FROM payments ORDER BY payment_id",
            &[],
        )
        .await
        .expect("read the payments table");
    rows.iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

async fn the_recipe_pays_once_resumes_and_parks(recipe: &Recipe) {
    recipe.require_installed();
    // The relay stores e-5531, with every header it writes.
    let outbox = TestDb::create(PgServer::shared()).await;
    outbox.psql(TEXT_ID_OUTBOX_SQL);
    let nats = NatsServer::start();
    let mut config = relay_config(&outbox, &nats);
    config.nats.duplicate_window_secs = 1;
    let stream = config.nats.stream.clone();
    let client = outbox.client().await;
    let relay = InProcessRelay::start_streaming(&config, &client).await;
    client
        .batch_execute(
            "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES \
             ('e-5531', 'Claim', '4711', 'ClaimApproved', \
              '{\"claim_id\": 4711, \"status\": \"approved\", \"amount\": 1250.00}')",
        )
        .await
        .expect("write e-5531");
    let js = nats.jetstream().await;
    wait_for("e-5531 in the stream", LIMIT, || async {
        stream_count(&js, &stream).await == 1
    })
    .await;
    relay.stop().await.expect("the relay stops cleanly");
    let original = read_all(&js, &stream).await.remove(0);
    assert_eq!(original.header("Nats-Msg-Id"), "e-5531", "{original:?}");
    let payload = original.payload_str().to_owned();

    // The same event twice more: once the window has passed, JetStream stores the same Nats-Msg-Id
    // again (an outage longer than the window); an atomic batch carries the id as Outbox-Event-Id.
    let mut again = false;
    for _ in 0..300 {
        if publish(&js, headers_like(&original, &[]), &payload).await {
            again = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(again, "JetStream dropped e-5531 for 30 s with a 1 s window");
    let atomic = headers_like(
        &original,
        &[("Nats-Msg-Id", None), ("Outbox-Event-Id", Some("e-5531"))],
    );
    assert!(publish(&js, atomic, &payload).await);

    let payments = TestDb::create(PgServer::shared()).await;
    let lines = recipe.run_until_caught_up(&payments, &nats, &stream).await;
    assert_eq!(lines.len(), 3, "one line per delivery: {lines:#?}");
    assert_eq!(lines[0], "paid claim 4711 for event e-5531", "{lines:#?}");
    for line in &lines[1..] {
        assert_eq!(
            line, "event e-5531 processed before: acknowledged, not paid again",
            "{lines:#?}"
        );
    }
    let paid = vec![("e-5531".to_owned(), 4711, "1250.00".to_owned())];
    assert_eq!(
        payments_made(&payments).await,
        paid,
        "e-5531 paid once, to the cent"
    );
    let mut consumer: jetstream::consumer::PullConsumer = js
        .get_stream(&stream)
        .await
        .expect("stream")
        .get_consumer(DURABLE)
        .await
        .expect("the recipe's durable consumer");
    let info = consumer.info().await.expect("consumer info");
    assert_eq!(
        (info.ack_floor.stream_sequence, info.num_ack_pending),
        (3, 0),
        "every delivery acknowledged after its commit"
    );

    // A restart resumes after what was acknowledged: only the new events, and the unreadable one
    // is parked (`term`) without a payment or an inbox row.
    let next = headers_like(
        &original,
        &[
            ("Nats-Msg-Id", Some("e-5532")),
            ("Outbox-Aggregate-Id", Some("4712")),
        ],
    );
    let body = r#"{"claim_id": 4712, "status": "approved", "amount": 80.50}"#;
    assert!(publish(&js, next, body).await);
    let bad = headers_like(&original, &[("Nats-Msg-Id", Some("e-5533"))]);
    assert!(publish(&js, bad, r#"{"claim_id": "4713"}"#).await);
    let lines = recipe.run_until_caught_up(&payments, &nats, &stream).await;
    assert_eq!(
        lines.len(),
        2,
        "only the events after the restart: {lines:#?}"
    );
    assert_eq!(lines[0], "paid claim 4712 for event e-5532", "{lines:#?}");
    assert!(lines[1].starts_with("parked event e-5533: "), "{lines:#?}");
    let mut paid = paid;
    paid.push(("e-5532".to_owned(), 4712, "80.50".to_owned()));
    assert_eq!(payments_made(&payments).await, paid);
    let parked_inbox: i64 = payments
        .client()
        .await
        .query_one(
            "SELECT count(*) FROM processed_events WHERE event_id = 'e-5533'",
            &[],
        )
        .await
        .expect("read the inbox")
        .get(0);
    assert_eq!(
        parked_inbox, 0,
        "the parked event's id was rolled back with it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_recipe_pays_a_redelivered_event_once_and_resumes() {
    the_recipe_pays_once_resumes_and_parks(&PYTHON).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_recipe_pays_a_redelivered_event_once_and_resumes() {
    the_recipe_pays_once_resumes_and_parks(&NODE).await;
}

/// The fenced blocks of `lang` in `doc`.
fn blocks<'a>(doc: &'a str, lang: &str) -> Vec<&'a str> {
    let fence = format!("```{lang}\n");
    doc.split(fence.as_str())
        .skip(1)
        .filter_map(|rest| rest.split_once("```").map(|(block, _)| block))
        .collect()
}

/// The code docs/consumer-dedup.md shows for Python and Node.js is the programs' own, line for line
/// (indentation aside), and each table of their `schema.sql` is one the page shows, so the page
/// cannot drift from what the tests above run.
#[test]
fn the_page_shows_the_recipes_as_they_run() {
    let doc =
        std::fs::read_to_string(root().join("docs/consumer-dedup.md")).expect("read the page");
    let schema = std::fs::read_to_string(root().join("examples/consumers/schema.sql"))
        .expect("read the recipes' schema");
    let sql = blocks(&doc, "sql").concat();
    let tables: Vec<String> = schema
        .split_inclusive(";\n")
        .map(|t| {
            t.lines()
                .filter(|l| !l.starts_with("--"))
                .collect::<Vec<_>>()
                .join("\n")
        })
        .filter(|t| !t.trim().is_empty())
        .collect();
    assert_eq!(tables.len(), 2, "{tables:?}");
    for table in tables {
        assert!(
            sql.contains(table.trim()),
            "docs/consumer-dedup.md does not show the recipes' table:\n{table}"
        );
    }
    for (lang, recipe) in [("python", &PYTHON), ("js", &NODE)] {
        let program = std::fs::read_to_string(root().join(recipe.script)).expect("read the recipe");
        let lines: Vec<&str> = program.lines().map(str::trim).collect();
        let shown = blocks(&doc, lang);
        assert!(
            shown.len() >= 2,
            "the page shows the {lang} recipe: {shown:?}"
        );
        for block in shown {
            let want: Vec<&str> = block.lines().map(str::trim).collect();
            assert!(
                lines.windows(want.len()).any(|w| w == want.as_slice()),
                "docs/consumer-dedup.md shows {lang} that {} does not have:\n{block}",
                recipe.script
            );
        }
    }
}
