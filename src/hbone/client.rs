//! The client half of HBONE: h2 over an established mutual-TLS stream, and one `CONNECT`
//! stream per tunnelled connection.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Empty;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

use super::{HboneError, CONNECTION_WINDOW, MAX_FRAME, PING_INTERVAL, PING_TIMEOUT, STREAM_WINDOW};
use crate::metrics::Metrics;
use crate::tls::Stream;

/// Headers of one HBONE request.
pub struct ConnectHeaders {
    pub source: SocketAddr,
    pub baggage: String,
}

/// HTTP/2 client handshake over `tls`; the connection is driven by a task of its own, which
/// ends when the peer closes or every sender is dropped.
pub async fn handshake<S: Stream>(
    tls: tokio_boring::SslStream<S>,
    dst: SocketAddr,
    metrics: Arc<Metrics>,
) -> Result<SendRequest<Empty<Bytes>>, HboneError> {
    let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME)
        .keep_alive_interval(PING_INTERVAL)
        .keep_alive_timeout(PING_TIMEOUT)
        .keep_alive_while_idle(true)
        .handshake(TokioIo::new(tls))
        .await?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            let kind = metrics.h2_error("client", &e);
            tracing::info!(%dst, error = %e, kind, "HBONE connection ended by an HTTP/2 error");
        }
    });
    Ok(sender)
}

/// Sends `CONNECT target` on `sender` and waits for the tunnel.
pub async fn connect(
    sender: &mut SendRequest<Empty<Bytes>>,
    target: SocketAddr,
    headers: &ConnectHeaders,
) -> Result<hyper::upgrade::Upgraded, HboneError> {
    sender.ready().await?;
    let req = Request::builder()
        .method(Method::CONNECT)
        .uri(target.to_string())
        .header("forwarded", format!("for=\"{}\"", headers.source))
        .header("baggage", &headers.baggage)
        .header("traceparent", traceparent())
        .body(Empty::<Bytes>::new())
        .map_err(|e| HboneError::H2(e.to_string()))?;
    let resp = sender.send_request(req).await?;
    if resp.status() != StatusCode::OK {
        return Err(HboneError::Status(resp.status()));
    }
    Ok(hyper::upgrade::on(resp).await?)
}

/// An open tunnel: the `CONNECT` stream's bytes, and the pool's lease on a stream slot of its
/// connection, given back when the tunnel is dropped.
pub struct Tunnel {
    io: TokioIo<hyper::upgrade::Upgraded>,
    _lease: super::pool::Lease,
}

impl Tunnel {
    pub(super) fn new(up: hyper::upgrade::Upgraded, lease: super::pool::Lease) -> Tunnel {
        Tunnel { io: TokioIo::new(up), _lease: lease }
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

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// A W3C `traceparent` with fresh random ids.
pub fn traceparent() -> String {
    let mut b = [0u8; 24];
    boring::rand::rand_bytes(&mut b).expect("BoringSSL RNG");
    let hex = |s: &[u8]| s.iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!("00-{}-{}-01", hex(&b[..16]), hex(&b[16..]))
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
    }
}
