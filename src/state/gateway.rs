//! Waypoints, network gateways and application tunnels, close to Istio's `GatewayAddress` and
//! `ApplicationTunnel`. A gateway is named by address (a workload's IP or a service VIP, on a
//! network) or by a namespaced hostname (a service), plus the port it terminates HBONE on.
//!
//! In the local file:
//! ```yaml
//! waypoint: {address: 10.96.0.9, hbone_port: 15008}          # a VIP or a pod IP
//! waypoint: {hostname: default/waypoint.default.svc.cluster.local, hbone_port: 15008}
//! application_tunnel: {protocol: PROXY, port: 15088}
//! ```
#![forbid(unsafe_code)]

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// What a gateway address names.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum GatewayTarget {
    /// A workload IP or a service VIP on `network` (empty: the default network).
    Address { network: String, ip: IpAddr },
    /// A service (or workload) hostname in `namespace`.
    Hostname { namespace: String, hostname: String },
}

/// A waypoint or network gateway, and its HBONE port.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawGateway", into = "RawGateway")]
pub struct GatewayAddress {
    pub target: GatewayTarget,
    /// The port that terminates HBONE (`hbone_mtls_port`): not always 15008.
    pub hbone_port: u16,
}

impl std::fmt::Display for GatewayAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.target {
            GatewayTarget::Address { network, ip } if network.is_empty() => write!(f, "{ip}"),
            GatewayTarget::Address { network, ip } => write!(f, "{network}/{ip}"),
            GatewayTarget::Hostname { namespace, hostname } => write!(f, "{namespace}/{hostname}"),
        }?;
        write!(f, " (HBONE port {})", self.hbone_port)
    }
}

/// The local file's form: exactly one of `address` and `hostname` (`namespace/host`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGateway {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    address: Option<IpAddr>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    network: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    hostname: Option<String>,
    hbone_port: u16,
}

impl TryFrom<RawGateway> for GatewayAddress {
    type Error = String;

    fn try_from(r: RawGateway) -> Result<Self, String> {
        if r.hbone_port == 0 {
            return Err(
                "a gateway address needs hbone_port (the port that terminates HBONE)".into()
            );
        }
        let target = match (r.address, r.hostname) {
            (Some(ip), None) => GatewayTarget::Address { network: r.network, ip },
            (None, Some(h)) => match h.split_once('/') {
                Some((ns, host)) if !ns.is_empty() && !host.is_empty() => {
                    GatewayTarget::Hostname { namespace: ns.into(), hostname: host.into() }
                }
                _ => return Err(format!("gateway hostname '{h}' is not 'namespace/hostname'")),
            },
            _ => return Err("a gateway address needs exactly one of address and hostname".into()),
        };
        Ok(GatewayAddress { target, hbone_port: r.hbone_port })
    }
}

impl From<GatewayAddress> for RawGateway {
    fn from(g: GatewayAddress) -> RawGateway {
        match g.target {
            GatewayTarget::Address { network, ip } => {
                RawGateway { address: Some(ip), network, hostname: None, hbone_port: g.hbone_port }
            }
            GatewayTarget::Hostname { namespace, hostname } => RawGateway {
                address: None,
                network: String::new(),
                hostname: Some(format!("{namespace}/{hostname}")),
                hbone_port: g.hbone_port,
            },
        }
    }
}

/// How the node proxy hands a tunnelled connection to a workload that terminates tunnels itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum TunnelHeader {
    /// The stream as it is.
    #[default]
    #[serde(rename = "NONE")]
    None,
    /// Behind a PROXY protocol v2 header: destination = the CONNECT target, TLV 0xD0 = the
    /// client's SPIFFE id.
    #[serde(rename = "PROXY")]
    Proxy,
}

/// A workload's application tunnel (`ApplicationTunnel`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppTunnel {
    #[serde(default)]
    pub protocol: TunnelHeader,
    /// The port it is delivered to; unset: the CONNECT target's port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_file_form() {
        let g: GatewayAddress =
            serde_yaml::from_str("{address: 10.0.0.9, hbone_port: 15019}").unwrap();
        assert_eq!(
            g.target,
            GatewayTarget::Address { network: String::new(), ip: "10.0.0.9".parse().unwrap() }
        );
        let h: GatewayAddress =
            serde_yaml::from_str("{hostname: ns/wp.ns.svc.cluster.local, hbone_port: 15008}")
                .unwrap();
        assert_eq!(h.to_string(), "ns/wp.ns.svc.cluster.local (HBONE port 15008)");
        let back: GatewayAddress =
            serde_yaml::from_str(&serde_yaml::to_string(&h).unwrap()).unwrap();
        assert_eq!(back, h);
        for bad in [
            "{address: 10.0.0.9}",
            "{address: 10.0.0.9, hbone_port: 0}",
            "{hostname: nons, hbone_port: 15008}",
            "{address: 10.0.0.9, hostname: a/b, hbone_port: 15008}",
            "{hbone_port: 15008}",
        ] {
            assert!(serde_yaml::from_str::<GatewayAddress>(bad).is_err(), "{bad}");
        }
    }
}
