//! HBONE: TCP carried in HTTP/2 `CONNECT` streams over mutual TLS. The client side pools h2
//! connections keyed as ztunnel keys them (source identity, destination identity, destination
//! address, source IP); the server side validates each `CONNECT` before it answers.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Empty;
use hyper::client::conn::http2::SendRequest;
use hyper::upgrade::Upgraded;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

use crate::identity::Identity;
use crate::inpod::netns::Netns;
use crate::metrics::Metrics;
use crate::proxy::socket::{dial, DialOpts};
use crate::tls::{Stream, TlsError, TlsProvider};

/// h2 settings as ztunnel's: large windows and frames, keepalive pings.
pub const STREAM_WINDOW: u32 = 4 * 1024 * 1024;
pub const CONNECTION_WINDOW: u32 = 16 * 1024 * 1024;
pub const MAX_FRAME: u32 = 1024 * 1024;
pub const PING_INTERVAL: Duration = Duration::from_secs(10);
pub const PING_TIMEOUT: Duration = Duration::from_secs(20);
pub const MAX_STREAMS: u32 = 100;
pub const POOL_IDLE: Duration = Duration::from_secs(300);

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
}

impl From<hyper::Error> for HboneError {
    fn from(e: hyper::Error) -> Self {
        HboneError::H2(e.to_string())
    }
}

/// What makes two outbound connections shareable.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PoolKey {
    pub src_id: Identity,
    pub dst_id: Identity,
    pub dst: SocketAddr,
    pub src_ip: IpAddr,
}

struct Pooled {
    sender: SendRequest<Empty<Bytes>>,
    last_used: Instant,
}

/// Opens HBONE to a workload of this node without the network. Given the HBONE address and the
/// client's address, returns the client end of an in-memory pipe whose other end the inbound side
/// serves, or `None` when the address is not a workload of this node. Used in eBPF mode, where a
/// dial to a local pod's 15008 would leave the node's namespace toward the pod itself.
pub type LocalConnector =
    Box<dyn Fn(SocketAddr, SocketAddr) -> Option<tokio::io::DuplexStream> + Send + Sync>;

/// The outbound HBONE connection pool.
pub struct Pool {
    tls: Arc<TlsProvider>,
    metrics: Arc<Metrics>,
    mark: u32,
    transparent: bool,
    conns: Mutex<HashMap<PoolKey, Pooled>>,
    local: std::sync::OnceLock<LocalConnector>,
}

/// Headers of one HBONE request.
pub struct ConnectHeaders {
    pub source: SocketAddr,
    pub baggage: String,
}

impl Pool {
    pub fn new(tls: Arc<TlsProvider>, metrics: Arc<Metrics>, mark: u32, transparent: bool) -> Pool {
        Pool {
            tls,
            metrics,
            mark,
            transparent,
            conns: Mutex::new(HashMap::new()),
            local: std::sync::OnceLock::new(),
        }
    }

    /// Routes HBONE to this node's own workloads through `f` (set once, at start-up).
    pub fn set_local_connector(&self, f: LocalConnector) {
        let _ = self.local.set(f);
    }

    /// Number of live pooled connections.
    pub fn len(&self) -> usize {
        self.conns.lock().unwrap().values().filter(|p| !p.sender.is_closed()).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn checkout(&self, key: &PoolKey) -> Option<SendRequest<Empty<Bytes>>> {
        let mut conns = self.conns.lock().unwrap();
        conns.retain(|_, p| !p.sender.is_closed() && p.last_used.elapsed() < POOL_IDLE);
        self.metrics.hbone_pool_connections.set(conns.len() as i64);
        let p = conns.get_mut(key)?;
        p.last_used = Instant::now();
        Some(p.sender.clone())
    }

    async fn connect(
        &self,
        key: &PoolKey,
        netns: Option<&Netns>,
    ) -> Result<SendRequest<Empty<Bytes>>, HboneError> {
        if let Some(pipe) =
            self.local.get().and_then(|f| f(key.dst, SocketAddr::new(key.src_ip, 0)))
        {
            let tls = self.tls.connect(pipe, &key.src_id, &key.dst_id).await?;
            return self.handshake(key, tls).await;
        }
        let source = self.transparent.then_some(key.src_ip);
        let tcp = dial(key.dst, DialOpts { mark: self.mark, source, netns })
            .await
            .map_err(|e| HboneError::Connect(key.dst, e))?;
        let tls = self.tls.connect(tcp, &key.src_id, &key.dst_id).await?;
        self.handshake(key, tls).await
    }

    /// HTTP/2 over an established TLS stream; the connection joins the pool.
    async fn handshake<S: Stream>(
        &self,
        key: &PoolKey,
        tls: tokio_boring::SslStream<S>,
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
        let dst = key.dst;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%dst, error = %e, "HBONE connection ended");
            }
        });
        let mut conns = self.conns.lock().unwrap();
        conns.insert(key.clone(), Pooled { sender: sender.clone(), last_used: Instant::now() });
        self.metrics.hbone_pool_connections.set(conns.len() as i64);
        Ok(sender)
    }

    /// Drops the pooled connections of source `ip` (its pod left; its sockets' namespace may be
    /// gone). Streams in flight on them finish.
    pub fn forget_source(&self, ip: IpAddr) {
        let mut conns = self.conns.lock().unwrap();
        conns.retain(|k, _| k.src_ip != ip);
        self.metrics.hbone_pool_connections.set(conns.len() as i64);
    }

    /// Opens a tunnel to `target` through the node at `key.dst`, reusing a pooled connection when
    /// one is usable. New connections are opened in `netns` when given (in-pod mode).
    pub async fn tunnel(
        &self,
        key: &PoolKey,
        target: SocketAddr,
        headers: &ConnectHeaders,
        netns: Option<&Netns>,
    ) -> Result<Upgraded, HboneError> {
        let mut sender = match self.checkout(key) {
            Some(s) => s,
            None => self.connect(key, netns).await?,
        };
        if sender.ready().await.is_err() {
            sender = self.connect(key, netns).await?;
        }
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
}

/// A W3C `traceparent` with fresh random ids.
pub fn traceparent() -> String {
    let mut b = [0u8; 24];
    boring::rand::rand_bytes(&mut b).expect("BoringSSL RNG");
    let hex = |s: &[u8]| s.iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!("00-{}-{}-01", hex(&b[..16]), hex(&b[16..]))
}

/// The server-side h2 builder with ztunnel's settings.
pub fn server_builder() -> hyper::server::conn::http2::Builder<TokioExecutor> {
    let mut b = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    b.timer(TokioTimer::new())
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME)
        .max_concurrent_streams(MAX_STREAMS)
        .keep_alive_interval(PING_INTERVAL)
        .keep_alive_timeout(PING_TIMEOUT);
    b
}

/// Why a `CONNECT` is refused, with its status code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnectRefusal {
    #[error("method {0} is not CONNECT")]
    Method(String),
    #[error("authority '{0}' is not ip:port")]
    Authority(String),
    #[error(
        "authority ip {authority} differs from the address the connection reached ({reached})"
    )]
    AddressMismatch { authority: IpAddr, reached: IpAddr },
    #[error("target {0} is not a workload on this node")]
    UnknownTarget(SocketAddr),
    #[error("upstream {0} unreachable: {1}")]
    Upstream(SocketAddr, String),
    #[error("target {0} is one of the proxy's own ports in the pod: would loop")]
    Loop(SocketAddr),
}

impl ConnectRefusal {
    pub fn status(&self) -> StatusCode {
        match self {
            ConnectRefusal::Method(_) => StatusCode::METHOD_NOT_ALLOWED,
            ConnectRefusal::Authority(_)
            | ConnectRefusal::AddressMismatch { .. }
            | ConnectRefusal::UnknownTarget(_)
            | ConnectRefusal::Loop(_) => StatusCode::BAD_REQUEST,
            ConnectRefusal::Upstream(..) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// Short label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            ConnectRefusal::Method(_) => "bad_method",
            ConnectRefusal::Authority(_) => "bad_authority",
            ConnectRefusal::AddressMismatch { .. } => "address_mismatch",
            ConnectRefusal::UnknownTarget(_) => "unknown_target",
            ConnectRefusal::Upstream(..) => "upstream_unreachable",
            ConnectRefusal::Loop(_) => "loop",
        }
    }
}

/// Checks method and authority form of a `CONNECT`; returns the target.
pub fn parse_connect<B>(req: &Request<B>) -> Result<SocketAddr, ConnectRefusal> {
    if req.method() != Method::CONNECT {
        return Err(ConnectRefusal::Method(req.method().to_string()));
    }
    let auth = req.uri().authority().map(|a| a.as_str().to_string()).unwrap_or_default();
    auth.parse::<SocketAddr>().map_err(|_| ConnectRefusal::Authority(auth))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_key_distinguishes_every_field() {
        let id = |s: &str| s.parse::<Identity>().unwrap();
        let base = PoolKey {
            src_id: id("spiffe://td/ns/a/sa/a"),
            dst_id: id("spiffe://td/ns/b/sa/b"),
            dst: "10.0.0.2:15008".parse().unwrap(),
            src_ip: "10.0.0.1".parse().unwrap(),
        };
        let mut set = std::collections::HashSet::new();
        set.insert(base.clone());
        assert!(!set.insert(base.clone()), "equal keys share");
        for k in [
            PoolKey { src_id: id("spiffe://td/ns/a/sa/x"), ..base.clone() },
            PoolKey { dst_id: id("spiffe://td/ns/b/sa/x"), ..base.clone() },
            PoolKey { dst: "10.0.0.3:15008".parse().unwrap(), ..base.clone() },
            PoolKey { src_ip: "10.0.0.9".parse().unwrap(), ..base.clone() },
        ] {
            assert!(set.insert(k), "each field separates pools");
        }
    }

    #[test]
    fn connect_validation() {
        let r = |m: Method, uri: &str| Request::builder().method(m).uri(uri).body(()).unwrap();
        assert_eq!(
            parse_connect(&r(Method::CONNECT, "10.1.2.3:80")),
            Ok("10.1.2.3:80".parse().unwrap())
        );
        assert_eq!(
            parse_connect(&r(Method::CONNECT, "[fd00::1]:80")),
            Ok("[fd00::1]:80".parse().unwrap())
        );
        let e = parse_connect(&r(Method::GET, "http://10.1.2.3/")).unwrap_err();
        assert_eq!(e.status(), StatusCode::METHOD_NOT_ALLOWED);
        let e = parse_connect(&r(Method::CONNECT, "example.com:80")).unwrap_err();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert!(e.to_string().contains("example.com:80"));
    }

    #[test]
    fn traceparent_shape() {
        let t = traceparent();
        assert_eq!(t.len(), 55);
        assert!(t.starts_with("00-") && t.ends_with("-01"));
        assert_ne!(t, traceparent());
    }
}
