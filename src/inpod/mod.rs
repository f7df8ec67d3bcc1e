//! In-pod mode: istio-cni enrols pods over ZDS (a Unix SOCK_SEQPACKET socket), handing over each
//! pod's network namespace; the proxy opens the pod's 15001 / 15006 / 15008 listeners inside that
//! namespace and opens its own sockets for the pod there too (marked `SO_MARK` 0x539 so the pod's
//! redirect rules let them through). See `proto/zds.proto` and the README.

pub mod client;
pub mod sys;
pub mod uds;
pub mod zds;

mod pods;

pub use client::run_client;
pub use pods::{InPod, PodError};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ZdsLabels {
    /// add, keep, del, snapshot_sent, malformed.
    pub kind: &'static str,
    /// ok or error (nacked).
    pub result: &'static str,
}

/// In-pod metrics: enrolled pods, ZDS requests by kind and outcome, ZDS connections.
#[derive(Clone, Default)]
pub struct InPodMetrics {
    pub pods: Gauge,
    /// Enrolled pods whose workload the mesh state does not hold yet.
    pub pending: Gauge,
    pub requests: Family<ZdsLabels, Counter>,
    pub connections: Counter,
    /// Pods whose listeners were opened (ztunnel's `istio_proxies_started_total`).
    pub started: Counter,
    /// Pods whose listeners were closed (ztunnel's `istio_proxies_stopped_total`).
    pub stopped: Counter,
}

impl InPodMetrics {
    pub fn register(registry: &mut Registry) -> InPodMetrics {
        let m = InPodMetrics::default();
        let r = registry.sub_registry_with_prefix("mbtunnel");
        r.register("inpod_pods", "Pods enrolled by the CNI (in-pod mode)", m.pods.clone());
        r.register(
            "inpod_pods_pending",
            "Enrolled pods whose workload is not in the mesh state yet (their connections wait for it)",
            m.pending.clone(),
        );
        r.register(
            "zds_requests",
            "ZDS requests from the CNI, by kind and result",
            m.requests.clone(),
        );
        r.register(
            "zds_connections",
            "Connections made to the CNI's ZDS socket",
            m.connections.clone(),
        );
        // ztunnel's workload-manager series, under its names. A pod here is "active" once its
        // listeners are open and "pending" while its workload is not in the mesh state (ztunnel
        // counts the pods it has not been able to start yet).
        let istio = registry.sub_registry_with_prefix("istio");
        istio.register(
            "active_proxy_count",
            "The total number current workloads with active proxies (unstable)",
            m.pods.clone(),
        );
        istio.register(
            "pending_proxy_count",
            "The total number current workloads with pending proxies (unstable)",
            m.pending.clone(),
        );
        istio.register(
            "proxies_started",
            "The total number of proxies that were started (unstable)",
            m.started.clone(),
        );
        istio.register(
            "proxies_stopped",
            "The total number of proxies that were stopped (unstable)",
            m.stopped.clone(),
        );
        m
    }
}

/// Outbound, inbound plaintext and inbound HBONE ports of the listeners in each pod.
pub const OUTBOUND_PORT: u16 = 15001;
pub const INBOUND_PLAINTEXT_PORT: u16 = 15006;
pub const INBOUND_PORT: u16 = 15008;
/// The proxy's ports inside a pod: a tunnelled or passed-through connection to one of them is a
/// loop and is refused.
pub const PROXY_PORTS: [u16; 3] = [OUTBOUND_PORT, INBOUND_PLAINTEXT_PORT, INBOUND_PORT];
