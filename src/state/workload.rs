//! A workload (pod) of the mesh, close to Istio's `istio.workload.Workload`: the fields the proxy
//! routes, authenticates and labels metrics with. The local file writes the same type in YAML.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use super::gateway::{AppTunnel, GatewayAddress};
use crate::identity::Identity;

/// How a workload is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum Protocol {
    /// Through the destination node's proxy over HBONE (mTLS).
    #[default]
    #[serde(rename = "HBONE")]
    Hbone,
    /// Plain TCP (not in the mesh).
    #[serde(rename = "TCP")]
    Tcp,
}

/// A service port and the port the workload listens on for it (0: the same).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortMapping {
    pub service_port: u16,
    #[serde(default)]
    pub target_port: u16,
}

/// A workload (pod) of the mesh.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    pub uid: String,
    pub name: String,
    #[serde(default = "default_namespace")]
    pub namespace: String,
    #[serde(default = "default_sa")]
    pub service_account: String,
    /// Empty: the proxy's trust domain.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trust_domain: String,
    #[serde(default)]
    pub ips: Vec<IpAddr>,
    /// Set for a workload reached by name (a ServiceEntry endpoint with DNS resolution): its
    /// address is looked up when a connection is made to it (cached for the records' TTL).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub hostname: String,
    pub node: String,
    #[serde(default)]
    pub protocol: Protocol,
    /// `service.istio.io/canonical-name` (or the `app` label); empty: the workload name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub canonical_name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub canonical_revision: String,
    /// The deployment (or other owner) name; empty: the pod name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub workload_name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cluster_id: String,
    /// What owns it, as ztunnel names it in baggage: `deployment`, `cronjob`, `pod` or `job`.
    #[serde(default = "default_kind", skip_serializing_if = "is_default_kind")]
    pub workload_type: String,
    /// `namespace/name` of the WORKLOAD_SELECTOR authorization policies that select it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub authorization_policies: Vec<String>,
    /// Services it backs, by `namespace/hostname`, with their port mappings (filled by xDS;
    /// in the local file the services list their workloads instead).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub services: BTreeMap<String, Vec<PortMapping>>,
    /// Where it runs, for locality-aware endpoint choice.
    #[serde(default, skip_serializing_if = "Locality::is_empty")]
    pub locality: Locality,
    /// Whether it is ready. An unhealthy workload stays known (identity, policies) and is chosen
    /// as an endpoint only by a service whose health policy is ALLOW_ALL.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub healthy: bool,
    /// The network it is on (empty: the default network). A destination on another network than
    /// the source is reached through its `network_gateway`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub network: String,
    /// The waypoint that connections addressed to its own IP go through (not those addressed to
    /// a service it backs: the service's waypoint applies to those).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waypoint: Option<GatewayAddress>,
    /// How it is reached from another network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_gateway: Option<GatewayAddress>,
    /// Set when it terminates tunnels itself (a waypoint in the mesh): what this proxy hands it
    /// inbound, and on which port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub application_tunnel: Option<AppTunnel>,
    /// Set (why) when this is a held version kept after its newer xDS version was refused:
    /// the policies it lists may have changed, so every connection to it is denied until a
    /// good version arrives. Never read from the local file.
    #[serde(default, skip_deserializing, skip_serializing_if = "Option::is_none")]
    pub fail_closed: Option<String>,
}

pub(crate) fn default_namespace() -> String {
    "default".into()
}
/// Region, zone and subzone (`Locality`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Locality {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub region: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub zone: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub subzone: String,
}

impl Locality {
    pub fn is_empty(&self) -> bool {
        self.region.is_empty() && self.zone.is_empty() && self.subzone.is_empty()
    }
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

fn default_kind() -> String {
    "deployment".into()
}

fn is_default_kind(k: &str) -> bool {
    k == "deployment"
}

pub(crate) fn default_sa() -> String {
    "default".into()
}

impl Workload {
    /// The workload's SPIFFE id; an empty trust domain means `default_td`.
    pub fn identity(&self, default_td: &str) -> Identity {
        let td = if self.trust_domain.is_empty() { default_td } else { &self.trust_domain };
        Identity::new(td, &self.namespace, &self.service_account)
    }

    /// The canonical service name for metrics (`destination_canonical_service`).
    pub fn canonical_service(&self) -> &str {
        if self.canonical_name.is_empty() {
            self.workload_or_name()
        } else {
            &self.canonical_name
        }
    }

    /// The owner name for metrics (`destination_workload`).
    pub fn workload_or_name(&self) -> &str {
        if self.workload_name.is_empty() {
            &self.name
        } else {
            &self.workload_name
        }
    }

    /// Checks what the store relies on; the message names the workload.
    pub fn validate(&self, default_td: &str) -> Result<(), String> {
        if self.uid.is_empty() {
            return Err(format!("workload '{}' has no uid", self.name));
        }
        // A workload of another network may have no address: its network gateway reaches it;
        // a hostname workload's address is looked up at connect time.
        if self.ips.is_empty() && self.hostname.is_empty() && self.network_gateway.is_none() {
            return Err(format!(
                "workload '{}' has no ips, no hostname and no network gateway",
                self.uid
            ));
        }
        let id = format!("{}", self.identity(default_td));
        id.parse::<Identity>().map_err(|e| format!("workload '{}': {e}", self.uid))?;
        Ok(())
    }
}
