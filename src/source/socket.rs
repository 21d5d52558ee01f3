//! The byte stream to one Postgres host, as libpq opens it: TCP to `host:port`, or, when the host is
//! a directory (it starts with `/`, like libpq's default `/run/postgresql` on Debian), the Unix socket
//! `<directory>/.s.PGSQL.<port>` in it.
//!
//! Over a Unix socket libpq never asks for TLS, whatever `sslmode` says: the kernel carries the bytes,
//! and the server can check who connects (`peer` authentication in `pg_hba.conf`, for which the
//! client sends nothing). Both connections follow that.

use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};

/// Whether `host` names a socket directory rather than a network host.
pub(super) fn is_socket_dir(host: &str) -> bool {
    host.starts_with('/')
}

/// Whether `dir` is a default socket directory of libpq builds: `/tmp` (upstream's) or
/// `/var/run/postgresql` (Debian's, Red Hat's; `/run/postgresql` is the same directory). libpq
/// matches a socket connection's password file lines by the name `localhost` only for its default
/// directory; any other directory is matched by its own path.
pub(super) fn is_default_socket_dir(dir: &str) -> bool {
    matches!(
        dir.trim_end_matches('/'),
        "/tmp" | "/var/run/postgresql" | "/run/postgresql"
    )
}

/// The socket file libpq uses for `dir` and `port`.
pub(super) fn socket_path(dir: &str, port: u16) -> PathBuf {
    PathBuf::from(dir).join(format!(".s.PGSQL.{port}"))
}

/// An open connection to one server.
#[derive(Debug)]
pub(super) enum PgStream {
    /// A TCP connection (with `TCP_NODELAY`: status updates are small and latency matters).
    Tcp(TcpStream),
    /// A Unix-domain socket connection.
    Unix(UnixStream),
}

impl PgStream {
    /// Connects to `host` (a name, an address or a socket directory) and `port`.
    pub(super) async fn connect(host: &str, port: u16) -> io::Result<Self> {
        if is_socket_dir(host) {
            return Ok(PgStream::Unix(
                UnixStream::connect(socket_path(host, port)).await?,
            ));
        }
        let tcp = TcpStream::connect((host, port)).await?;
        tcp.set_nodelay(true)?;
        Ok(PgStream::Tcp(tcp))
    }

    /// Whether TLS may be negotiated on this stream (libpq: never over a Unix socket).
    pub(super) fn supports_tls(&self) -> bool {
        matches!(self, PgStream::Tcp(_))
    }
}

impl AsyncRead for PgStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PgStream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            PgStream::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for PgStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            PgStream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            PgStream::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PgStream::Tcp(s) => Pin::new(s).poll_flush(cx),
            PgStream::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PgStream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            PgStream::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            PgStream::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            PgStream::Unix(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            PgStream::Tcp(s) => s.is_write_vectored(),
            PgStream::Unix(s) => s.is_write_vectored(),
        }
    }
}
