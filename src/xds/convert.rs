//! xDS resources → mesh-state resources. Everything istiod may get wrong is checked here and
//! named: missing names, IPs that are not 4 or 16 bytes, enum values this proxy does not know,
//! ports out of range. A refused resource is NACKed; the others of the same response apply.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::net::IpAddr;

use prost::Message;

use crate::proto::{security as pb_sec, workload as pb};
use crate::state::policy::{
    Action, Authorization, Cidr, Clause, Match, Rule, Scope, ServiceAccountMatch, StringMatch,
};
use crate::state::{
    AppTunnel, GatewayAddress, GatewayTarget, HealthPolicy, IpFamilies, LbMode, LbScope,
    LoadBalancing, Locality, PortMapping, Protocol, Resource, Service, ServicePort, TunnelHeader,
    Workload,
};

pub const ADDRESS_TYPE: &str = "type.googleapis.com/istio.workload.Address";
pub const AUTHORIZATION_TYPE: &str = "type.googleapis.com/istio.security.Authorization";

fn ip_of(b: &[u8]) -> Result<IpAddr, String> {
    match b.len() {
        4 => Ok(IpAddr::from(<[u8; 4]>::try_from(b).unwrap())),
        16 => Ok(IpAddr::from(<[u8; 16]>::try_from(b).unwrap())),
        n => Err(format!("an IP address of {n} bytes (expected 4 or 16)")),
    }
}

fn port_of(p: u32, what: &str) -> Result<u16, String> {
    u16::try_from(p).map_err(|_| format!("{what} {p} is out of range"))
}

/// A waypoint or network gateway reference. Malformed ones (no destination, an address of the
/// wrong length, an empty namespace or hostname, no HBONE port) are refused: a connection must
/// never go direct because its waypoint could not be read.
fn gateway(g: Option<pb::GatewayAddress>, what: &str) -> Result<Option<GatewayAddress>, String> {
    use pb::gateway_address::Destination;
    let Some(g) = g else { return Ok(None) };
    let target = match g.destination {
        Some(Destination::Address(a)) => GatewayTarget::Address {
            network: a.network,
            ip: ip_of(&a.address).map_err(|e| format!("{what}: {e}"))?,
        },
        Some(Destination::Hostname(h)) if !h.namespace.is_empty() && !h.hostname.is_empty() => {
            GatewayTarget::Hostname { namespace: h.namespace, hostname: h.hostname }
        }
        Some(Destination::Hostname(h)) => {
            return Err(format!(
                "{what}: hostname '{}' in namespace '{}' (both are needed)",
                h.hostname, h.namespace
            ))
        }
        None => return Err(format!("{what} names neither an address nor a hostname")),
    };
    let hbone_port = port_of(g.hbone_mtls_port, &format!("{what} HBONE port"))?;
    if hbone_port == 0 {
        return Err(format!("{what} has no HBONE port (hbone_mtls_port 0)"));
    }
    Ok(Some(GatewayAddress { target, hbone_port }))
}

/// A service's load-balancing settings; an unknown scope, mode or policy is refused rather than
/// guessed (a STRICT read as anything else could send traffic out of its zone).
fn load_balancing(lb: &pb::LoadBalancing) -> Result<LoadBalancing, String> {
    use pb::load_balancing as l;
    let routing_preference = lb
        .routing_preference
        .iter()
        .map(|s| match l::Scope::try_from(*s) {
            Ok(l::Scope::Region) => Ok(LbScope::Region),
            Ok(l::Scope::Zone) => Ok(LbScope::Zone),
            Ok(l::Scope::Subzone) => Ok(LbScope::Subzone),
            Ok(l::Scope::Node) => Ok(LbScope::Node),
            Ok(l::Scope::Cluster) => Ok(LbScope::Cluster),
            Ok(l::Scope::Network) => Ok(LbScope::Network),
            _ => Err(format!("unknown load_balancing scope {s}")),
        })
        .collect::<Result<_, _>>()?;
    let mode = match l::Mode::try_from(lb.mode) {
        Ok(l::Mode::UnspecifiedMode) => LbMode::Standard,
        Ok(l::Mode::Strict) => LbMode::Strict,
        Ok(l::Mode::Failover) => LbMode::Failover,
        Ok(l::Mode::Passthrough) => LbMode::Passthrough,
        Err(_) => return Err(format!("unknown load_balancing mode {}", lb.mode)),
    };
    let health_policy = match l::HealthPolicy::try_from(lb.health_policy) {
        Ok(l::HealthPolicy::OnlyHealthy) => HealthPolicy::OnlyHealthy,
        Ok(l::HealthPolicy::AllowAll) => HealthPolicy::AllowAll,
        Err(_) => return Err(format!("unknown load_balancing health_policy {}", lb.health_policy)),
    };
    Ok(LoadBalancing { routing_preference, mode, health_policy })
}

fn app_tunnel(t: Option<pb::ApplicationTunnel>) -> Result<Option<AppTunnel>, String> {
    let Some(t) = t else { return Ok(None) };
    let protocol = match pb::application_tunnel::Protocol::try_from(t.protocol) {
        Ok(pb::application_tunnel::Protocol::None) => TunnelHeader::None,
        Ok(pb::application_tunnel::Protocol::Proxy) => TunnelHeader::Proxy,
        Err(_) => return Err(format!("unknown application_tunnel protocol {}", t.protocol)),
    };
    let port = port_of(t.port, "application_tunnel port")?;
    Ok(Some(AppTunnel { protocol, port: (port != 0).then_some(port) }))
}

/// What stands for an `istio.workload.Address` refused (`why`) because of its waypoint or network
/// gateway: the same resource without them, marked fail-closed, so that connections to it are
/// refused rather than sent direct. `None` when the rest does not decode either.
pub fn address_stand_in(bytes: &[u8], why: &str) -> Option<Resource> {
    let a = pb::Address::decode(bytes).ok()?;
    let why = format!("its newest xDS version was refused: {why}");
    match a.r#type? {
        pb::address::Type::Workload(mut w) => {
            w.waypoint = None;
            w.network_gateway = None;
            let mut w = workload(w).ok()?;
            w.fail_closed = Some(why);
            Some(Resource::Workload(w))
        }
        pb::address::Type::Service(mut s) => {
            s.waypoint = None;
            let mut s = service(s).ok()?;
            s.fail_closed = Some(why);
            Some(Resource::Service(s))
        }
    }
}

/// Decodes one `istio.workload.Address` payload.
pub fn address(bytes: &[u8]) -> Result<Resource, String> {
    let a = pb::Address::decode(bytes).map_err(|e| format!("malformed Address: {e}"))?;
    match a.r#type {
        Some(pb::address::Type::Workload(w)) => workload(w).map(Resource::Workload),
        Some(pb::address::Type::Service(s)) => service(s).map(Resource::Service),
        None => Err("Address holds neither a workload nor a service".into()),
    }
}

pub fn workload(w: pb::Workload) -> Result<Workload, String> {
    if w.uid.is_empty() {
        return Err(format!("workload '{}/{}' has no uid", w.namespace, w.name));
    }
    if w.namespace.is_empty() {
        return Err("workload has no namespace".into());
    }
    let protocol = match pb::TunnelProtocol::try_from(w.tunnel_protocol) {
        Ok(pb::TunnelProtocol::Hbone) => Protocol::Hbone,
        Ok(pb::TunnelProtocol::None) => Protocol::Tcp,
        Err(_) => return Err(format!("unknown tunnel_protocol {}", w.tunnel_protocol)),
    };
    let status = pb::WorkloadStatus::try_from(w.status)
        .map_err(|_| format!("unknown status {}", w.status))?;
    let workload_type = match pb::WorkloadType::try_from(w.workload_type) {
        Ok(pb::WorkloadType::Deployment) => "deployment",
        Ok(pb::WorkloadType::Cronjob) => "cronjob",
        Ok(pb::WorkloadType::Pod) => "pod",
        Ok(pb::WorkloadType::Job) => "job",
        Err(_) => return Err(format!("unknown workload_type {}", w.workload_type)),
    };
    let ips = w.addresses.iter().map(|a| ip_of(a)).collect::<Result<Vec<_>, _>>()?;
    let network_gateway = gateway(w.network_gateway, "network gateway")?;
    if ips.is_empty() && w.hostname.is_empty() && network_gateway.is_none() {
        // A hostname workload (ServiceEntry with DNS resolution) is resolved at connect time;
        // one of another network without an address is reached through its network gateway.
        return Err("workload has no addresses, no hostname and no network gateway".into());
    }
    if !w.hostname.is_empty() && hickory_proto::rr::Name::from_utf8(&w.hostname).is_err() {
        return Err(format!("hostname '{}' is not a DNS name", w.hostname));
    }
    let mut services = BTreeMap::new();
    // An unhealthy workload stays an endpoint of its services, chosen only by those whose health
    // policy is ALLOW_ALL (see `state::route`).
    {
        for (svc, list) in w.services {
            let ports = list
                .ports
                .iter()
                .map(|p| {
                    Ok(PortMapping {
                        service_port: port_of(p.service_port, "service port")?,
                        target_port: port_of(p.target_port, "target port")?,
                    })
                })
                .collect::<Result<Vec<_>, String>>()?;
            services.insert(svc, ports);
        }
    }
    Ok(Workload {
        uid: w.uid,
        name: w.name,
        namespace: w.namespace,
        service_account: if w.service_account.is_empty() {
            "default".into()
        } else {
            w.service_account
        },
        trust_domain: w.trust_domain,
        ips,
        hostname: w.hostname,
        node: w.node,
        protocol,
        canonical_name: w.canonical_name,
        canonical_revision: w.canonical_revision,
        workload_name: w.workload_name,
        cluster_id: w.cluster_id,
        workload_type: workload_type.into(),
        authorization_policies: w.authorization_policies,
        services,
        locality: w
            .locality
            .map(|l| Locality { region: l.region, zone: l.zone, subzone: l.subzone })
            .unwrap_or_default(),
        healthy: status == pb::WorkloadStatus::Healthy,
        network: w.network,
        waypoint: gateway(w.waypoint, "waypoint")?,
        network_gateway,
        application_tunnel: app_tunnel(w.application_tunnel)?,
        fail_closed: None,
    })
}

pub fn service(s: pb::Service) -> Result<Service, String> {
    if s.hostname.is_empty() || s.namespace.is_empty() {
        return Err(format!("service '{}' has no hostname or namespace", s.name));
    }
    let ip_families = match pb::IpFamilies::try_from(s.ip_families) {
        Ok(pb::IpFamilies::Automatic) => IpFamilies::Automatic,
        Ok(pb::IpFamilies::Ipv4Only) => IpFamilies::Ipv4Only,
        Ok(pb::IpFamilies::Ipv6Only) => IpFamilies::Ipv6Only,
        Ok(pb::IpFamilies::Dual) => IpFamilies::Dual,
        Err(_) => return Err(format!("unknown ip_families {}", s.ip_families)),
    };
    let load_balancing = s.load_balancing.as_ref().map(load_balancing).transpose()?;
    let vips = s.addresses.iter().map(|a| ip_of(&a.address)).collect::<Result<Vec<_>, _>>()?;
    let ports = s
        .ports
        .iter()
        .map(|p| {
            let target = port_of(p.target_port, "target port")?;
            Ok(ServicePort {
                port: port_of(p.service_port, "service port")?,
                target_port: (target != 0).then_some(target),
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Service {
        name: s.name,
        namespace: s.namespace,
        hostname: Some(s.hostname),
        vips,
        ports,
        workloads: Vec::new(),
        waypoint: gateway(s.waypoint, "waypoint")?,
        load_balancing,
        ip_families,
        subject_alt_names: s.subject_alt_names,
        fail_closed: None,
    })
}

fn string_match(m: &pb_sec::StringMatch) -> Result<StringMatch, String> {
    use pb_sec::string_match::MatchType;
    match &m.match_type {
        Some(MatchType::Exact(s)) => Ok(StringMatch::Exact(s.clone())),
        Some(MatchType::Prefix(s)) => Ok(StringMatch::Prefix(s.clone())),
        Some(MatchType::Suffix(s)) => Ok(StringMatch::Suffix(s.clone())),
        Some(MatchType::Presence(_)) => Ok(StringMatch::Presence),
        None => Err("a string match with no match type".into()),
    }
}

fn cidr(a: &pb_sec::Address) -> Result<Cidr, String> {
    let ip = ip_of(&a.address)?;
    let len = u8::try_from(a.length).map_err(|_| format!("prefix length {}", a.length))?;
    Cidr::new(ip, len)
}

fn matches(m: &pb_sec::Match) -> Result<Match, String> {
    let strs = |v: &[pb_sec::StringMatch]| v.iter().map(string_match).collect::<Result<_, _>>();
    let cidrs = |v: &[pb_sec::Address]| v.iter().map(cidr).collect::<Result<_, _>>();
    let ports = |v: &[u32]| v.iter().map(|p| port_of(*p, "port")).collect::<Result<_, _>>();
    let sas = |v: &[pb_sec::ServiceAccountMatch]| {
        v.iter()
            .map(|s| ServiceAccountMatch {
                namespace: s.namespace.clone(),
                service_account: s.service_account.clone(),
            })
            .collect()
    };
    Ok(Match {
        namespaces: strs(&m.namespaces)?,
        not_namespaces: strs(&m.not_namespaces)?,
        principals: strs(&m.principals)?,
        not_principals: strs(&m.not_principals)?,
        service_accounts: sas(&m.service_accounts),
        not_service_accounts: sas(&m.not_service_accounts),
        source_ips: cidrs(&m.source_ips)?,
        not_source_ips: cidrs(&m.not_source_ips)?,
        destination_ips: cidrs(&m.destination_ips)?,
        not_destination_ips: cidrs(&m.not_destination_ips)?,
        destination_ports: ports(&m.destination_ports)?,
        not_destination_ports: ports(&m.not_destination_ports)?,
    })
}

/// Decodes one `istio.security.Authorization` payload.
pub fn authorization(bytes: &[u8]) -> Result<Resource, String> {
    let a = pb_sec::Authorization::decode(bytes)
        .map_err(|e| format!("malformed Authorization: {e}"))?;
    if a.name.is_empty() || a.namespace.is_empty() {
        return Err("policy has no name or namespace".into());
    }
    let scope = match pb_sec::Scope::try_from(a.scope) {
        Ok(pb_sec::Scope::Global) => Scope::Global,
        Ok(pb_sec::Scope::Namespace) => Scope::Namespace,
        Ok(pb_sec::Scope::WorkloadSelector) => Scope::WorkloadSelector,
        Err(_) => return Err(format!("unknown scope {}", a.scope)),
    };
    let action = match pb_sec::Action::try_from(a.action) {
        Ok(pb_sec::Action::Allow) => Action::Allow,
        Ok(pb_sec::Action::Deny) => Action::Deny,
        Err(_) => return Err(format!("unknown action {}", a.action)),
    };
    // Fields this proxy does not know (a newer istiod) could narrow what a rule matches:
    // fail closed rather than guess. An ALLOW then matches nothing (it still exists, so it
    // denies what no other ALLOW allows) and a DENY matches everything.
    if a.encoded_len() != bytes.len() {
        tracing::warn!(policy = %format_args!("{}/{}", a.namespace, a.name), action = ?action,
            "authorization policy carries fields this proxy does not support: enforced fail-closed \
             (an ALLOW matches nothing, a DENY matches every connection)");
        let rules = match action {
            Action::Allow => vec![],
            Action::Deny => vec![Rule::default()],
        };
        return Ok(Resource::Policy(Authorization {
            name: a.name,
            namespace: a.namespace,
            scope,
            action,
            rules,
            dry_run: a.dry_run,
            fail_closed: Some("carries fields this proxy does not support".into()),
        }));
    }
    let rules = a
        .rules
        .iter()
        .map(|r| {
            Ok(Rule {
                clauses: r
                    .clauses
                    .iter()
                    .map(|c| {
                        Ok(Clause {
                            matches: c
                                .matches
                                .iter()
                                .map(matches)
                                .collect::<Result<_, String>>()?,
                        })
                    })
                    .collect::<Result<_, String>>()?,
            })
        })
        .collect::<Result<_, String>>()?;
    Ok(Resource::Policy(Authorization {
        name: a.name,
        namespace: a.namespace,
        scope,
        action,
        rules,
        dry_run: a.dry_run,
        fail_closed: None,
    }))
}

/// The stand-in for an `istio.security.Authorization` resource named `name` that was refused
/// (`why`), enforced until a good version arrives: a DENY that matches every connection or an
/// ALLOW that matches none, with whatever of the payload can still be read. What cannot be read
/// is taken from the version held (`held`), else the choice that cannot widen access: an
/// unreadable action is DENY, an unreadable scope GLOBAL (the policy might have been global, so
/// any narrower scope could leave workloads it covers unprotected). Workloads that list the
/// policy by name get it whatever its scope.
pub fn authorization_fail_closed(
    name: &str,
    payload: Option<&[u8]>,
    held: Option<&Authorization>,
    why: &str,
) -> Authorization {
    let a = payload.and_then(|b| pb_sec::Authorization::decode(b).ok());
    let (key_ns, key_name) = name.split_once('/').unwrap_or(("", name));
    let pick = |from_payload: Option<&String>, from_key: &str, from_held: Option<&String>| {
        from_payload
            .filter(|s| !s.is_empty())
            .map(String::as_str)
            .or(Some(from_key).filter(|s| !s.is_empty()))
            .or(from_held.map(String::as_str))
            .unwrap_or_default()
            .to_string()
    };
    let namespace = pick(a.as_ref().map(|a| &a.namespace), key_ns, held.map(|h| &h.namespace));
    let pname = pick(a.as_ref().map(|a| &a.name), key_name, held.map(|h| &h.name));
    let scope = match a.as_ref().map(|a| pb_sec::Scope::try_from(a.scope)) {
        Some(Ok(pb_sec::Scope::Global)) => Scope::Global,
        Some(Ok(pb_sec::Scope::Namespace)) if !namespace.is_empty() => Scope::Namespace,
        Some(Ok(pb_sec::Scope::WorkloadSelector)) => Scope::WorkloadSelector,
        _ => held.map(|h| h.scope).unwrap_or(Scope::Global),
    };
    let action = match a.as_ref().map(|a| pb_sec::Action::try_from(a.action)) {
        Some(Ok(pb_sec::Action::Allow)) => Action::Allow,
        Some(Ok(pb_sec::Action::Deny)) => Action::Deny,
        _ => Action::Deny,
    };
    let rules = match action {
        Action::Allow => vec![],
        Action::Deny => vec![Rule::default()],
    };
    Authorization {
        name: pname,
        namespace,
        scope,
        action,
        rules,
        dry_run: a.as_ref().map(|a| a.dry_run).or(held.map(|h| h.dry_run)).unwrap_or(false),
        fail_closed: Some(format!("refused: {why}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wl() -> pb::Workload {
        pb::Workload {
            uid: "c1//Pod/ns/p".into(),
            name: "p".into(),
            namespace: "ns".into(),
            addresses: vec![vec![10, 0, 0, 1]],
            tunnel_protocol: pb::TunnelProtocol::Hbone as i32,
            node: "n1".into(),
            ..Default::default()
        }
    }

    #[test]
    fn defaults_and_refusals() {
        let w = workload(wl()).unwrap();
        assert_eq!(w.service_account, "default");
        assert_eq!(
            w.identity("cluster.local").to_string(),
            "spiffe://cluster.local/ns/ns/sa/default"
        );
        assert_eq!(w.protocol, Protocol::Hbone);
        for (f, want) in [
            (
                Box::new(|w: &mut pb::Workload| w.addresses = vec![vec![1, 2, 3]])
                    as Box<dyn Fn(&mut pb::Workload)>,
                "3 bytes",
            ),
            (Box::new(|w: &mut pb::Workload| w.tunnel_protocol = 7), "tunnel_protocol 7"),
            (Box::new(|w: &mut pb::Workload| w.status = 9), "status 9"),
            (Box::new(|w: &mut pb::Workload| w.uid.clear()), "no uid"),
        ] {
            let mut w = wl();
            f(&mut w);
            let e = workload(w).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        let e = address(b"\xff\xff\xff").unwrap_err();
        assert!(e.contains("malformed"), "{e}");
        let p = pb_sec::Authorization {
            name: "p".into(),
            namespace: "n".into(),
            action: 5,
            ..Default::default()
        };
        let e = authorization(&p.encode_to_vec()).unwrap_err();
        assert!(e.contains("unknown action 5"), "{e}");
        let bad_cidr = pb_sec::Authorization {
            name: "p".into(),
            namespace: "n".into(),
            rules: vec![pb_sec::Rule {
                clauses: vec![pb_sec::Clause {
                    matches: vec![pb_sec::Match {
                        source_ips: vec![pb_sec::Address {
                            address: vec![10, 0, 0, 0],
                            length: 33,
                        }],
                        ..Default::default()
                    }],
                }],
            }],
            ..Default::default()
        };
        let e = authorization(&bad_cidr.encode_to_vec()).unwrap_err();
        assert!(e.contains("33"), "{e}");
        // An unknown field (number 99, a string) in a match: fail closed.
        for (action, want_rules) in [(pb_sec::Action::Allow, 0), (pb_sec::Action::Deny, 1)] {
            let p = pb_sec::Authorization {
                name: "p".into(),
                namespace: "n".into(),
                action: action as i32,
                rules: vec![pb_sec::Rule {
                    clauses: vec![pb_sec::Clause {
                        matches: vec![pb_sec::Match {
                            destination_ports: vec![80],
                            ..Default::default()
                        }],
                    }],
                }],
                ..Default::default()
            };
            let mut b = p.encode_to_vec();
            b.extend_from_slice(&[0x9a, 0x06, 0x01, b'x']); // field 99, length-delimited "x"
            let Resource::Policy(got) = authorization(&b).unwrap() else { panic!() };
            assert_eq!(got.rules.len(), want_rules, "{action:?}");
            assert!(got.rules.iter().all(|r| r.clauses.is_empty()), "{got:?}");
            assert!(got.fail_closed.is_some());
        }
    }

    fn pol(scope: pb_sec::Scope, action: i32) -> pb_sec::Authorization {
        pb_sec::Authorization {
            name: "p".into(),
            namespace: "n".into(),
            scope: scope as i32,
            action,
            ..Default::default()
        }
    }

    #[test]
    fn a_refused_policy_stands_in_fail_closed() {
        use pb_sec::Scope as S;
        let deny = pb_sec::Action::Deny as i32;
        let allow = pb_sec::Action::Allow as i32;
        // What the payload says is kept; the rules fail closed.
        let d = authorization_fail_closed(
            "n/p",
            Some(&pol(S::Namespace, deny).encode_to_vec()),
            None,
            "x",
        );
        assert_eq!((d.key().as_str(), d.scope, d.action), ("n/p", Scope::Namespace, Action::Deny));
        assert_eq!(d.rules, vec![Rule::default()], "a DENY matches everything");
        assert_eq!(d.fail_closed.as_deref(), Some("refused: x"));
        let a = authorization_fail_closed(
            "n/p",
            Some(&pol(S::WorkloadSelector, allow).encode_to_vec()),
            None,
            "x",
        );
        assert_eq!((a.scope, a.action, a.rules.len()), (Scope::WorkloadSelector, Action::Allow, 0));
        // An unknown action: DENY. An unknown scope: the held version's, else GLOBAL.
        let u = authorization_fail_closed(
            "n/p",
            Some(&pol(S::Namespace, 7).encode_to_vec()),
            None,
            "x",
        );
        assert_eq!((u.scope, u.action), (Scope::Namespace, Action::Deny));
        let mut bad_scope = pol(S::Namespace, allow);
        bad_scope.scope = 9;
        let g = authorization_fail_closed("n/p", Some(&bad_scope.encode_to_vec()), None, "x");
        assert_eq!((g.scope, g.action), (Scope::Global, Action::Allow));
        let Resource::Policy(held) =
            authorization(&pol(S::WorkloadSelector, deny).encode_to_vec()).unwrap()
        else {
            panic!()
        };
        let h =
            authorization_fail_closed("n/p", Some(&bad_scope.encode_to_vec()), Some(&held), "x");
        assert_eq!(h.scope, Scope::WorkloadSelector);
        // Nothing readable: the name from the key, GLOBAL DENY.
        let m = authorization_fail_closed("n/p", Some(b"\xff\xff\xff"), None, "x");
        assert_eq!((m.key().as_str(), m.scope, m.action), ("n/p", Scope::Global, Action::Deny));
        let m = authorization_fail_closed("n/p", None, Some(&held), "x");
        assert_eq!((m.scope, m.action), (Scope::WorkloadSelector, Action::Deny));
    }
}

#[cfg(test)]
mod gateway_tests {
    use super::*;

    fn addr(ip: [u8; 4]) -> pb::NetworkAddress {
        pb::NetworkAddress { network: String::new(), address: ip.to_vec() }
    }

    fn gw(d: Option<pb::gateway_address::Destination>, port: u32) -> Option<pb::GatewayAddress> {
        Some(pb::GatewayAddress { destination: d, hbone_mtls_port: port })
    }

    fn encoded(t: pb::address::Type) -> Vec<u8> {
        pb::Address { r#type: Some(t) }.encode_to_vec()
    }

    fn wl() -> pb::Workload {
        pb::Workload {
            uid: "u".into(),
            name: "n".into(),
            namespace: "ns".into(),
            addresses: vec![vec![10, 0, 0, 1]],
            ..Default::default()
        }
    }

    fn svc() -> pb::Service {
        pb::Service {
            name: "s".into(),
            namespace: "ns".into(),
            hostname: "s.ns.svc.cluster.local".into(),
            addresses: vec![addr([10, 96, 0, 1])],
            ..Default::default()
        }
    }

    #[test]
    fn waypoints_tunnels_and_networks_decode() {
        use pb::gateway_address::Destination as D;
        let w = pb::Workload {
            network: "net1".into(),
            waypoint: gw(Some(D::Address(addr([10, 96, 0, 9]))), 15019),
            network_gateway: gw(
                Some(D::Hostname(pb::NamespacedHostname {
                    namespace: "istio-system".into(),
                    hostname: "ew.istio-system.svc.cluster.local".into(),
                })),
                15009,
            ),
            application_tunnel: Some(pb::ApplicationTunnel {
                protocol: pb::application_tunnel::Protocol::Proxy as i32,
                port: 15088,
            }),
            workload_type: pb::WorkloadType::Pod as i32,
            ..wl()
        };
        let Resource::Workload(w) = address(&encoded(pb::address::Type::Workload(w))).unwrap()
        else {
            panic!()
        };
        assert_eq!(w.network, "net1");
        assert_eq!(w.workload_type, "pod");
        assert_eq!(
            w.waypoint,
            Some(GatewayAddress {
                target: GatewayTarget::Address {
                    network: String::new(),
                    ip: "10.96.0.9".parse().unwrap()
                },
                hbone_port: 15019
            })
        );
        assert_eq!(
            w.network_gateway.unwrap().to_string(),
            "istio-system/ew.istio-system.svc.cluster.local (HBONE port 15009)"
        );
        assert_eq!(
            w.application_tunnel,
            Some(AppTunnel { protocol: TunnelHeader::Proxy, port: Some(15088) })
        );
        let s = pb::Service {
            waypoint: gw(
                Some(D::Hostname(pb::NamespacedHostname {
                    namespace: "ns".into(),
                    hostname: "wp.ns.svc.cluster.local".into(),
                })),
                15008,
            ),
            subject_alt_names: vec!["spiffe://td/ns/ns/sa/alt".into()],
            ..svc()
        };
        let Resource::Service(s) = address(&encoded(pb::address::Type::Service(s))).unwrap() else {
            panic!()
        };
        assert_eq!(
            s.waypoint.unwrap().to_string(),
            "ns/wp.ns.svc.cluster.local (HBONE port 15008)"
        );
        assert_eq!(s.subject_alt_names, ["spiffe://td/ns/ns/sa/alt"]);
    }

    #[test]
    fn load_balancing_families_locality_and_health_decode() {
        use pb::load_balancing as l;
        let s = pb::Service {
            load_balancing: Some(pb::LoadBalancing {
                routing_preference: vec![l::Scope::Network as i32, l::Scope::Zone as i32],
                mode: l::Mode::Failover as i32,
                health_policy: l::HealthPolicy::AllowAll as i32,
            }),
            ip_families: pb::IpFamilies::Ipv6Only as i32,
            ..svc()
        };
        let Resource::Service(s) = address(&encoded(pb::address::Type::Service(s))).unwrap() else {
            panic!()
        };
        assert_eq!(
            s.load_balancing,
            Some(LoadBalancing {
                routing_preference: vec![LbScope::Network, LbScope::Zone],
                mode: LbMode::Failover,
                health_policy: HealthPolicy::AllowAll,
            })
        );
        assert_eq!(s.ip_families, IpFamilies::Ipv6Only);
        for (bad, what) in [
            (pb::LoadBalancing { routing_preference: vec![0], ..Default::default() }, "scope 0"),
            (pb::LoadBalancing { mode: 9, ..Default::default() }, "mode 9"),
            (pb::LoadBalancing { health_policy: 9, ..Default::default() }, "health_policy 9"),
        ] {
            let s = pb::Service { load_balancing: Some(bad), ..svc() };
            let e = address(&encoded(pb::address::Type::Service(s))).unwrap_err();
            assert!(e.contains(what), "{e}");
        }
        let w = pb::Workload {
            locality: Some(pb::Locality {
                region: "r".into(),
                zone: "z".into(),
                subzone: "s".into(),
            }),
            status: pb::WorkloadStatus::Unhealthy as i32,
            services: [("ns/s.ns.svc.cluster.local".to_string(), pb::PortList { ports: vec![] })]
                .into(),
            ..wl()
        };
        let Resource::Workload(w) = address(&encoded(pb::address::Type::Workload(w))).unwrap()
        else {
            panic!()
        };
        assert_eq!(
            (w.locality.region.as_str(), w.locality.zone.as_str(), w.locality.subzone.as_str()),
            ("r", "z", "s")
        );
        assert!(!w.healthy);
        assert!(
            w.services.contains_key("ns/s.ns.svc.cluster.local"),
            "still an endpoint (ALLOW_ALL)"
        );
    }

    #[test]
    fn bad_gateway_addresses_are_refused_and_stand_in_fail_closed() {
        use pb::gateway_address::Destination as D;
        let bad = [
            ("no destination", gw(None, 15008)),
            (
                "bad ip",
                gw(
                    Some(D::Address(pb::NetworkAddress {
                        network: String::new(),
                        address: vec![1, 2, 3],
                    })),
                    15008,
                ),
            ),
            ("no port", gw(Some(D::Address(addr([10, 96, 0, 9]))), 0)),
            ("port out of range", gw(Some(D::Address(addr([10, 96, 0, 9]))), 70000)),
            (
                "empty namespace",
                gw(
                    Some(D::Hostname(pb::NamespacedHostname {
                        namespace: String::new(),
                        hostname: "h".into(),
                    })),
                    15008,
                ),
            ),
        ];
        for (name, g) in bad {
            for t in [
                pb::address::Type::Workload(pb::Workload { waypoint: g.clone(), ..wl() }),
                pb::address::Type::Workload(pb::Workload { network_gateway: g.clone(), ..wl() }),
                pb::address::Type::Service(pb::Service { waypoint: g.clone(), ..svc() }),
            ] {
                let bytes = encoded(t);
                let e = address(&bytes).expect_err(name);
                // What stands in is the same resource, without the gateway, fail-closed.
                match address_stand_in(&bytes, &e) {
                    Some(Resource::Workload(w)) => {
                        assert!(w.fail_closed.as_deref().unwrap().contains(&e), "{name}");
                        assert_eq!((w.waypoint, w.network_gateway), (None, None), "{name}");
                        assert_eq!(w.ips, ["10.0.0.1".parse::<IpAddr>().unwrap()], "{name}");
                    }
                    Some(Resource::Service(s)) => {
                        assert!(s.fail_closed.is_some(), "{name}");
                        assert_eq!(s.vips, ["10.96.0.1".parse::<IpAddr>().unwrap()], "{name}");
                    }
                    other => panic!("{name}: {other:?}"),
                }
            }
        }
        let t = pb::ApplicationTunnel { protocol: 7, port: 1 };
        let e = address(&encoded(pb::address::Type::Workload(pb::Workload {
            application_tunnel: Some(t),
            ..wl()
        })))
        .unwrap_err();
        assert!(e.contains("application_tunnel protocol 7"), "{e}");
        // A refusal that is not about a gateway has no stand-in of its own.
        let no_uid =
            encoded(pb::address::Type::Workload(pb::Workload { uid: String::new(), ..wl() }));
        assert!(address_stand_in(&no_uid, "x").is_none());
    }
}
