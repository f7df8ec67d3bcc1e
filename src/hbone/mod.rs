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

use std::net::SocketAddr;
use std::time::Duration;

use http::StatusCode;

use crate::tls::TlsError;

pub use client::{traceparent, ConnectHeaders, Tunnel};
pub use pool::{LocalConnector, Pool, PoolKey};
pub use server::{check_connect, parse_connect, server_builder, ConnectRefusal};

/// h2 settings as ztunnel's: large windows and frames, keepalive pings.
pub const STREAM_WINDOW: u32 = 4 * 1024 * 1024;
pub const CONNECTION_WINDOW: u32 = 16 * 1024 * 1024;
pub const MAX_FRAME: u32 = 1024 * 1024;
pub const PING_INTERVAL: Duration = Duration::from_secs(10);
pub const PING_TIMEOUT: Duration = Duration::from_secs(20);
/// Streams our server allows per connection (what ztunnel's server allows too).
pub const MAX_STREAMS: u32 = 100;

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

impl From<hyper::Error> for HboneError {
    fn from(e: hyper::Error) -> Self {
        HboneError::H2(e.to_string())
    }
}
