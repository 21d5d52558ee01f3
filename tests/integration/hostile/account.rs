//! The account boundary (docs/security.md, security round 5, findings 1 and 2): two relays and an
//! ordinary `payments.>` stream in one NATS account, with the users docs/operations.md prints, and a
//! requester who may publish nothing but requests. It asks each relay's position service to answer
//! on the other relay's stream, its dead-letter subject, its inbox, `payments.>`, the relay's own
//! subjects and JetStream's API. No stream may store an answer, neither relay may restart, and the
//! requester's own inbox is answered. The same attack runs against relay users that still have
//! `allow_responses` (the relay's own rule alone must hold), and against the account-of-its-own
//! layout, where the relays' account stays clean and an importing account gets the answer on the
//! subject its requester named (the limit docs/operations.md states).

use std::time::Duration;

use async_nats::jetstream;
use outbox_relay::config::Config;
use tokio_postgres::Client;

use super::{LIMIT, set, wait_for_active_slot};
use crate::permissions::{RELAY_PASSWORD, RELAY_USER, SERVICE_PASSWORD, SERVICE_USER};
use crate::support::{
    InProcessRelay, NatsServer, PgServer, TestDb, default_outbox_sql, read_all, relay_config,
    relay_env, run_command, stream_count, wait_for,
};

const BILLING_USER: &str = "billing-relay";
const BILLING_PASSWORD: &str = "change-me-billing";
/// A user of the account that may publish requests and nothing else.
const REQUESTER: &str = "requester";

/// One relay of the account: its configuration and database.
struct Relay {
    config: Config,
    client: Client,
    _db: TestDb,
}

impl Relay {
    /// A relay of `db` with `stream`, `subject`, `dead_letter`, `inbox` and the user `user`, and
    /// `setup` run as that user.
    async fn new(
        db: TestDb,
        nats: &NatsServer,
        names: [&str; 4],
        (user, password): (&str, &str),
        reply_prefixes: &str,
    ) -> Relay {
        let [stream, subject, dead_letter, inbox] = names;
        db.psql(&default_outbox_sql());
        let mut config = relay_config(&db, nats);
        config.nats.stream = stream.into();
        config.nats.subject = subject.into();
        config.nats.dead_letter_subject = dead_letter.into();
        config.nats.user = user.into();
        config.nats.password = password.into();
        config.nats.inbox_prefix = inbox.into();
        config.nats.service_reply_prefixes = vec![reply_prefixes.into()];
        let mut env = relay_env(&config);
        for (k, v) in [
            ("OUTBOX_RELAY_NATS_SUBJECT", subject),
            ("OUTBOX_RELAY_NATS_DEAD_LETTER_SUBJECT", dead_letter),
            ("OUTBOX_RELAY_NATS_USER", user),
            ("OUTBOX_RELAY_NATS_PASSWORD", password),
            ("OUTBOX_RELAY_NATS_INBOX_PREFIX", inbox),
            ("OUTBOX_RELAY_NATS_SERVICE_REPLY_PREFIXES", reply_prefixes),
        ] {
            set(&mut env, k, v);
        }
        let setup = run_command(&["setup"], &env, LIMIT);
        assert!(
            setup.status.success(),
            "setup of {stream}: {}",
            setup.stderr
        );
        let client = db.client().await;
        Relay {
            config,
            client,
            _db: db,
        }
    }

    fn prefix(&self) -> String {
        format!("outbox-relay.{}", self.config.postgres.slot)
    }

    /// Inserts one event of aggregate `Claim`/`Invoice` with aggregate id `id`.
    async fn insert(&self, aggregate_type: &str, id: &str) {
        self.client
            .execute(
                "INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ($1, $2, 'Happened', '{}')",
                &[&aggregate_type, &id],
            )
            .await
            .unwrap_or_else(|e| panic!("insert {id}: {e}"));
    }
}

/// The documented relay `OUTBOX` and the second relay `BILLING`, each with its own database, as
/// their documented users, answering under `reply_prefix`.
async fn both(nats: &NatsServer, reply_prefix: &str) -> (Relay, Relay) {
    let dbs = [
        TestDb::create(PgServer::shared()).await,
        TestDb::create(PgServer::shared()).await,
    ];
    both_of(dbs, nats, reply_prefix).await
}

async fn both_of(dbs: [TestDb; 2], nats: &NatsServer, reply_prefix: &str) -> (Relay, Relay) {
    let [a, b] = dbs;
    let outbox = Relay::new(
        a,
        nats,
        OUTBOX_NAMES,
        (RELAY_USER, RELAY_PASSWORD),
        reply_prefix,
    )
    .await;
    let billing = Relay::new(
        b,
        nats,
        BILLING_NAMES,
        (BILLING_USER, BILLING_PASSWORD),
        reply_prefix,
    )
    .await;
    (outbox, billing)
}

/// Stream, subject template, dead-letter subject and inbox prefix of the two documented relays.
const OUTBOX_NAMES: [&str; 4] = [
    "OUTBOX",
    "outbox.{aggregate_type}",
    "outbox_dead_letter",
    "_INBOX_outbox_relay",
];
const BILLING_NAMES: [&str; 4] = [
    "BILLING",
    "bil.{aggregate_type}",
    "bil_dead_letter",
    "_INBOX_billing_relay",
];

/// The account of docs/operations.md's first block with a requester added: it may publish to the
/// service's subjects only, so anything stored elsewhere was stored by a relay.
fn with_requester(conf: &str) -> String {
    let requester = format!(
        "users: [\n      {{\n        user: \"{REQUESTER}\"\n        password: \"{REQUESTER}\"\n        \
         permissions {{\n          publish {{ allow: [\"outbox-relay.>\", \"$SRV.>\"] }}\n          \
         subscribe {{ allow: [\"_INBOX.>\"] }}\n        }}\n      }}"
    );
    assert!(conf.contains("users: ["), "{conf}");
    conf.replacen("users: [", &requester, 1)
}

async fn connect(nats: &NatsServer, user: &str, password: &str) -> async_nats::Client {
    async_nats::ConnectOptions::with_user_and_password(user.into(), password.into())
        .connect(nats.url())
        .await
        .unwrap_or_else(|e| panic!("connect as {user}: {e}"))
}

/// Waits until `subject` answers a request from `client` (the service streams and has checked the
/// account).
async fn wait_answered(client: &async_nats::Client, subject: String) {
    wait_for(&format!("an answer from {subject}"), LIMIT, || async {
        let req = async_nats::Request::new().timeout(Some(Duration::from_secs(1)));
        client.send_request(subject.clone(), req).await.is_ok()
    })
    .await;
}

/// The reply subjects the requester names: everything a relay must never publish to.
fn hostile_replies() -> Vec<&'static str> {
    vec![
        "bil.Invoice",
        "bil_dead_letter",
        "outbox.Claim",
        "outbox_dead_letter",
        "payments.card.charged",
        "_INBOX_outbox_relay.planted.1",
        "_INBOX_billing_relay.planted.1",
        "$JS.API.STREAM.PURGE.BILLING",
        "$JS.API.STREAM.PURGE.PAYMENTS",
    ]
}

/// Sends every request of both relays' services (and discovery, which both answer) with every
/// hostile reply subject; returns how many each relay received.
async fn attack(requester: &async_nats::Client, relays: [&Relay; 2]) -> f64 {
    let mut subjects = vec![
        "$SRV.PING".to_owned(),
        "$SRV.INFO.outbox-relay".to_owned(),
        "$SRV.STATS".to_owned(),
    ];
    for r in relays {
        subjects.push(format!("{}.position", r.prefix()));
        subjects.push(format!("{}.wait", r.prefix()));
    }
    let body = r#"{"lsn": "FFFF/0", "timeout_ms": 0}"#;
    for reply in hostile_replies() {
        for subject in &subjects {
            requester
                .publish_with_reply(subject.clone(), reply.to_owned(), body.into())
                .await
                .expect("publish");
        }
    }
    requester.flush().await.expect("flush");
    // Each relay gets discovery and its own two endpoints.
    (hostile_replies().len() * 5) as f64
}

/// The stream's messages, each as its subject (and its payload, when it has no event id).
async fn contents(js: &jetstream::Context, stream: &str) -> Vec<String> {
    read_all(js, stream)
        .await
        .iter()
        .map(|m| match m.headers.get("Nats-Msg-Id") {
            Some(_) => m.subject.clone(),
            None => format!("{}: {}", m.subject, String::from_utf8_lossy(&m.payload)),
        })
        .collect()
}

/// The attack against the account of `conf` (docs/operations.md's first block, or a variant).
async fn two_relays_and_payments(conf: &str) {
    let nats = NatsServer::start_with_config(&with_requester(conf));
    let (outbox, billing) = both(&nats, "_INBOX.").await;
    // An ordinary stream of the account, made by a service of it.
    let service = connect(&nats, SERVICE_USER, SERVICE_PASSWORD).await;
    let js = jetstream::new(service);
    js.create_stream(jetstream::stream::Config {
        name: "PAYMENTS".into(),
        subjects: vec!["payments.>".into()],
        ..Default::default()
    })
    .await
    .expect("create PAYMENTS");

    let relay_a = InProcessRelay::start(outbox.config.clone());
    let relay_b = InProcessRelay::start(billing.config.clone());
    for r in [&outbox, &billing] {
        wait_for_active_slot(&r.client, &r.config.postgres.slot).await;
    }
    outbox.insert("Claim", "a-1").await;
    billing.insert("Invoice", "b-1").await;
    wait_for("the first events", LIMIT, || async {
        stream_count(&js, "OUTBOX").await == 1 && stream_count(&js, "BILLING").await == 1
    })
    .await;
    let requester = connect(&nats, REQUESTER, REQUESTER).await;
    for r in [&outbox, &billing] {
        wait_answered(&requester, format!("{}.position", r.prefix())).await;
    }
    let before = [&relay_a, &relay_b].map(|r| r.metrics.position_refused_reply.get());

    let sent = attack(&requester, [&outbox, &billing]).await;
    // A stored answer would be there within milliseconds; a restart within the ack timeout.
    tokio::time::sleep(Duration::from_secs(3)).await;
    outbox.insert("Claim", "a-2").await;
    billing.insert("Invoice", "b-2").await;
    wait_for("the second events", LIMIT, || async {
        stream_count(&js, "OUTBOX").await >= 2 && stream_count(&js, "BILLING").await >= 2
    })
    .await;

    assert_eq!(
        contents(&js, "OUTBOX").await,
        ["outbox.Claim", "outbox.Claim"],
        "OUTBOX holds its relay's two events and no answer"
    );
    assert_eq!(
        contents(&js, "BILLING").await,
        ["bil.Invoice", "bil.Invoice"],
        "BILLING holds its relay's two events and no answer"
    );
    assert_eq!(
        contents(&js, "PAYMENTS").await,
        Vec::<String>::new(),
        "PAYMENTS stores no answer"
    );
    for (name, relay, before) in [
        ("OUTBOX", &relay_a, before[0]),
        ("BILLING", &relay_b, before[1]),
    ] {
        assert_eq!(
            relay.metrics.reconnects.get(),
            0,
            "the {name} relay never restarted"
        );
        assert!(!relay.is_finished(), "the {name} relay runs on");
        assert_eq!(
            relay.metrics.position_refused_reply.get() as f64 - before as f64,
            sent,
            "the {name} relay refused (and counted) every hostile reply subject"
        );
    }
    // The requester's own inbox is answered, by each relay.
    for r in [&outbox, &billing] {
        let answer = requester
            .request(format!("{}.position", r.prefix()), "".into())
            .await
            .expect("position on the requester's inbox");
        let v: serde_json::Value = serde_json::from_slice(&answer.payload).expect("JSON");
        assert_eq!(v["stream"], r.config.nats.stream.as_str(), "{v}");
    }
    for r in [relay_a, relay_b] {
        r.stop().await.expect("relay stops cleanly");
    }
}

/// Findings 1 and 2 with the permissions docs/operations.md prints (no `allow_responses`): the
/// server and the relay both keep answers out of every stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_users_store_no_answer_in_any_stream_of_the_account() {
    two_relays_and_payments(&crate::permissions::documented_nats_config()).await;
}

/// Findings 1 and 2 as reported: relay users with `allow_responses` (the permissions documented
/// before), which nats-server lets answer on any subject. Only the relay's own rule stands between
/// a request and the other streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_users_with_allow_responses_store_no_answer_either() {
    let documented = crate::permissions::documented_nats_config();
    let conf = documented.replace(r#", "_INBOX.>""#, "").replace(
        r#""outbox-relay.>", "$SRV.>"] }"#,
        "\"outbox-relay.>\", \"$SRV.>\"] }\n          allow_responses: true",
    );
    assert_eq!(
        conf.matches("allow_responses: true").count(),
        2,
        "both relay users answer through allow_responses:\n{conf}"
    );
    assert!(!conf.contains(r#""_INBOX.>""#), "{conf}");
    two_relays_and_payments(&conf).await;
}

/// The second block of docs/operations.md's NATS permissions (the relays in an account of their
/// own), with the test's slots.
fn documented_account_of_its_own(slots: [&str; 2]) -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md");
    let text = std::fs::read_to_string(path).expect("read docs/operations.md");
    let (_, section) = text
        .split_once("\n### The position service from an account of its own\n")
        .expect("docs/operations.md has the account-of-its-own section");
    let (_, block) = section.split_once("\n```\n").expect("it prints a block");
    let (block, _) = block.split_once("\n```").expect("the block ends");
    block
        .replace(
            "outbox-relay.outbox_relay_billing.>",
            &format!("outbox-relay.{}.>", slots[1]),
        )
        .replace(
            "outbox-relay.outbox_relay.>",
            &format!("outbox-relay.{}.>", slots[0]),
        )
}

/// The account-of-its-own layout: requests from the callers' account reach the relays with `_R_.`
/// reply subjects. Whatever reply subject a caller names, nothing reaches the relays' account's
/// streams and neither relay restarts; the caller's own inbox is answered. A second importing
/// account with a `payments.>` stream shows the limit docs/operations.md states: there a requester
/// denied `payments.>` gets the answer stored in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_account_of_their_own_keeps_answers_out_of_the_relays_streams() {
    // Slots are known before the server starts: the exports name them.
    let dbs = [
        TestDb::create(PgServer::shared()).await,
        TestDb::create(PgServer::shared()).await,
    ];
    let slots = [dbs[0].slot_name(), dbs[1].slot_name()];
    let mut conf = documented_account_of_its_own([&slots[0], &slots[1]]);
    // An administrator of the relays' account (to read the streams), and an account with a
    // stream of its own that imports relay OUTBOX's service too.
    conf = conf.replacen(
        "users: [",
        "users: [\n      { user: \"admin\", password: \"admin\" }",
        1,
    );
    let app = format!(
        "  APP {{\n    jetstream: enabled\n    users: [\n      {{ user: \"app\", password: \"app\" }}\n      \
         {{ user: \"{REQUESTER}\", password: \"{REQUESTER}\", permissions: {{ publish: {{ deny: [\"payments.>\"] }} }} }}\n    ]\n    \
         imports: [ {{ service: {{ account: RELAYS, subject: \"outbox-relay.{}.>\" }} }} ]\n  }}\n}}",
        slots[0]
    );
    let end = conf.rfind('}').expect("the block ends with }");
    conf.replace_range(end.., &app);
    let nats = NatsServer::start_with_config(&conf);
    let (outbox, billing) = both_of(dbs, &nats, "_R_.").await;
    let relays_js = jetstream::new(connect(&nats, "admin", "admin").await);
    let app_js = jetstream::new(connect(&nats, "app", "app").await);
    app_js
        .create_stream(jetstream::stream::Config {
            name: "PAYMENTS".into(),
            subjects: vec!["payments.>".into()],
            ..Default::default()
        })
        .await
        .expect("create PAYMENTS in APP");

    let relay_a = InProcessRelay::start(outbox.config.clone());
    let relay_b = InProcessRelay::start(billing.config.clone());
    for r in [&outbox, &billing] {
        wait_for_active_slot(&r.client, &r.config.postgres.slot).await;
    }
    outbox.insert("Claim", "a-1").await;
    billing.insert("Invoice", "b-1").await;
    wait_for("the first events", LIMIT, || async {
        stream_count(&relays_js, "OUTBOX").await == 1
            && stream_count(&relays_js, "BILLING").await == 1
    })
    .await;
    let caller = connect(&nats, SERVICE_USER, SERVICE_PASSWORD).await;
    for r in [&outbox, &billing] {
        wait_answered(&caller, format!("{}.position", r.prefix())).await;
    }
    let mut subjects = Vec::new();
    for r in [&outbox, &billing] {
        subjects.push(format!("{}.position", r.prefix()));
        subjects.push(format!("{}.wait", r.prefix()));
    }
    let body = r#"{"lsn": "FFFF/0", "timeout_ms": 0}"#;
    for reply in hostile_replies() {
        for subject in &subjects {
            caller
                .publish_with_reply(subject.clone(), reply.to_owned(), body.into())
                .await
                .expect("publish");
        }
    }
    caller.flush().await.expect("flush");
    // The documented limit: an importing account's own stream, on a subject its requester is denied.
    let requester = connect(&nats, REQUESTER, REQUESTER).await;
    for _ in 0..3 {
        requester
            .publish_with_reply(
                format!("{}.position", outbox.prefix()),
                "payments.card.charged".to_owned(),
                "".into(),
            )
            .await
            .expect("publish");
    }
    requester.flush().await.expect("flush");
    tokio::time::sleep(Duration::from_secs(3)).await;
    outbox.insert("Claim", "a-2").await;
    billing.insert("Invoice", "b-2").await;
    wait_for("the second events", LIMIT, || async {
        stream_count(&relays_js, "OUTBOX").await >= 2
            && stream_count(&relays_js, "BILLING").await >= 2
    })
    .await;
    assert_eq!(
        contents(&relays_js, "OUTBOX").await,
        ["outbox.Claim", "outbox.Claim"]
    );
    assert_eq!(
        contents(&relays_js, "BILLING").await,
        ["bil.Invoice", "bil.Invoice"]
    );
    for (name, relay) in [("OUTBOX", &relay_a), ("BILLING", &relay_b)] {
        assert_eq!(
            relay.metrics.reconnects.get(),
            0,
            "the {name} relay never restarted"
        );
        assert!(!relay.is_finished(), "the {name} relay runs on");
    }
    wait_for("the importing account's stream", LIMIT, || async {
        stream_count(&app_js, "PAYMENTS").await >= 3
    })
    .await;
    assert_eq!(
        stream_count(&app_js, "PAYMENTS").await,
        3,
        "the limit docs/operations.md states: an importing account's stream gets the answers its \
         requester directs there"
    );
    let answer = caller
        .request(format!("{}.position", billing.prefix()), "".into())
        .await
        .expect("position on the caller's inbox");
    let v: serde_json::Value = serde_json::from_slice(&answer.payload).expect("JSON");
    assert_eq!(v["stream"], "BILLING", "{v}");
    for r in [relay_a, relay_b] {
        r.stop().await.expect("relay stops cleanly");
    }
}
