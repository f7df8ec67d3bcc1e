//! HBONE: TCP carried in HTTP/2 `CONNECT` streams over mutual TLS.
//! - [`pool`]: the outbound connection pool, keyed as ztunnel keys it (source identity,
//!   destination identity, destination address, source IP), single-flight per key, more than
//!   one connection per key when streams run out, idle connections closed by a timer.
//! - [`client`]: one h2 connection's handshake and one `CONNECT` on it.
//! - [`server`]: the h2 server settings and the checks on each `CONNECT` before it is answered.
#![forbid(unsafe_code)]

pub mod client;
pub mod pool;
pub mod server;
pub mod stream;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;

use crate::tls::TlsError;

pub use client::{baggage, traceparent, ConnectHeaders, H2Client, Tunnel};
pub use pool::{LocalConnector, Pool, PoolKey};
pub use server::{check_connect, parse_connect, server_builder, ConnectRefusal};
pub use stream::H2Stream;

/// h2 settings as ztunnel's: large windows and frames, keepalive pings.
pub const STREAM_WINDOW: u32 = 4 * 1024 * 1024;
pub const CONNECTION_WINDOW: u32 = 16 * 1024 * 1024;
pub const MAX_FRAME: u32 = 1024 * 1024;
pub const PING_INTERVAL: Duration = Duration::from_secs(10);
pub const PING_TIMEOUT: Duration = Duration::from_secs(20);
/// Streams our server allows per connection (what ztunnel's server allows too).
pub const MAX_STREAMS: u32 = 100;
/// Largest header block either side accepts (hyper's default, which these settings replaced).
pub const MAX_HEADER_LIST: u32 = 16 * 1024;
/// Streams a client may open and reset before the server reads them, before the connection is
/// closed with ENHANCE_YOUR_CALM (the "rapid reset" bound; h2's default).
pub const MAX_PENDING_ACCEPT_RESETS: usize = 20;
/// Streams the server may reset for protocol errors on one connection before closing it.
pub const MAX_LOCAL_ERROR_RESETS: usize = 1024;
/// Bytes queued for sending per stream beyond the peer's window (hyper's server default).
pub const MAX_SEND_BUFFER: usize = 400 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum HboneError {
    #[error("connect to {0}: {1}")]
    Connect(SocketAddr, std::io::Error),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("HTTP/2: {0}")]
    H2(String),
    #[error("CONNECT refused with status {0}")]
    Status(StatusCode),
    /// Another caller's attempt to open the key's connection, which this caller waited for,
    /// failed with this error.
    #[error("{0}")]
    Shared(String),
}

impl From<h2::Error> for HboneError {
    fn from(e: h2::Error) -> Self {
        HboneError::H2(e.to_string())
    }
}

/// A count of open HBONE connections that a drain can wait on: each connection holds a
/// [`LiveGuard`] until its GOAWAY and TLS close_notify are sent and its socket is closed.
#[derive(Clone, Default)]
pub struct Live(Arc<LiveInner>);

#[derive(Default)]
struct LiveInner {
    open: AtomicUsize,
    none: tokio::sync::Notify,
}

/// Held by one open HBONE connection.
pub struct LiveGuard(Live);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        if self.0 .0.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0 .0.none.notify_waiters();
        }
    }
}

impl Live {
    pub fn enter(&self) -> LiveGuard {
        self.0.open.fetch_add(1, Ordering::AcqRel);
        LiveGuard(self.clone())
    }

    pub fn count(&self) -> usize {
        self.0.open.load(Ordering::Acquire)
    }

    /// Waits until no connection is open or `until` passes; returns how many are left.
    pub async fn wait_closed(&self, until: tokio::time::Instant) -> usize {
        loop {
            let none = self.0.none.notified();
            if self.count() == 0 {
                return 0;
            }
            if tokio::time::timeout_at(until, none).await.is_err() {
                return self.count();
            }
        }
    }
}
