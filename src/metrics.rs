//! Prometheus metrics with Istio's names and labels for traffic, plus mbtunnel's own.
#![forbid(unsafe_code)]

use std::borrow::Cow;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::OnceLock;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelSetEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::state::{Service, Workload};

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

/// Labels of Istio's TCP metrics: the set ztunnel emits, filled from the mesh state so that
/// Istio's dashboards and Kiali group the traffic. Unknown values are `unknown`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnLabels {
    pub reporter: Reporter,
    pub source_workload: Label,
    pub source_canonical_service: Label,
    pub source_canonical_revision: Label,
    pub source_workload_namespace: Label,
    pub source_principal: Label,
    pub source_app: Label,
    pub source_version: Label,
    pub source_cluster: Label,
    pub destination_service: Label,
    pub destination_service_namespace: Label,
    pub destination_service_name: Label,
    pub destination_workload: Label,
    pub destination_canonical_service: Label,
    pub destination_canonical_revision: Label,
    pub destination_workload_namespace: Label,
    pub destination_principal: Label,
    pub destination_app: Label,
    pub destination_version: Label,
    pub destination_cluster: Label,
    pub request_protocol: Label,
    pub response_flags: Label,
    pub connection_security_policy: SecurityPolicy,
    /// `source_region`, `source_zone`, `destination_region`, `destination_zone`: present (each
    /// `unknown` when empty) once either side's workload is known, as ztunnel emits them.
    #[prometheus(flatten)]
    pub locality: MaybeLocality,
}

/// `istio_tcp_sockets_open`'s one label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SocketLabels {
    pub reporter: Reporter,
}

/// One socket counted in `istio_tcp_sockets_open`, until dropped.
pub struct SocketOpen(Gauge);

impl Drop for SocketOpen {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The four locality labels of a connection, or none.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct MaybeLocality(pub Option<LocalityLabels>);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LocalityLabels {
    pub source_region: Label,
    pub source_zone: Label,
    pub destination_region: Label,
    pub destination_zone: Label,
}

impl EncodeLabelSet for MaybeLocality {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        match &self.0 {
            Some(l) => l.encode(encoder),
            None => Ok(()),
        }
    }
}

impl MaybeLocality {
    fn get(&mut self) -> &mut LocalityLabels {
        self.0.get_or_insert(LocalityLabels {
            source_region: UNKNOWN,
            source_zone: UNKNOWN,
            destination_region: UNKNOWN,
            destination_zone: UNKNOWN,
        })
    }
}

/// A label value: the constant ones (`unknown`, `tcp`, `-`, Istio's defaults) are borrowed, so
/// a connection's label set allocates only for what its workloads name.
pub type Label = Cow<'static, str>;

const UNKNOWN: Label = Cow::Borrowed("unknown");

/// What the metric labels say of one side of a connection, as ztunnel derives it from the
/// workload: its owner name, canonical name and revision (also as app and version), namespace,
/// cluster and locality, each `unknown` when empty.
struct Side {
    workload: Label,
    canonical_service: Label,
    canonical_revision: Label,
    namespace: Label,
    app: Label,
    version: Label,
    cluster: Label,
    region: Label,
    zone: Label,
}

/// `s`, or `unknown` when empty.
fn or_unknown(s: &str) -> Label {
    if s.is_empty() {
        UNKNOWN
    } else {
        Cow::Owned(s.to_string())
    }
}

impl Side {
    fn of(w: &Workload) -> Side {
        Side {
            workload: or_unknown(&w.workload_name),
            canonical_service: or_unknown(&w.canonical_name),
            canonical_revision: or_unknown(&w.canonical_revision),
            namespace: or_unknown(&w.namespace),
            app: or_unknown(&w.canonical_name),
            version: or_unknown(&w.canonical_revision),
            cluster: or_unknown(&w.cluster_id),
            region: or_unknown(&w.locality.region),
            zone: or_unknown(&w.locality.zone),
        }
    }
}

impl ConnLabels {
    /// Every label `unknown`, protocol `tcp`, no flags.
    pub fn new(reporter: Reporter, policy: SecurityPolicy) -> ConnLabels {
        let u = || UNKNOWN;
        ConnLabels {
            reporter,
            source_workload: u(),
            source_canonical_service: u(),
            source_canonical_revision: u(),
            source_workload_namespace: u(),
            source_principal: u(),
            source_app: u(),
            source_version: u(),
            source_cluster: u(),
            destination_service: u(),
            destination_service_namespace: u(),
            destination_service_name: u(),
            destination_workload: u(),
            destination_canonical_service: u(),
            destination_canonical_revision: u(),
            destination_workload_namespace: u(),
            destination_principal: u(),
            destination_app: u(),
            destination_version: u(),
            destination_cluster: u(),
            request_protocol: Cow::Borrowed("tcp"),
            response_flags: Cow::Borrowed("-"),
            connection_security_policy: policy,
            locality: MaybeLocality::default(),
        }
    }

    /// The source: its workload if known, its principal if authenticated (or known locally).
    pub fn with_source(mut self, w: Option<&Workload>, principal: Option<String>) -> ConnLabels {
        if let Some(w) = w {
            let s = Side::of(w);
            self.source_workload = s.workload;
            self.source_canonical_service = s.canonical_service;
            self.source_canonical_revision = s.canonical_revision;
            self.source_workload_namespace = s.namespace;
            self.source_app = s.app;
            self.source_version = s.version;
            self.source_cluster = s.cluster;
            let l = self.locality.get();
            l.source_region = s.region;
            l.source_zone = s.zone;
        }
        if let Some(p) = principal {
            self.source_principal = Cow::Owned(p);
        }
        self
    }

    pub fn with_destination(
        mut self,
        w: Option<&Workload>,
        principal: Option<String>,
    ) -> ConnLabels {
        if let Some(w) = w {
            let s = Side::of(w);
            self.destination_workload = s.workload;
            self.destination_canonical_service = s.canonical_service;
            self.destination_canonical_revision = s.canonical_revision;
            self.destination_workload_namespace = s.namespace;
            self.destination_app = s.app;
            self.destination_version = s.version;
            self.destination_cluster = s.cluster;
            let l = self.locality.get();
            l.destination_region = s.region;
            l.destination_zone = s.zone;
        }
        if let Some(p) = principal {
            self.destination_principal = Cow::Owned(p);
        }
        self
    }

    /// The service the destination was addressed through.
    pub fn with_service(mut self, s: Option<&Service>) -> ConnLabels {
        if let Some(s) = s {
            self.destination_service = Cow::Owned(s.hostname());
            self.destination_service_namespace = Cow::Owned(s.namespace.clone());
            self.destination_service_name = Cow::Owned(s.name.clone());
        }
        self
    }
}

/// A connection's label set with its hash computed once. A connection looks its counters up
/// four times (opened, and received, sent, closed at its end); hashing the 23 labels each time
/// was the largest single user-space cost of a connection-per-request run (SipHash, ~1.3 % of
/// both proxies' CPU). The hash is keyed per process, as the maps' own are, so label values a
/// peer influences (its principal) cannot be chosen to collide. Immutable: a changed label set
/// is a new key.
#[derive(Clone, Debug)]
pub struct ConnKey {
    hash: u64,
    labels: ConnLabels,
}

impl ConnKey {
    pub fn new(labels: ConnLabels) -> ConnKey {
        static KEYS: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
        let hash = KEYS.get_or_init(Default::default).hash_one(&labels);
        ConnKey { hash, labels }
    }

    pub fn labels(&self) -> &ConnLabels {
        &self.labels
    }

    /// The same labels with `response_flags` set: `CONNECT` for a connection that failed,
    /// `DENY` for one refused by authorization (see `ConnRecord`).
    pub fn with_flags(&self, flags: &'static str) -> ConnKey {
        let mut labels = self.labels.clone();
        labels.response_flags = Cow::Borrowed(flags);
        ConnKey::new(labels)
    }
}

impl Hash for ConnKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl PartialEq for ConnKey {
    fn eq(&self, other: &ConnKey) -> bool {
        self.hash == other.hash && self.labels == other.labels
    }
}

impl Eq for ConnKey {}

impl EncodeLabelSet for ConnKey {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        self.labels.encode(encoder)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HandshakeLabels {
    /// `client` or `server`.
    pub side: &'static str,
    /// `success` or `failure`.
    pub result: &'static str,
    /// `resumed` (TLS 1.3 resumption between mbtunnel peers) or `full` (a failure is `full`).
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabels {
    pub listener: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct H2ErrorLabels {
    /// `client` or `server`.
    pub side: &'static str,
    /// The HTTP/2 error code (`ENHANCE_YOUR_CALM`, `PROTOCOL_ERROR`, …), `unknown` for a code
    /// RFC 9113 does not define, `io`, or `other`.
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AlertLabels {
    /// `sent` or `received`.
    pub direction: &'static str,
    /// The RFC 8446 alert name (`certificate_unknown`, `bad_certificate`, …).
    pub alert: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    pub reason: &'static str,
}

/// How a peer's certificate chain was judged: `verified` (in full), `cached` (the same chain
/// verified earlier, see `tls::verify`), `refused`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ChainCheckLabels {
    pub result: &'static str,
}

pub struct Metrics {
    pub opened: Family<ConnKey, Counter>,
    pub closed: Family<ConnKey, Counter>,
    /// Connections that ended with a failure flag (`DENY`, `CONNECT`), as ztunnel counts them.
    pub failed: Family<ConnKey, Counter>,
    pub sent: Family<ConnKey, Counter>,
    /// Sockets accepted by the traffic listeners and not yet finished, by reporter.
    pub sockets_open: Family<SocketLabels, Gauge>,
    pub received: Family<ConnKey, Counter>,
    pub handshakes: Family<HandshakeLabels, Counter>,
    pub handshake_seconds: Family<HandshakeLabels, Histogram>,
    pub refused: Family<RefusalLabels, Counter>,
    pub active_connections: Gauge,
    pub hbone_pool_connections: Gauge,
    pub accept_errors: Family<ListenerLabels, Counter>,
    pub h2_errors: Family<H2ErrorLabels, Counter>,
    pub tls_alerts: Family<AlertLabels, Counter>,
    pub chain_checks: Family<ChainCheckLabels, Counter>,
    /// Open inbound connections evaluated again by the live re-check.
    pub rechecked: Counter,
    /// Connections to hostname workloads, whose address was looked up (`istio_on_demand_dns`).
    pub on_demand_dns: Family<OnDemandDnsLabels, Counter>,
}

/// ztunnel's labels of `istio_on_demand_dns_total`: the source and the hostname looked up.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OnDemandDnsLabels {
    pub source_workload: Label,
    pub source_canonical_service: Label,
    pub source_canonical_revision: Label,
    pub source_workload_namespace: Label,
    pub source_principal: Label,
    pub source_app: Label,
    pub source_version: Label,
    pub source_cluster: Label,
    pub hostname: Label,
}

impl OnDemandDnsLabels {
    pub fn new(src: &Workload, principal: String, hostname: &str) -> OnDemandDnsLabels {
        let s = Side::of(src);
        OnDemandDnsLabels {
            source_workload: s.workload,
            source_canonical_service: s.canonical_service,
            source_canonical_revision: s.canonical_revision,
            source_workload_namespace: s.namespace,
            source_principal: Cow::Owned(principal),
            source_app: s.app,
            source_version: s.version,
            source_cluster: s.cluster,
            hostname: Cow::Owned(hostname.to_string()),
        }
    }
}

/// The label of an HTTP/2 error: the name of its RFC 9113 code, `unknown` for any other code (a
/// peer chooses the code: naming each one it sends would let it grow the label set without
/// bound), `io`, or `other`. An h2 error inside an `io::Error` counts as itself: `io::Error`'s
/// `source()` skips the error it wraps, so the chain is also entered through `get_ref`.
pub fn h2_error_kind(e: &(dyn std::error::Error + 'static)) -> &'static str {
    const NAMES: [&str; 14] = [
        "NO_ERROR",
        "PROTOCOL_ERROR",
        "INTERNAL_ERROR",
        "FLOW_CONTROL_ERROR",
        "SETTINGS_TIMEOUT",
        "STREAM_CLOSED",
        "FRAME_SIZE_ERROR",
        "REFUSED_STREAM",
        "CANCEL",
        "COMPRESSION_ERROR",
        "CONNECT_ERROR",
        "ENHANCE_YOUR_CALM",
        "INADEQUATE_SECURITY",
        "HTTP_1_1_REQUIRED",
    ];
    let mut src = Some(e);
    while let Some(x) = src {
        if let Some(h) = x.downcast_ref::<h2::Error>() {
            return match h.reason() {
                Some(r) => NAMES.get(u32::from(r) as usize).copied().unwrap_or("unknown"),
                None if h.is_io() => "io",
                None => "other",
            };
        }
        src = match x.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref()) {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => x.source(),
        };
    }
    "other"
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
            failed: Family::default(),
            sockets_open: Family::default(),
            sent: Family::default(),
            received: Family::default(),
            handshakes: Family::default(),
            handshake_seconds: Family::new_with_constructor(handshake_histogram),
            refused: Family::default(),
            active_connections: Gauge::default(),
            hbone_pool_connections: Gauge::default(),
            accept_errors: Family::default(),
            h2_errors: Family::default(),
            tls_alerts: Family::default(),
            chain_checks: Family::default(),
            rechecked: Counter::default(),
            on_demand_dns: Family::default(),
        };
        let istio = registry.sub_registry_with_prefix("istio");
        istio.register("tcp_connections_opened", "Connections opened", m.opened.clone());
        istio.register("tcp_connections_closed", "Connections closed", m.closed.clone());
        istio.register(
            "tcp_connections_failed",
            "Connections that failed to establish (denied, or the upstream could not be reached)",
            m.failed.clone(),
        );
        istio.register(
            "tcp_sockets_open",
            "Sockets accepted by the traffic listeners and still open",
            m.sockets_open.clone(),
        );
        istio.register(
            "tcp_sent_bytes",
            "Bytes sent toward the client (destination to client)",
            m.sent.clone(),
        );
        istio.register(
            "tcp_received_bytes",
            "Bytes received from the client (client to destination)",
            m.received.clone(),
        );
        istio.register(
            "on_demand_dns",
            "The total number of requests that used on-demand DNS (unstable)",
            m.on_demand_dns.clone(),
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
            "authz_rechecked_connections",
            "Open inbound connections evaluated again because a policy or a local workload changed",
            m.rechecked.clone(),
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
        mbt.register(
            "accept_errors",
            "Failed accepts (e.g. out of file descriptors), by listener",
            m.accept_errors.clone(),
        );
        mbt.register(
            "h2_errors",
            "HTTP/2 connections ended by a protocol error, by side and error code",
            m.h2_errors.clone(),
        );
        mbt.register("tls_alerts", "TLS alerts sent and received, by alert", m.tls_alerts.clone());
        mbt.register(
            "tls_peer_chains",
            "Peer certificate chains judged, by result: verified, cached (verified earlier), refused",
            m.chain_checks.clone(),
        );
        m
    }

    /// Counts a socket open in `istio_tcp_sockets_open` until the returned guard drops.
    pub fn socket_opened(&self, reporter: Reporter) -> SocketOpen {
        let g = self.sockets_open.get_or_create(&SocketLabels { reporter }).clone();
        g.inc();
        SocketOpen(g)
    }

    /// The accept-error counter of `listener`.
    pub fn accept_error_counter(&self, listener: &'static str) -> Counter {
        self.accept_errors.get_or_create(&ListenerLabels { listener }).clone()
    }

    /// Counts an HTTP/2 connection error, by the h2 error code when there is one.
    pub fn h2_error(
        &self,
        side: &'static str,
        e: &(dyn std::error::Error + 'static),
    ) -> &'static str {
        let kind = h2_error_kind(e);
        self.h2_errors.get_or_create(&H2ErrorLabels { side, kind }).inc();
        kind
    }

    pub fn refuse(&self, reason: &'static str) {
        self.refused.get_or_create(&RefusalLabels { reason }).inc();
    }
}

/// ztunnel's process series, read at each scrape: `process_open_fds`, `process_max_fds`.
#[derive(Debug, Default)]
pub struct ProcessCollector;

impl prometheus_client::collector::Collector for ProcessCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::gauge::ConstGauge;
        let open = std::fs::read_dir("/proc/self/fd").map(|d| d.count() as i64).ok();
        let max = std::fs::read_to_string("/proc/self/limits").ok().and_then(|l| {
            let line = l.lines().find(|l| l.starts_with("Max open files"))?;
            line.split_whitespace().nth(3)?.parse::<i64>().ok()
        });
        for (name, help, v) in [
            ("process_open_fds", "Number of open file descriptors", open),
            ("process_max_fds", "Maximum number of file descriptors", max),
        ] {
            if let Some(v) = v {
                let g = ConstGauge::new(v);
                g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
            }
        }
        Ok(())
    }
}

/// `istio_build{component, tag}` = 1, as ztunnel exports it: the component is the role
/// (`ztunnel`, so fleet dashboards count node proxies whichever implements them), the tag the
/// Istio version from `ISTIO_META_ISTIO_VERSION` (`unknown` without it). mbtunnel's own version is
/// in `mbtunnel_build_info`.
pub fn register_build(registry: &mut Registry, istio_version: Option<String>) {
    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    struct BuildLabels {
        component: &'static str,
        tag: String,
    }
    let f: Family<BuildLabels, Gauge> = Family::default();
    let tag = istio_version.filter(|v| !v.is_empty()).unwrap_or_else(|| "unknown".into());
    f.get_or_create(&BuildLabels { component: "ztunnel", tag }).set(1);
    registry.sub_registry_with_prefix("istio").register("build", "Istio component build info", f);
    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    struct OwnLabels {
        version: &'static str,
    }
    let own: Family<OwnLabels, Gauge> = Family::default();
    own.get_or_create(&OwnLabels { version: env!("CARGO_PKG_VERSION") }).set(1);
    registry.sub_registry_with_prefix("mbtunnel").register("build_info", "mbtunnel's version", own);
    registry.register_collector(Box::new(ProcessCollector));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_key_counts_one_series_per_label_set() {
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry);
        let labels = || {
            let mut l = ConnLabels::new(Reporter::source, SecurityPolicy::mutual_tls);
            l.source_principal = Cow::Owned(format!("spiffe://{}/ns/a/sa/b", "cluster.local"));
            l
        };
        // Built apart, the same labels are one key and one series.
        let (a, b) = (ConnKey::new(labels()), ConnKey::new(labels()));
        assert_eq!(a, b);
        m.opened.get_or_create(&a).inc();
        m.opened.get_or_create(&b).inc();
        // Another flag is another series; so is another principal.
        let failed = a.with_flags("CONNECT");
        assert_ne!(failed, a);
        assert_eq!(failed.labels().response_flags, "CONNECT");
        m.opened.get_or_create(&failed).inc();
        let mut other = labels();
        other.source_principal = Cow::Borrowed("spiffe://cluster.local/ns/a/sa/c");
        m.opened.get_or_create(&ConnKey::new(other)).inc();
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let lines: Vec<&str> =
            text.lines().filter(|l| l.starts_with("istio_tcp_connections_opened_total{")).collect();
        assert_eq!(lines.len(), 3, "{text}");
        let ok = lines
            .iter()
            .find(|l| {
                l.contains(r#"source_principal="spiffe://cluster.local/ns/a/sa/b""#)
                    && l.contains(r#"response_flags="-""#)
            })
            .expect("the series of the two equal keys");
        assert!(ok.starts_with(r#"istio_tcp_connections_opened_total{reporter="source","#), "{ok}");
        assert!(ok.ends_with(" 2"), "{ok}");
        assert!(
            ok.contains(r#"source_workload="unknown""#) && ok.contains(r#"request_protocol="tcp""#)
        );
        assert!(lines
            .iter()
            .any(|l| l.contains(r#"response_flags="CONNECT""#) && l.ends_with(" 1")));
        // No workload on either side: no locality labels (ztunnel leaves them out).
        assert!(!ok.contains("source_region"), "{ok}");
    }

    /// ztunnel's derivation: owner name, canonical name and revision (also as app and version),
    /// cluster and locality from the workload, each `unknown` when empty; the four locality
    /// labels last, present once a workload is known.
    #[test]
    fn labels_come_from_the_workload_as_ztunnel_derives_them() {
        let w: Workload = serde_yaml::from_str(
            "{uid: u, name: pod-1, namespace: ns, ips: [10.0.0.1], node: n, workload_name: web,
              canonical_name: web-app, canonical_revision: v2, cluster_id: c1,
              locality: {region: r, zone: z}}",
        )
        .unwrap();
        let bare: Workload =
            serde_yaml::from_str("{uid: b, name: pod-2, namespace: ns, ips: [10.0.0.2], node: n}")
                .unwrap();
        let l = ConnLabels::new(Reporter::source, SecurityPolicy::mutual_tls)
            .with_source(Some(&w), None)
            .with_destination(Some(&bare), None);
        let got = [
            &l.source_workload,
            &l.source_canonical_service,
            &l.source_canonical_revision,
            &l.source_app,
            &l.source_version,
            &l.source_cluster,
            &l.destination_workload,
            &l.destination_canonical_service,
            &l.destination_canonical_revision,
            &l.destination_app,
            &l.destination_version,
            &l.destination_cluster,
        ];
        let want = [
            "web", "web-app", "v2", "web-app", "v2", "c1", "unknown", "unknown", "unknown",
            "unknown", "unknown", "unknown",
        ];
        assert_eq!(got.map(|c| c.as_ref()), want);
        let loc = l.locality.0.as_ref().expect("locality labels");
        assert_eq!(
            [&loc.source_region, &loc.source_zone, &loc.destination_region, &loc.destination_zone]
                .map(|c| c.as_ref()),
            ["r", "z", "unknown", "unknown"]
        );
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry);
        m.opened.get_or_create(&ConnKey::new(l)).inc();
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let line =
            text.lines().find(|l| l.starts_with("istio_tcp_connections_opened_total{")).unwrap();
        let names: Vec<&str> =
            line.split(['{', ',']).skip(1).map(|kv| kv.split('=').next().unwrap()).collect();
        assert_eq!(names.len(), 27, "{line}");
        assert_eq!(
            names[22..],
            [
                "connection_security_policy",
                "source_region",
                "source_zone",
                "destination_region",
                "destination_zone"
            ]
        );
    }

    #[test]
    fn h2_error_kinds_are_the_rfc_names_and_a_bounded_rest() {
        for code in 0u32..14 {
            let r = h2::Reason::from(code);
            let e = h2::Error::from(r);
            assert_eq!(h2_error_kind(&e), format!("{r:?}"), "code {code}");
        }
        // Codes a peer makes up share one label instead of one series each.
        for code in [14u32, 0xdead, u32::MAX] {
            assert_eq!(h2_error_kind(&h2::Error::from(h2::Reason::from(code))), "unknown");
        }
        assert_eq!(h2_error_kind(&std::io::Error::other("x")), "other");
        // Wrapped in an io::Error (as a byte stream over h2 reports it), still named by its code.
        let wrapped = std::io::Error::other(h2::Error::from(h2::Reason::ENHANCE_YOUR_CALM));
        assert_eq!(h2_error_kind(&wrapped), "ENHANCE_YOUR_CALM");
        let twice =
            std::io::Error::other(std::io::Error::other(h2::Error::from(h2::Reason::from(0xdead))));
        assert_eq!(h2_error_kind(&twice), "unknown");
    }
}
