//! The client half of HBONE: h2 over an established mutual-TLS stream, and one `CONNECT`
//! stream per tunnelled connection.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Method, Request, StatusCode};

use super::stream::H2Stream;
use super::{HboneError, CONNECTION_WINDOW, MAX_FRAME, PING_INTERVAL, PING_TIMEOUT, STREAM_WINDOW};
use crate::metrics::Metrics;
use crate::tls::Stream;

/// Headers of one HBONE request, as ztunnel sends them: `forwarded: for="<source>"` (plus
/// `;host=<service hostname>` when the connection was addressed to a service), `baggage` with the
/// source workload's attributes, and a fresh `traceparent`.
#[derive(Clone, Debug)]
pub struct ConnectHeaders {
    pub source: SocketAddr,
    pub baggage: String,
    /// The hostname of the service the connection was addressed to.
    pub host: Option<String>,
    /// The source's network, sent as `x-forwarded-network` on the inner CONNECT of double HBONE.
    pub network: Option<String>,
}

impl ConnectHeaders {
    /// The `forwarded` header's value.
    pub fn forwarded(&self) -> String {
        match &self.host {
            Some(h) => format!("for=\"{}\";host={h}", self.source),
            None => format!("for=\"{}\"", self.source),
        }
    }
}

/// The `baggage` header for a connection from `w`, in ztunnel's keys and order; empty
/// attributes are left out.
pub fn baggage(w: &crate::state::Workload) -> String {
    let kind = w.workload_type.as_str();
    let parts = [
        ("k8s.cluster.name", w.cluster_id.as_str()),
        ("k8s.namespace.name", w.namespace.as_str()),
        ("", w.workload_name.as_str()),
        ("service.name", w.canonical_name.as_str()),
        ("service.version", w.canonical_revision.as_str()),
    ];
    let mut out = String::new();
    for (k, v) in parts {
        if v.is_empty() {
            continue;
        }
        if !out.is_empty() {
            out.push(',');
        }
        if k.is_empty() {
            out.push_str(&format!("k8s.{kind}.name={v}"));
        } else {
            out.push_str(&format!("{k}={v}"));
        }
    }
    out
}

/// The client end of one h2 connection: clones share it.
#[derive(Clone)]
pub struct H2Client {
    sender: h2::client::SendRequest<Bytes>,
    closed: Arc<AtomicBool>,
}

impl H2Client {
    /// The connection ended (peer closed, error, keepalive timeout) or is going away.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Waits until a stream can be opened; fails when the connection is gone.
    pub async fn ready(&mut self) -> Result<(), HboneError> {
        std::future::poll_fn(|cx| self.sender.poll_ready(cx)).await.map_err(|e| {
            self.closed.store(true, Ordering::Release);
            HboneError::from(e)
        })
    }
}

/// HTTP/2 client handshake over `tls`; the connection is driven by a task of its own, which
/// pings the peer every [`PING_INTERVAL`] and ends the connection when a pong takes longer than
/// [`PING_TIMEOUT`], when the peer closes, or when every clone of the client is dropped. In the
/// last case (the pool let it go, and its last tunnel ended) h2 sends GOAWAY and shuts the TLS
/// stream down, which sends close_notify. The task holds `live` until the socket is closed.
pub async fn handshake<S: Stream>(
    tls: tokio_boring::SslStream<S>,
    dst: SocketAddr,
    metrics: Arc<Metrics>,
    live: super::LiveGuard,
) -> Result<H2Client, HboneError> {
    let (sender, mut conn) = h2::client::Builder::new()
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME)
        .max_header_list_size(super::MAX_HEADER_LIST)
        .enable_push(false)
        .handshake::<_, Bytes>(tls)
        .await?;
    let closed = Arc::new(AtomicBool::new(false));
    let flag = closed.clone();
    let ping = conn.ping_pong();
    tokio::spawn(async move {
        tokio::select! {
            r = &mut conn => if let Err(e) = r {
                let kind = metrics.h2_error("client", &e);
                tracing::info!(%dst, error = %e, kind, "HBONE connection ended by an HTTP/2 error");
            },
            why = keepalive(ping) => {
                tracing::info!(%dst, why, "HBONE connection closed: keepalive failed");
            }
        }
        flag.store(true, Ordering::Release);
        drop(conn);
        drop(live);
    });
    Ok(H2Client { sender, closed })
}

/// Pings every [`PING_INTERVAL`]; returns why it stopped when a pong is late or pings fail.
pub(super) async fn keepalive(ping: Option<h2::PingPong>) -> &'static str {
    let Some(mut ping) = ping else { return std::future::pending().await };
    loop {
        tokio::time::sleep(PING_INTERVAL).await;
        match tokio::time::timeout(PING_TIMEOUT, ping.ping(h2::Ping::opaque())).await {
            Ok(Ok(_pong)) => {}
            Ok(Err(_)) => return "ping failed",
            Err(_) => return "no pong within the timeout",
        }
    }
}

/// Sends `CONNECT target` on `client` and waits for the tunnel.
pub async fn connect(
    client: &mut H2Client,
    target: &str,
    headers: &ConnectHeaders,
) -> Result<H2Stream, HboneError> {
    client.ready().await?;
    let mut req = Request::builder()
        .method(Method::CONNECT)
        .uri(target)
        .header("baggage", &headers.baggage)
        .header("forwarded", headers.forwarded())
        .header("traceparent", traceparent());
    if let Some(n) = &headers.network {
        req = req.header("x-forwarded-network", n);
    }
    let req = req.body(()).map_err(|e| HboneError::H2(e.to_string()))?;
    let (resp, send) = client.sender.send_request(req, false)?;
    let resp = resp.await?;
    if resp.status() != StatusCode::OK {
        return Err(HboneError::Status(resp.status()));
    }
    Ok(H2Stream::new(send, resp.into_body()))
}

/// An open tunnel: the `CONNECT` stream's bytes, and the pool's lease on a stream slot of its
/// connection, given back when the tunnel is dropped.
pub struct Tunnel {
    io: H2Stream,
    /// Unset for the inner tunnel of double HBONE, whose h2 connection (`_inner`) runs over an
    /// outer tunnel that holds the lease.
    lease: Option<super::pool::Lease>,
    _inner: Option<H2Client>,
}

impl Tunnel {
    pub(super) fn new(io: H2Stream, lease: super::pool::Lease) -> Tunnel {
        Tunnel { io, lease: Some(lease), _inner: None }
    }

    /// The inner tunnel of double HBONE: a stream of `client`, an h2 connection of its own.
    pub(super) fn inner(io: H2Stream, client: H2Client) -> Tunnel {
        Tunnel { io, lease: None, _inner: Some(client) }
    }

    /// Ends the tunnel abnormally (its client connection was reset or cut): the far side resets
    /// its upstream connection instead of closing it cleanly.
    pub fn reset(&mut self) {
        self.io.reset();
    }

    /// The worker thread its HBONE connection runs on (see [`crate::net::workers`]).
    pub fn home(&self) -> Option<usize> {
        self.lease.as_ref().and_then(|l| l.home())
    }

    /// The `CONNECT` stream itself (for chunked, copy-free I/O).
    pub fn stream(&mut self) -> &mut H2Stream {
        &mut self.io
    }
}

impl tokio::io::AsyncRead for Tunnel {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Tunnel {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// A W3C `traceparent` with fresh random ids.
///
/// The ids come from BoringSSL's generator, drawn 32 ids' worth at a time per thread: each call
/// into it pays a fixed cost (reseeding input from RDRAND, slow on AMD parts) that, per request,
/// was most of this function's ~1 % of the proxies' CPU in a connection-per-request run.
pub fn traceparent() -> String {
    const ID: usize = 24;
    thread_local! {
        static POOL: std::cell::RefCell<([u8; 32 * ID], usize)> =
            const { std::cell::RefCell::new(([0; 32 * ID], 32 * ID)) };
    }
    let mut b = [0u8; ID];
    POOL.with(|p| {
        let (pool, used) = &mut *p.borrow_mut();
        if *used == pool.len() {
            boring::rand::rand_bytes(pool).expect("BoringSSL RNG");
            *used = 0;
        }
        b.copy_from_slice(&pool[*used..*used + ID]);
        // Each id is handed out once.
        pool[*used..*used + ID].fill(0);
        *used += ID;
    });
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut t = String::with_capacity(55);
    t.push_str("00-");
    for (i, x) in b.iter().enumerate() {
        if i == 16 {
            t.push('-');
        }
        t.push(HEX[usize::from(x >> 4)] as char);
        t.push(HEX[usize::from(x & 15)] as char);
    }
    t.push_str("-01");
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_shape() {
        let t = traceparent();
        assert_eq!(t.len(), 55);
        assert!(t.starts_with("00-") && t.ends_with("-01"));
        assert_ne!(t, traceparent());
        let hex = |s: &str| s.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c));
        let parts: Vec<&str> = t.split('-').collect();
        assert_eq!(parts.iter().map(|p| p.len()).collect::<Vec<_>>(), [2, 32, 16, 2]);
        assert!(parts.iter().all(|p| hex(p)), "{t}");
        // Across more than one refill of the per-thread pool, no id repeats and none is zero.
        let ids: std::collections::HashSet<String> = (0..100).map(|_| traceparent()).collect();
        assert_eq!(ids.len(), 100);
        assert!(ids.iter().all(|t| !t[3..35].bytes().all(|c| c == b'0')));
    }
}
