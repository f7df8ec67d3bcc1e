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
