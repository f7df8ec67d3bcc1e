//! Listeners and connection handling: outbound (15001), inbound HBONE (15008), inbound plaintext
//! (15006), drain on shutdown, and one metrics/access-log record per proxied connection.
#![forbid(unsafe_code)]

pub mod admission;
pub mod drain;
pub mod inbound;
pub mod outbound;
pub mod registry;
pub mod target;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::hbone::Pool;
use crate::metrics::{ConnKey, ConnLabels, Metrics};
use crate::net::Workers;
use crate::ratelog::RateLog;
use crate::state::State;
use crate::tls::TlsProvider;

pub use admission::{Pending, PendingHandshakes};
pub use drain::{drain_cut, Drain, DrainGuard};
pub use registry::{run_recheck, ConnRegistry, Registered};

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
    /// Timeouts and caps on the connection path.
    pub limits: crate::net::Limits,
    /// Inbound HBONE connections still in their TLS handshake (all 15008 listeners).
    pub pending: Arc<PendingHandshakes>,
    /// The threads connections run on.
    pub workers: Arc<Workers>,
    /// Per-connection lines a peer can cause (refusals, HTTP/2 errors): one a second per
    /// (site, reason), the rest at debug (see `crate::ratelog`).
    pub peer_logs: RateLog<(&'static str, &'static str)>,
    /// The DNS proxy (in-pod mode: opened in each pod), when enabled.
    pub dns: Option<Arc<crate::dns::Dns>>,
    /// The node's resolvers: hostname workloads are resolved through them.
    pub upstream: Arc<crate::dns::Upstream>,
}

impl Ctx {
    /// Options for a socket toward the network or an application.
    pub fn dial_opts<'a>(
        &self,
        source: Option<std::net::IpAddr>,
        netns: Option<&'a crate::net::netns::Netns>,
    ) -> crate::net::socket::DialOpts<'a> {
        crate::net::socket::DialOpts {
            mark: self.mark,
            source,
            netns,
            timeout: self.limits.dial_timeout,
        }
    }
}

/// One proxied connection's bookkeeping: opened/closed counters, bytes, access log.
///
/// It keeps the span it was opened in (the connection's: id, source, destination) and logs its
/// end inside it, so the relay between open and close can run outside any span: entering a span
/// costs the log filter two lock reads, and a relay is polled for every chunk it moves.
pub struct ConnRecord {
    metrics: Arc<Metrics>,
    /// Boxed (over 500 bytes inline): a record moves with its connection, from set-up to relay
    /// and between workers, and each move of a future that holds it copies it.
    key: Box<ConnKey>,
    src: SocketAddr,
    dst: SocketAddr,
    start: Instant,
    span: tracing::Span,
    _guard: DrainGuard,
}

impl ConnRecord {
    pub fn open(ctx: &Ctx, src: SocketAddr, dst: SocketAddr, labels: ConnLabels) -> ConnRecord {
        let key = Box::new(ConnKey::new(labels));
        ctx.metrics.opened.get_or_create(&key).inc();
        ctx.metrics.active_connections.inc();
        ConnRecord {
            metrics: ctx.metrics.clone(),
            key,
            src,
            dst,
            start: Instant::now(),
            span: tracing::Span::current(),
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
        let key = ConnKey::new(labels);
        ctx.metrics.opened.get_or_create(&key).inc();
        ctx.metrics.closed.get_or_create(&key).inc();
        let labels = key.labels();
        ctx.metrics.refuse("authorization_denied");
        tracing::warn!(target: "access", src = %src, dst = %dst,
            src_identity = %labels.source_principal, dst_identity = %labels.destination_principal,
            dst_workload = %labels.destination_workload, result = "denied", reason = %reason,
            "connection denied");
    }

    /// Closes the record with what the copy moved (client → destination, destination → client).
    pub fn finish(self, c: Copied) {
        self.close(c.ab, c.ba, c.result)
    }

    /// Closes the record: `received` = bytes from the client toward the destination, `sent` =
    /// bytes back to the client (Istio's meaning of the TCP byte counters).
    pub fn close(mut self, received: u64, sent: u64, result: Result<(), String>) {
        if result.is_err() {
            *self.key = self.key.with_flags("UF");
        }
        let key = &*self.key;
        self.metrics.received.get_or_create(key).inc_by(received);
        self.metrics.sent.get_or_create(key).inc_by(sent);
        self.metrics.closed.get_or_create(key).inc();
        self.metrics.active_connections.dec();
        let l = key.labels();
        let duration_ms = self.start.elapsed().as_millis() as u64;
        let _in = self.span.enter();
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

/// What one proxied connection moved: `ab` from the first side to the second, `ba` back, counted
/// as the bytes are written, so a connection that fails half-way reports what it moved.
#[derive(Debug)]
pub struct Copied {
    pub ab: u64,
    pub ba: u64,
    pub result: Result<(), String>,
}

/// One direction of a copy: the chunk in flight, what was written, and how large the next read
/// may be.
struct Half {
    /// Where reads from a TCP leg land; each chunk is split off and handed on without a copy.
    buf: bytes::BytesMut,
    /// Read and not yet written.
    chunk: bytes::Bytes,
    /// Size of the next read: doubles while reads fill it, up to [`MAX_READ`].
    want: usize,
    written: u64,
    eof: bool,
    unflushed: bool,
    done: bool,
}

/// First read of a connection; reads grow from here while they fill, and do not shrink back.
const MIN_READ: usize = 16 * 1024;
/// Largest read: one chunk handed to the other leg at once (an h2 DATA frame on HBONE).
const MAX_READ: usize = 256 * 1024;

impl Half {
    fn new() -> Half {
        Half {
            buf: bytes::BytesMut::new(),
            chunk: bytes::Bytes::new(),
            want: MIN_READ,
            written: 0,
            eof: false,
            unflushed: false,
            done: false,
        }
    }

    /// Moves bytes from `r` to `w` until `r` ends (then shuts `w` down), an error, or pending.
    fn poll_copy<R: Leg + ?Sized, W: Leg + ?Sized>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        r: &mut R,
        w: &mut W,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::{ready, Poll};
        loop {
            if self.chunk.is_empty() && !self.eof {
                match r.poll_read_chunk(cx, &mut self.buf, self.want) {
                    Poll::Ready(Ok(Some(c))) => {
                        // A read that filled its buffer suggests more is waiting: read more.
                        if c.len() >= self.want {
                            self.want = (self.want * 2).min(MAX_READ);
                        }
                        self.chunk = c;
                    }
                    Poll::Ready(Ok(None)) => self.eof = true,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {
                        // Nothing more to read now: hold no buffer while idle, and push out
                        // what was written.
                        self.buf = bytes::BytesMut::new();
                        if self.unflushed {
                            ready!(std::pin::Pin::new(&mut *w).poll_flush(cx))?;
                            self.unflushed = false;
                        }
                        return Poll::Pending;
                    }
                }
            }
            while !self.chunk.is_empty() {
                let n = ready!(w.poll_write_chunk(cx, &mut self.chunk))?;
                if n == 0 {
                    return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
                }
                self.written += n as u64;
                self.unflushed = true;
            }
            if self.eof {
                ready!(std::pin::Pin::new(&mut *w).poll_flush(cx))?;
                ready!(std::pin::Pin::new(&mut *w).poll_shutdown(cx))?;
                return Poll::Ready(Ok(()));
            }
        }
    }
}

/// Copies both ways until both sides closed (a side that ends has the other's write side shut
/// down: half-close), an error, or `stop` resolves with a reason. Bytes moved are reported in
/// every case. The caller resets its TCP sockets when the result is an error, so the peers see a
/// reset rather than a clean end they would take for success.
pub async fn copy_both<A, B>(
    a: &mut A,
    b: &mut B,
    stop: impl std::future::Future<Output = String>,
) -> Copied
where
    A: Leg + ?Sized,
    B: Leg + ?Sized,
{
    use std::task::Poll;
    let (mut ab, mut ba) = (Half::new(), Half::new());
    let mut stop = std::pin::pin!(stop);
    let stop_wake = Arc::new(StopWake::default());
    let mut stop_polled = false;
    let result = std::future::poll_fn(|cx| {
        // Most wake-ups are bytes to move: `stop` (drain and revocation watches, a lock each to
        // poll) is polled first, then only when it woke the task itself.
        stop_wake.task.register(cx.waker());
        if !stop_polled || stop_wake.woken.swap(false, Ordering::AcqRel) {
            stop_polled = true;
            let waker = futures::task::waker_ref(&stop_wake);
            if let Poll::Ready(reason) =
                stop.as_mut().poll(&mut std::task::Context::from_waker(&waker))
            {
                return Poll::Ready(Err(reason));
            }
        }
        if !ab.done {
            match ab.poll_copy(cx, &mut *a, &mut *b) {
                Poll::Ready(Ok(())) => ab.done = true,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.to_string())),
                Poll::Pending => {}
            }
        }
        if !ba.done {
            match ba.poll_copy(cx, &mut *b, &mut *a) {
                Poll::Ready(Ok(())) => ba.done = true,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.to_string())),
                Poll::Pending => {}
            }
        }
        if ab.done && ba.done {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    })
    .await;
    Copied { ab: ab.written, ba: ba.written, result }
}

/// The waker `copy_both` gives its `stop` future: it records that `stop` woke, then wakes the
/// task.
#[derive(Default)]
struct StopWake {
    woken: AtomicBool,
    task: futures::task::AtomicWaker,
}

impl futures::task::ArcWake for StopWake {
    fn wake_by_ref(this: &Arc<Self>) {
        this.woken.store(true, Ordering::Release);
        this.task.wake();
    }
}

/// Resets a TCP connection when it is dropped (`SO_LINGER` 0: RST instead of FIN), so that a
/// cut connection is never mistaken for a complete one.
pub fn reset_on_close(s: &tokio::net::TcpStream) {
    let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
}

/// One side of a relayed connection, which can be ended abnormally so that its far end learns
/// the connection was cut rather than finished: RST instead of FIN on TCP,
/// `RST_STREAM(CONNECT_ERROR)` instead of END_STREAM on an HBONE stream.
///
/// Bytes move between legs as [`Bytes`](bytes::Bytes) chunks, so an HBONE leg hands h2's
/// received frames to the socket, and the socket's reads to h2, without copying them. The
/// provided methods serve any byte stream.
pub trait Leg: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin {
    fn abort(&mut self);

    /// The next bytes this leg received, read into `buf` (at most `want` of them) unless the
    /// leg already holds them; `None` when the peer has finished.
    fn poll_read_chunk(
        &mut self,
        cx: &mut std::task::Context<'_>,
        buf: &mut bytes::BytesMut,
        want: usize,
    ) -> std::task::Poll<std::io::Result<Option<bytes::Bytes>>> {
        read_chunk(self, cx, buf, want)
    }

    /// Writes the start of `chunk` and advances it past what was written; returns that length.
    fn poll_write_chunk(
        &mut self,
        cx: &mut std::task::Context<'_>,
        chunk: &mut bytes::Bytes,
    ) -> std::task::Poll<std::io::Result<usize>> {
        let n = std::task::ready!(std::pin::Pin::new(self).poll_write(cx, chunk))?;
        bytes::Buf::advance(chunk, n);
        std::task::Poll::Ready(Ok(n))
    }
}

/// Reads into `buf` (at most `want` bytes) and splits what was read off as a chunk.
fn read_chunk<R: tokio::io::AsyncRead + Unpin + ?Sized>(
    r: &mut R,
    cx: &mut std::task::Context<'_>,
    buf: &mut bytes::BytesMut,
    want: usize,
) -> std::task::Poll<std::io::Result<Option<bytes::Bytes>>> {
    use std::task::ready;
    buf.clear();
    buf.reserve(want);
    // Read no more than `want` even when the buffer kept a larger capacity.
    let mut limited = bytes::BufMut::limit(&mut *buf, want);
    let n = ready!(tokio_util::io::poll_read_buf(std::pin::Pin::new(r), cx, &mut limited))?;
    std::task::Poll::Ready(Ok((n > 0).then(|| buf.split().freeze())))
}

impl Leg for tokio::net::TcpStream {
    fn abort(&mut self) {
        reset_on_close(self);
    }

    /// A read that drained the socket cleared its readiness, so a request/response connection
    /// asks here, and allocates a read buffer only when bytes (or the end) are waiting.
    fn poll_read_chunk(
        &mut self,
        cx: &mut std::task::Context<'_>,
        buf: &mut bytes::BytesMut,
        want: usize,
    ) -> std::task::Poll<std::io::Result<Option<bytes::Bytes>>> {
        std::task::ready!(self.poll_read_ready(cx))?;
        read_chunk(self, cx, buf, want)
    }
}

impl Leg for crate::hbone::Tunnel {
    fn abort(&mut self) {
        self.reset();
    }

    fn poll_read_chunk(
        &mut self,
        cx: &mut std::task::Context<'_>,
        _: &mut bytes::BytesMut,
        _: usize,
    ) -> std::task::Poll<std::io::Result<Option<bytes::Bytes>>> {
        self.stream().poll_chunk(cx)
    }

    fn poll_write_chunk(
        &mut self,
        cx: &mut std::task::Context<'_>,
        chunk: &mut bytes::Bytes,
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.stream().poll_send_chunk(cx, chunk)
    }
}

impl Leg for crate::hbone::H2Stream {
    fn abort(&mut self) {
        self.reset();
    }

    fn poll_read_chunk(
        &mut self,
        cx: &mut std::task::Context<'_>,
        _: &mut bytes::BytesMut,
        _: usize,
    ) -> std::task::Poll<std::io::Result<Option<bytes::Bytes>>> {
        self.poll_chunk(cx)
    }

    fn poll_write_chunk(
        &mut self,
        cx: &mut std::task::Context<'_>,
        chunk: &mut bytes::Bytes,
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.poll_send_chunk(cx, chunk)
    }
}

/// [`copy_both`], then, when the connection did not end cleanly on both sides (a leg failed or
/// `stop` cut it), aborts both legs: a reset on one side arrives as a reset on the other.
pub async fn relay<A: Leg, B: Leg>(a: &mut A, b: &mut B, stop: Stop<'_>) -> Copied {
    let c = copy_both(a, b, stop).await;
    if c.result.is_err() {
        a.abort();
        b.abort();
    }
    c
}

/// What ends a relay early, with the reason. Boxed: a future passed by value is stored again
/// at each level of `async fn` it goes down, and a relay task's future is copied whole when it
/// is spawned and when it completes.
pub type Stop<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = String> + Send + 'a>>;

/// Accepts one connection, backing off on errors (EMFILE and the like would otherwise spin):
/// 5 ms doubling to 1 s while errors repeat. Each error is counted and logged at most once a
/// second.
pub async fn accept_backing_off(
    name: &'static str,
    listener: &tokio::net::TcpListener,
    errors: &prometheus_client::metrics::counter::Counter,
    backoff: &mut Duration,
    last_log: &mut Option<Instant>,
) -> (tokio::net::TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(x) => {
                *backoff = Duration::ZERO;
                return x;
            }
            Err(e) => {
                errors.inc();
                if last_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                    *last_log = Some(Instant::now());
                    tracing::warn!(listener = name, error = %e, total = errors.get(),
                        "accept failed; backing off");
                }
                *backoff = (*backoff * 2).clamp(Duration::from_millis(5), Duration::from_secs(1));
                tokio::time::sleep(*backoff).await;
            }
        }
    }
}

/// Accepts on `listener` until drain, on one of `workers`, running `handle` per connection on
/// the next of them.
pub fn spawn_accept_loop<F, Fut>(
    name: &'static str,
    listener: tokio::net::TcpListener,
    drain: Drain,
    metrics: Arc<Metrics>,
    workers: Arc<Workers>,
    handle: F,
) -> tokio::task::JoinHandle<()>
where
    F: Fn(tokio::net::TcpStream, SocketAddr) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let w = workers.clone();
    w.spawn_listener(name, listener, move |listener| async move {
        let handle = Arc::new(handle);
        let errors = metrics.accept_error_counter(name);
        let (mut backoff, mut last_log) = (Duration::ZERO, None);
        loop {
            tokio::select! {
                biased;
                _ = drain.signaled() => {
                    tracing::info!(listener = name, "draining: stopped accepting");
                    return;
                }
                (s, peer) = accept_backing_off(name, &listener, &errors, &mut backoff, &mut last_log) => {
                    let _ = s.set_nodelay(true);
                    // A dual-stack listener reports IPv4 peers as ::ffff:a.b.c.d.
                    let peer = crate::net::socket::canonical(peer);
                    let handle = handle.clone();
                    workers.spawn_conn(s, move |s| handle(s, peer));
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn tcp_pair(
        l: &tokio::net::TcpListener,
    ) -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        let c = tokio::net::TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        (c, l.accept().await.unwrap().0)
    }

    /// `copy_both` polls its stop future only when that future woke it: a stop that fires
    /// after many wake-ups by bytes must still end the relay, with its reason and the bytes
    /// moved until then.
    #[tokio::test]
    async fn a_stop_that_fires_mid_relay_ends_it_with_its_reason_and_the_bytes_moved() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (mut app, mut a) = tcp_pair(&l).await;
        let (mut b, mut server) = tcp_pair(&l).await;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let relay = tokio::spawn(async move {
            copy_both(&mut a, &mut b, async {
                let _ = rx.await;
                "stopped".to_string()
            })
            .await
        });
        for i in 0..20u8 {
            app.write_all(&[i]).await.unwrap();
            let mut got = [0u8; 1];
            server.read_exact(&mut got).await.unwrap();
            assert_eq!(got[0], i);
            server.write_all(&[i, i]).await.unwrap();
            let mut back = [0u8; 2];
            app.read_exact(&mut back).await.unwrap();
        }
        tx.send(()).unwrap();
        let c = tokio::time::timeout(Duration::from_secs(10), relay)
            .await
            .expect("the relay did not see its stop")
            .unwrap();
        assert_eq!(c.result, Err("stopped".to_string()));
        assert_eq!((c.ab, c.ba), (20, 40));
    }
}
