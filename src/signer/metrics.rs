//! Signer metrics (registered under the `mbtunnel_signer_` prefix).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

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
        }
    }
}

impl SignerMetrics {
    /// Registers the metrics (clones share state) under `mbtunnel_signer_`.
    pub fn register(&self, registry: &mut Registry, backend: &crate::mb::BackendChoice) {
        let r = registry.sub_registry_with_prefix("mbtunnel_signer");
        r.register("ops", "Signatures computed, by algorithm and backend", self.ops.clone());
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
            "backend",
            "Signer backend and detected CPU features",
            Info::new(vec![
                ("backend".to_string(), backend.backend.to_string()),
                ("cpu_features".to_string(), backend.features.to_string()),
            ]),
        );
    }
}
