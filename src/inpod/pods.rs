//! The enrolled pods: for each, its namespace thread, its three listeners and their accept
//! loops. Adding a pod opens the listeners and issues its certificate; removing it closes them.
#![forbid(unsafe_code)]

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use super::zds::WorkloadInfo;
use super::{INBOUND_PLAINTEXT_PORT, INBOUND_PORT, OUTBOUND_PORT};
use crate::identity::store::CertStore;
use crate::identity::Identity;
use crate::net::netns::{Netns, NetnsId};
use crate::net::socket;
use crate::proxy::{self, Ctx};

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum PodError {
    #[error(
        "pod {0}: no workload with this uid in the mesh state, and the CNI gave no identity for it"
    )]
    UnknownUid(String),
    #[error("pod {uid}: the CNI says {cni} but the mesh state says {state}")]
    IdentityMismatch { uid: String, cni: String, state: String },
    #[error("pod {0}: add without a network namespace fd")]
    NoNetns(String),
    #[error("pod {uid}: cannot enter its network namespace: {error}")]
    Netns { uid: String, error: String },
    #[error("pod {uid}: cannot listen on {addr} in its network namespace: {error}")]
    Listen { uid: String, addr: SocketAddr, error: String },
    #[error("pod {uid}: certificate for {identity}: {error}")]
    Certificate { uid: String, identity: String, error: String },
    #[error("keep for pod {0}, which this proxy does not hold")]
    KeepUnknown(String),
}

struct Pod {
    /// Who it is: the name the CNI or the mesh state gave, and its identity.
    name: String,
    id: Identity,
    netns: Arc<Netns>,
    ips: Vec<IpAddr>,
    listeners: Vec<tokio::task::JoinHandle<()>>,
}

/// What the proxy holds for the CNI.
pub struct InPod {
    ctx: Arc<Ctx>,
    store: Arc<CertStore>,
    pods: Mutex<HashMap<String, Pod>>,
    pub(crate) metrics: super::InPodMetrics,
}

impl InPod {
    pub fn new(ctx: Arc<Ctx>, store: Arc<CertStore>, metrics: super::InPodMetrics) -> InPod {
        InPod { ctx, store, pods: Mutex::new(HashMap::new()), metrics }
    }

    /// Uids of the pods held now.
    pub fn uids(&self) -> Vec<String> {
        let mut v: Vec<_> = self.pods.lock().unwrap().keys().cloned().collect();
        v.sort();
        v
    }

    /// ztunnel's `workloadState` (config dump): each held pod by uid with its state and who it
    /// is. A held pod's listeners are open, so its state is `Up` (ztunnel's `Pending` is a proxy
    /// not started yet; a pod waiting for its workload is listed by `pending`).
    pub fn workload_state(&self) -> serde_json::Value {
        let pods = self.pods.lock().unwrap();
        let m: serde_json::Map<String, serde_json::Value> = pods
            .iter()
            .map(|(uid, p)| {
                let info = serde_json::json!({
                    "name": p.name,
                    "namespace": p.id.namespace,
                    "trustDomain": p.id.trust_domain,
                    "serviceAccount": p.id.service_account,
                });
                (uid.clone(), serde_json::json!({"state": "Up", "info": info}))
            })
            .collect();
        serde_json::Value::Object(m)
    }

    pub fn holds(&self, uid: &str) -> bool {
        self.pods.lock().unwrap().contains_key(uid)
    }

    /// Enrols a pod: checks it against the mesh state, enters its namespace, opens its listeners,
    /// issues its certificate. Re-adding a pod in the same namespace is a no-op; in another
    /// namespace (the pod was re-created) it replaces the old one.
    pub async fn add(
        &self,
        uid: &str,
        info: Option<&WorkloadInfo>,
        fd: Option<OwnedFd>,
    ) -> Result<(), PodError> {
        let state = &self.ctx.state;
        let w = state.workload_by_uid(uid);
        // istio-cni sends the ADD before the pod has a published IP, so before istiod can have
        // sent its workload: such a pod is enrolled from what the CNI says (its identity) and
        // its connections wait for the workload (see `proxy::outbound`).
        let (id, ips) = match (&w, info) {
            (Some(w), _) => (state.identity_of(w), w.ips.clone()),
            (None, Some(i)) if !i.namespace.is_empty() && !i.service_account.is_empty() => {
                (Identity::new(state.trust_domain(), &i.namespace, &i.service_account), vec![])
            }
            (None, _) => return Err(PodError::UnknownUid(uid.into())),
        };
        if let (Some(w), Some(i)) = (&w, info) {
            let cni = format!("{}/{} (sa {})", i.namespace, i.name, i.service_account);
            let st = format!("{}/{} (sa {})", w.namespace, w.name, w.service_account);
            // The identity is what matters; an empty field is "not told".
            if (!i.namespace.is_empty() && i.namespace != w.namespace)
                || (!i.service_account.is_empty() && i.service_account != w.service_account)
            {
                return Err(PodError::IdentityMismatch { uid: uid.into(), cni, state: st });
            }
        }
        let fd = fd.ok_or_else(|| PodError::NoNetns(uid.into()))?;
        let new_id = crate::net::netns::netns_id(std::os::fd::AsFd::as_fd(&fd))
            .map_err(|e| PodError::Netns { uid: uid.into(), error: e.to_string() })?;
        if let Some(old) = self.held_netns(uid) {
            if old == new_id {
                tracing::info!(uid, netns = %new_id, "pod already enrolled in this namespace");
                return Ok(());
            }
            tracing::info!(uid, old = %old, new = %new_id, "pod re-created: replacing it");
            self.remove(uid).await;
        }
        let netns = Arc::new(
            Netns::enter(fd, uid)
                .map_err(|e| PodError::Netns { uid: uid.into(), error: e.to_string() })?,
        );
        // Its families, or both while its addresses are not known (IPv6 is left out when the
        // namespace has none, below).
        let mut addrs = Vec::new();
        if ips.is_empty() || ips.iter().any(|ip| ip.is_ipv4()) {
            addrs.push(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        }
        if ips.is_empty() || ips.iter().any(|ip| ip.is_ipv6()) {
            addrs.push(IpAddr::V6(Ipv6Addr::UNSPECIFIED));
        }
        let mut bound = Vec::new();
        for ip in addrs {
            for port in [OUTBOUND_PORT, INBOUND_PLAINTEXT_PORT, INBOUND_PORT] {
                let addr = SocketAddr::new(ip, port);
                match socket::listen_in(&netns, addr).await {
                    Ok(l) => bound.push((port, l)),
                    // A namespace without IPv6 (disabled, or no kernel support): IPv4 only.
                    Err(e)
                        if ip.is_ipv6()
                            && matches!(
                                e.raw_os_error(),
                                Some(libc::EAFNOSUPPORT | libc::EADDRNOTAVAIL)
                            ) =>
                    {
                        tracing::warn!(uid, error = %e,
                            "pod has an IPv6 address but its namespace has no IPv6: capturing IPv4 only");
                        break;
                    }
                    Err(e) => {
                        return Err(PodError::Listen {
                            uid: uid.into(),
                            addr,
                            error: e.to_string(),
                        })
                    }
                }
            }
        }
        // Enrolled first, so that the certificate manager counts the identity as wanted while
        // its certificate is requested. The store owns the request (one, shared with the
        // manager's), so during a CA backoff the ADD fails at once with the store's reason
        // instead of starting a request of its own.
        match &w {
            Some(_) => state.set_enrolled(uid, true),
            None => state.set_enrolled_pending(uid, id.clone()),
        }
        if let Err(e) = self.store.fetch(&id).await {
            state.set_enrolled(uid, false);
            return Err(PodError::Certificate {
                uid: uid.into(),
                identity: id.to_string(),
                error: e.to_string(),
            });
        }
        let pod_uid: Arc<str> = Arc::from(uid);
        let mut listeners = Vec::new();
        for (port, l) in bound {
            let ctx = self.ctx.clone();
            let ns = netns.clone();
            let pod_uid = pod_uid.clone();
            let drain = ctx.drain.clone();
            listeners.push(match port {
                OUTBOUND_PORT => proxy::spawn_accept_loop(
                    "pod_outbound",
                    l,
                    drain,
                    ctx.metrics.clone(),
                    ctx.workers.clone(),
                    move |s, p| {
                        proxy::outbound::handle(
                            ctx.clone(),
                            s,
                            p,
                            Some(ns.clone()),
                            Some(pod_uid.clone()),
                        )
                    },
                ),
                INBOUND_PORT => proxy::spawn_accept_loop(
                    "pod_inbound",
                    l,
                    drain,
                    ctx.metrics.clone(),
                    ctx.workers.clone(),
                    move |s, p| proxy::inbound::handle_hbone(ctx.clone(), s, p, Some(ns.clone())),
                ),
                _ => proxy::spawn_accept_loop(
                    "pod_inbound_plaintext",
                    l,
                    drain,
                    ctx.metrics.clone(),
                    ctx.workers.clone(),
                    move |s, p| {
                        proxy::inbound::handle_plaintext(ctx.clone(), s, p, Some(ns.clone()))
                    },
                ),
            });
        }
        if let Some(dns) = &self.ctx.dns {
            let clients = crate::dns::Clients::Pod(pod_uid.clone());
            match crate::dns::server::listen(dns, Some(&netns), dns.addr, clients, &self.ctx.drain)
                .await
            {
                Ok(t) => listeners.extend(t),
                Err(e) => {
                    for t in &listeners {
                        t.abort();
                    }
                    state.set_enrolled(uid, false);
                    return Err(PodError::Listen {
                        uid: uid.into(),
                        addr: dns.addr,
                        error: format!("DNS proxy: {e}"),
                    });
                }
            }
        }
        match &w {
            Some(w) => tracing::info!(uid, workload = %w.name, identity = %id, netns = %netns.id(),
                ips = ?w.ips, "pod enrolled: listening on 15001/15006/15008 in its network namespace"),
            None => tracing::info!(uid, identity = %id, netns = %netns.id(),
                "pod enrolled before its workload is in the mesh state (pending): listening on \
                 15001/15006/15008; its connections wait for the workload"),
        }
        let mut pods = self.pods.lock().unwrap();
        let name = w.as_ref().map(|w| w.name.clone()).or_else(|| info.map(|i| i.name.clone()));
        pods.insert(uid.into(), Pod { name: name.unwrap_or_default(), id, netns, ips, listeners });
        self.metrics.pods.set(pods.len() as i64);
        self.metrics.started.inc();
        drop(pods);
        self.count_pending();
        Ok(())
    }

    /// Enrolled pods whose workload the mesh state does not hold (yet).
    pub fn pending(&self) -> Vec<String> {
        let state = &self.ctx.state;
        let mut v: Vec<String> =
            self.uids().into_iter().filter(|u| state.workload_by_uid(u).is_none()).collect();
        v.sort();
        v
    }

    /// Keeps the pending gauge current as the mesh state changes (a pending pod's workload
    /// arrives); ends with the state.
    pub async fn watch_pending(self: Arc<Self>) {
        let mut rx = self.ctx.state.subscribe();
        while rx.changed().await.is_ok() {
            let before = self.metrics.pending.get();
            self.count_pending();
            if before > 0 && self.metrics.pending.get() < before {
                tracing::info!(pending = ?self.pending(), "a pending pod's workload arrived");
            }
        }
    }

    /// Updates the pending gauge (after an enrolment, a removal, or a mesh-state change).
    pub fn count_pending(&self) {
        self.metrics.pending.set(self.pending().len() as i64);
    }

    fn held_netns(&self, uid: &str) -> Option<NetnsId> {
        self.pods.lock().unwrap().get(uid).map(|p| p.netns.id())
    }

    /// Removes a pod: its listeners are closed when this returns; connections in flight finish
    /// on their own. Returns whether it was held.
    pub async fn remove(&self, uid: &str) -> bool {
        let pod = {
            let mut pods = self.pods.lock().unwrap();
            let pod = pods.remove(uid);
            self.metrics.pods.set(pods.len() as i64);
            pod
        };
        let Some(pod) = pod else { return false };
        self.metrics.stopped.inc();
        self.ctx.state.set_enrolled(uid, false);
        for t in &pod.listeners {
            t.abort();
        }
        for t in pod.listeners {
            let _ = t.await;
        }
        // Its addresses as enrolled, and as the mesh state has them now (a pod enrolled pending).
        let now = self.ctx.state.workload_by_uid(uid).map(|w| w.ips.clone()).unwrap_or_default();
        for ip in pod.ips.iter().chain(&now) {
            self.ctx.pool.forget_source(*ip);
        }
        tracing::info!(uid, netns = %pod.netns.id(), "pod removed: listeners closed");
        self.count_pending();
        true
    }

    /// After a snapshot: removes every pod not in `seen`; returns the removed uids.
    pub async fn reconcile(&self, seen: &HashSet<String>) -> Vec<String> {
        let stale: Vec<String> = self.uids().into_iter().filter(|u| !seen.contains(u)).collect();
        for uid in &stale {
            tracing::info!(uid, "pod not in the CNI's snapshot: removing it");
            self.remove(uid).await;
        }
        stale
    }
}
