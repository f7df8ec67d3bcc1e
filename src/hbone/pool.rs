//! The outbound HBONE connection pool, with ztunnel's semantics:
//! - connections are shared by key (source identity, destination identity, destination address,
//!   source IP);
//! - the first connection of a key is opened once however many callers want it at that moment
//!   (single-flight): the others wait for it, and share its failure if it fails;
//! - a connection carries at most `pool_max_streams` tunnels; the next caller opens another
//!   connection instead of queueing behind the peer's stream limit;
//! - a connection without streams for `pool_idle_timeout` is closed by a timer;
//! - on drain ([`Pool::drain`]) the pool lets every connection go: each sends GOAWAY and TLS
//!   close_notify once its last tunnel has ended, and [`Pool::wait_closed`] waits for that.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::client::{self, ConnectHeaders, H2Client, Tunnel};
use super::{HboneError, Live};
use crate::identity::Identity;
use crate::metrics::Metrics;
use crate::net::netns::Netns;
use crate::net::socket::{dial, DialOpts};
use crate::net::Limits;
use crate::tls::TlsProvider;

/// What makes two outbound connections shareable. A pooled connection belongs to one pod: its
/// workload (`src_pod`, the uid) and identity, never merely to the source address its packets
/// carry, so a pod that binds a neighbour's address does not ride the neighbour's connection.
/// `src_ip` is the address the connection is dialled from (transparent mode).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PoolKey {
    pub src_id: Identity,
    pub src_pod: Arc<str>,
    pub dst_id: Identity,
    /// Other identities the destination may present (its service's subject alt names).
    pub dst_sans: Vec<Identity>,
    pub dst: SocketAddr,
    pub src_ip: IpAddr,
}

/// Opens HBONE to a workload of this node without the network. Given the HBONE address and the
/// client's address, returns the client end of an in-memory pipe whose other end the inbound side
/// serves, or `None` when the address is not a workload of this node. Used in eBPF mode, where a
/// dial to a local pod's 15008 would leave the node's namespace toward the pod itself.
pub type LocalConnector =
    Box<dyn Fn(SocketAddr, SocketAddr) -> Option<tokio::io::DuplexStream> + Send + Sync>;

/// One pooled h2 connection.
struct Conn {
    sender: H2Client,
    /// Tunnels open on it now.
    streams: AtomicUsize,
    /// When the last tunnel on it closed (or when it opened).
    idle_since: Mutex<Instant>,
    /// The worker thread it was opened on, where its h2 task runs ([`crate::net::workers`]).
    home: Option<usize>,
}

/// A tunnel's claim on a stream slot of a pooled connection.
pub struct Lease {
    conn: Arc<Conn>,
}

impl Lease {
    /// The worker thread the connection's h2 task runs on, if it was opened on one.
    pub fn home(&self) -> Option<usize> {
        self.conn.home
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.conn.streams.fetch_sub(1, Ordering::AcqRel) == 1 {
            *self.conn.idle_since.lock().unwrap() = Instant::now();
        }
    }
}

/// The connections of one key.
#[derive(Default)]
struct KeyPool {
    conns: Mutex<Vec<Arc<Conn>>>,
    /// Held while a connection of this key is being opened (single-flight).
    opening: tokio::sync::Mutex<()>,
    /// Opening attempts made so far, and the last failure with the attempt number it ended.
    attempts: AtomicU64,
    failure: Mutex<Option<(u64, String)>>,
}

impl KeyPool {
    /// A stream slot on a live connection with room, if there is one.
    fn lease(&self, max_streams: usize) -> Option<Lease> {
        let conns = self.conns.lock().unwrap();
        let c = conns
            .iter()
            .find(|c| !c.sender.is_closed() && c.streams.load(Ordering::Acquire) < max_streams)?;
        c.streams.fetch_add(1, Ordering::AcqRel);
        Some(Lease { conn: c.clone() })
    }
}

/// The outbound HBONE connection pool.
pub struct Pool {
    tls: Arc<TlsProvider>,
    metrics: Arc<Metrics>,
    mark: u32,
    transparent: bool,
    limits: Limits,
    keys: Mutex<HashMap<PoolKey, Arc<KeyPool>>>,
    local: OnceLock<LocalConnector>,
    /// Connections in the pool (mirrors the `hbone_pool_connections` gauge).
    size: AtomicUsize,
    /// Set by [`Pool::drain`]: connections opened from then on are not pooled.
    draining: AtomicBool,
    /// Every connection the pool opened whose h2 task still runs, pooled or let go.
    live: Live,
}

impl Pool {
    /// A pool; its idle timer runs once [`Pool::start_idle_timer`] is called.
    pub fn new(
        tls: Arc<TlsProvider>,
        metrics: Arc<Metrics>,
        mark: u32,
        transparent: bool,
        limits: Limits,
    ) -> Pool {
        Pool {
            tls,
            metrics,
            mark,
            transparent,
            limits,
            keys: Mutex::new(HashMap::new()),
            local: OnceLock::new(),
            size: AtomicUsize::new(0),
            draining: AtomicBool::new(false),
            live: Live::default(),
        }
    }

    /// Closes connections idle for `pool_idle_timeout`, checking a few times per timeout; the
    /// task ends when the pool is dropped.
    pub fn start_idle_timer(self: &Arc<Self>) {
        let weak: Weak<Pool> = Arc::downgrade(self);
        let every = (self.limits.pool_idle_timeout / 4)
            .clamp(Duration::from_millis(50), Duration::from_secs(30));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(pool) = weak.upgrade() else { return };
                pool.close_idle();
            }
        });
    }

    /// Drops connections that closed, or that have had no stream for the idle timeout, and keys
    /// left without connections. Dropping the last sender ends the h2 connection.
    pub fn close_idle(&self) -> usize {
        let idle = self.limits.pool_idle_timeout;
        let mut removed = 0;
        let mut keys = self.keys.lock().unwrap();
        keys.retain(|_, kp| {
            let mut conns = kp.conns.lock().unwrap();
            let before = conns.len();
            conns.retain(|c| {
                !c.sender.is_closed()
                    && (c.streams.load(Ordering::Acquire) > 0
                        || c.idle_since.lock().unwrap().elapsed() < idle)
            });
            removed += before - conns.len();
            // A key being opened right now stays (its opener will add to it).
            !conns.is_empty() || kp.opening.try_lock().is_err()
        });
        drop(keys);
        if removed > 0 {
            self.size.fetch_sub(removed, Ordering::AcqRel);
            self.metrics.hbone_pool_connections.dec_by(removed as i64);
            tracing::debug!(closed = removed, "closed idle HBONE connections");
        }
        removed
    }

    /// Routes HBONE to this node's own workloads through `f` (set once, at start-up).
    pub fn set_local_connector(&self, f: LocalConnector) {
        let _ = self.local.set(f);
    }

    /// Number of live pooled connections.
    pub fn len(&self) -> usize {
        let keys = self.keys.lock().unwrap();
        keys.values()
            .map(|kp| kp.conns.lock().unwrap().iter().filter(|c| !c.sender.is_closed()).count())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn key_pool(&self, key: &PoolKey) -> Arc<KeyPool> {
        self.keys.lock().unwrap().entry(key.clone()).or_default().clone()
    }

    /// Opens the TLS + h2 connection for `key`.
    async fn connect(&self, key: &PoolKey, netns: Option<&Netns>) -> Result<H2Client, HboneError> {
        if let Some(pipe) =
            self.local.get().and_then(|f| f(key.dst, SocketAddr::new(key.src_ip, 0)))
        {
            let tls = self.handshake(pipe, key).await?;
            let live = self.live.enter();
            return self.h2(key, client::handshake(tls, key.dst, self.metrics.clone(), live)).await;
        }
        let source = self.transparent.then_some(key.src_ip);
        let opts = DialOpts { mark: self.mark, source, netns, timeout: self.limits.dial_timeout };
        let tcp = dial(key.dst, opts).await.map_err(|e| HboneError::Connect(key.dst, e))?;
        let tls = self.handshake(tcp, key).await?;
        let live = self.live.enter();
        self.h2(key, client::handshake(tls, key.dst, self.metrics.clone(), live)).await
    }

    /// The client TLS handshake for `key`: the destination must present its identity or one
    /// of its service's subject alt names.
    async fn handshake<S: crate::tls::Stream>(
        &self,
        io: S,
        key: &PoolKey,
    ) -> Result<tokio_boring::SslStream<crate::net::io::Buffered<S>>, crate::tls::TlsError> {
        if key.dst_sans.is_empty() {
            return self.tls.connect_to(io, &key.src_id, &key.dst_id, Some(key.dst)).await;
        }
        let ids: Vec<Identity> =
            std::iter::once(key.dst_id.clone()).chain(key.dst_sans.iter().cloned()).collect();
        self.tls.connect_to_any(io, &key.src_id, &ids, Some(key.dst)).await
    }

    async fn h2(
        &self,
        key: &PoolKey,
        f: impl std::future::Future<Output = Result<H2Client, HboneError>>,
    ) -> Result<H2Client, HboneError> {
        match tokio::time::timeout(self.limits.handshake_timeout, f).await {
            Ok(r) => r,
            Err(_) => Err(HboneError::H2(format!("HTTP/2 handshake with {} timed out", key.dst))),
        }
    }

    /// A stream slot for `key`: on a pooled connection with room, else on a new connection,
    /// opened once for all the callers that need one at the same moment.
    async fn lease(
        &self,
        kp: &KeyPool,
        key: &PoolKey,
        netns: Option<&Netns>,
    ) -> Result<Lease, HboneError> {
        let max = self.limits.pool_max_streams;
        if let Some(l) = kp.lease(max) {
            return Ok(l);
        }
        let seen = kp.attempts.load(Ordering::Acquire);
        let _opening = kp.opening.lock().await;
        // While this caller waited, another may have opened a connection with room...
        if let Some(l) = kp.lease(max) {
            return Ok(l);
        }
        // ...or failed to: then this caller fails the same way instead of trying again at once.
        if let Some((n, e)) = kp.failure.lock().unwrap().clone() {
            if n > seen {
                return Err(HboneError::Shared(e));
            }
        }
        let r = self.connect(key, netns).await;
        let n = kp.attempts.fetch_add(1, Ordering::AcqRel) + 1;
        let sender = match r {
            Ok(s) => s,
            Err(e) => {
                *kp.failure.lock().unwrap() = Some((n, e.to_string()));
                return Err(e);
            }
        };
        let conn = Arc::new(Conn {
            sender,
            streams: AtomicUsize::new(1),
            idle_since: Mutex::new(Instant::now()),
            home: crate::net::workers::current(),
        });
        {
            // Checked under the key's lock, which `drain` takes after setting the flag: a
            // connection is either pooled before the drain empties the key, or not pooled.
            let mut conns = kp.conns.lock().unwrap();
            if !self.draining.load(Ordering::Acquire) {
                conns.push(conn.clone());
                self.size.fetch_add(1, Ordering::AcqRel);
                self.metrics.hbone_pool_connections.inc();
            }
        }
        Ok(Lease { conn })
    }

    /// Drops the pooled connections of source `ip` (its pod left; its sockets' namespace may be
    /// gone). Streams in flight on them finish.
    pub fn forget_source(&self, ip: IpAddr) {
        let mut removed = 0;
        self.keys.lock().unwrap().retain(|k, kp| {
            if k.src_ip == ip {
                removed += kp.conns.lock().unwrap().len();
            }
            k.src_ip != ip
        });
        if removed > 0 {
            self.size.fetch_sub(removed, Ordering::AcqRel);
            self.metrics.hbone_pool_connections.dec_by(removed as i64);
        }
    }

    /// Shutdown: lets every pooled connection go and pools none from now on. A connection
    /// without tunnels sends GOAWAY and close_notify at once; one with tunnels when its last
    /// ends (dropping the last handle on an h2 client connection closes it that way).
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Release);
        let keys = std::mem::take(&mut *self.keys.lock().unwrap());
        let mut removed = 0;
        for kp in keys.values() {
            removed += std::mem::take(&mut *kp.conns.lock().unwrap()).len();
        }
        if removed > 0 {
            self.size.fetch_sub(removed, Ordering::AcqRel);
            self.metrics.hbone_pool_connections.dec_by(removed as i64);
        }
        tracing::debug!(released = removed, open = self.live.count(), "HBONE pool drained");
    }

    /// Connections opened by the pool that are not closed yet (pooled or let go).
    pub fn open_connections(&self) -> usize {
        self.live.count()
    }

    /// Waits until every connection the pool opened has closed, or `until`; returns how many
    /// are left.
    pub async fn wait_closed(&self, until: tokio::time::Instant) -> usize {
        self.live.wait_closed(until).await
    }

    /// Opens a tunnel to `target` through the node at `key.dst`. New connections are opened in
    /// `netns` when given (in-pod mode).
    pub async fn tunnel(
        &self,
        key: &PoolKey,
        target: &str,
        headers: &ConnectHeaders,
        netns: Option<&Netns>,
    ) -> Result<Tunnel, HboneError> {
        let kp = self.key_pool(key);
        let mut lease = self.lease(&kp, key, netns).await?;
        let mut sender = lease.conn.sender.clone();
        if sender.ready().await.is_err() {
            // The connection died since it was pooled: take (or open) another, once.
            drop(lease);
            lease = self.lease(&kp, key, netns).await?;
            sender = lease.conn.sender.clone();
        }
        let up = client::connect(&mut sender, target, headers).await?;
        Ok(Tunnel::new(up, lease))
    }

    /// Double HBONE, through a network gateway to a destination on another network: an outer
    /// tunnel to the gateway (`key`, pooled, CONNECT `authority`), then mutual TLS *inside* it
    /// with the final destination, which must present one of `inner_ids`, an h2 connection of
    /// its own (not pooled: each reaches whichever endpoint the gateway picks), and the inner
    /// CONNECT to the same `authority` with `x-forwarded-network`.
    pub async fn double(
        &self,
        key: &PoolKey,
        authority: &str,
        headers: &ConnectHeaders,
        inner_ids: &[Identity],
        netns: Option<&Netns>,
    ) -> Result<Tunnel, HboneError> {
        // The origin network goes on the inner CONNECT only, as ztunnel sends it.
        let outer_headers = ConnectHeaders { network: None, ..headers.clone() };
        let outer = self.tunnel(key, authority, &outer_headers, netns).await?;
        let tls = self.tls.connect_to_any(outer, &key.src_id, inner_ids, None).await?;
        let live = self.live.enter();
        let mut inner = client::handshake(tls, key.dst, self.metrics.clone(), live).await?;
        let io = client::connect(&mut inner, authority, headers).await?;
        Ok(Tunnel::inner(io, inner))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_key_distinguishes_every_field() {
        let id = |s: &str| s.parse::<Identity>().unwrap();
        let base = PoolKey {
            src_id: id("spiffe://td/ns/a/sa/a"),
            src_pod: "pod-a".into(),
            dst_id: id("spiffe://td/ns/b/sa/b"),
            dst_sans: vec![],
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
            // Same identity, same address, another pod: its own connection.
            PoolKey { src_pod: "pod-b".into(), ..base.clone() },
        ] {
            assert!(set.insert(k), "each field separates pools");
        }
    }
}
