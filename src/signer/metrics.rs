//! Signer metrics (registered under the `mbtunnel_signer_` prefix).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabels {
    pub algorithm: &'static str,
    pub backend: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AlgLabels {
    pub algorithm: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BudgetLabels {
    pub budget: &'static str,
}

/// A key kind as calibrated (`ecdsa-p256`, `rsa-2048`, …).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: String,
}

type FGauge = Gauge<f64, AtomicU64>;

#[derive(Clone)]
pub struct SignerMetrics {
    pub ops: Family<OpLabels, Counter>,
    pub batch_size: Family<AlgLabels, Histogram>,
    pub queue_wait: Family<AlgLabels, Histogram>,
    pub batch_seconds: Family<OpLabels, Histogram>,
    pub queue_depth: Gauge,
    pub rejected: Family<ReasonLabels, Counter>,
    pub fault_check_failures: Counter,
    pub thread_restarts: Counter,
    /// Batches the adaptive fill rule held open for more lanes, by how the hold ended.
    pub fill_holds: Family<OutcomeLabels, Counter>,
    /// Requests dropped before signing because their handshake had gone (waiter dropped).
    pub abandoned: Family<AlgLabels, Counter>,
    /// Requests signed on the calling thread (idle signer, cheap key), by algorithm.
    pub inline_ops: Family<AlgLabels, Counter>,
    /// Requests waiting, per budget.
    pub budget_depth: Family<BudgetLabels, Gauge>,
    /// Requests refused because their budget was full, per budget.
    pub budget_rejected: Family<BudgetLabels, Counter>,
    /// Start-up calibration: two thread hand-offs (round trip), seconds.
    pub calibrated_handoff: FGauge,
    /// Keys whose single op costs at most this sign inline on an idle signer, seconds.
    pub calibrated_inline_max: FGauge,
    /// Calibrated single-op (BoringSSL) cost per key kind, seconds.
    pub calibrated_single_op: Family<KindLabels, FGauge>,
    /// Calibrated 8-lane multi-buffer pass per class (IFMA backend only), seconds.
    pub calibrated_batch: Family<KindLabels, FGauge>,
    /// Crossover in force per class: batches of at most this many use single ops.
    pub scalar_below: Family<KindLabels, Gauge>,
    /// Adaptive fill bound in force per class, seconds (0 = off).
    pub fill_wait: Family<KindLabels, FGauge>,
}

impl Default for SignerMetrics {
    fn default() -> Self {
        SignerMetrics {
            ops: Family::default(),
            batch_size: Family::new_with_constructor(|| {
                Histogram::new([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
            }),
            queue_wait: Family::new_with_constructor(|| {
                Histogram::new([
                    1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1,
                ])
            }),
            batch_seconds: Family::new_with_constructor(|| {
                Histogram::new([
                    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2,
                ])
            }),
            queue_depth: Gauge::default(),
            rejected: Family::default(),
            fault_check_failures: Counter::default(),
            thread_restarts: Counter::default(),
            fill_holds: Family::default(),
            abandoned: Family::default(),
            inline_ops: Family::default(),
            budget_depth: Family::default(),
            budget_rejected: Family::default(),
            calibrated_handoff: FGauge::default(),
            calibrated_inline_max: FGauge::default(),
            calibrated_single_op: Family::default(),
            calibrated_batch: Family::default(),
            scalar_below: Family::default(),
            fill_wait: Family::default(),
        }
    }
}

impl SignerMetrics {
    /// Registers the metrics (clones share state) under `mbtunnel_signer_`.
    pub fn register(&self, registry: &mut Registry, backend: &crate::mb::BackendChoice) {
        let r = registry.sub_registry_with_prefix("mbtunnel_signer");
        r.register(
            "ops",
            "Signatures computed, by queue (algorithm; other: BoringSSL single-op) and backend",
            self.ops.clone(),
        );
        r.register("batch_size", "Requests per batch, by algorithm", self.batch_size.clone());
        r.register(
            "queue_wait_seconds",
            "Time a request waited in the queue before its batch started",
            self.queue_wait.clone(),
        );
        r.register("batch_seconds", "Time to compute one batch", self.batch_seconds.clone());
        r.register(
            "queue_depth",
            "Requests waiting in the signer queues",
            self.queue_depth.clone(),
        );
        r.register("rejected", "Requests refused by the signer, by reason", self.rejected.clone());
        r.register(
            "fault_check_failures",
            "RSA signatures withheld because the public-key re-check failed",
            self.fault_check_failures.clone(),
        );
        r.register(
            "thread_restarts",
            "Signer threads restarted after a panic",
            self.thread_restarts.clone(),
        );
        r.register(
            "fill_holds",
            "Batches held open for more lanes by the adaptive fill rule, by how the hold ended \
             (full: eight lanes; pause: arrivals paused; bound: the fill bound expired; \
             other: another class needed the thread)",
            self.fill_holds.clone(),
        );
        r.register(
            "abandoned",
            "Requests dropped before signing because the handshake waiting for them had gone",
            self.abandoned.clone(),
        );
        r.register(
            "inline_ops",
            "Signatures computed on the calling thread (idle signer, key cheaper than the \
             calibrated inline threshold)",
            self.inline_ops.clone(),
        );
        r.register(
            "budget_depth",
            "Requests waiting, per budget (inbound: server side; outbound: client side)",
            self.budget_depth.clone(),
        );
        r.register(
            "budget_rejected",
            "Requests refused because their budget's queue was full, per budget",
            self.budget_rejected.clone(),
        );
        r.register(
            "calibrated_handoff_seconds",
            "Start-up calibration: round trip of two thread hand-offs",
            self.calibrated_handoff.clone(),
        );
        r.register(
            "calibrated_inline_max_seconds",
            "Keys whose single op costs at most this are signed on the calling thread when the \
             signer is idle",
            self.calibrated_inline_max.clone(),
        );
        r.register(
            "calibrated_single_op_seconds",
            "Calibrated BoringSSL single-op cost per key kind",
            self.calibrated_single_op.clone(),
        );
        r.register(
            "calibrated_batch_seconds",
            "Calibrated 8-lane multi-buffer pass per class (IFMA backend)",
            self.calibrated_batch.clone(),
        );
        r.register(
            "scalar_below",
            "Crossover in force: batches of at most this many requests use single ops",
            self.scalar_below.clone(),
        );
        r.register(
            "fill_wait_seconds",
            "Adaptive fill bound in force per class (0 = off)",
            self.fill_wait.clone(),
        );
        r.register(
            "backend",
            "Signer backend and detected CPU features",
            Info::new(vec![
                ("backend".to_string(), backend.backend.to_string()),
                ("cpu_features".to_string(), backend.features.to_string()),
            ]),
        );
    }
}
