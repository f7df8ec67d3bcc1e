//! The mesh as this node sees it: workloads and services, looked up by address. Fed by the local
//! YAML file today (xDS later).
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use crate::config::{Config, Protocol, Service, Workload};
use crate::identity::Identity;

/// Where an outbound connection goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Upstream {
    pub workload: Arc<Workload>,
    /// The workload address the connection is for (after service VIP translation).
    pub target: SocketAddr,
    pub identity: Identity,
    pub protocol: Protocol,
    /// Where to dial for HBONE (the destination node's inbound).
    pub hbone_addr: SocketAddr,
}

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum LookupError {
    #[error("service {0} has no workloads")]
    NoEndpoints(String),
    #[error("service {service} has no port {port}")]
    NoServicePort { service: String, port: u16 },
}

#[derive(Debug)]
pub struct State {
    pub trust_domain: String,
    pub node_name: String,
    hbone_port: u16,
    by_ip: HashMap<IpAddr, Arc<Workload>>,
    by_uid: HashMap<String, Arc<Workload>>,
    services_by_vip: HashMap<IpAddr, Arc<Service>>,
    node_hbone: HashMap<String, SocketAddr>,
    rr: AtomicUsize,
    /// In-pod mode: the workloads served here are the pods the CNI enrolled (by uid), not the
    /// ones whose `node` matches.
    inpod: Option<RwLock<HashSet<String>>>,
}

impl State {
    pub fn new(cfg: &Config) -> State {
        let mut by_ip = HashMap::new();
        let mut by_uid = HashMap::new();
        for w in &cfg.workloads {
            let w = Arc::new(w.clone());
            for ip in &w.ips {
                by_ip.insert(*ip, w.clone());
            }
            by_uid.insert(w.uid.clone(), w);
        }
        let mut services_by_vip = HashMap::new();
        for s in &cfg.services {
            let s = Arc::new(s.clone());
            for vip in &s.vips {
                services_by_vip.insert(*vip, s.clone());
            }
        }
        State {
            trust_domain: cfg.trust_domain.clone(),
            node_name: cfg.node_name.clone(),
            hbone_port: cfg.hbone_port,
            by_ip,
            by_uid,
            services_by_vip,
            node_hbone: cfg.nodes.iter().map(|n| (n.name.clone(), n.hbone_addr)).collect(),
            rr: AtomicUsize::new(0),
            inpod: cfg.inpod_enabled.then(|| RwLock::new(HashSet::new())),
        }
    }

    pub fn workload_by_ip(&self, ip: IpAddr) -> Option<&Arc<Workload>> {
        self.by_ip.get(&ip)
    }

    pub fn workload_by_uid(&self, uid: &str) -> Option<&Arc<Workload>> {
        self.by_uid.get(uid)
    }

    fn is_local(&self, w: &Workload) -> bool {
        match &self.inpod {
            Some(set) => set.read().unwrap().contains(&w.uid),
            None => w.node == self.node_name,
        }
    }

    /// Workloads served by this proxy: those of this node, or in in-pod mode the enrolled pods.
    pub fn local_workloads(&self) -> impl Iterator<Item = &Arc<Workload>> {
        self.by_uid.values().filter(|w| self.is_local(w))
    }

    /// The local workload owning `ip`, if any.
    pub fn local_workload_by_ip(&self, ip: IpAddr) -> Option<&Arc<Workload>> {
        self.by_ip.get(&ip).filter(|w| self.is_local(w))
    }

    /// In-pod mode: starts (`true`) or stops serving the workload `uid`. No-op otherwise.
    pub fn set_enrolled(&self, uid: &str, enrolled: bool) {
        if let Some(set) = &self.inpod {
            let mut set = set.write().unwrap();
            if enrolled {
                set.insert(uid.to_string());
            } else {
                set.remove(uid);
            }
        }
    }

    pub fn identity_of(&self, w: &Workload) -> Identity {
        w.identity(&self.trust_domain)
    }

    /// Resolves an original destination to an upstream. `Ok(None)`: not a mesh address
    /// (passthrough).
    pub fn resolve(&self, dst: SocketAddr) -> Result<Option<Upstream>, LookupError> {
        let (workload, target) = if let Some(svc) = self.services_by_vip.get(&dst.ip()) {
            let port = svc.ports.iter().find(|p| p.port == dst.port()).ok_or_else(|| {
                LookupError::NoServicePort {
                    service: format!("{}/{}", svc.namespace, svc.name),
                    port: dst.port(),
                }
            })?;
            if svc.workloads.is_empty() {
                return Err(LookupError::NoEndpoints(format!("{}/{}", svc.namespace, svc.name)));
            }
            let i = self.rr.fetch_add(1, Ordering::Relaxed) % svc.workloads.len();
            let w = self
                .by_uid
                .get(&svc.workloads[i])
                .ok_or_else(|| LookupError::NoEndpoints(svc.name.clone()))?;
            let ip = w.ips[0];
            (w.clone(), SocketAddr::new(ip, port.target_port.unwrap_or(port.port)))
        } else if let Some(w) = self.by_ip.get(&dst.ip()) {
            (w.clone(), dst)
        } else {
            return Ok(None);
        };
        let hbone_addr = self
            .node_hbone
            .get(&workload.node)
            .copied()
            .unwrap_or_else(|| SocketAddr::new(target.ip(), self.hbone_port));
        Ok(Some(Upstream {
            identity: self.identity_of(&workload),
            protocol: workload.protocol,
            workload,
            target,
            hbone_addr,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn state() -> State {
        let cfg = Config::from_yaml(
            r#"
node_name: a
workloads:
  - {uid: c, name: client, ips: [10.0.1.2], node: a}
  - {uid: s1, name: echo-1, service_account: echo, ips: [10.0.2.2], node: b}
  - {uid: s2, name: echo-2, service_account: echo, ips: [10.0.2.3], node: b}
services:
  - {name: echo, vips: [10.96.0.1], ports: [{port: 80, target_port: 8080}], workloads: [s1, s2]}
nodes:
  - {name: b, hbone_addr: "127.0.0.3:25008"}
"#,
            Path::new("t"),
        )
        .unwrap();
        State::new(&cfg)
    }

    #[test]
    fn resolves_workload_and_service() {
        let s = state();
        let u = s.resolve("10.0.2.2:9000".parse().unwrap()).unwrap().unwrap();
        assert_eq!(u.target, "10.0.2.2:9000".parse().unwrap());
        assert_eq!(u.hbone_addr, "127.0.0.3:25008".parse().unwrap());
        assert_eq!(u.identity.to_string(), "spiffe://cluster.local/ns/default/sa/echo");
        let a = s.resolve("10.96.0.1:80".parse().unwrap()).unwrap().unwrap();
        let b = s.resolve("10.96.0.1:80".parse().unwrap()).unwrap().unwrap();
        assert_eq!(a.target.port(), 8080);
        assert_ne!(a.target, b.target, "round robin over endpoints");
        assert!(s.resolve("10.96.0.1:81".parse().unwrap()).is_err());
        assert!(s.resolve("1.1.1.1:80".parse().unwrap()).unwrap().is_none());
        let c = s.resolve("10.0.1.2:1".parse().unwrap()).unwrap().unwrap();
        assert_eq!(c.hbone_addr, "10.0.1.2:15008".parse().unwrap(), "default: workload ip:15008");
        assert_eq!(s.local_workloads().count(), 1);
    }

    #[test]
    fn inpod_serves_enrolled_pods_only() {
        let cfg = Config::from_yaml(
            "node_name: a\ninpod_enabled: true\nworkloads:\n  - {uid: c, name: client, ips: [10.0.1.2], node: a}\n",
            Path::new("t"),
        )
        .unwrap();
        let s = State::new(&cfg);
        let ip = "10.0.1.2".parse().unwrap();
        assert!(s.local_workload_by_ip(ip).is_none(), "node match alone is not enough in-pod");
        s.set_enrolled("c", true);
        assert_eq!(s.local_workload_by_ip(ip).unwrap().name, "client");
        assert_eq!(s.local_workloads().count(), 1);
        s.set_enrolled("c", false);
        assert!(s.local_workload_by_ip(ip).is_none());
    }
}
