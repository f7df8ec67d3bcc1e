//! Prometheus metrics with Istio's names and labels for traffic, plus mbtunnel's own.
#![forbid(unsafe_code)]

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Reporter {
    source,
    destination,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum SecurityPolicy {
    mutual_tls,
    unknown,
}

/// Labels of Istio's TCP metrics (the subset mbtunnel knows).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnLabels {
    pub reporter: Reporter,
    pub source_principal: String,
    pub destination_principal: String,
    pub source_workload: String,
    pub destination_workload: String,
    pub connection_security_policy: SecurityPolicy,
    pub response_flags: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HandshakeLabels {
    /// `client` or `server`.
    pub side: &'static str,
    /// `success` or `failure`.
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    pub reason: &'static str,
}

pub struct Metrics {
    pub opened: Family<ConnLabels, Counter>,
    pub closed: Family<ConnLabels, Counter>,
    pub sent: Family<ConnLabels, Counter>,
    pub received: Family<ConnLabels, Counter>,
    pub handshakes: Family<HandshakeLabels, Counter>,
    pub handshake_seconds: Family<HandshakeLabels, Histogram>,
    pub refused: Family<RefusalLabels, Counter>,
    pub active_connections: Gauge,
    pub hbone_pool_connections: Gauge,
}

fn handshake_histogram() -> Histogram {
    Histogram::new([0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5])
}

impl Metrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn new(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            opened: Family::default(),
            closed: Family::default(),
            sent: Family::default(),
            received: Family::default(),
            handshakes: Family::default(),
            handshake_seconds: Family::new_with_constructor(handshake_histogram),
            refused: Family::default(),
            active_connections: Gauge::default(),
            hbone_pool_connections: Gauge::default(),
        };
        let istio = registry.sub_registry_with_prefix("istio");
        istio.register("tcp_connections_opened", "Connections opened", m.opened.clone());
        istio.register("tcp_connections_closed", "Connections closed", m.closed.clone());
        istio.register("tcp_sent_bytes", "Bytes sent toward the destination", m.sent.clone());
        istio.register(
            "tcp_received_bytes",
            "Bytes received from the destination",
            m.received.clone(),
        );
        let mbt = registry.sub_registry_with_prefix("mbtunnel");
        mbt.register("tls_handshakes", "TLS handshakes completed or failed", m.handshakes.clone());
        mbt.register(
            "tls_handshake_duration_seconds",
            "TLS handshake duration",
            m.handshake_seconds.clone(),
        );
        mbt.register(
            "connections_refused",
            "Connections or requests refused, by reason",
            m.refused.clone(),
        );
        mbt.register(
            "active_connections",
            "Proxied connections open now",
            m.active_connections.clone(),
        );
        mbt.register(
            "hbone_pool_connections",
            "HBONE (HTTP/2) connections in the outbound pool",
            m.hbone_pool_connections.clone(),
        );
        m
    }

    pub fn refuse(&self, reason: &'static str) {
        self.refused.get_or_create(&RefusalLabels { reason }).inc();
    }
}
