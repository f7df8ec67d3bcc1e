//! `/config_dump` in ztunnel's JSON shape, so that `istioctl ztunnel-config workloads|services|
//! policies|certificates|all` and scripts written for ztunnel read mbtunnel's the same way.
//!
//! The top level is ztunnel's: `workloads`, `services`, `policies`, `stagedServices`,
//! `certificates`, `config`, `staticConfig`, `version`, and `workloadState` in in-pod mode. Each
//! object carries ztunnel's field names (camelCase), value spellings (`"HBONE"`, `"Healthy"`,
//! `"Deny"`, a VIP as `network/ip`) and omissions (a field left out where ztunnel leaves it out
//! when empty). `config` names the settings mbtunnel shares with ztunnel by ztunnel's keys.
//! What only mbtunnel has (the signer, its own settings in full, the HBONE pool, xDS and
//! redirect status, resources held fail-closed) is under one more key, `mbtunnel`.
//!
//! Built by hand from mbtunnel's types rather than by deriving: those serialise as the local
//! file's YAML (snake_case), which stays as it is.
//!
//! Secrets never appear: certificates are public, keys are not dumped, and the bearer token and
//! header values are `config::Secret`s (`<redacted>`).
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use super::AdminState;
use crate::config::Config;
use crate::identity::store::{humantime, CertStore, Slot};
use crate::state::gateway::{AppTunnel, GatewayAddress, GatewayTarget, TunnelHeader};
use crate::state::policy::{Action, Authorization, Match, Scope, StringMatch};
use crate::state::service::{HealthPolicy, IpFamilies, LbMode, LbScope, Service};
use crate::state::workload::{Protocol, Workload};
use crate::state::Contents;

/// Everything `/config_dump` shows.
pub fn config_dump(st: &AdminState) -> Value {
    let cfg = &st.cfg;
    let td = st.ctx.state.trust_domain().to_string();
    let contents = st.ctx.state.contents();
    let mut v = state(&contents, &td);
    v["certificates"] = certificates(&st.store);
    v["config"] = config(cfg);
    v["staticConfig"] = static_config(cfg, &td);
    v["version"] = version();
    if let Some(p) = &st.inpod {
        v["workloadState"] = p.workload_state();
    }
    v["mbtunnel"] = own(st, &contents);
    v
}

/// `workloads`, `services`, `policies` and `stagedServices`, as ztunnel's proxy state.
pub fn state(c: &Contents, trust_domain: &str) -> Value {
    let staged: Map<String, Value> =
        c.staged.iter().map(|(key, ws)| (key.clone(), endpoints(key, ws))).collect();
    json!({
        "workloads": c.workloads.iter().map(|w| workload(w, trust_domain)).collect::<Vec<_>>(),
        "services": c.services.iter().map(|(s, ws)| service(s, ws)).collect::<Vec<_>>(),
        "policies": c.policies.iter().map(|p| policy(p)).collect::<Vec<_>>(),
        "stagedServices": staged,
    })
}

/// Inserts `v` under `k` unless it is empty (ztunnel's `skip_serializing_if = "is_default"`).
fn put_str(m: &mut Map<String, Value>, k: &str, v: &str) {
    if !v.is_empty() {
        m.insert(k.into(), json!(v));
    }
}

fn gateway(g: &GatewayAddress) -> Value {
    let destination = match &g.target {
        GatewayTarget::Address { network, ip } => format!("{network}/{ip}"),
        GatewayTarget::Hostname { namespace, hostname } => format!("{namespace}/{hostname}"),
    };
    json!({"destination": destination, "hboneMtlsPort": g.hbone_port})
}

fn app_tunnel(t: &AppTunnel) -> Value {
    let protocol = match t.protocol {
        TunnelHeader::None => "NONE",
        TunnelHeader::Proxy => "PROXY",
    };
    json!({"protocol": protocol, "port": t.port})
}

fn health(healthy: bool) -> &'static str {
    if healthy {
        "Healthy"
    } else {
        "Unhealthy"
    }
}

/// One workload as ztunnel's `Workload`.
pub fn workload(w: &Workload, trust_domain: &str) -> Value {
    let mut m = Map::new();
    m.insert(
        "workloadIps".into(),
        json!(w.ips.iter().map(|ip| ip.to_string()).collect::<Vec<_>>()),
    );
    if let Some(g) = &w.waypoint {
        m.insert("waypoint".into(), gateway(g));
    }
    if let Some(g) = &w.network_gateway {
        m.insert("networkGateway".into(), gateway(g));
    }
    let protocol = match w.protocol {
        Protocol::Hbone => "HBONE",
        Protocol::Tcp => "TCP",
    };
    m.insert("protocol".into(), json!(protocol));
    m.insert("networkMode".into(), json!("Standard"));
    put_str(&mut m, "uid", &w.uid);
    m.insert("name".into(), json!(w.name));
    m.insert("namespace".into(), json!(w.namespace));
    put_str(
        &mut m,
        "trustDomain",
        if w.trust_domain.is_empty() { trust_domain } else { &w.trust_domain },
    );
    put_str(&mut m, "serviceAccount", &w.service_account);
    put_str(&mut m, "network", &w.network);
    put_str(&mut m, "workloadName", &w.workload_name);
    put_str(&mut m, "workloadType", &w.workload_type);
    put_str(&mut m, "canonicalName", &w.canonical_name);
    put_str(&mut m, "canonicalRevision", &w.canonical_revision);
    put_str(&mut m, "hostname", &w.hostname);
    put_str(&mut m, "node", &w.node);
    if let Some(t) = &w.application_tunnel {
        m.insert("applicationTunnel".into(), app_tunnel(t));
    }
    if !w.authorization_policies.is_empty() {
        m.insert("authorizationPolicies".into(), json!(w.authorization_policies));
    }
    m.insert("status".into(), json!(health(w.healthy)));
    m.insert("clusterId".into(), json!(w.cluster_id));
    if !w.locality.is_empty() {
        let l = &w.locality;
        m.insert(
            "locality".into(),
            json!({"region": l.region, "zone": l.zone, "subzone": l.subzone}),
        );
    }
    if !w.services.is_empty() {
        m.insert("services".into(), json!(w.services.keys().collect::<Vec<_>>()));
    }
    m.insert("capacity".into(), json!(1));
    Value::Object(m)
}

/// A service's endpoints: workload uid → `{workloadUid, port: {service: target}, status}`.
fn endpoints(key: &str, ws: &[std::sync::Arc<Workload>]) -> Value {
    let m: Map<String, Value> = ws
        .iter()
        .map(|w| {
            let ports: BTreeMap<String, u16> = w
                .services
                .get(key)
                .map(|ps| ps.iter().map(|p| (p.service_port.to_string(), p.target_port)).collect())
                .unwrap_or_default();
            let ep = json!({"workloadUid": w.uid, "port": ports, "status": health(w.healthy)});
            (w.uid.clone(), ep)
        })
        .collect();
    Value::Object(m)
}

fn scope_name(s: LbScope) -> &'static str {
    match s {
        LbScope::Region => "Region",
        LbScope::Zone => "Zone",
        LbScope::Subzone => "Subzone",
        LbScope::Node => "Node",
        LbScope::Cluster => "Cluster",
        LbScope::Network => "Network",
    }
}

/// One service as ztunnel's `Service`, with its endpoints.
pub fn service(s: &Service, ws: &[std::sync::Arc<Workload>]) -> Value {
    let ports: BTreeMap<String, u16> =
        s.ports.iter().map(|p| (p.port.to_string(), p.target_port.unwrap_or(0))).collect();
    let mut m = Map::new();
    m.insert("name".into(), json!(s.name));
    m.insert("namespace".into(), json!(s.namespace));
    m.insert("hostname".into(), json!(s.hostname()));
    m.insert("vips".into(), json!(s.vips.iter().map(|ip| format!("/{ip}")).collect::<Vec<_>>()));
    m.insert("ports".into(), json!(ports));
    m.insert("endpoints".into(), endpoints(&s.key(), ws));
    m.insert("subjectAltNames".into(), json!(s.subject_alt_names));
    if let Some(g) = &s.waypoint {
        m.insert("waypoint".into(), gateway(g));
    }
    if let Some(lb) = &s.load_balancing {
        let mode = match lb.mode {
            LbMode::Standard => "Standard",
            LbMode::Strict => "Strict",
            LbMode::Failover => "Failover",
            LbMode::Passthrough => "Passthrough",
        };
        let health_policy = match lb.health_policy {
            HealthPolicy::OnlyHealthy => "OnlyHealthy",
            HealthPolicy::AllowAll => "AllowAll",
        };
        let prefs: Vec<_> = lb.routing_preference.iter().map(|p| scope_name(*p)).collect();
        m.insert(
            "loadBalancer".into(),
            json!({"routingPreferences": prefs, "mode": mode, "healthPolicy": health_policy}),
        );
    }
    let families = match s.ip_families {
        IpFamilies::Automatic => None,
        IpFamilies::Ipv4Only => Some("IPv4"),
        IpFamilies::Ipv6Only => Some("IPv6"),
        IpFamilies::Dual => Some("Dual"),
    };
    if let Some(f) = families {
        m.insert("ipFamilies".into(), json!(f));
    }
    m.insert("canonical".into(), json!(false));
    m.insert("visibility".into(), json!("Public"));
    Value::Object(m)
}

fn string_match(s: &StringMatch) -> Value {
    match s {
        StringMatch::Exact(v) => json!({"Exact": v}),
        StringMatch::Prefix(v) => json!({"Prefix": v}),
        StringMatch::Suffix(v) => json!({"Suffix": v}),
        StringMatch::Presence => json!({"Presence": []}),
    }
}

/// One match (a leaf of `rules`), its empty lists left out as ztunnel leaves them out.
fn rbac_match(m: &Match) -> Value {
    let mut o = Map::new();
    let mut strings = |k: &str, v: &[StringMatch]| {
        if !v.is_empty() {
            o.insert(k.into(), Value::Array(v.iter().map(string_match).collect()));
        }
    };
    strings("namespaces", &m.namespaces);
    strings("notNamespaces", &m.not_namespaces);
    strings("principals", &m.principals);
    strings("notPrincipals", &m.not_principals);
    for (k, v) in
        [("serviceAccounts", &m.service_accounts), ("notServiceAccounts", &m.not_service_accounts)]
    {
        if !v.is_empty() {
            let list: Vec<_> = v
                .iter()
                .map(|s| json!({"namespace": s.namespace, "serviceAccount": s.service_account}))
                .collect();
            o.insert(k.into(), json!(list));
        }
    }
    for (k, v) in [
        ("sourceIps", &m.source_ips),
        ("notSourceIps", &m.not_source_ips),
        ("destinationIps", &m.destination_ips),
        ("notDestinationIps", &m.not_destination_ips),
    ] {
        if !v.is_empty() {
            o.insert(k.into(), json!(v.iter().map(|c| c.to_string()).collect::<Vec<_>>()));
        }
    }
    for (k, v) in [
        ("destinationPorts", &m.destination_ports),
        ("notDestinationPorts", &m.not_destination_ports),
    ] {
        if !v.is_empty() {
            o.insert(k.into(), json!(v));
        }
    }
    Value::Object(o)
}

/// One policy as ztunnel's `Authorization`: rules → clauses → matches as nested lists.
pub fn policy(p: &Authorization) -> Value {
    let scope = match p.scope {
        Scope::Global => "Global",
        Scope::Namespace => "Namespace",
        Scope::WorkloadSelector => "WorkloadSelector",
    };
    let action = match p.action {
        Action::Allow => "Allow",
        Action::Deny => "Deny",
    };
    let rules: Vec<Vec<Vec<Value>>> = p
        .rules
        .iter()
        .map(|r| r.clauses.iter().map(|c| c.matches.iter().map(rbac_match).collect()).collect())
        .collect();
    json!({
        "name": p.name,
        "namespace": p.namespace,
        "scope": scope,
        "action": action,
        "rules": rules,
        "dryRun": p.dry_run,
    })
}

/// RFC 3339 to the second, in UTC (`2026-12-05T09:03:52Z`), as ztunnel writes certificate times.
fn rfc3339_secs(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO).as_secs();
    humantime(UNIX_EPOCH + Duration::from_secs(secs))
}

/// One certificate: its PEM (base64 of the PEM text, as ztunnel), decimal serial, validity.
fn cert(der: &[u8]) -> Value {
    use x509_parser::prelude::*;
    let pem = boring::x509::X509::from_der(der)
        .and_then(|x| x.to_pem())
        .map(|p| boring::base64::encode_block(&p))
        .unwrap_or_default();
    let (serial, from, to) = match X509Certificate::from_der(der) {
        Ok((_, x)) => {
            let at = |t: ASN1Time| {
                rfc3339_secs(UNIX_EPOCH + Duration::from_secs(t.timestamp().max(0) as u64))
            };
            (
                x.tbs_certificate.serial.to_string(),
                at(x.validity().not_before),
                at(x.validity().not_after),
            )
        }
        Err(_) => Default::default(),
    };
    json!({"pem": pem, "serialNumber": serial, "validFrom": from, "expirationTime": to})
}

/// `certificates`: each identity the store holds, with ztunnel's states (`Available`,
/// `Initializing`, `Unavailable: <error>`), its chain (leaf first) and roots.
pub fn certificates(store: &CertStore) -> Value {
    let list: Vec<Value> = store
        .slots()
        .into_iter()
        .map(|(id, slot)| {
            let (state, chain, roots) = match slot {
                Slot::Ready(b) => {
                    let chain: Vec<_> = std::iter::once(&b.cert_der)
                        .chain(b.chain_der.iter())
                        .map(|d| cert(d))
                        .collect();
                    let roots: Vec<_> = b.roots_der.iter().map(|d| cert(d)).collect();
                    ("Available".to_string(), chain, roots)
                }
                Slot::Pending => ("Initializing".to_string(), vec![], vec![]),
                Slot::Failed { error, .. } => (format!("Unavailable: {error}"), vec![], vec![]),
            };
            json!({"identity": id.to_string(), "state": state, "certChain": chain, "rootCerts": roots})
        })
        .collect();
    Value::Array(list)
}

fn addr(a: SocketAddr) -> Value {
    json!({"SocketAddr": a.to_string()})
}

fn duration(secs: u64) -> Value {
    json!({"secs": secs, "nanos": 0})
}

/// `config`: the settings mbtunnel shares with ztunnel, under ztunnel's keys and in its value
/// shapes. The rest of mbtunnel's settings are in `mbtunnel.config`.
pub fn config(c: &Config) -> Value {
    let ports = [c.outbound_addr.port(), c.inbound_addr.port(), c.inbound_plaintext_addr.port()];
    json!({
        "adminAddr": addr(c.admin_addr),
        "statsAddr": addr(c.metrics_addr),
        "readinessAddr": addr(c.readiness_addr),
        "inboundAddr": c.inbound_addr.to_string(),
        "inboundPlaintextAddr": c.inbound_plaintext_addr.to_string(),
        "outboundAddr": c.outbound_addr.to_string(),
        "dnsProxy": c.dns_capture.unwrap_or(false),
        "dnsProxyAddr": addr(c.dns_proxy_addr),
        "clusterDomain": c.cluster_domain,
        "clusterId": c.cluster_id,
        "localNode": (!c.node_name.is_empty()).then_some(&c.node_name),
        "xdsAddress": c.xds_address,
        "caAddress": c.ca_address,
        "numWorkerThreads": c.worker_threads,
        "poolMaxStreamsPerConn": c.pool_max_streams,
        "poolUnusedReleaseTimeout": duration(c.pool_idle_timeout_secs),
        "secretTtl": duration(c.cert_lifetime_secs),
        "packetMark": c.socket_mark,
        "illegalPorts": ports,
        "inpodUds": c.inpod_socket,
        "proxyMode": "Shared",
        "proxy": true,
        "network": "",
    })
}

/// `staticConfig`: what the local file says (ztunnel's local-config shape: each workload with
/// its services' port maps); empty lists when the state comes from xDS.
fn static_config(c: &Config, trust_domain: &str) -> Value {
    if c.xds_address.is_some() {
        return json!({"workloads": [], "services": [], "policies": []});
    }
    let resources = crate::state::local_resources(&c.workloads, &c.services, &c.policies);
    let (mut workloads, mut services, mut policies) = (vec![], vec![], vec![]);
    for r in resources {
        match r {
            crate::state::Resource::Workload(w) => {
                let mut v = workload(&w, trust_domain);
                let svcs: Map<String, Value> = w
                    .services
                    .iter()
                    .map(|(k, ps)| {
                        let m: BTreeMap<String, u16> = ps
                            .iter()
                            .map(|p| (p.service_port.to_string(), p.target_port))
                            .collect();
                        (k.clone(), json!(m))
                    })
                    .collect();
                v["services"] = Value::Object(svcs);
                workloads.push(v);
            }
            crate::state::Resource::Service(s) => services.push(service(&s, &[])),
            crate::state::Resource::Policy(p) => policies.push(policy(&p)),
        }
    }
    json!({"workloads": workloads, "services": services, "policies": policies})
}

/// `version`: ztunnel's build-info keys.
pub fn version() -> Value {
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "gitRevision": option_env!("MBTUNNEL_GIT_REVISION").unwrap_or("unknown"),
        "rustVersion": option_env!("MBTUNNEL_RUSTC_VERSION").unwrap_or("unknown"),
        "buildProfile": option_env!("MBTUNNEL_BUILD_PROFILE").unwrap_or("unknown"),
        "buildStatus": "unknown",
        "istioVersion": std::env::var(crate::config::env::ISTIO_VERSION).unwrap_or_else(|_| "unknown".into()),
        "cryptoProvider": "boringssl",
    })
}

/// `mbtunnel`: what only mbtunnel has.
fn own(st: &AdminState, contents: &Contents) -> Value {
    let (cfg, store, ctx) = (&st.cfg, &st.store, &st.ctx);
    let b = crate::mb::backend_choice();
    let certs: Vec<_> = store
        .snapshot()
        .iter()
        .map(|c| {
            json!({
                "identity": c.identity.to_string(),
                "serial": c.serial,
                "algorithm": c.algorithm,
                "not_before": humantime(c.not_before),
                "not_after": humantime(c.not_after),
                "issued_at": humantime(c.issued_at),
                "renew_at": humantime(c.refresh_at()),
            })
        })
        .collect();
    let mut fail_closed = vec![];
    for w in &contents.workloads {
        if let Some(why) = &w.fail_closed {
            fail_closed.push(json!({"workload": w.uid, "reason": why}));
        }
    }
    for (s, _) in &contents.services {
        if let Some(why) = &s.fail_closed {
            fail_closed.push(json!({"service": s.key(), "reason": why}));
        }
    }
    for p in &contents.policies {
        if let Some(why) = &p.fail_closed {
            fail_closed.push(json!({"policy": p.key(), "reason": why}));
        }
    }
    let mut v = json!({
        "config": **cfg,
        "local_workloads": ctx.state.local_workloads().iter().map(|w| w.uid.clone()).collect::<Vec<_>>(),
        "certificate_source": store.source().describe(),
        "holds_ca_key": store.source().holds_ca_key(),
        "certificates": certs,
        "held_fail_closed": fail_closed,
        "signer": {
            "backend": b.backend.to_string(),
            "cpu_features": b.features.to_string(),
            "reason": b.reason,
            "state": st.signer.dump(),
        },
        "hbone_pool_connections": ctx.pool.len(),
        "active_connections": ctx.drain.active(),
        "draining": ctx.drain.is_draining(),
    });
    if let Some(p) = &st.inpod {
        v["inpod_pods"] = json!(p.uids());
    }
    if let Some(e) = &st.ebpf {
        v["redirect"] = e.status();
    }
    if let Some(x) = &st.xds {
        v["xds"] = json!(x.status());
    }
    v
}
