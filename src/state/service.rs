//! A service, close to Istio's `istio.workload.Service`: virtual IPs, a hostname and ports. Its
//! endpoints are the workloads that name it (`Workload::services`).
#![forbid(unsafe_code)]

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use super::gateway::GatewayAddress;
use super::workload::default_namespace;

/// A port of a service: the port clients use and the port the workloads listen on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServicePort {
    pub port: u16,
    #[serde(default)]
    pub target_port: Option<u16>,
}

/// A scope endpoints are ranked by (`LoadBalancing.Scope`): an endpoint matches it when it shares
/// the source's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum LbScope {
    Region,
    Zone,
    Subzone,
    Node,
    Cluster,
    Network,
}

/// How the ranking is used (`LoadBalancing.Mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum LbMode {
    /// No ranking: every endpoint.
    #[default]
    Standard,
    /// Only endpoints that match every scope; none matching: no endpoint.
    Strict,
    /// The best-ranked endpoints: those matching the most leading scopes.
    Failover,
    /// No endpoint choice: the connection goes to the address dialled.
    Passthrough,
}

/// Which endpoints may be chosen (`LoadBalancing.HealthPolicy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum HealthPolicy {
    #[default]
    OnlyHealthy,
    AllowAll,
}

/// A service's load-balancing settings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct LoadBalancing {
    #[serde(default)]
    pub routing_preference: Vec<LbScope>,
    #[serde(default)]
    pub mode: LbMode,
    #[serde(default)]
    pub health_policy: HealthPolicy,
}

/// The address families a service's endpoints are reached on (`IPFamilies`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum IpFamilies {
    /// No restriction (the family of the address dialled is preferred).
    #[default]
    Automatic,
    Ipv4Only,
    Ipv6Only,
    Dual,
}

impl IpFamilies {
    pub fn accepts(self, ip: IpAddr) -> bool {
        match self {
            IpFamilies::Ipv4Only => ip.is_ipv4(),
            IpFamilies::Ipv6Only => ip.is_ipv6(),
            IpFamilies::Automatic | IpFamilies::Dual => true,
        }
    }
}

/// A service: virtual IPs and a hostname, ports, and (local file only) the workloads behind it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Service {
    pub name: String,
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// Empty: `<name>.<namespace>.svc.cluster.local`.
    #[serde(default)]
    pub hostname: Option<String>,
    #[serde(default)]
    pub vips: Vec<IpAddr>,
    pub ports: Vec<ServicePort>,
    /// Local file: workload uids behind the service. Over xDS the workloads name their services
    /// and this stays empty.
    #[serde(default)]
    pub workloads: Vec<String>,
    /// The waypoint every connection addressed to the service goes through, whatever its port
    /// and whether or not it has endpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waypoint: Option<GatewayAddress>,
    /// How endpoints are chosen; unset: any healthy endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_balancing: Option<LoadBalancing>,
    #[serde(default, skip_serializing_if = "is_automatic")]
    pub ip_families: IpFamilies,
    /// Identities its endpoints may present besides their own (`subject_alt_names`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subject_alt_names: Vec<String>,
    /// Set (why) when this stands for a refused xDS version: every connection addressed to it is
    /// refused until a good version arrives (its waypoint may have changed). Never read from the
    /// local file.
    #[serde(default, skip_deserializing, skip_serializing_if = "Option::is_none")]
    pub fail_closed: Option<String>,
}

fn is_automatic(f: &IpFamilies) -> bool {
    *f == IpFamilies::Automatic
}

impl Service {
    pub fn hostname(&self) -> String {
        self.hostname
            .clone()
            .unwrap_or_else(|| format!("{}.{}.svc.cluster.local", self.name, self.namespace))
    }

    /// The store's key and the xDS resource name: `namespace/hostname`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.hostname())
    }
}
