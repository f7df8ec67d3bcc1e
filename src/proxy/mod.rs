//! Listeners and connection handling: outbound (15001), inbound HBONE (15008), inbound plaintext
//! (15006), drain on shutdown, and one metrics/access-log record per proxied connection.
#![forbid(unsafe_code)]

pub mod inbound;
pub mod outbound;
pub mod socket;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{watch, Notify};

use crate::hbone::Pool;
use crate::metrics::{ConnLabels, Metrics};
use crate::state::State;
use crate::tls::TlsProvider;

/// Everything a connection handler needs.
pub struct Ctx {
    pub state: Arc<State>,
    pub tls: Arc<TlsProvider>,
    pub pool: Arc<Pool>,
    pub metrics: Arc<Metrics>,
    pub drain: Drain,
    pub mark: u32,
    pub transparent: bool,
    /// The proxy's own listener addresses (connections to them are loops).
    pub own_addrs: Vec<SocketAddr>,
    /// Open inbound connections, re-checked when authorization changes.
    pub conns: Arc<ConnRegistry>,
}

/// Shutdown coordination: a trigger, watchers, and a count of in-flight connections.
#[derive(Clone)]
pub struct Drain {
    tx: Arc<watch::Sender<bool>>,
    active: Arc<AtomicUsize>,
    idle: Arc<Notify>,
}

impl Default for Drain {
    fn default() -> Self {
        Drain {
            tx: Arc::new(watch::channel(false).0),
            active: Arc::new(AtomicUsize::new(0)),
            idle: Arc::new(Notify::new()),
        }
    }
}

/// Held by each in-flight connection.
pub struct DrainGuard(Drain);

impl Drop for DrainGuard {
    fn drop(&mut self) {
        if self.0.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Drain {
    pub fn start(&self) {
        self.tx.send_replace(true);
    }

    pub fn is_draining(&self) -> bool {
        *self.tx.borrow()
    }

    /// Resolves when draining starts.
    pub async fn signaled(&self) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|d| *d).await;
    }

    pub fn guard(&self) -> DrainGuard {
        self.active.fetch_add(1, Ordering::AcqRel);
        DrainGuard(self.clone())
    }

    pub fn active(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }

    /// Waits until no connection is in flight or `deadline` passes; returns what is left.
    pub async fn wait_idle(&self, deadline: Duration) -> usize {
        let end = Instant::now() + deadline;
        loop {
            let notified = self.idle.notified();
            if self.active() == 0 {
                return 0;
            }
            if tokio::time::timeout_at(end.into(), notified).await.is_err() {
                return self.active();
            }
        }
    }
}

/// One proxied connection's bookkeeping: opened/closed counters, bytes, access log.
pub struct ConnRecord {
    metrics: Arc<Metrics>,
    labels: ConnLabels,
    src: SocketAddr,
    dst: SocketAddr,
    start: Instant,
    _guard: DrainGuard,
}

impl ConnRecord {
    pub fn open(ctx: &Ctx, src: SocketAddr, dst: SocketAddr, labels: ConnLabels) -> ConnRecord {
        ctx.metrics.opened.get_or_create(&labels).inc();
        ctx.metrics.active_connections.inc();
        ConnRecord {
            metrics: ctx.metrics.clone(),
            labels,
            src,
            dst,
            start: Instant::now(),
            _guard: ctx.drain.guard(),
        }
    }

    /// A connection refused by authorization: counted as opened and closed with
    /// `response_flags="DENY"` (as ztunnel labels it), and in the access log with the reason.
    pub fn denied(
        ctx: &Ctx,
        src: SocketAddr,
        dst: SocketAddr,
        mut labels: ConnLabels,
        reason: &str,
    ) {
        labels.response_flags = "DENY".into();
        ctx.metrics.opened.get_or_create(&labels).inc();
        ctx.metrics.closed.get_or_create(&labels).inc();
        ctx.metrics.refuse("authorization_denied");
        tracing::warn!(target: "access", src = %src, dst = %dst,
            src_identity = %labels.source_principal, dst_identity = %labels.destination_principal,
            dst_workload = %labels.destination_workload, result = "denied", reason = %reason,
            "connection denied");
    }

    /// Closes the record: `received` = bytes from the client toward the destination, `sent` =
    /// bytes back to the client (Istio's meaning of the TCP byte counters).
    pub fn close(mut self, received: u64, sent: u64, result: Result<(), String>) {
        if result.is_err() {
            self.labels.response_flags = "UF".into();
        }
        self.metrics.received.get_or_create(&self.labels).inc_by(received);
        self.metrics.sent.get_or_create(&self.labels).inc_by(sent);
        self.metrics.closed.get_or_create(&self.labels).inc();
        self.metrics.active_connections.dec();
        let l = &self.labels;
        let duration_ms = self.start.elapsed().as_millis() as u64;
        match result {
            Ok(()) => tracing::info!(target: "access", src = %self.src, dst = %self.dst,
                src_identity = %l.source_principal, dst_identity = %l.destination_principal,
                src_workload = %l.source_workload, dst_workload = %l.destination_workload,
                bytes_received = received, bytes_sent = sent, duration_ms, result = "ok",
                "connection complete"),
            Err(e) => tracing::warn!(target: "access", src = %self.src, dst = %self.dst,
                src_identity = %l.source_principal, dst_identity = %l.destination_principal,
                src_workload = %l.source_workload, dst_workload = %l.destination_workload,
                bytes_received = received, bytes_sent = sent, duration_ms, result = "error",
                error = %e, "connection failed"),
        }
    }
}

/// Copies both ways until both sides closed, handling half-close; returns (a→b, b→a) bytes.
pub async fn copy_both<A, B>(a: &mut A, b: &mut B) -> (u64, u64, Result<(), String>)
where
    A: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + ?Sized,
    B: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + ?Sized,
{
    // copy_bidirectional shuts down the write side of one peer when the other reaches EOF.
    match tokio::io::copy_bidirectional_with_sizes(a, b, 64 * 1024, 64 * 1024).await {
        Ok((ab, ba)) => (ab, ba, Ok(())),
        Err(e) => (0, 0, Err(e.to_string())),
    }
}

/// Accepts on `listener` until drain, spawning `handle` per connection.
pub async fn accept_loop<F, Fut>(
    name: &'static str,
    listener: tokio::net::TcpListener,
    drain: Drain,
    handle: F,
) where
    F: Fn(tokio::net::TcpStream, SocketAddr) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    loop {
        tokio::select! {
            biased;
            _ = drain.signaled() => {
                tracing::info!(listener = name, "draining: stopped accepting");
                return;
            }
            r = listener.accept() => match r {
                Ok((s, peer)) => {
                    let _ = s.set_nodelay(true);
                    // A dual-stack listener reports IPv4 peers as ::ffff:a.b.c.d.
                    tokio::spawn(handle(s, socket::canonical(peer)));
                }
                Err(e) => {
                    tracing::warn!(listener = name, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

/// Open inbound connections with what authorization needs to re-check them when the policies
/// change (as ztunnel's connection manager does); a connection now denied is told to close.
#[derive(Default)]
pub struct ConnRegistry {
    next: std::sync::atomic::AtomicU64,
    open: std::sync::Mutex<std::collections::HashMap<u64, Tracked>>,
}

struct Tracked {
    dst_uid: String,
    src: Option<crate::identity::Identity>,
    principal: Option<String>,
    src_ip: std::net::IpAddr,
    dst: SocketAddr,
    close: watch::Sender<Option<String>>,
}

/// Held by a tracked connection; deregisters on drop.
pub struct Registered {
    reg: Arc<ConnRegistry>,
    id: u64,
    /// Turns `Some(reason)` when the connection must close.
    pub closed: watch::Receiver<Option<String>>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.reg.open.lock().unwrap().remove(&self.id);
    }
}

impl ConnRegistry {
    pub fn register(
        self: &Arc<Self>,
        dst_uid: &str,
        src: Option<&crate::identity::Identity>,
        src_ip: std::net::IpAddr,
        dst: SocketAddr,
    ) -> Registered {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (close, closed) = watch::channel(None);
        self.open.lock().unwrap().insert(
            id,
            Tracked {
                dst_uid: dst_uid.to_string(),
                src: src.cloned(),
                principal: src.map(crate::authz::principal_of),
                src_ip,
                dst,
                close,
            },
        );
        Registered { reg: self.clone(), id, closed }
    }

    pub fn len(&self) -> usize {
        self.open.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Re-checks every open connection against the current state; closes those now denied
    /// (or whose destination left). Returns how many were closed.
    pub fn recheck(&self, state: &crate::state::Store) -> usize {
        let open = self.open.lock().unwrap();
        let mut closed = 0;
        for t in open.values() {
            if t.close.borrow().is_some() {
                continue;
            }
            let verdict = match state.workload_by_uid(&t.dst_uid) {
                None => Some("the destination workload left the mesh".to_string()),
                Some(w) => {
                    let c = crate::authz::Conn {
                        src: t.src.as_ref(),
                        principal: t.principal.as_deref(),
                        src_ip: t.src_ip,
                        dst_ip: t.dst.ip(),
                        dst_port: t.dst.port(),
                    };
                    let d = crate::authz::decide(state, &w, &c, None);
                    (!d.allowed()).then(|| d.reason())
                }
            };
            if let Some(reason) = verdict {
                tracing::warn!(src = %t.src_ip, dst = %t.dst, identity = ?t.src.as_ref().map(|i| i.to_string()),
                    reason = %reason, "authorization changed: closing an open connection");
                t.close.send_replace(Some(reason));
                closed += 1;
            }
        }
        closed
    }
}

/// Re-checks open inbound connections whenever the mesh state changes.
pub async fn run_recheck(ctx: Arc<Ctx>) {
    let mut rx = ctx.state.subscribe();
    while rx.changed().await.is_ok() {
        let n = ctx.conns.recheck(&ctx.state);
        if n > 0 {
            ctx.metrics
                .refused
                .get_or_create(&crate::metrics::RefusalLabels { reason: "authorization_revoked" })
                .inc_by(n as u64);
        }
    }
}
