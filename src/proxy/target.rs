//! Inbound `CONNECT` targets: which are accepted for the local workload a connection reached, and
//! where each is delivered. Beyond the workload's own `ip:port` (checked by
//! [`check_connect`]), ztunnel's rules for a waypoint on this node:
//! - a workload with an application tunnel (a waypoint in the mesh) accepts any target: it gets
//!   the target in the PROXY header and decides itself;
//! - otherwise a target other than the workload's own address is accepted only when this
//!   workload is the target's waypoint: a pod whose own waypoint names it (by its pod IP, or by a
//!   VIP or hostname of a service it backs), or a service VIP whose service waypoint does. A
//!   service waypoint does not attach a pod target, a workload waypoint does not attach a service
//!   target; anything else is 400;
//! - a target by service hostname (`host:port`, as a double-HBONE client sends) is accepted when
//!   the workload backs that service, is its waypoint, or has an application tunnel.
//!
//! An accepted target is delivered to the workload's own IP on the target's port (a hostname's
//! port is translated through the service's mapping), or to its application tunnel.
#![forbid(unsafe_code)]

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use http::Request;

use crate::hbone::{check_connect, ConnectRefusal};
use crate::state::{GatewayAddress, GatewayTarget, Store, TunnelHeader, Workload};

/// An accepted `CONNECT`.
#[derive(Debug)]
pub struct Accepted {
    /// The local workload it is for.
    pub workload: Arc<Workload>,
    /// Where the workload is dialled: its address and the target's port, or its tunnel's port.
    pub upstream: SocketAddr,
    /// What authorization sees as the destination: its address and the target's port (before
    /// an application tunnel's port replaces it).
    pub authz_dst: SocketAddr,
    /// Set when the workload has an application tunnel with protocol PROXY: the destination the
    /// PROXY header names (the CONNECT target; for a hostname, the service's VIP).
    pub proxy_destination: Option<SocketAddr>,
    /// Delivered through an application tunnel (dialled from loopback inside a pod).
    pub tunnel: bool,
}

/// Decides `req`, which arrived on a connection that reached `reached` (see the module docs).
/// `own_ports`: the proxy's own ports when it serves from inside a pod (a target there loops).
pub fn accept<B>(
    state: &Store,
    req: &Request<B>,
    reached: SocketAddr,
    own_ports: &[u16],
) -> Result<Accepted, ConnectRefusal> {
    let e = match check_connect(req, reached, own_ports, |ip| state.local_workload_by_ip(ip)) {
        Ok((target, w)) => return deliver(w, target.port(), target, own_ports),
        Err(e @ (ConnectRefusal::UnknownTarget(_) | ConnectRefusal::AddressMismatch { .. })) => e,
        Err(e @ ConnectRefusal::Authority(_)) => {
            return by_hostname(state, req, reached, own_ports).ok_or(e)?
        }
        Err(e) => return Err(e),
    };
    let target = crate::hbone::parse_connect(req)?;
    let Some(local) = state.local_workload_by_ip(reached.ip()) else { return Err(e) };
    if local.application_tunnel.is_none()
        && !is_waypoint_of(state, target.ip(), &local, reached.ip())
    {
        return Err(e);
    }
    tracing::debug!(%target, waypoint = %local.uid, "CONNECT for a destination this waypoint serves");
    deliver(local, target.port(), target, own_ports)
}

/// A `host:port` authority naming a service this workload backs, is the waypoint of, or takes
/// through its application tunnel. `None`: not such a name (the authority error stands).
fn by_hostname<B>(
    state: &Store,
    req: &Request<B>,
    reached: SocketAddr,
    own_ports: &[u16],
) -> Option<Result<Accepted, ConnectRefusal>> {
    let auth = req.uri().authority()?;
    let (host, port) = (auth.host(), auth.port_u16()?);
    let svc = state.service_by_hostname(host)?;
    let local = state.local_workload_by_ip(reached.ip())?;
    let key = svc.key();
    let backs = local.services.get(&key);
    let is_waypoint =
        svc.waypoint.as_ref().is_some_and(|wp| names(state, wp, &local, reached.ip()));
    if backs.is_none() && !is_waypoint && local.application_tunnel.is_none() {
        return None;
    }
    let mapped = backs
        .and_then(|ps| ps.iter().find(|m| m.service_port == port))
        .map(|m| m.target_port)
        .filter(|p| *p != 0);
    let svc_port = svc.ports.iter().find(|p| p.port == port);
    let Some(to_port) =
        mapped.or(svc_port.and_then(|p| p.target_port)).or(svc_port.map(|p| p.port))
    else {
        return Some(Err(ConnectRefusal::Authority(format!(
            "{host}:{port} (service {key} has no port {port})"
        ))));
    };
    // PROXY headers carry addresses: the service's VIP, IPv4 first.
    let vip = svc.vips.iter().max_by_key(|v| v.is_ipv4()).copied();
    let named = SocketAddr::new(vip.unwrap_or(reached.ip()), port);
    Some(deliver(local, to_port, named, own_ports))
}

/// Where `w` gets a connection for `target` (port `port` on its own address, or its tunnel).
fn deliver(
    w: Arc<Workload>,
    to_port: u16,
    target: SocketAddr,
    own_ports: &[u16],
) -> Result<Accepted, ConnectRefusal> {
    // A local workload has an address (it was reached at it).
    let Some(ip) = w.ips.iter().find(|ip| ip.is_ipv4() == target.is_ipv4()).or(w.ips.first())
    else {
        return Err(ConnectRefusal::UnknownTarget(target));
    };
    let (port, proxy_destination, tunnel) = match w.application_tunnel {
        Some(t) => {
            (t.port.unwrap_or(to_port), (t.protocol == TunnelHeader::Proxy).then_some(target), true)
        }
        None => (to_port, None, false),
    };
    let authz_dst = SocketAddr::new(*ip, to_port);
    let upstream = SocketAddr::new(*ip, port);
    if own_ports.contains(&port) {
        return Err(ConnectRefusal::Loop(upstream));
    }
    Ok(Accepted { workload: w, upstream, authz_dst, proxy_destination, tunnel })
}

/// Whether local workload `local` (reached at `reached`) is the waypoint of what `ip` is: a
/// service VIP through its service's waypoint, a pod IP through its workload's waypoint.
fn is_waypoint_of(state: &Store, ip: IpAddr, local: &Workload, reached: IpAddr) -> bool {
    let wp = match state.service_by_vip(ip) {
        Some(svc) => svc.waypoint.clone(),
        None => state.workload_by_ip(ip).and_then(|w| w.waypoint.clone()),
    };
    wp.is_some_and(|wp| names(state, &wp, local, reached))
}

/// Whether gateway address `wp` names `local`: its own IP, or a service it backs.
fn names(state: &Store, wp: &GatewayAddress, local: &Workload, reached: IpAddr) -> bool {
    match &wp.target {
        GatewayTarget::Address { ip, .. } => match state.service_by_vip(*ip) {
            Some(svc) => local.services.contains_key(&svc.key()),
            None => state.workload_by_ip(*ip).is_some_and(|w| w.ips.contains(&reached)),
        },
        GatewayTarget::Hostname { namespace, hostname } => {
            local.services.contains_key(&format!("{namespace}/{hostname}"))
        }
    }
}

/// The PROXY protocol v2 header an application tunnel is given: source = the HBONE peer's
/// address, destination = the CONNECT target, TLV 0xD0 = the peer's SPIFFE id (as ztunnel
/// writes it).
pub fn proxy_header(
    source: SocketAddr,
    destination: SocketAddr,
    peer: Option<&crate::identity::Identity>,
) -> std::io::Result<Vec<u8>> {
    use ppp::v2::{Builder, Command, Protocol, Version};
    let mut b = Builder::with_addresses(
        Version::Two | Command::Proxy,
        Protocol::Stream,
        (source, destination),
    );
    if let Some(id) = peer {
        b = b.write_tlv(PROXY_AUTHORITY_TLV, id.to_string().as_bytes())?;
    }
    b.build()
}

/// The PROXY v2 TLV type carrying the client's SPIFFE id.
pub const PROXY_AUTHORITY_TLV: u8 = 0xD0;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{local_resources, Delta, Service, StoreConfig};

    const WP_POD: &str = "10.0.3.9";
    const WP_VIP: &str = "10.96.0.9";
    const SERVER_POD: &str = "10.0.2.2";
    const SERVER_VIP: &str = "10.96.0.2";
    const CLIENT_POD: &str = "10.0.1.2";

    /// How the server is attached to the waypoint, as in ztunnel's inbound table.
    #[derive(Clone, Copy)]
    enum Attach {
        None,
        /// The server workload's own waypoint, named by this address.
        Workload(&'static str),
        /// The server service's waypoint, named by this address.
        Service(&'static str),
    }

    fn store(attach: Attach, app_tunnel: bool) -> Store {
        let s = Store::new(StoreConfig {
            trust_domain: "cluster.local".into(),
            node_name: "b".into(),
            hbone_port: 15008,
            node_hbone: Default::default(),
            inpod: false,
            sync_timeout: None,
        });
        let gw = |ip: &str| format!("waypoint: {{address: {ip}, hbone_port: 15008}}");
        let (wl_wp, svc_wp) = match attach {
            Attach::None => (String::new(), String::new()),
            Attach::Workload(ip) => (format!(", {}", gw(ip)), String::new()),
            Attach::Service(ip) => (String::new(), format!(", {}", gw(ip))),
        };
        let tunnel =
            if app_tunnel { ", application_tunnel: {protocol: PROXY, port: 15088}" } else { "" };
        let yaml = format!(
            r#"
workloads:
- {{uid: c, name: client, service_account: client, ips: [{CLIENT_POD}], node: a}}
- {{uid: wp, name: waypoint, service_account: waypoint, ips: [{WP_POD}], node: b{tunnel}}}
- {{uid: s1, name: server, service_account: server, ips: [{SERVER_POD}], node: b{wl_wp}}}
services:
- {{name: waypoint, vips: [{WP_VIP}], ports: [{{port: 15008}}], workloads: [wp]}}
- {{name: server, vips: [{SERVER_VIP}], ports: [{{port: 80, target_port: 8080}}], workloads: [s1]{svc_wp}}}
"#
        );
        #[derive(serde::Deserialize)]
        struct Mesh {
            workloads: Vec<Workload>,
            services: Vec<Service>,
        }
        let m: Mesh = serde_yaml::from_str(&yaml).unwrap();
        s.apply(Delta {
            upserts: local_resources(&m.workloads, &m.services, &[]),
            removes: vec![],
        });
        s
    }

    fn connect(authority: &str) -> Request<()> {
        Request::builder().method(http::Method::CONNECT).uri(authority).body(()).unwrap()
    }

    #[test]
    fn inbound_waypoint_table() {
        use Attach::*;
        let server = "server.default.svc.cluster.local";
        // Delivered to (ip, port, PROXY destination), or refused.
        type Delivered<'a> = Option<(&'a str, u16, Option<String>)>;
        #[rustfmt::skip]
        let cases: &[(&str, Attach, bool, &str, String, Delivered)] = &[
            // (name, attachment, app tunnel, reached, CONNECT target, delivered to (ip, port, PROXY destination))
            ("to workload no waypoint", None, false, SERVER_POD, format!("{SERVER_POD}:8080"), Some((SERVER_POD, 8080, Option::None))),
            ("svc hostname to workload no waypoint", None, false, SERVER_POD, format!("{server}:80"), Some((SERVER_POD, 8080, Option::None))),
            ("to workload with waypoint referenced by pod", Workload(WP_POD), false, WP_POD, format!("{SERVER_POD}:8080"), Some((WP_POD, 8080, Option::None))),
            ("to workload with waypoint referenced by vip", Workload(WP_VIP), false, WP_POD, format!("{SERVER_POD}:8080"), Some((WP_POD, 8080, Option::None))),
            ("to workload with app tunnel", Workload(WP_VIP), true, WP_POD, format!("{SERVER_POD}:8080"), Some((WP_POD, 15088, Some(format!("{SERVER_POD}:8080"))))),
            ("to service with waypoint referenced by pod", Service(WP_POD), false, WP_POD, format!("{SERVER_VIP}:80"), Some((WP_POD, 80, Option::None))),
            ("to service with waypoint referenced by vip", Service(WP_VIP), false, WP_POD, format!("{SERVER_VIP}:80"), Some((WP_POD, 80, Option::None))),
            ("to service with app tunnel", Service(WP_VIP), true, WP_POD, format!("{SERVER_VIP}:80"), Some((WP_POD, 15088, Some(format!("{SERVER_VIP}:80"))))),
            ("svc hostname to its waypoint", Service(WP_VIP), false, WP_POD, format!("{server}:80"), Some((WP_POD, 8080, Option::None))),
            ("svc hostname with app tunnel: PROXY names the VIP", Service(WP_VIP), true, WP_POD, format!("{server}:80"), Some((WP_POD, 15088, Some(format!("{SERVER_VIP}:80"))))),
            ("app tunnel takes an unattached target", None, true, WP_POD, format!("{CLIENT_POD}:80"), Some((WP_POD, 15088, Some(format!("{CLIENT_POD}:80"))))),
            ("to waypoint itself", None, false, WP_POD, format!("{WP_POD}:9090"), Some((WP_POD, 9090, Option::None))),
            // Refused (400).
            ("to waypoint without attachment", None, false, WP_POD, format!("{CLIENT_POD}:8080"), Option::None),
            ("to workload via waypoint with wrong attachment", Service(WP_POD), false, WP_POD, format!("{SERVER_POD}:8080"), Option::None),
            ("to service via waypoint with wrong attachment", Workload(WP_POD), false, WP_POD, format!("{SERVER_VIP}:80"), Option::None),
            ("unknown IP", Workload(WP_POD), false, WP_POD, "192.0.2.1:80".into(), Option::None),
            ("svc hostname not attached", None, false, WP_POD, format!("{server}:80"), Option::None),
            ("unknown hostname", None, false, SERVER_POD, "nowhere.default.svc.cluster.local:80".into(), Option::None),
            ("no waypoint: another pod's address", None, false, SERVER_POD, format!("{WP_POD}:8080"), Option::None),
        ];
        for (name, attach, tunnel, reached, target, want) in cases {
            let s = store(*attach, *tunnel);
            let reached = SocketAddr::new(reached.parse().unwrap(), 15008);
            let got = accept(&s, &connect(target), reached, &[]);
            match (want, got) {
                (Some((ip, port, proxy)), Ok(a)) => {
                    assert_eq!(a.upstream, SocketAddr::new(ip.parse().unwrap(), *port), "{name}");
                    assert_eq!(a.proxy_destination.map(|d| d.to_string()), *proxy, "{name}");
                    assert_eq!(a.tunnel, *tunnel, "{name}");
                }
                (Option::None, Err(e)) => {
                    assert_eq!(e.status(), http::StatusCode::BAD_REQUEST, "{name}: {e}")
                }
                (_, got) => panic!("{name}: got {got:?}"),
            }
        }
    }

    #[test]
    fn a_tunnel_port_that_is_the_proxys_own_loops() {
        let s = store(Attach::None, true);
        let reached = SocketAddr::new(WP_POD.parse().unwrap(), 15008);
        let e = accept(&s, &connect(&format!("{WP_POD}:80")), reached, &[15088]).unwrap_err();
        assert_eq!(e.reason(), "loop");
    }

    #[test]
    fn proxy_header_is_what_ztunnel_writes() {
        // The bytes of ztunnel 62d82653's header for the same addresses and identity
        // (tests/fixtures/ztunnel-waypoint/inbound.json, case service_vip).
        let fixture: serde_json::Value = serde_json::from_str(include_str!(
            "../../tests/fixtures/ztunnel-waypoint/inbound.json"
        ))
        .unwrap();
        let case = &fixture["variants"][0]["cases"][0];
        let up = &case["upstream_connections"][0];
        let hex = up["proxy_header_hex"].as_str().expect("proxy header hex in the fixture");
        let src: SocketAddr = up["proxy_header"]["source"].as_str().unwrap().parse().unwrap();
        let dst: SocketAddr = up["proxy_header"]["destination"].as_str().unwrap().parse().unwrap();
        let id: crate::identity::Identity =
            case["input"]["client_identity"].as_str().unwrap().parse().unwrap();
        let ours = proxy_header(src, dst, Some(&id)).unwrap();
        let ours_hex: String = ours.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(ours_hex, hex);
    }
}
