//! Drain on shutdown, as an HBONE peer sees it: every HBONE connection, inbound and pooled, ends
//! with an HTTP/2 GOAWAY and then a TLS close_notify before its socket closes (a ztunnel peer
//! logs an error for a connection that just drops). The peers here are raw: they read frames
//! and answer PING and SETTINGS by hand, so nothing in between hides what arrived.
//! Addresses: 127.0.106.x (inbound), 127.0.107.x (pool).

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use boring::ssl::SslRef;
use common::*;
use foreign_types::ForeignTypeRef;
use mbtunnel::config::KeyAlgorithm;
use mbtunnel::identity::ca::DevCa;
use mbtunnel::identity::store::CertStore;
use mbtunnel::metrics::Metrics;
use mbtunnel::signer::Signer;
use mbtunnel::tls::TlsProvider;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_boring::SslStream;

const CLIENT: &str = "spiffe://cluster.local/ns/demo/sa/client";
const ECHO: &str = "spiffe://cluster.local/ns/demo/sa/echo";
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0;
const HEADERS: u8 = 1;
const SETTINGS: u8 = 4;
const PING: u8 = 6;
const GOAWAY: u8 = 7;
const ACK: u8 = 1;
const END_STREAM: u8 = 1;
const END_HEADERS: u8 = 4;

/// A TLS endpoint of our own with certificates from `ca_dir`'s CA.
fn tls_provider(ca_dir: &std::path::Path) -> Arc<TlsProvider> {
    let ca = DevCa::load_or_create(ca_dir, "cluster.local").unwrap();
    let store = Arc::new(CertStore::new(ca, KeyAlgorithm::EcdsaP256, Duration::from_secs(3600)));
    let mut reg = Registry::default();
    Arc::new(TlsProvider::new(
        store,
        Signer::start(mbtunnel::signer::SignerConfig { threads: 1, ..Default::default() }),
        "cluster.local".into(),
        Arc::new(Metrics::new(&mut reg)),
    ))
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let n = payload.len() as u32;
    let mut f = vec![(n >> 16) as u8, (n >> 8) as u8, n as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
}

/// Whether the peer's close_notify has been read (BoringSSL's `SSL_get_shutdown`; `boring`
/// offers it only on its blocking stream type).
fn close_notify_received(ssl: &SslRef) -> bool {
    // SAFETY: `ssl` is a live SSL object borrowed for the call; the function only reads a flag.
    let bits = unsafe { boring_sys::SSL_get_shutdown(ssl.as_ptr()) };
    bits & boring_sys::SSL_RECEIVED_SHUTDOWN != 0
}

/// One end of an h2 connection over TLS, spoken by hand.
struct RawPeer<S> {
    io: SslStream<S>,
    buf: Vec<u8>,
    /// Every frame type received, in order.
    kinds: Vec<u8>,
    /// How long a PING waits for its answer: a peer a round trip away.
    pong_delay: Duration,
}

impl<S: AsyncRead + AsyncWrite + Unpin> RawPeer<S> {
    fn new(io: SslStream<S>) -> Self {
        RawPeer { io, buf: Vec::new(), kinds: Vec::new(), pong_delay: Duration::ZERO }
    }

    async fn send(&mut self, bytes: &[u8]) {
        // The peer may already have closed; what it received is what the test checks.
        let _ = self.io.write_all(bytes).await;
        let _ = self.io.flush().await;
    }

    /// The next frame, answering PING and SETTINGS on the way; `None` at the end of the stream,
    /// with how it ended: `Ok(true)` when the peer sent close_notify, `Ok(false)` when the
    /// transport just ended, `Err` on a read error (a reset).
    async fn next(&mut self) -> Result<Frame, Result<bool, String>> {
        loop {
            if self.buf.len() >= 9 {
                let len = usize::from(self.buf[0]) << 16
                    | usize::from(self.buf[1]) << 8
                    | usize::from(self.buf[2]);
                if self.buf.len() >= 9 + len {
                    let f: Vec<u8> = self.buf.drain(..9 + len).collect();
                    let (kind, flags) = (f[3], f[4]);
                    let stream = u32::from_be_bytes([f[5], f[6], f[7], f[8]]) & 0x7fff_ffff;
                    self.kinds.push(kind);
                    if kind == PING && flags & ACK == 0 {
                        tokio::time::sleep(self.pong_delay).await;
                        self.send(&frame(PING, ACK, 0, &f[9..])).await;
                    }
                    if kind == SETTINGS && flags & ACK == 0 {
                        self.send(&frame(SETTINGS, ACK, 0, &[])).await;
                    }
                    return Ok(Frame { kind, flags, stream });
                }
            }
            let mut chunk = [0u8; 16 * 1024];
            match self.io.read(&mut chunk).await {
                Ok(0) => {
                    // BoringSSL reports a bare TCP end as end of stream too: the shutdown
                    // state tells whether close_notify came first.
                    return Err(Ok(close_notify_received(self.io.ssl())));
                }
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) => return Err(Err(e.to_string())),
            }
        }
    }

    /// Reads (and answers) frames until the stream ends; returns how it ended.
    async fn until_end(&mut self) -> Result<bool, String> {
        loop {
            if let Err(end) = self.next().await {
                return end;
            }
        }
    }
}

/// An inbound HBONE connection whose peer is idle when the proxy drains: it receives GOAWAY,
/// then close_notify, then the end of the stream; and the drain waited for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbound_hbone_connection_gets_goaway_then_close_notify_on_drain() {
    let net = 106;
    let ca_dir = temp_dir(&format!("drain{net}"));
    let b = mbtunnel::app::start(config(net, "node-b", &ca_dir, "echo", "ecdsa-p256"), None)
        .await
        .expect("start B");
    assert!(b.wait_ready(Duration::from_secs(30)).await);
    let tls = tls_provider(&ca_dir);
    let tcp = tokio::net::TcpStream::connect(b.bound.inbound).await.unwrap();
    let io = tls.connect(tcp, &CLIENT.parse().unwrap(), &ECHO.parse().unwrap()).await.unwrap();
    let mut peer = RawPeer::new(io);
    peer.send(PREFACE).await;
    peer.send(&frame(SETTINGS, 0, 0, &[])).await;
    // The server's SETTINGS: the connection is in its h2 phase.
    let first = peer.next().await.expect("the server's SETTINGS");
    assert_eq!(first.kind, SETTINGS);
    // The final GOAWAY waits for a PING round trip: a slow one shows whether the drain waits.
    peer.pong_delay = Duration::from_millis(300);

    let (left, end) = tokio::join!(b.shutdown(), async {
        tokio::time::timeout(Duration::from_secs(20), peer.until_end()).await
    });
    let end = end.expect("the connection stayed open after the drain");
    assert!(peer.kinds.contains(&GOAWAY), "no GOAWAY: {:?}", peer.kinds);
    assert_eq!(end, Ok(true), "the stream ended without close_notify (frames {:?})", peer.kinds);
    assert_eq!(left, 0, "the drain waited for the connection to close, within its deadline");
    let _ = std::fs::remove_dir_all(&ca_dir);
}

/// A pooled outbound HBONE connection, idle when the proxy drains: the server at the far end
/// (a plain h2 server spoken by hand) receives GOAWAY, then close_notify.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_hbone_connection_sends_goaway_then_close_notify_on_drain() {
    let net = 107;
    let ca_dir = temp_dir(&format!("drain{net}"));
    // The destination node's HBONE address: this test's server instead of a proxy.
    let hbone = tokio::net::TcpListener::bind(SocketAddr::new(ip(net, 3), 15008)).await.unwrap();
    let a = mbtunnel::app::start(config(net, "node-a", &ca_dir, "echo", "ecdsa-p256"), None)
        .await
        .expect("start A");
    assert!(a.wait_ready(Duration::from_secs(30)).await);
    let tls = tls_provider(&ca_dir);
    let (seen_tx, seen_rx) = tokio::sync::oneshot::channel();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let (tcp, _) = hbone.accept().await.unwrap();
        let (io, peer_id) = tls.accept(tcp, &ECHO.parse().unwrap()).await.expect("mTLS");
        assert_eq!(peer_id.to_string(), CLIENT);
        let mut preface = [0u8; 24];
        let mut io = io;
        io.read_exact(&mut preface).await.unwrap();
        assert_eq!(preface, PREFACE);
        let mut peer = RawPeer::new(io);
        peer.send(&frame(SETTINGS, 0, 0, &[])).await;
        // One CONNECT: answered 200 (HPACK static index 8), then its end answered with ours.
        loop {
            let f = peer.next().await.expect("the CONNECT");
            if f.kind == HEADERS {
                peer.send(&frame(HEADERS, END_HEADERS, f.stream, &[0x88])).await;
                if f.flags & END_STREAM != 0 {
                    peer.send(&frame(DATA, END_STREAM, f.stream, &[])).await;
                    break;
                }
            }
            if f.kind == DATA && f.flags & END_STREAM != 0 {
                peer.send(&frame(DATA, END_STREAM, f.stream, &[])).await;
                break;
            }
        }
        let _ = seen_tx.send(());
        // Idle in the pool until the proxy drains.
        let _ = done_rx.await;
        let end = tokio::time::timeout(Duration::from_secs(20), peer.until_end()).await;
        (end, peer.kinds)
    });

    // A tunnel through the pool: the client half-closes at once and reads to the end.
    let mut c = client(net).await;
    c.shutdown().await.unwrap();
    let mut back = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), c.read_to_end(&mut back))
        .await
        .expect("the tunnel did not end")
        .unwrap();
    seen_rx.await.expect("the server saw the CONNECT");
    assert!(wait_for(|| a.ctx.drain.active() == 0).await, "the tunnel's record did not close");
    let _ = done_tx.send(());
    let left = a.shutdown().await;
    let (end, kinds) = server.await.unwrap();
    let end = end.expect("the pooled connection stayed open after the drain");
    assert!(kinds.contains(&GOAWAY), "no GOAWAY: {kinds:?}");
    assert_eq!(end, Ok(true), "the stream ended without close_notify (frames {kinds:?})");
    assert_eq!(left, 0);
    let _ = std::fs::remove_dir_all(&ca_dir);
}
