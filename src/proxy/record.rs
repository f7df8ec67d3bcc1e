//! One record per proxied connection: the `istio_tcp_*` counters and the access-log line.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Copied, Ctx, DrainGuard};
use crate::metrics::{ConnKey, ConnLabels, Label, Metrics, Reporter, SecurityPolicy};
use crate::state::Workload;

/// The two ends of a proxied connection as its access line names them.
pub struct Ends {
    /// The client's address.
    pub src: SocketAddr,
    /// Where this proxy's side of the connection goes (outbound: the peer proxy's HBONE address
    /// or, without HBONE, the destination) or arrived (inbound: the address the client reached).
    pub dst: SocketAddr,
    /// The HBONE `:authority` (`dst.hbone_addr`), when the connection rides HBONE.
    pub hbone: Option<SocketAddr>,
    pub src_workload: Option<Arc<Workload>>,
    pub dst_workload: Option<Arc<Workload>>,
}

impl Ends {
    pub fn new(src: SocketAddr, dst: SocketAddr) -> Ends {
        Ends { src, dst, hbone: None, src_workload: None, dst_workload: None }
    }

    pub fn hbone(mut self, target: SocketAddr) -> Ends {
        self.hbone = Some(target);
        self
    }

    pub fn workloads(mut self, src: Option<&Arc<Workload>>, dst: Option<&Arc<Workload>>) -> Ends {
        self.src_workload = src.cloned();
        self.dst_workload = dst.cloned();
        self
    }
}

/// One proxied connection's bookkeeping: opened/closed/failed counters, bytes, access log.
///
/// The access line is ztunnel's (`connection complete`, target `access`, its field names and
/// values): log pipelines built for ztunnel parse it. It is emitted without a parent span, as
/// ztunnel's, so the relay between open and close runs outside any span: entering a span costs
/// the log filter two lock reads, and a relay is polled for every chunk it moves.
pub struct ConnRecord {
    metrics: Arc<Metrics>,
    /// Boxed (over 500 bytes inline): a record moves with its connection, from set-up to relay
    /// and between workers, and each move of a future that holds it copies it.
    key: Box<(ConnKey, Ends)>,
    start: Instant,
    _guard: DrainGuard,
}

impl ConnRecord {
    pub fn open(ctx: &Ctx, ends: Ends, labels: ConnLabels) -> ConnRecord {
        let key = Box::new((ConnKey::new(labels), ends));
        ctx.metrics.opened.get_or_create(&key.0).inc();
        ctx.metrics.active_connections.inc();
        ConnRecord {
            metrics: ctx.metrics.clone(),
            key,
            start: Instant::now(),
            _guard: ctx.drain.guard(),
        }
    }

    /// A connection refused by authorization, counted as ztunnel counts it: opened (no flags),
    /// closed and failed with `response_flags="DENY"`; its access line carries the reason.
    pub fn denied(ctx: &Ctx, ends: Ends, labels: ConnLabels, reason: &str) {
        let open = ConnKey::new(labels);
        ctx.metrics.opened.get_or_create(&open).inc();
        // Its byte series exist (at zero) under the labels it was opened with, as ztunnel's.
        let _ = ctx.metrics.received.get_or_create(&open);
        let _ = ctx.metrics.sent.get_or_create(&open);
        let key = open.with_flags("DENY");
        ctx.metrics.closed.get_or_create(&key).inc();
        ctx.metrics.failed.get_or_create(&key).inc();
        ctx.metrics.refuse("authorization_denied");
        let err = format!("connection closed due to policy rejection: {reason}");
        access_line(key.labels(), &ends, 0, 0, Duration::ZERO, Some(&err));
    }

    /// Closes the record with what the copy moved (client → destination, destination → client).
    pub fn finish(self, c: Copied) {
        self.close(c.ab, c.ba, c.result)
    }

    /// Closes the record: `received` = bytes from the client toward the destination, `sent` =
    /// bytes back to the client (Istio's meaning of the TCP byte counters).
    pub fn close(mut self, received: u64, sent: u64, result: Result<(), String>) {
        let (key, ends) = &mut *self.key;
        // Bytes under the labels the connection was opened with; the close (and, for a failure,
        // the failed count) under `CONNECT`, as ztunnel counts them.
        self.metrics.received.get_or_create(key).inc_by(received);
        self.metrics.sent.get_or_create(key).inc_by(sent);
        if result.is_err() {
            *key = key.with_flags("CONNECT");
            self.metrics.failed.get_or_create(key).inc();
        }
        self.metrics.closed.get_or_create(key).inc();
        self.metrics.active_connections.dec();
        access_line(
            key.labels(),
            ends,
            received,
            sent,
            self.start.elapsed(),
            result.err().as_deref(),
        );
    }
}

/// A label's value for the access line: absent when `unknown`, as ztunnel leaves it out.
fn known(l: &Label) -> Option<&str> {
    (l != "unknown").then_some(l.as_ref())
}

/// The access line of a finished connection, field for field ztunnel's: `src.*`, `dst.*`,
/// `direction`, `bytes_sent` / `bytes_recv` as the client saw them (the metric's sides unflipped),
/// `duration` in milliseconds; `info` when it succeeded, `error` with the error otherwise.
fn access_line(
    l: &ConnLabels,
    ends: &Ends,
    received: u64,
    sent: u64,
    elapsed: Duration,
    error: Option<&str>,
) {
    let mtls = l.connection_security_policy == SecurityPolicy::mutual_tls;
    // The pod's name, else its canonical service.
    let name = |w: &Option<Arc<Workload>>, canonical: &Label| match w {
        Some(w) if !w.name.is_empty() => Some(w.name.clone()),
        _ => known(canonical).map(str::to_string),
    };
    let outbound = l.reporter == Reporter::source;
    let (bytes_sent, bytes_recv) = if outbound { (received, sent) } else { (sent, received) };
    let duration = format!("{}ms", elapsed.as_millis());
    macro_rules! line {
        ($level:expr, $($error:tt)*) => {
            tracing::event!(target: "access", parent: None, $level,
                src.addr = %ends.src,
                src.workload = name(&ends.src_workload, &l.source_canonical_service),
                src.namespace = known(&l.source_workload_namespace),
                src.identity = known(&l.source_principal).filter(|_| mtls),
                src.cluster = known(&l.source_cluster),
                dst.addr = %ends.dst,
                dst.hbone_addr = ends.hbone.map(tracing::field::display),
                dst.service = known(&l.destination_service),
                dst.workload = name(&ends.dst_workload, &l.destination_canonical_service),
                dst.namespace = known(&l.destination_workload_namespace),
                dst.identity = known(&l.destination_principal).filter(|_| mtls),
                dst.cluster = known(&l.destination_cluster),
                direction = if outbound { "outbound" } else { "inbound" },
                bytes_sent,
                bytes_recv,
                duration,
                $($error)*
                "connection complete")
        };
    }
    match error {
        None => line!(tracing::Level::INFO,),
        Some(e) => line!(tracing::Level::ERROR, error = e,),
    }
}
