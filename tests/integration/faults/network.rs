//! The network between the relay and its servers breaks: connections cut (the relay sees a close) or
//! a black hole (silence: the relay must notice by its own timeouts, or the server's
//! `wal_sender_timeout`, not by a close).

use std::time::Duration;

use super::{Writer, assert_all_stored_once_in_order_within, text_id_db, wait_for_slot};
use crate::support::{InProcessRelay, NatsServer, PgServer, Proxy, relay_config, wait_for};

#[derive(Clone, Copy, Debug)]
enum Link {
    Nats,
    Postgres,
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    /// Three cuts, 2 s apart.
    Cut,
    /// Silence for 15 s.
    Blackhole,
}

/// Runs the relay through a proxy on `link`, writes ~50 events/s, applies `fault`, and checks the
/// invariants once the network is back.
async fn through_proxy(link: Link, fault: Fault) {
    let db = text_id_db(PgServer::shared()).await;
    let nats = NatsServer::start();
    let mut config = relay_config(&db, &nats);
    let proxy = match link {
        Link::Nats => {
            let p = Proxy::start(nats.port());
            config.nats.url = p.nats_url();
            p
        }
        Link::Postgres => {
            let p = Proxy::start(PgServer::shared().port());
            config.postgres.url = p.postgres_url(&config.postgres.url);
            p
        }
    };
    config.nats.ack_timeout_ms = 2000;
    let stream = config.nats.stream.clone();
    let relay = InProcessRelay::start(config.clone());
    let client = db.client().await;
    wait_for_slot(&client, &config.postgres.slot).await;
    wait_for("the relay to stream", Duration::from_secs(30), || async {
        relay.metrics.streaming.get() == 1
    })
    .await;
    let writer = Writer::start(db.url(), "e", 50);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let reconnects_before = relay.metrics.reconnects.get();
    let mut noticed = None;
    match fault {
        Fault::Cut => {
            for _ in 0..3 {
                proxy.cut();
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
        Fault::Blackhole => {
            proxy.blackhole(true);
            let start = std::time::Instant::now();
            while start.elapsed() < Duration::from_secs(15) {
                if noticed.is_none() && relay.metrics.reconnects.get() > reconnects_before {
                    noticed = Some(start.elapsed());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            proxy.blackhole(false);
        }
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let expected = writer.stop().await;
    let js = nats.jetstream().await;
    let t =
        assert_all_stored_once_in_order_within(&js, &stream, &expected, Duration::from_secs(60))
            .await;
    let reconnects = relay.metrics.reconnects.get() - reconnects_before;
    eprintln!(
        "{link:?} {fault:?}: {reconnects} reconnects, black hole noticed during it after {noticed:?}, \
         {} proxy connections",
        proxy.accepted()
    );
    // A cut NATS connection is re-established by the client itself; silence must be noticed.
    if matches!(fault, Fault::Blackhole) {
        assert!(reconnects > 0, "the relay never noticed the {fault:?}");
    }
    let name = match (link, fault) {
        (Link::Nats, Fault::Cut) => "relay-NATS connections cut x3",
        (Link::Nats, Fault::Blackhole) => "relay-NATS black hole 15 s (ack timeout 2 s)",
        (Link::Postgres, Fault::Cut) => "relay-Postgres connections cut x3",
        (Link::Postgres, Fault::Blackhole) => "relay-Postgres black hole 15 s",
    };
    t.report(name, 1);
    relay.stop().await.expect("relay stops cleanly");
    drop(proxy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_connection_cut() {
    through_proxy(Link::Nats, Fault::Cut).await;
}

/// The relay's ack timeout (2 s) must fire in the silence; once the route is back, everything arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_black_hole_for_15_s() {
    through_proxy(Link::Nats, Fault::Blackhole).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_connection_cut() {
    through_proxy(Link::Postgres, Fault::Cut).await;
}

/// The walsender's `wal_sender_timeout` (10 s on the test server) ends its side in the silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_black_hole_for_15_s() {
    through_proxy(Link::Postgres, Fault::Blackhole).await;
}
