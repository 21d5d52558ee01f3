//! A TCP proxy for fault tests: put it between the relay and NATS or Postgres (point the relay's URL at
//! `proxy.port()`) and break the network on demand.
//!
//! - `cut()`: close every current connection (both sides see the close), keep accepting new ones.
//! - `blackhole(true)`: forward nothing in either direction, on current and new connections, without
//!   closing anything: the peers see silence, as when a route or a firewall drops packets. Bytes already
//!   read are held and forwarded when the black hole ends, as TCP retransmission would deliver them.
//! - `refuse(true)`: close new connections as soon as they are accepted.
//!
//! It runs on a thread with its own Tokio runtime, so it outlives the runtime of the test that made it
//! (a `#[tokio::test]` runtime is torn down before the locals of an outer scope are dropped) and keeps
//! forwarding while a test blocks its own thread. Drop closes the listener and every connection.

use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub(crate) struct Proxy {
    port: u16,
    shared: Arc<Shared>,
}

struct Shared {
    target: SocketAddr,
    /// Bumped by `cut`: connections made under an older generation close.
    generation: watch::Sender<u64>,
    blackhole: watch::Sender<bool>,
    refuse: AtomicBool,
    shutdown: watch::Sender<bool>,
    /// Connections accepted so far (for test diagnostics).
    accepted: AtomicU64,
}

impl Proxy {
    /// A proxy on `127.0.0.1:<free port>` forwarding to `127.0.0.1:target_port`.
    pub(crate) fn start(target_port: u16) -> Proxy {
        let listener = StdListener::bind("127.0.0.1:0").expect("bind proxy port");
        listener
            .set_nonblocking(true)
            .expect("nonblocking proxy listener");
        let port = listener.local_addr().expect("proxy address").port();
        let shared = Arc::new(Shared {
            target: SocketAddr::from(([127, 0, 0, 1], target_port)),
            generation: watch::channel(0).0,
            blackhole: watch::channel(false).0,
            refuse: AtomicBool::new(false),
            shutdown: watch::channel(false).0,
            accepted: AtomicU64::new(0),
        });
        let s = Arc::clone(&shared);
        std::thread::Builder::new()
            .name(format!("proxy-{port}"))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("proxy runtime");
                rt.block_on(accept_loop(listener, s));
            })
            .expect("spawn proxy thread");
        Proxy { port, shared }
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// `nats://127.0.0.1:<port>`
    pub(crate) fn nats_url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// `url` (a `postgres://` URL on 127.0.0.1) with its port replaced by the proxy's.
    pub(crate) fn postgres_url(&self, url: &str) -> String {
        let target = format!("127.0.0.1:{}", self.shared.target.port());
        assert!(url.contains(&target), "{url} does not point at {target}");
        url.replace(&target, &format!("127.0.0.1:{}", self.port))
    }

    /// Closes every current connection; new ones are accepted as before.
    pub(crate) fn cut(&self) {
        self.shared.generation.send_modify(|g| *g += 1);
    }

    /// While on, nothing is forwarded in either direction and nothing is closed.
    pub(crate) fn blackhole(&self, on: bool) {
        self.shared.blackhole.send_replace(on);
    }

    /// While on, new connections are closed as soon as they are accepted.
    pub(crate) fn refuse(&self, on: bool) {
        self.shared.refuse.store(on, Ordering::SeqCst);
    }

    /// Connections accepted so far.
    pub(crate) fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.shutdown.send_replace(true);
        self.cut();
    }
}

async fn accept_loop(listener: StdListener, shared: Arc<Shared>) {
    let listener = TcpListener::from_std(listener).expect("tokio proxy listener");
    let mut shutdown = shared.shutdown.subscribe();
    loop {
        let (client, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(_) => continue,
            },
            _ = shutdown.wait_for(|s| *s) => return,
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        if shared.refuse.load(Ordering::SeqCst) {
            drop(client);
            continue;
        }
        tokio::spawn(connection(client, Arc::clone(&shared)));
    }
}

async fn connection(client: TcpStream, shared: Arc<Shared>) {
    let mut generation = shared.generation.subscribe();
    let born = *generation.borrow_and_update();
    let cut = async move {
        let _ = generation.wait_for(|g| *g != born).await;
    };
    let run = async {
        let Ok(server) = TcpStream::connect(shared.target).await else {
            return;
        };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let (cr, cw) = client.into_split();
        let (sr, sw) = server.into_split();
        // Either direction ending (EOF or error) ends the connection: neither protocol half-closes.
        tokio::select! {
            _ = pump(cr, sw, shared.blackhole.subscribe()) => {}
            _ = pump(sr, cw, shared.blackhole.subscribe()) => {}
        }
    };
    tokio::select! {
        _ = run => {}
        _ = cut => {}
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut blackhole: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // Not reading while the black hole is on lets TCP flow control stall the sender, as a dead
        // route would.
        if blackhole.wait_for(|b| !*b).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if blackhole.wait_for(|b| !*b).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
