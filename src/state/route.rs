//! Outbound routing: where a local workload's connection to an original destination goes — its
//! destination (over HBONE to the destination's node, or plain TCP), or the destination's
//! waypoint. The rules are ztunnel's:
//! - addressed to a service VIP whose service has a waypoint: to the waypoint, for every source
//!   (the waypoint itself included), whatever the port, endpoints or not; CONNECT target = the VIP
//!   and port as dialled;
//! - addressed to a pod IP whose workload has a waypoint: to the waypoint, CONNECT target = the
//!   pod IP and port — unless the source *is* that waypoint (same identity and IP: the waypoint
//!   sending on what it processed, the "sandwich"), which goes to the destination;
//! - a service's waypoint never applies to pod-addressed traffic, a workload's never to
//!   service-addressed traffic;
//! - a waypoint that cannot be resolved (unknown VIP or hostname, no endpoint serving its HBONE
//!   port), a destination held fail-closed, or one on another network: refused with a reason,
//!   never sent direct.
#![forbid(unsafe_code)]

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{
    GatewayAddress, GatewayTarget, HealthPolicy, Index, IpFamilies, LbMode, LbScope, LoadBalancing,
    Protocol, Service, Store, Workload,
};
use crate::identity::Identity;

/// How an upstream was reached from the original destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// The destination itself (its node's HBONE, or plain TCP).
    Direct,
    /// The service's waypoint (service-addressed traffic).
    ServiceWaypoint,
    /// The destination workload's waypoint (traffic addressed to the pod's IP).
    WorkloadWaypoint,
    /// A network gateway, with double HBONE, to a destination (or its waypoint) on another
    /// network: [`Upstream::double`] says what the inner tunnel asks for.
    Gateway,
}

/// The inner tunnel of double HBONE.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Double {
    /// The CONNECT target of both tunnels: `<service hostname>:<port>`.
    pub authority: String,
    /// The identities the final destination (behind the gateway) may present.
    pub identities: Vec<Identity>,
}

/// Where an outbound connection goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Upstream {
    /// The next hop's workload: the destination, or its waypoint (what metrics and access logs
    /// report as the destination workload).
    pub workload: Arc<Workload>,
    /// HBONE: the CONNECT target (the workload address after VIP translation when direct; the
    /// original destination when through a waypoint). TCP: the address dialled.
    pub target: SocketAddr,
    /// The identity the next hop must present…
    pub identity: Identity,
    /// …or one of these (its service's `subject_alt_names`).
    pub sans: Vec<Identity>,
    pub protocol: Protocol,
    /// Where to dial for HBONE: the destination node's inbound, or the waypoint's HBONE port.
    pub hbone_addr: SocketAddr,
    /// The service the destination was addressed through, if any (the intended service, also
    /// when the next hop is a waypoint).
    pub service: Option<Arc<Service>>,
    pub via: Via,
    /// Set for [`Via::Gateway`]: the next hop is the gateway, `identity`/`sans` are its own.
    pub double: Option<Double>,
    /// Set when the destination is a hostname workload: `target`'s address (and `hbone_addr`'s,
    /// when it is the workload's own) is unspecified until [`Upstream::resolved`] sets it.
    pub resolve: Option<String>,
}

impl Upstream {
    /// Fills in the address a hostname workload resolved to.
    pub fn resolved(&mut self, ip: IpAddr) {
        if self.hbone_addr.ip().is_unspecified() {
            self.hbone_addr.set_ip(ip);
        }
        self.target.set_ip(ip);
        self.resolve = None;
    }
}

/// Why a mesh destination has no route. [`reason`](Self::reason) is the refusal metric's label.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum LookupError {
    #[error("service {0} has no workloads")]
    NoEndpoints(String),
    #[error("service {service} has no port {port}")]
    NoServicePort { service: String, port: u16 },
    #[error("{dst}'s waypoint {waypoint} is not in the mesh state (no such workload IP, VIP or service hostname)")]
    UnknownWaypoint { dst: String, waypoint: String },
    #[error("{dst}'s waypoint {waypoint} has no endpoint serving its HBONE port")]
    NoWaypointEndpoint { dst: String, waypoint: String },
    #[error("{what} is held fail-closed: {why}")]
    FailClosed { what: String, why: String },
    #[error("{dst} is on network '{network}', this source on '{src_network}', and it has no network gateway")]
    NoNetworkGateway { dst: String, network: String, src_network: String },
    #[error("{dst}'s network gateway {gateway} is not in the mesh state or has no endpoint")]
    UnknownGateway { dst: String, gateway: String },
    #[error("{dst} is on another network: only service-addressed traffic crosses networks")]
    NotServiceAddressed { dst: String },
}

impl LookupError {
    pub fn reason(&self) -> &'static str {
        match self {
            LookupError::NoEndpoints(_) => "no_endpoints",
            LookupError::NoServicePort { .. } => "no_service_port",
            LookupError::UnknownWaypoint { .. } => "waypoint_unknown",
            LookupError::NoWaypointEndpoint { .. } => "waypoint_no_endpoint",
            LookupError::FailClosed { .. } => "destination_fail_closed",
            LookupError::NoNetworkGateway { .. } => "no_network_gateway",
            LookupError::UnknownGateway { .. } => "network_gateway_unknown",
            LookupError::NotServiceAddressed { .. } => "other_network_not_service",
        }
    }
}

/// A chosen next hop before it becomes an [`Upstream`].
struct Hop {
    workload: Arc<Workload>,
    addr: SocketAddr,
    sans: Vec<String>,
}

/// An address of `w` that `families` accepts, in the family of `like` if it has one.
fn ip_like(w: &Workload, like: IpAddr, families: IpFamilies) -> Option<IpAddr> {
    let mut ok = w.ips.iter().filter(|ip| families.accepts(**ip));
    let first = ok.clone().next().copied();
    ok.find(|ip| ip.is_ipv4() == like.is_ipv4()).copied().or(first)
}

/// How many of `lb`'s routing preferences `w` shares with the source, leading ones first (a
/// mismatch ends the count), as ztunnel ranks endpoints; `None` when STRICT and not all match.
/// With NETWORK first, a same-network endpoint outranks every other-network one.
fn rank(lb: &LoadBalancing, src: Option<&Workload>, w: &Workload) -> Option<usize> {
    let s = |f: fn(&Workload) -> &str| src.map(f).unwrap_or_default();
    let network_first = lb.routing_preference.first() == Some(&LbScope::Network);
    let (mut rank, mut adjust) = (0, 0);
    for scope in &lb.routing_preference {
        let matches = match scope {
            LbScope::Region => s(|w| &w.locality.region) == w.locality.region,
            LbScope::Zone => s(|w| &w.locality.zone) == w.locality.zone,
            LbScope::Subzone => s(|w| &w.locality.subzone) == w.locality.subzone,
            LbScope::Node => s(|w| &w.node) == w.node,
            LbScope::Cluster => s(|w| &w.cluster_id) == w.cluster_id,
            LbScope::Network => {
                let m = s(|w| &w.network) == w.network;
                if network_first {
                    if !m {
                        // The other scopes still rank it among other-network endpoints.
                        continue;
                    }
                    adjust = lb.routing_preference.len() - 1;
                }
                m
            }
        };
        if !matches {
            break;
        }
        rank += 1;
    }
    if lb.mode == LbMode::Strict && rank != lb.routing_preference.len() {
        return None;
    }
    Some(rank + adjust)
}

impl Store {
    /// Resolves the original destination `dst` of a connection from `src` (a local workload, at
    /// `src_ip`) to an upstream. `Ok(None)`: not a mesh address (passthrough).
    pub fn resolve(
        &self,
        dst: SocketAddr,
        src: Option<&Workload>,
        src_ip: IpAddr,
    ) -> Result<Option<Upstream>, LookupError> {
        let ix = self.index.read().unwrap();
        let src_network = src.map(|w| w.network.as_str()).unwrap_or_default();
        if let Some(svc) = ix.by_vip.get(&dst.ip()) {
            let key = svc.key();
            if let Some(why) = &svc.fail_closed {
                return Err(LookupError::FailClosed {
                    what: format!("service {key}"),
                    why: why.clone(),
                });
            }
            if let Some(wp) = &svc.waypoint {
                let hop = self.waypoint_hop(&ix, wp, src, dst, &key)?;
                if hop.workload.network != src_network {
                    return self.through_gateway(&ix, hop, svc, src, dst).map(Some);
                }
                return Ok(Some(self.upstream(hop, dst, Some(svc.clone()), Via::ServiceWaypoint)));
            }
            // No endpoint choice: to the address dialled, as it is.
            if svc.load_balancing.as_ref().is_some_and(|l| l.mode == LbMode::Passthrough) {
                return Ok(None);
            }
            let port = svc.ports.iter().find(|p| p.port == dst.port()).ok_or_else(|| {
                LookupError::NoServicePort { service: key.clone(), port: dst.port() }
            })?;
            let eps: Vec<(&Arc<Workload>, ())> = ix
                .endpoints
                .get(&key)
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .filter_map(|uid| ix.workloads.get(uid))
                // An address of the service's families; another network's endpoints may have
                // none: its gateway reaches them.
                .filter(|w| {
                    w.fail_closed.is_none()
                        && (w.ips.iter().any(|ip| svc.ip_families.accepts(*ip))
                            || (w.ips.is_empty() && !w.hostname.is_empty())
                            || (w.network != src_network && w.network_gateway.is_some()))
                })
                .map(|w| (w, ()))
                .collect();
            let Some((w, ())) = self.choose(svc, src, eps) else {
                return Err(LookupError::NoEndpoints(key));
            };
            if w.network != src_network {
                let hop =
                    Hop { workload: w.clone(), addr: dst, sans: svc.subject_alt_names.clone() };
                return self.through_gateway(&ix, hop, svc, src, dst).map(Some);
            }
            let mapped = w
                .services
                .get(&key)
                .and_then(|ports| ports.iter().find(|m| m.service_port == port.port))
                .map(|m| m.target_port)
                .filter(|p| *p != 0);
            let target_port = mapped.or(port.target_port).unwrap_or(port.port);
            // A hostname workload: its address is looked up when the connection is made.
            let by_name = w.ips.is_empty() && !w.hostname.is_empty();
            let ip = match ip_like(w, dst.ip(), svc.ip_families) {
                Some(ip) => ip,
                None if by_name && dst.is_ipv4() => IpAddr::from([0u8; 4]),
                None if by_name => IpAddr::from([0u16; 8]),
                None => return Err(LookupError::NoEndpoints(key.clone())),
            };
            let target = SocketAddr::new(ip, target_port);
            let hop =
                Hop { workload: w.clone(), addr: target, sans: svc.subject_alt_names.clone() };
            let mut up = self.direct(hop, Some(svc.clone()));
            if by_name {
                up.resolve = Some(w.hostname.clone());
            }
            return Ok(Some(up));
        }
        // A pod IP: only workloads of the source's network share its address space.
        let Some(w) = ix.by_ip.get(&dst.ip()).filter(|w| w.network == src_network) else {
            return Ok(None);
        };
        if let Some(why) = &w.fail_closed {
            return Err(LookupError::FailClosed {
                what: format!("workload {}", w.uid),
                why: why.clone(),
            });
        }
        if let Some(wp) = &w.waypoint {
            if !self.is_from_waypoint(&ix, wp, src, src_ip) {
                let hop = self.waypoint_hop(&ix, wp, src, dst, &w.uid)?;
                return Ok(Some(self.upstream(hop, dst, None, Via::WorkloadWaypoint)));
            }
        }
        let hop = Hop { workload: w.clone(), addr: dst, sans: Vec::new() };
        Ok(Some(self.direct(hop, None)))
    }

    /// One of `svc`'s candidate endpoints for `src`: those its health policy allows, ranked by
    /// its routing preferences when its mode is STRICT or FAILOVER (the best rank only), then
    /// taken in turn.
    fn choose<'a, T: Copy>(
        &self,
        svc: &Service,
        src: Option<&Workload>,
        cands: Vec<(&'a Arc<Workload>, T)>,
    ) -> Option<(&'a Arc<Workload>, T)> {
        let lb = svc.load_balancing.as_ref();
        let allow_all = lb.is_some_and(|l| l.health_policy == HealthPolicy::AllowAll);
        let mut cands: Vec<_> = cands.into_iter().filter(|(w, _)| w.healthy || allow_all).collect();
        if let Some(lb) = lb.filter(|l| matches!(l.mode, LbMode::Strict | LbMode::Failover)) {
            let ranked: Vec<_> =
                cands.into_iter().filter_map(|c| rank(lb, src, c.0).map(|r| (r, c))).collect();
            let best = ranked.iter().map(|(r, _)| *r).max()?;
            cands = ranked.into_iter().filter(|(r, _)| *r == best).map(|(_, c)| c).collect();
        }
        if cands.is_empty() {
            return None;
        }
        Some(cands[self.rr.fetch_add(1, Ordering::Relaxed) % cands.len()])
    }

    /// Straight to the destination: HBONE to its node's inbound (CONNECT target = the workload
    /// address), or TCP to the address.
    fn direct(&self, hop: Hop, service: Option<Arc<Service>>) -> Upstream {
        let hbone_addr = self
            .cfg
            .node_hbone
            .get(&hop.workload.node)
            .copied()
            .unwrap_or_else(|| SocketAddr::new(hop.addr.ip(), self.cfg.hbone_port));
        Upstream {
            identity: self.identity_of(&hop.workload),
            sans: parse_sans(&hop.sans),
            protocol: hop.workload.protocol,
            workload: hop.workload,
            target: hop.addr,
            hbone_addr,
            service,
            via: Via::Direct,
            double: None,
            resolve: None,
        }
    }

    /// To `hop` (an endpoint or waypoint of `svc` on another network) through its network
    /// gateway: the gateway is the next hop; both CONNECTs name the service's hostname and the
    /// port dialled; the inner TLS must reach `hop`'s identity or its service's SANs.
    fn through_gateway(
        &self,
        ix: &Index,
        hop: Hop,
        svc: &Arc<Service>,
        src: Option<&Workload>,
        dst: SocketAddr,
    ) -> Result<Upstream, LookupError> {
        let src_network = src.map(|w| w.network.as_str()).unwrap_or_default();
        let what = format!("service {} endpoint {}", svc.key(), hop.workload.uid);
        let Some(gw) = &hop.workload.network_gateway else {
            return Err(LookupError::NoNetworkGateway {
                dst: what,
                network: hop.workload.network.clone(),
                src_network: src_network.into(),
            });
        };
        let g = self.waypoint_hop(ix, gw, src, dst, &what).map_err(|e| match e {
            LookupError::UnknownWaypoint { dst, .. }
            | LookupError::NoWaypointEndpoint { dst, .. } => {
                LookupError::UnknownGateway { dst, gateway: gw.to_string() }
            }
            e => e,
        })?;
        let mut identities = vec![self.identity_of(&hop.workload)];
        identities.extend(parse_sans(&hop.sans));
        let mut up = self.upstream(g, dst, Some(svc.clone()), Via::Gateway);
        up.double =
            Some(Double { authority: format!("{}:{}", svc.hostname(), dst.port()), identities });
        Ok(up)
    }

    /// Through a waypoint: always HBONE, to the waypoint's HBONE port, CONNECT target = the
    /// original destination.
    fn upstream(
        &self,
        hop: Hop,
        dst: SocketAddr,
        service: Option<Arc<Service>>,
        via: Via,
    ) -> Upstream {
        // A waypoint enrolled in the mesh on a node of this machine (local file, several nodes)
        // is reached through that node's inbound, as a redirect would deliver it.
        let hbone_addr = self
            .cfg
            .node_hbone
            .get(&hop.workload.node)
            .filter(|_| hop.addr.port() == self.cfg.hbone_port)
            .copied()
            .unwrap_or(hop.addr);
        Upstream {
            identity: self.identity_of(&hop.workload),
            sans: parse_sans(&hop.sans),
            protocol: Protocol::Hbone,
            workload: hop.workload,
            target: dst,
            hbone_addr,
            service,
            via,
            double: None,
            resolve: None,
        }
    }

    /// The waypoint endpoint for a connection to `dst` (whose waypoint `wp` is, `what` naming
    /// the destination for errors). A waypoint named by a pod IP is used as named; one named by
    /// a VIP or hostname is one of its service's endpoints that serves the HBONE port (by the
    /// service's port, its own port mapping, or an application tunnel).
    fn waypoint_hop(
        &self,
        ix: &Index,
        wp: &GatewayAddress,
        src: Option<&Workload>,
        dst: SocketAddr,
        what: &str,
    ) -> Result<Hop, LookupError> {
        let via_service = |svc: &Arc<Service>| -> Result<Hop, LookupError> {
            let key = svc.key();
            if let Some(why) = &svc.fail_closed {
                return Err(LookupError::FailClosed {
                    what: format!("waypoint service {key}"),
                    why: why.clone(),
                });
            }
            let port = svc.ports.iter().find(|p| p.port == wp.hbone_port);
            let eps: Vec<(&Arc<Workload>, u16)> = ix
                .endpoints
                .get(&key)
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .filter_map(|uid| ix.workloads.get(uid))
                .filter(|w| {
                    w.fail_closed.is_none() && ip_like(w, dst.ip(), svc.ip_families).is_some()
                })
                .filter_map(|w| {
                    let mapped = w
                        .services
                        .get(&key)
                        .and_then(|ps| ps.iter().find(|m| m.service_port == wp.hbone_port))
                        .map(|m| m.target_port)
                        .filter(|p| *p != 0);
                    match (mapped, port) {
                        (Some(p), _) => Some((w, p)),
                        (None, Some(p)) => Some((w, p.target_port.unwrap_or(p.port))),
                        // An application tunnel terminates HBONE whatever the service's ports.
                        (None, None) => w.application_tunnel.map(|_| (w, wp.hbone_port)),
                    }
                })
                .collect();
            let Some((w, port)) = self.choose(svc, src, eps) else {
                return Err(LookupError::NoWaypointEndpoint {
                    dst: what.into(),
                    waypoint: wp.to_string(),
                });
            };
            let ip = ip_like(w, dst.ip(), svc.ip_families).expect("filtered above");
            Ok(Hop {
                workload: w.clone(),
                addr: SocketAddr::new(ip, port),
                sans: svc.subject_alt_names.clone(),
            })
        };
        let unknown =
            || LookupError::UnknownWaypoint { dst: what.into(), waypoint: wp.to_string() };
        match &wp.target {
            GatewayTarget::Address { ip, .. } => {
                if let Some(svc) = ix.by_vip.get(ip) {
                    via_service(svc)
                } else if let Some(w) = ix.by_ip.get(ip) {
                    Ok(Hop {
                        workload: w.clone(),
                        addr: SocketAddr::new(*ip, wp.hbone_port),
                        sans: vec![],
                    })
                } else {
                    Err(unknown())
                }
            }
            GatewayTarget::Hostname { namespace, hostname } => {
                let svc =
                    ix.services.get(&format!("{namespace}/{hostname}")).ok_or_else(unknown)?;
                via_service(svc)
            }
        }
    }

    /// Whether the source is one of the workloads that make up waypoint `wp`: its identity and
    /// one of its IPs (the waypoint sending on what it processed).
    fn is_from_waypoint(
        &self,
        ix: &Index,
        wp: &GatewayAddress,
        src: Option<&Workload>,
        src_ip: IpAddr,
    ) -> bool {
        let Some(src) = src else { return false };
        let id = self.identity_of(src);
        let is_it = |w: &Workload| w.ips.contains(&src_ip) && self.identity_of(w) == id;
        let any_endpoint = |svc: &Service| {
            ix.endpoints.get(&svc.key()).is_some_and(|uids| {
                uids.iter().filter_map(|u| ix.workloads.get(u)).any(|w| is_it(w))
            })
        };
        match &wp.target {
            GatewayTarget::Address { ip, .. } => match ix.by_vip.get(ip) {
                Some(svc) => any_endpoint(svc),
                None => ix.by_ip.get(ip).is_some_and(|w| is_it(w)),
            },
            GatewayTarget::Hostname { namespace, hostname } => {
                ix.services.get(&format!("{namespace}/{hostname}")).is_some_and(|s| any_endpoint(s))
            }
        }
    }
}

/// The SANs that are SPIFFE ids; others are skipped with a warning (ztunnel does the same).
fn parse_sans(sans: &[String]) -> Vec<Identity> {
    sans.iter()
        .filter_map(|s| match s.parse::<Identity>() {
            Ok(id) => Some(id),
            Err(e) => {
                tracing::warn!(san = %s, error = %e, "ignoring a subject alt name that is not a SPIFFE id");
                None
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::{local_resources, Delta, PortMapping, Resource, StoreConfig};
    use super::*;

    const MESH: &str = r#"
workloads:
- {uid: c, name: client, service_account: client, ips: [10.0.1.2], node: a}
- {uid: wp, name: waypoint, service_account: waypoint, ips: [10.0.3.9], node: w}
- {uid: wp4, name: tunnelled-wp, service_account: twp, ips: [10.0.3.4], node: b,
   application_tunnel: {protocol: PROXY, port: 15088}}
- {uid: s1, name: server, service_account: server, ips: [10.0.2.2], node: b}
- {uid: s2, name: plain, service_account: plain, ips: [10.0.2.3], node: b}
- {uid: s3, name: wl-wp, service_account: s3, ips: [10.0.2.4], node: b,
   waypoint: {address: 10.96.0.9, hbone_port: 15008}}
- {uid: s6, name: both, service_account: s6, ips: [10.0.2.6], node: b,
   waypoint: {address: 10.0.3.9, hbone_port: 15019}}
- {uid: s7, name: lost-wl, service_account: s7, ips: [10.0.2.7], node: b,
   waypoint: {address: 10.9.9.9, hbone_port: 15008}}
- {uid: r1, name: remote, service_account: r1, ips: [10.1.0.1], node: far, network: net2}
- {uid: r2, name: remote2, service_account: r2, ips: [], node: far, network: net2,
   network_gateway: {address: 10.1.0.100, hbone_port: 15008}}
- {uid: r3, name: remote3, service_account: r3, ips: [], node: far, network: net2,
   network_gateway: {hostname: istio-system/ew.istio-system.svc.cluster.local, hbone_port: 15009}}
- {uid: ew, name: eastwest, namespace: istio-system, service_account: ew, ips: [10.2.0.9], node: g,
   network: net2}
services:
- {name: waypoint, vips: [10.96.0.9], ports: [{port: 15008}], workloads: [wp],
   subject_alt_names: ["spiffe://cluster.local/ns/default/sa/waypoint-alt"]}
- {name: server, vips: [10.96.0.2], ports: [{port: 80, target_port: 8080}], workloads: [s1],
   waypoint: {hostname: default/waypoint.default.svc.cluster.local, hbone_port: 15008}}
- {name: plain, vips: [10.96.0.3], ports: [{port: 80}], workloads: [s2]}
- {name: plain2, vips: [10.96.0.11], ports: [{port: 80, target_port: 8080}], workloads: [s3]}
- {name: server2, vips: [10.96.0.12], ports: [{port: 80, target_port: 8080}], workloads: [s6],
   waypoint: {hostname: default/waypoint.default.svc.cluster.local, hbone_port: 15008}}
- {name: lost, vips: [10.96.0.4], ports: [{port: 80}],
   waypoint: {hostname: default/nowhere.default.svc.cluster.local, hbone_port: 15008}}
- {name: wp-empty, vips: [10.96.0.6], ports: [{port: 15008}]}
- {name: empty-wp, vips: [10.96.0.5], ports: [{port: 80}], waypoint: {address: 10.96.0.6, hbone_port: 15008}}
- {name: wp-noport, vips: [10.96.0.8], ports: [{port: 15021}], workloads: [wp]}
- {name: noport, vips: [10.96.0.7], ports: [{port: 80}], waypoint: {address: 10.96.0.8, hbone_port: 15008}}
- {name: wp-tunnel, vips: [10.96.0.14], ports: [{port: 15021}], workloads: [wp4]}
- {name: tunnelled, vips: [10.96.0.13], ports: [{port: 80}],
   waypoint: {hostname: default/wp-tunnel.default.svc.cluster.local, hbone_port: 15008}}
- {name: remote, vips: [10.96.0.10], ports: [{port: 80}], workloads: [r1]}
- {name: remote-gw, vips: [10.96.0.16], ports: [{port: 80}], workloads: [r2]}
- {name: remote-ew, vips: [10.96.0.17], ports: [{port: 80}], workloads: [r3],
   subject_alt_names: ["spiffe://cluster.local/ns/default/sa/remote-alt"]}
- {name: ew, namespace: istio-system, vips: [10.96.0.18], ports: [{port: 15009}], workloads: [ew]}
- {name: ext, hostname: api.example.org, vips: [240.240.0.9], ports: [{port: 443, target_port: 8443}],
   workloads: [h1]}
"#;

    /// A ServiceEntry endpoint with DNS resolution: no address, a hostname.
    const HOSTNAME_WORKLOAD: &str =
        "{uid: h1, name: ext, hostname: api.example.org, node: '', protocol: TCP}";

    #[derive(serde::Deserialize)]
    struct Mesh {
        workloads: Vec<Workload>,
        services: Vec<Service>,
    }

    fn store() -> Store {
        let s = Store::new(StoreConfig {
            trust_domain: "cluster.local".into(),
            node_name: "a".into(),
            hbone_port: 15008,
            node_hbone: [("b".to_string(), "127.0.0.3:25008".parse().unwrap())].into(),
            inpod: false,
            sync_timeout: None,
        });
        let m: Mesh = serde_yaml::from_str(MESH).unwrap();
        let mut upserts = local_resources(&m.workloads, &m.services, &[]);
        let mut closed: Service =
            serde_yaml::from_str("{name: closed, vips: [10.96.0.15], ports: [{port: 80}]}")
                .unwrap();
        closed.fail_closed = Some("refused: bad waypoint".into());
        upserts.push(Resource::Service(closed));
        let mut h: Workload = serde_yaml::from_str(HOSTNAME_WORKLOAD).unwrap();
        h.services.insert(
            "default/api.example.org".into(),
            vec![PortMapping { service_port: 443, target_port: 8443 }],
        );
        upserts.push(Resource::Workload(h));
        s.apply(Delta { upserts, removes: vec![] });
        s
    }

    /// What a case expects: the hop (via, HBONE address, CONNECT target, identity, intended
    /// service) or the refusal's reason.
    enum Want {
        Hop(Via, &'static str, &'static str, &'static str, Option<&'static str>),
        Refused(&'static str),
        Passthrough,
    }
    use Want::*;

    #[test]
    fn a_hostname_workload_is_chosen_and_resolved_at_connect_time() {
        let s = store();
        let c = s.workload_by_uid("c").unwrap();
        let mut u =
            s.resolve("240.240.0.9:443".parse().unwrap(), Some(&c), c.ips[0]).unwrap().unwrap();
        assert_eq!(u.resolve.as_deref(), Some("api.example.org"));
        assert_eq!(u.target, "0.0.0.0:8443".parse().unwrap());
        assert_eq!((u.protocol, u.workload.uid.as_str()), (Protocol::Tcp, "h1"));
        u.resolved("192.0.2.10".parse().unwrap());
        assert_eq!(u.target, "192.0.2.10:8443".parse().unwrap());
        assert_eq!(u.resolve, None);
        // Accepted by validation (an address is not needed with a hostname).
        let h: Workload = serde_yaml::from_str(HOSTNAME_WORKLOAD).unwrap();
        assert!(h.validate("cluster.local").is_ok());
        let mut none = h.clone();
        none.hostname.clear();
        assert!(none.validate("cluster.local").unwrap_err().contains("no hostname"));
    }

    #[test]
    fn route_table() {
        let s = store();
        let sa = |n: &str| format!("spiffe://cluster.local/ns/default/sa/{n}");
        let svc = |n: &str| format!("{n}.default.svc.cluster.local");
        #[rustfmt::skip]
        let cases: &[(&str, &str, &str, &str, Want)] = &[
            // (name, source uid, source ip, destination, expected)
            ("service waypoint by hostname", "c", "10.0.1.2", "10.96.0.2:80",
                Hop(Via::ServiceWaypoint, "10.0.3.9:15008", "10.96.0.2:80", "waypoint", Some("server"))),
            ("service waypoint on a port the service lacks", "c", "10.0.1.2", "10.96.0.2:9999",
                Hop(Via::ServiceWaypoint, "10.0.3.9:15008", "10.96.0.2:9999", "waypoint", Some("server"))),
            ("the waypoint itself to its service", "wp", "10.0.3.9", "10.96.0.2:80",
                Hop(Via::ServiceWaypoint, "10.0.3.9:15008", "10.96.0.2:80", "waypoint", Some("server"))),
            ("service waypoint not for pod-addressed", "c", "10.0.1.2", "10.0.2.2:8080",
                Hop(Via::Direct, "127.0.0.3:25008", "10.0.2.2:8080", "server", None)),
            ("workload waypoint by VIP", "c", "10.0.1.2", "10.0.2.4:8080",
                Hop(Via::WorkloadWaypoint, "10.0.3.9:15008", "10.0.2.4:8080", "waypoint", None)),
            ("workload waypoint not for VIP-addressed", "c", "10.0.1.2", "10.96.0.11:80",
                Hop(Via::Direct, "127.0.0.3:25008", "10.0.2.4:8080", "s3", Some("plain2"))),
            ("sandwich: the waypoint on to the pod", "wp", "10.0.3.9", "10.0.2.4:8080",
                Hop(Via::Direct, "127.0.0.3:25008", "10.0.2.4:8080", "s3", None)),
            ("waypoint's address, other identity", "c", "10.0.3.9", "10.0.2.4:8080",
                Hop(Via::WorkloadWaypoint, "10.0.3.9:15008", "10.0.2.4:8080", "waypoint", None)),
            ("waypoint's identity, other address", "wp", "10.0.1.2", "10.0.2.4:8080",
                Hop(Via::WorkloadWaypoint, "10.0.3.9:15008", "10.0.2.4:8080", "waypoint", None)),
            ("both set: pod-addressed takes the workload's (pod IP, its port)", "c", "10.0.1.2", "10.0.2.6:8080",
                Hop(Via::WorkloadWaypoint, "10.0.3.9:15019", "10.0.2.6:8080", "waypoint", None)),
            ("both set: VIP-addressed takes the service's", "c", "10.0.1.2", "10.96.0.12:80",
                Hop(Via::ServiceWaypoint, "10.0.3.9:15008", "10.96.0.12:80", "waypoint", Some("server2"))),
            ("no waypoint: direct to the pod", "c", "10.0.1.2", "10.0.2.3:80",
                Hop(Via::Direct, "127.0.0.3:25008", "10.0.2.3:80", "plain", None)),
            ("no waypoint: VIP translated", "c", "10.0.1.2", "10.96.0.3:80",
                Hop(Via::Direct, "127.0.0.3:25008", "10.0.2.3:80", "plain", Some("plain"))),
            ("waypoint by application tunnel, port not on its service", "c", "10.0.1.2", "10.96.0.13:80",
                Hop(Via::ServiceWaypoint, "127.0.0.3:25008", "10.96.0.13:80", "twp", Some("tunnelled"))),
            ("unknown waypoint hostname", "c", "10.0.1.2", "10.96.0.4:80", Refused("waypoint_unknown")),
            ("unknown waypoint IP", "c", "10.0.1.2", "10.0.2.7:80", Refused("waypoint_unknown")),
            ("waypoint service without endpoints", "c", "10.0.1.2", "10.96.0.5:80", Refused("waypoint_no_endpoint")),
            ("waypoint service without its HBONE port", "c", "10.0.1.2", "10.96.0.7:80", Refused("waypoint_no_endpoint")),
            ("service held fail-closed", "c", "10.0.1.2", "10.96.0.15:80", Refused("destination_fail_closed")),
            ("endpoint on another network without a gateway", "c", "10.0.1.2", "10.96.0.10:80", Refused("no_network_gateway")),
            ("endpoint on another network, gateway unknown", "c", "10.0.1.2", "10.96.0.16:80", Refused("network_gateway_unknown")),
            ("another network's pod IP is not ours", "c", "10.0.1.2", "10.1.0.1:80", Passthrough),
            ("not in the mesh", "c", "10.0.1.2", "1.1.1.1:443", Passthrough),
        ];
        for (name, src, src_ip, dst, want) in cases {
            let w = s.workload_by_uid(src).unwrap();
            let got = s.resolve(dst.parse().unwrap(), Some(&w), src_ip.parse().unwrap());
            match (want, got) {
                (Hop(via, hop, target, id, service), Ok(Some(u))) => {
                    assert_eq!(u.via, *via, "{name}");
                    assert_eq!(u.hbone_addr.to_string(), *hop, "{name}");
                    assert_eq!(u.target.to_string(), *target, "{name}");
                    assert_eq!(u.identity.to_string(), sa(id), "{name}");
                    assert_eq!(
                        u.service.as_ref().map(|s| s.hostname()),
                        service.map(svc),
                        "{name}"
                    );
                    if *via != Via::Direct {
                        assert_eq!(u.protocol, Protocol::Hbone, "{name}");
                    }
                }
                (Refused(reason), Err(e)) => assert_eq!(e.reason(), *reason, "{name}: {e}"),
                (Passthrough, Ok(None)) => {}
                (_, got) => panic!("{name}: got {got:?}"),
            }
        }
    }

    #[test]
    fn another_network_through_its_gateway_with_double_hbone() {
        let s = store();
        let c = s.workload_by_uid("c").unwrap();
        let u = s.resolve("10.96.0.17:80".parse().unwrap(), Some(&c), c.ips[0]).unwrap().unwrap();
        assert_eq!(u.via, Via::Gateway);
        assert_eq!(u.hbone_addr.to_string(), "10.2.0.9:15009", "the gateway's HBONE port");
        assert_eq!(u.identity.to_string(), "spiffe://cluster.local/ns/istio-system/sa/ew");
        assert_eq!(u.service.as_ref().unwrap().hostname(), "remote-ew.default.svc.cluster.local");
        let d = u.double.unwrap();
        assert_eq!(d.authority, "remote-ew.default.svc.cluster.local:80");
        let ids: Vec<String> = d.identities.iter().map(|i| i.to_string()).collect();
        assert_eq!(
            ids,
            [
                "spiffe://cluster.local/ns/default/sa/r3",
                "spiffe://cluster.local/ns/default/sa/remote-alt"
            ]
        );
    }

    #[test]
    fn waypoint_service_sans_are_accepted_identities() {
        let s = store();
        let c = s.workload_by_uid("c").unwrap();
        let u = s.resolve("10.96.0.2:80".parse().unwrap(), Some(&c), c.ips[0]).unwrap().unwrap();
        let sans: Vec<String> = u.sans.iter().map(|i| i.to_string()).collect();
        assert_eq!(sans, ["spiffe://cluster.local/ns/default/sa/waypoint-alt"]);
    }
}

#[cfg(test)]
mod choice_tests {
    use super::*;
    use std::collections::BTreeSet;

    const MESH: &str = r#"
workloads:
- {uid: src, name: src, ips: [10.0.0.1], node: a, cluster_id: c1,
   locality: {region: r1, zone: z1, subzone: s1}}
- {uid: zone, name: zone, ips: [10.0.1.1], node: b, cluster_id: c1,
   locality: {region: r1, zone: z1, subzone: s2}}
- {uid: region, name: region, ips: [10.0.1.2], node: b, cluster_id: c1,
   locality: {region: r1, zone: z2}}
- {uid: far, name: far, ips: [10.0.1.3], node: c, cluster_id: c2,
   locality: {region: r2, zone: z9}}
- {uid: node, name: node, ips: [10.0.1.4], node: a, cluster_id: c1,
   locality: {region: r1, zone: z1, subzone: s1}}
- {uid: sick, name: sick, ips: [10.0.1.5], node: a, healthy: false,
   locality: {region: r1, zone: z1, subzone: s1}}
- {uid: dual, name: dual, ips: [10.0.1.6, "fd00::6"], node: b}
- {uid: v6, name: v6, ips: ["fd00::7"], node: b}
- {uid: remote, name: remote, ips: [10.9.0.1], node: r, network: net2,
   locality: {region: r1}, network_gateway: {address: 10.9.0.100, hbone_port: 15008}}
- {uid: ew, name: ew, ips: [10.9.0.100], node: g}
services:
- {name: failover, vips: [10.96.1.1], ports: [{port: 80}], workloads: [zone, region, far],
   load_balancing: {routing_preference: [REGION, ZONE, SUBZONE], mode: FAILOVER}}
- {name: failover-far, vips: [10.96.1.2], ports: [{port: 80}], workloads: [far],
   load_balancing: {routing_preference: [REGION, ZONE], mode: FAILOVER}}
- {name: strict-zone, vips: [10.96.1.3], ports: [{port: 80}], workloads: [region, far],
   load_balancing: {routing_preference: [REGION, ZONE], mode: STRICT}}
- {name: strict-region, vips: [10.96.1.4], ports: [{port: 80}], workloads: [region, far],
   load_balancing: {routing_preference: [REGION], mode: STRICT}}
- {name: node-first, vips: [10.96.1.5], ports: [{port: 80}], workloads: [node, zone],
   load_balancing: {routing_preference: [NODE], mode: FAILOVER}}
- {name: healthy-only, vips: [10.96.1.6], ports: [{port: 80}], workloads: [sick, far]}
- {name: allow-all, vips: [10.96.1.7], ports: [{port: 80}], workloads: [sick, far],
   load_balancing: {routing_preference: [NODE], mode: FAILOVER, health_policy: ALLOW_ALL}}
- {name: v6-only, vips: [10.96.1.8], ports: [{port: 80}], workloads: [zone, dual], ip_families: IPV6_ONLY}
- {name: v4-only, vips: [10.96.1.9], ports: [{port: 80}], workloads: [v6], ip_families: IPV4_ONLY}
- {name: passthrough, vips: [10.96.1.10], ports: [{port: 80}], workloads: [zone],
   load_balancing: {mode: PASSTHROUGH}}
- {name: network-first, vips: [10.96.1.11], ports: [{port: 80}], workloads: [remote, far],
   load_balancing: {routing_preference: [NETWORK, REGION], mode: FAILOVER}}
- {name: cluster, vips: [10.96.1.12], ports: [{port: 80}], workloads: [far, region],
   load_balancing: {routing_preference: [CLUSTER], mode: FAILOVER}}
- {name: standard, vips: [10.96.1.13], ports: [{port: 80}], workloads: [zone, far],
   load_balancing: {routing_preference: [REGION, ZONE]}}
- {name: ew, vips: [10.96.1.14], ports: [{port: 15008}], workloads: [ew]}
"#;

    fn store() -> Store {
        super::super::store_of_yaml("a", MESH).unwrap()
    }

    #[test]
    fn endpoint_choice_table() {
        let s = store();
        let src = s.workload_by_uid("src").unwrap();
        // The endpoints ever chosen, or the refusal's reason.
        type Chosen<'a> = Result<&'a [&'a str], &'a str>;
        #[rustfmt::skip]
        let cases: &[(&str, &str, Chosen)] = &[
            // (name, VIP, the endpoints ever chosen — or the refusal)
            ("FAILOVER: the most leading scopes matched", "10.96.1.1", Ok(&["zone"])),
            ("FAILOVER: nothing close, the rest", "10.96.1.2", Ok(&["far"])),
            ("STRICT: every scope or nothing", "10.96.1.3", Err("no_endpoints")),
            ("STRICT: every scope matched", "10.96.1.4", Ok(&["region"])),
            ("NODE first", "10.96.1.5", Ok(&["node"])),
            ("unhealthy left out by default", "10.96.1.6", Ok(&["far"])),
            ("ALLOW_ALL: unhealthy chosen too", "10.96.1.7", Ok(&["sick"])),
            ("IPV6_ONLY: only endpoints with an IPv6 address", "10.96.1.8", Ok(&["dual"])),
            ("IPV4_ONLY: none has one", "10.96.1.9", Err("no_endpoints")),
            ("NETWORK first: same network outranks", "10.96.1.11", Ok(&["far"])),
            ("CLUSTER", "10.96.1.12", Ok(&["region"])),
            ("no mode: preferences ignored, every endpoint in turn", "10.96.1.13", Ok(&["far", "zone"])),
        ];
        for (name, vip, want) in cases {
            let dst = SocketAddr::new(vip.parse().unwrap(), 80);
            let mut got = BTreeSet::new();
            let mut err = None;
            for _ in 0..8 {
                match s.resolve(dst, Some(&src), src.ips[0]) {
                    Ok(Some(u)) => {
                        got.insert(u.workload.uid.clone());
                    }
                    Ok(None) => panic!("{name}: passthrough"),
                    Err(e) => err = Some(e.reason()),
                }
            }
            match want {
                Ok(uids) => {
                    assert_eq!(err, None, "{name}");
                    assert_eq!(got, uids.iter().map(|u| u.to_string()).collect(), "{name}");
                }
                Err(reason) => assert_eq!(err, Some(*reason), "{name}: chose {got:?}"),
            }
        }
        // The family restriction also picks the address.
        let u =
            s.resolve("10.96.1.8:80".parse().unwrap(), Some(&src), src.ips[0]).unwrap().unwrap();
        assert_eq!(u.target, "[fd00::6]:80".parse().unwrap());
        // PASSTHROUGH: no endpoint choice, the address as dialled.
        assert!(s
            .resolve("10.96.1.10:80".parse().unwrap(), Some(&src), src.ips[0])
            .unwrap()
            .is_none());
    }
}
