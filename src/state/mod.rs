//! The mesh as this node sees it: workloads, services and authorization policies in one live
//! store. Two sources feed it through [`Store::apply`]: the local YAML file (reloaded when it
//! changes) and delta xDS from istiod. Lookups by IP, uid, service VIP and hostname are hash
//! lookups; subscribers (the certificate manager, in-pod mode, the proxy) watch a version number
//! that moves on every applied change.
#![forbid(unsafe_code)]

pub mod gateway;
pub mod policy;
mod route;
pub mod service;
pub mod workload;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::watch;

pub use gateway::{AppTunnel, GatewayAddress, GatewayTarget, TunnelHeader};
pub use policy::Authorization;
pub use route::{LookupError, Upstream, Via};
pub use service::{HealthPolicy, IpFamilies, LbMode, LbScope, LoadBalancing, Service, ServicePort};
pub use workload::{Locality, PortMapping, Protocol, Workload};

use crate::identity::Identity;

/// A connection arrived before the mesh state's first complete sync and the bound passed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[error(
    "no first complete response from the control plane within {waited:?} (missing: {missing}): \
     nothing is decided against a partial mesh state; check the xDS stream \
     (mbtunnel_xds_connection_state, /config_dump \"xds\"), or raise xds_sync_timeout_ms"
)]
pub struct NotSynced {
    pub waited: Duration,
    /// The families not received yet: `Address`, `Authorization` or both.
    pub missing: &'static str,
}

impl NotSynced {
    /// The refusal metric's reason.
    pub fn reason(&self) -> &'static str {
        "xds_not_synced"
    }
}

const SYNCED_ADDRESS: u8 = 1;
const SYNCED_POLICY: u8 = 2;
const SYNCED_ALL: u8 = SYNCED_ADDRESS | SYNCED_POLICY;

/// One resource of the mesh. Short-lived (an xDS response or a file reload is turned into a
/// batch of them and applied), so its variants are not boxed.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resource {
    Workload(Workload),
    Service(Service),
    Policy(Authorization),
}

impl Resource {
    /// The resource name (workload uid, service `namespace/hostname`, policy `namespace/name`).
    pub fn name(&self) -> String {
        match self {
            Resource::Workload(w) => w.uid.clone(),
            Resource::Service(s) => s.key(),
            Resource::Policy(p) => p.key(),
        }
    }
}

/// The two resource families of Istio's xDS: addresses (workloads and services share a name
/// space) and authorization policies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    Address,
    Policy,
}

/// A change: resources inserted or replaced, names removed.
#[derive(Clone, Debug, Default)]
pub struct Delta {
    pub upserts: Vec<Resource>,
    pub removes: Vec<(Family, String)>,
}

/// Static facts the store needs to answer lookups.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub trust_domain: String,
    pub node_name: String,
    pub hbone_port: u16,
    /// Node name → HBONE address, when not `<workload ip>:hbone_port` (several nodes on one
    /// machine, local file only).
    pub node_hbone: HashMap<String, SocketAddr>,
    /// In-pod mode: the workloads served here are the pods the CNI enrolled (by uid).
    pub inpod: bool,
    /// Set when the state comes from xDS: until the first complete response of both families
    /// has been applied ([`Store::mark_synced`]), a new connection waits at most this long
    /// ([`Store::wait_synced`]). Unset (local file): synced from the start.
    pub sync_timeout: Option<Duration>,
}

#[derive(Default, Debug)]
struct Index {
    workloads: HashMap<String, Arc<Workload>>,
    by_ip: HashMap<IpAddr, Arc<Workload>>,
    services: HashMap<String, Arc<Service>>,
    by_vip: HashMap<IpAddr, Arc<Service>>,
    by_host: HashMap<String, Arc<Service>>,
    /// Service key → uids of the workloads behind it, sorted.
    endpoints: HashMap<String, Vec<String>>,
    policies: HashMap<String, Arc<Authorization>>,
    /// GLOBAL-scope policies, and NAMESPACE-scope ones by namespace: what applies to a
    /// workload is found without scanning every policy.
    global: BTreeMap<String, Arc<Authorization>>,
    by_ns: HashMap<String, BTreeMap<String, Arc<Authorization>>>,
    /// Held policies and workloads that are fail-closed stand-ins (`fail_closed` set).
    failed_policies: usize,
    failed_workloads: usize,
}

impl Index {
    fn remove_workload(&mut self, uid: &str) -> bool {
        let Some(old) = self.workloads.remove(uid) else { return false };
        self.failed_workloads -= old.fail_closed.is_some() as usize;
        for ip in &old.ips {
            if self.by_ip.get(ip).is_some_and(|w| w.uid == uid) {
                self.by_ip.remove(ip);
            }
        }
        for svc in old.services.keys() {
            if let Some(v) = self.endpoints.get_mut(svc) {
                v.retain(|u| u != uid);
                if v.is_empty() {
                    self.endpoints.remove(svc);
                }
            }
        }
        true
    }

    fn insert_workload(&mut self, w: Workload) {
        self.remove_workload(&w.uid);
        self.failed_workloads += w.fail_closed.is_some() as usize;
        let w = Arc::new(w);
        for ip in &w.ips {
            if let Some(prev) = self.by_ip.insert(*ip, w.clone()) {
                if prev.uid != w.uid {
                    tracing::warn!(%ip, old = %prev.uid, new = %w.uid,
                        "two workloads claim one address: the newer one wins");
                }
            }
        }
        for svc in w.services.keys() {
            let v = self.endpoints.entry(svc.clone()).or_default();
            if let Err(i) = v.binary_search(&w.uid) {
                v.insert(i, w.uid.clone());
            }
        }
        self.workloads.insert(w.uid.clone(), w);
    }

    fn remove_policy(&mut self, key: &str) {
        if let Some(old) = self.policies.remove(key) {
            self.failed_policies -= old.fail_closed.is_some() as usize;
            self.global.remove(key);
            if let Some(m) = self.by_ns.get_mut(&old.namespace) {
                m.remove(key);
                if m.is_empty() {
                    self.by_ns.remove(&old.namespace);
                }
            }
        }
    }

    fn insert_policy(&mut self, p: Authorization) {
        let key = p.key();
        self.remove_policy(&key);
        self.failed_policies += p.fail_closed.is_some() as usize;
        let p = Arc::new(p);
        match p.scope {
            policy::Scope::Global => {
                self.global.insert(key.clone(), p.clone());
            }
            policy::Scope::Namespace => {
                self.by_ns.entry(p.namespace.clone()).or_default().insert(key.clone(), p.clone());
            }
            policy::Scope::WorkloadSelector => {}
        }
        self.policies.insert(key, p);
    }

    fn remove_service(&mut self, key: &str) -> bool {
        let Some(old) = self.services.remove(key) else { return false };
        for vip in &old.vips {
            if self.by_vip.get(vip).is_some_and(|s| s.key() == key) {
                self.by_vip.remove(vip);
            }
        }
        let host = old.hostname();
        if self.by_host.get(&host).is_some_and(|s| s.key() == key) {
            self.by_host.remove(&host);
        }
        true
    }

    fn insert_service(&mut self, s: Service) {
        let key = s.key();
        self.remove_service(&key);
        let s = Arc::new(s);
        for vip in &s.vips {
            self.by_vip.insert(*vip, s.clone());
        }
        self.by_host.insert(s.hostname(), s.clone());
        self.services.insert(key, s);
    }
}

/// Resource counts, for metrics and the config dump.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counts {
    pub workloads: usize,
    pub services: usize,
    pub policies: usize,
}

/// The live mesh state.
#[derive(Debug)]
pub struct Store {
    cfg: StoreConfig,
    index: RwLock<Index>,
    version: watch::Sender<u64>,
    /// Moves only when a decision about an open connection can change: a policy changed, or a
    /// local workload (a destination policies are evaluated for) changed, came or left.
    authz_epoch: watch::Sender<u64>,
    rr: AtomicUsize,
    /// In-pod: enrolled pod uids, with the identity the CNI named for a pod enrolled before its
    /// workload arrived (its certificate is wanted meanwhile).
    enrolled: RwLock<HashMap<String, Option<Identity>>>,
    warned: std::sync::Mutex<HashSet<String>>,
    /// Families whose first complete response has been applied (`SYNCED_*` bits), and the
    /// same as one flag for the per-connection fast path.
    synced_families: watch::Sender<u8>,
    synced: AtomicBool,
}

pub type State = Store;

impl Store {
    pub fn new(cfg: StoreConfig) -> Store {
        let synced = cfg.sync_timeout.is_none();
        Store {
            synced_families: watch::channel(if synced { SYNCED_ALL } else { 0 }).0,
            synced: AtomicBool::new(synced),
            cfg,
            index: RwLock::new(Index::default()),
            version: watch::channel(0).0,
            authz_epoch: watch::channel(0).0,
            rr: AtomicUsize::new(0),
            enrolled: RwLock::new(HashMap::new()),
            warned: Default::default(),
        }
    }

    pub fn trust_domain(&self) -> &str {
        &self.cfg.trust_domain
    }

    pub fn node_name(&self) -> &str {
        &self.cfg.node_name
    }

    /// Applies a change and notifies subscribers (once per call, even if nothing moved). The
    /// authorization epoch ([`subscribe_authz`](Self::subscribe_authz)) moves only when a policy
    /// or a local workload actually changed: a push about other nodes' workloads, or the same
    /// version sent again, re-checks no open connection.
    pub fn apply(&self, delta: Delta) {
        let mut authz_changed = false;
        {
            let mut ix = self.index.write().unwrap();
            for (family, name) in &delta.removes {
                match family {
                    Family::Address => {
                        let local =
                            ix.workloads.get(name.as_str()).is_some_and(|w| self.is_local(w));
                        authz_changed |= local;
                        if !ix.remove_workload(name) {
                            ix.remove_service(name);
                        }
                    }
                    Family::Policy => {
                        authz_changed |= ix.policies.contains_key(name.as_str());
                        ix.remove_policy(name)
                    }
                }
            }
            for r in delta.upserts {
                match r {
                    Resource::Workload(w) => {
                        let old = ix.workloads.get(&w.uid);
                        if old.is_none_or(|o| **o != w) {
                            authz_changed |=
                                self.is_local(&w) || old.is_some_and(|o| self.is_local(o));
                        }
                        ix.insert_workload(w)
                    }
                    Resource::Service(s) => ix.insert_service(s),
                    Resource::Policy(p) => {
                        authz_changed |= ix.policies.get(&p.key()).is_none_or(|o| **o != p);
                        ix.insert_policy(p)
                    }
                }
            }
        }
        self.version.send_modify(|v| *v += 1);
        if authz_changed {
            self.authz_epoch.send_modify(|v| *v += 1);
        }
    }

    /// Records that the first complete response of `family` has been applied; once both
    /// families have, waiting connections go on and new ones no longer wait.
    pub fn mark_synced(&self, family: Family) {
        let bit = match family {
            Family::Address => SYNCED_ADDRESS,
            Family::Policy => SYNCED_POLICY,
        };
        self.synced_families.send_if_modified(|b| {
            let before = *b;
            *b |= bit;
            if *b == SYNCED_ALL {
                self.synced.store(true, Ordering::Release);
            }
            *b != before
        });
    }

    /// Whether the first complete sync has happened (always, for the local file).
    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// Waits until the mesh state has had its first complete sync (xDS: a response of each
    /// family applied), at most the configured bound; at once when it has. A connection is
    /// never decided against the empty or partial state of a proxy that just started.
    pub async fn wait_synced(&self) -> Result<(), NotSynced> {
        if self.is_synced() {
            return Ok(());
        }
        let waited = self.cfg.sync_timeout.unwrap_or_default();
        let mut rx = self.synced_families.subscribe();
        let done = tokio::time::timeout(waited, rx.wait_for(|b| *b == SYNCED_ALL))
            .await
            .is_ok_and(|r| r.is_ok());
        if done {
            return Ok(());
        }
        let missing = match *rx.borrow() & SYNCED_ALL {
            SYNCED_ALL => return Ok(()),
            SYNCED_ADDRESS => "Authorization",
            SYNCED_POLICY => "Address",
            _ => "Address and Authorization",
        };
        Err(NotSynced { waited, missing })
    }

    /// A receiver whose value moves on every applied change.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    /// A receiver whose value moves when a decision about an open inbound connection can have
    /// changed (see [`apply`](Self::apply)): what the live re-check waits on.
    pub fn subscribe_authz(&self) -> watch::Receiver<u64> {
        self.authz_epoch.subscribe()
    }

    pub fn counts(&self) -> Counts {
        let ix = self.index.read().unwrap();
        Counts {
            workloads: ix.workloads.len(),
            services: ix.services.len(),
            policies: ix.policies.len(),
        }
    }

    /// Held (policies, workloads) that are enforced fail-closed: stand-ins for refused or
    /// half-understood xDS versions (see `fail_closed` on each).
    pub fn failed_closed(&self) -> (usize, usize) {
        let ix = self.index.read().unwrap();
        (ix.failed_policies, ix.failed_workloads)
    }

    /// Names held now, per family (what a reconnecting xDS client or a file reload compares).
    pub fn names(&self, family: Family) -> Vec<String> {
        let ix = self.index.read().unwrap();
        let mut v: Vec<String> = match family {
            Family::Address => ix.workloads.keys().chain(ix.services.keys()).cloned().collect(),
            Family::Policy => ix.policies.keys().cloned().collect(),
        };
        v.sort();
        v
    }

    pub fn workload_by_ip(&self, ip: IpAddr) -> Option<Arc<Workload>> {
        self.index.read().unwrap().by_ip.get(&ip).cloned()
    }

    pub fn workload_by_uid(&self, uid: &str) -> Option<Arc<Workload>> {
        self.index.read().unwrap().workloads.get(uid).cloned()
    }

    /// Workload `uid`, waiting at most `bound` for it to arrive (a pod enrolled before istiod
    /// sent its workload).
    pub async fn wait_workload(&self, uid: &str, bound: Duration) -> Option<Arc<Workload>> {
        let mut rx = self.subscribe();
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            if let Some(w) = self.workload_by_uid(uid) {
                return Some(w);
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return self.workload_by_uid(uid),
            }
        }
    }

    pub fn service_by_vip(&self, ip: IpAddr) -> Option<Arc<Service>> {
        self.index.read().unwrap().by_vip.get(&ip).cloned()
    }

    pub fn service_by_hostname(&self, host: &str) -> Option<Arc<Service>> {
        self.index.read().unwrap().by_host.get(host).cloned()
    }

    /// The service a pod of `namespace` means by `host`: its own namespace's, else `preferred`'s,
    /// else any (ztunnel's best match among services sharing a hostname).
    pub fn service_for_host(
        &self,
        host: &str,
        namespace: &str,
        preferred: Option<&str>,
    ) -> Option<Arc<Service>> {
        let ix = self.index.read().unwrap();
        let in_ns = |ns: &str| ix.services.get(&format!("{ns}/{host}")).cloned();
        in_ns(namespace)
            .or_else(|| preferred.and_then(in_ns))
            .or_else(|| ix.by_host.get(host).cloned())
    }

    /// The workloads behind `svc` (any health).
    pub fn endpoints_of(&self, svc: &Service) -> Vec<Arc<Workload>> {
        let ix = self.index.read().unwrap();
        let uids = ix.endpoints.get(&svc.key()).map(Vec::as_slice).unwrap_or_default();
        uids.iter().filter_map(|u| ix.workloads.get(u).cloned()).collect()
    }

    pub fn policy(&self, key: &str) -> Option<Arc<Authorization>> {
        self.index.read().unwrap().policies.get(key).cloned()
    }

    pub fn policies(&self) -> Vec<Arc<Authorization>> {
        let mut v: Vec<_> = self.index.read().unwrap().policies.values().cloned().collect();
        v.sort_by_key(|p| p.key());
        v
    }

    /// Calls `f` with every policy that applies to `w`, in ztunnel's order: its namespace's
    /// NAMESPACE ones, the GLOBAL ones, then every policy it lists by name whatever its scope
    /// (one already given through its scope is not given twice; a name the store does not hold
    /// is skipped with a warning, once per name). Holds the read lock; allocates nothing.
    pub fn for_each_policy_of(&self, w: &Workload, mut f: impl FnMut(&Arc<Authorization>)) {
        let ix = self.index.read().unwrap();
        if let Some(m) = ix.by_ns.get(&w.namespace) {
            for p in m.values() {
                f(p);
            }
        }
        for p in ix.global.values() {
            f(p);
        }
        for name in &w.authorization_policies {
            match ix.policies.get(name) {
                // Already given through its scope.
                Some(p) if p.scope == policy::Scope::Global => {}
                Some(p) if p.scope == policy::Scope::Namespace && p.namespace == w.namespace => {}
                Some(p) => f(p),
                None => {
                    let mut warned = self.warned.lock().unwrap();
                    if warned.insert(name.clone()) {
                        tracing::warn!(workload = %w.uid, policy = %name,
                            "workload names an authorization policy the mesh state does not hold: skipped");
                    }
                }
            }
        }
    }

    fn is_local(&self, w: &Workload) -> bool {
        if self.cfg.inpod {
            self.enrolled.read().unwrap().contains_key(&w.uid)
        } else {
            w.node == self.cfg.node_name
        }
    }

    /// Workloads served by this proxy: those of this node, or in in-pod mode the enrolled pods.
    pub fn local_workloads(&self) -> Vec<Arc<Workload>> {
        let ix = self.index.read().unwrap();
        let mut v: Vec<_> = ix.workloads.values().filter(|w| self.is_local(w)).cloned().collect();
        v.sort_by(|a, b| a.uid.cmp(&b.uid));
        v
    }

    /// Identities of the local workloads (what this node needs certificates for).
    pub fn local_identities(&self) -> HashSet<Identity> {
        let mut ids: HashSet<Identity> =
            self.local_workloads().iter().map(|w| self.identity_of(w)).collect();
        // Pods enrolled before their workload arrived: the identity the CNI named.
        let pending: Vec<(String, Identity)> = self
            .enrolled
            .read()
            .unwrap()
            .iter()
            .filter_map(|(u, id)| id.clone().map(|id| (u.clone(), id)))
            .collect();
        for (uid, id) in pending {
            if self.workload_by_uid(&uid).is_none() {
                ids.insert(id);
            }
        }
        ids
    }

    /// The local workload owning `ip`, if any.
    pub fn local_workload_by_ip(&self, ip: IpAddr) -> Option<Arc<Workload>> {
        self.workload_by_ip(ip).filter(|w| self.is_local(w))
    }

    /// In-pod mode: starts (`true`) or stops serving the workload `uid`. No-op otherwise.
    pub fn set_enrolled(&self, uid: &str, enrolled: bool) {
        self.enroll(uid, enrolled.then_some(None))
    }

    /// In-pod mode: serves pod `uid`, whose workload the state does not hold yet, as `identity`
    /// (what the CNI's ADD named) until it arrives.
    pub fn set_enrolled_pending(&self, uid: &str, identity: Identity) {
        self.enroll(uid, Some(Some(identity)))
    }

    fn enroll(&self, uid: &str, enrolled: Option<Option<Identity>>) {
        if !self.cfg.inpod {
            return;
        }
        {
            let mut set = self.enrolled.write().unwrap();
            match enrolled {
                Some(id) => {
                    set.insert(uid.to_string(), id);
                }
                None => {
                    set.remove(uid);
                }
            }
        }
        self.version.send_modify(|v| *v += 1);
        self.authz_epoch.send_modify(|v| *v += 1);
    }

    pub fn identity_of(&self, w: &Workload) -> Identity {
        w.identity(&self.cfg.trust_domain)
    }

    /// Everything the store holds, sorted by key, for the admin config dump: workloads by uid,
    /// services by key with the uids behind them, policies by key, and the endpoints of services
    /// not (yet) known (ztunnel's "staged services").
    pub fn contents(&self) -> Contents {
        let ix = self.index.read().unwrap();
        let mut workloads: Vec<_> = ix.workloads.values().cloned().collect();
        workloads.sort_by(|a, b| a.uid.cmp(&b.uid));
        let mut services: Vec<_> = ix
            .services
            .values()
            .map(|s| {
                let uids = ix.endpoints.get(&s.key()).cloned().unwrap_or_default();
                let ws = uids.iter().filter_map(|u| ix.workloads.get(u).cloned()).collect();
                (s.clone(), ws)
            })
            .collect();
        services.sort_by_key(|(s, _)| s.key());
        let mut policies: Vec<_> = ix.policies.values().cloned().collect();
        policies.sort_by_key(|p| p.key());
        let mut staged: Vec<_> = ix
            .endpoints
            .iter()
            .filter(|(k, _)| !ix.services.contains_key(*k))
            .map(|(k, uids)| {
                (k.clone(), uids.iter().filter_map(|u| ix.workloads.get(u).cloned()).collect())
            })
            .collect();
        staged.sort_by(|a: &(String, Vec<_>), b| a.0.cmp(&b.0));
        Contents { workloads, services, policies, staged }
    }
}

/// What [`Store::contents`] returns.
pub struct Contents {
    pub workloads: Vec<Arc<Workload>>,
    /// Each service with the workloads behind it.
    pub services: Vec<(Arc<Service>, Vec<Arc<Workload>>)>,
    pub policies: Vec<Arc<Authorization>>,
    /// Endpoints of services the store does not hold: service key → workloads.
    pub staged: Vec<(String, Vec<Arc<Workload>>)>,
}

/// The resources a local file describes: services list their workloads there, so each listed
/// workload gets the service's port mappings (as xDS would send them).
pub fn local_resources(
    workloads: &[Workload],
    services: &[Service],
    policies: &[Authorization],
) -> Vec<Resource> {
    let mut ws: BTreeMap<&str, Workload> =
        workloads.iter().map(|w| (w.uid.as_str(), w.clone())).collect();
    for s in services {
        let ports: Vec<PortMapping> = s
            .ports
            .iter()
            .map(|p| PortMapping { service_port: p.port, target_port: p.target_port.unwrap_or(0) })
            .collect();
        for uid in &s.workloads {
            if let Some(w) = ws.get_mut(uid.as_str()) {
                w.services.insert(s.key(), ports.clone());
            }
        }
    }
    let mut out: Vec<Resource> = ws.into_values().map(Resource::Workload).collect();
    out.extend(services.iter().cloned().map(Resource::Service));
    out.extend(policies.iter().cloned().map(Resource::Policy));
    out
}

/// A node `node`'s store (trust domain `cluster.local`, HBONE port 15008, local-file mode)
/// holding the workloads and services of `yaml` (`{workloads: [...], services: [...]}`, as the
/// local file writes them): tables of tests, fuzz targets and benches.
pub fn store_of_yaml(node: &str, yaml: &str) -> Result<Store, String> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Mesh {
        #[serde(default)]
        workloads: Vec<Workload>,
        #[serde(default)]
        services: Vec<Service>,
    }
    let m: Mesh = serde_yaml::from_str(yaml).map_err(|e| e.to_string())?;
    let s = Store::new(StoreConfig {
        trust_domain: "cluster.local".into(),
        node_name: node.into(),
        hbone_port: 15008,
        node_hbone: HashMap::new(),
        inpod: false,
        sync_timeout: None,
    });
    s.apply(Delta { upserts: local_resources(&m.workloads, &m.services, &[]), removes: vec![] });
    Ok(s)
}

/// The delta that turns what `store` holds into exactly `resources` (a full-state source such as
/// the local file).
pub fn replace_delta(store: &Store, resources: Vec<Resource>) -> Delta {
    let mut keep_addr = HashSet::new();
    let mut keep_pol = HashSet::new();
    for r in &resources {
        match r {
            Resource::Policy(p) => keep_pol.insert(p.key()),
            other => keep_addr.insert(other.name()),
        };
    }
    let mut removes = Vec::new();
    for n in store.names(Family::Address) {
        if !keep_addr.contains(&n) {
            removes.push((Family::Address, n));
        }
    }
    for n in store.names(Family::Policy) {
        if !keep_pol.contains(&n) {
            removes.push((Family::Policy, n));
        }
    }
    Delta { upserts: resources, removes }
}

#[cfg(test)]
mod tests {
    use super::*;
    const UNSPEC: IpAddr = IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED);

    fn wl(uid: &str, name: &str, sa: &str, ip: &str, node: &str) -> Workload {
        serde_yaml::from_str(&format!(
            "{{uid: {uid}, name: {name}, service_account: {sa}, ips: [{ip}], node: {node}}}"
        ))
        .unwrap()
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
        let svc: Service = serde_yaml::from_str(
            "{name: echo, vips: [10.96.0.1], ports: [{port: 80, target_port: 8080}], workloads: [s1, s2]}",
        )
        .unwrap();
        let ws = [
            wl("c", "client", "default", "10.0.1.2", "a"),
            wl("s1", "echo-1", "echo", "10.0.2.2", "b"),
            wl("s2", "echo-2", "echo", "10.0.2.3", "b"),
        ];
        s.apply(Delta { upserts: local_resources(&ws, &[svc], &[]), removes: vec![] });
        s
    }

    #[test]
    fn resolves_workload_and_service() {
        let s = store();
        let u = s.resolve("10.0.2.2:9000".parse().unwrap(), None, UNSPEC).unwrap().unwrap();
        assert_eq!(u.target, "10.0.2.2:9000".parse().unwrap());
        assert_eq!(u.hbone_addr, "127.0.0.3:25008".parse().unwrap());
        assert_eq!(u.identity.to_string(), "spiffe://cluster.local/ns/default/sa/echo");
        let a = s.resolve("10.96.0.1:80".parse().unwrap(), None, UNSPEC).unwrap().unwrap();
        let b = s.resolve("10.96.0.1:80".parse().unwrap(), None, UNSPEC).unwrap().unwrap();
        assert_eq!(a.target.port(), 8080);
        assert_ne!(a.target, b.target, "round robin over endpoints");
        assert!(s.resolve("10.96.0.1:81".parse().unwrap(), None, UNSPEC).is_err());
        assert!(s.resolve("1.1.1.1:80".parse().unwrap(), None, UNSPEC).unwrap().is_none());
        let c = s.resolve("10.0.1.2:1".parse().unwrap(), None, UNSPEC).unwrap().unwrap();
        assert_eq!(c.hbone_addr, "10.0.1.2:15008".parse().unwrap(), "default: workload ip:15008");
        assert_eq!(s.local_workloads().len(), 1);
        assert!(s.service_by_hostname("echo.default.svc.cluster.local").is_some());
    }

    #[test]
    fn authz_epoch_moves_only_for_policies_and_local_workloads() {
        let s = store();
        let mut rx = s.subscribe_authz();
        rx.borrow_and_update();
        let moved = |rx: &mut watch::Receiver<u64>| {
            rx.has_changed().unwrap() && {
                rx.borrow_and_update();
                true
            }
        };
        let push = |w: Workload| {
            s.apply(Delta { upserts: vec![Resource::Workload(w)], removes: vec![] });
        };
        // Another node's workload, new or changed: no decision here rests on it.
        push(wl("s3", "echo-3", "echo", "10.0.2.4", "b"));
        push(wl("s3", "echo-3", "other", "10.0.2.4", "b"));
        assert!(!moved(&mut rx), "a remote workload moved the epoch");
        // The local workload sent again unchanged: nothing to re-check.
        push(wl("c", "client", "default", "10.0.1.2", "a"));
        assert!(!moved(&mut rx), "an unchanged local workload moved the epoch");
        // The local workload changed: its connections' decisions can change.
        push(wl("c", "client", "other", "10.0.1.2", "a"));
        assert!(moved(&mut rx));
        // A workload moving off this node, and a local one leaving.
        push(wl("c", "client", "other", "10.0.1.2", "b"));
        assert!(moved(&mut rx));
        push(wl("c2", "client-2", "default", "10.0.1.3", "a"));
        assert!(moved(&mut rx));
        s.apply(Delta { upserts: vec![], removes: vec![(Family::Address, "c2".into())] });
        assert!(moved(&mut rx));
        s.apply(Delta { upserts: vec![], removes: vec![(Family::Address, "s3".into())] });
        assert!(!moved(&mut rx), "a remote workload leaving moved the epoch");
        // Policies: new, the same again, changed, removed, removed again.
        let p = |action: &str| -> Authorization {
            serde_yaml::from_str(&format!(
                "{{name: p, namespace: default, scope: NAMESPACE, action: {action}, rules: []}}"
            ))
            .unwrap()
        };
        let put = |a: Authorization| {
            s.apply(Delta { upserts: vec![Resource::Policy(a)], removes: vec![] });
        };
        put(p("ALLOW"));
        assert!(moved(&mut rx));
        put(p("ALLOW"));
        assert!(!moved(&mut rx), "the same policy again moved the epoch");
        put(p("DENY"));
        assert!(moved(&mut rx));
        let key = p("DENY").key();
        s.apply(Delta { upserts: vec![], removes: vec![(Family::Policy, key.clone())] });
        assert!(moved(&mut rx));
        s.apply(Delta { upserts: vec![], removes: vec![(Family::Policy, key)] });
        assert!(!moved(&mut rx), "removing an absent policy moved the epoch");
    }

    #[test]
    fn deltas_update_every_index_and_notify() {
        let s = store();
        let mut rx = s.subscribe();
        rx.borrow_and_update();
        // s1 moves to a new address and leaves the service; s2 is removed.
        let mut moved = wl("s1", "echo-1", "echo", "10.0.2.9", "b");
        moved.services.clear();
        s.apply(Delta {
            upserts: vec![Resource::Workload(moved)],
            removes: vec![(Family::Address, "s2".into())],
        });
        assert!(rx.has_changed().unwrap());
        assert!(s.workload_by_ip("10.0.2.2".parse().unwrap()).is_none(), "old ip gone");
        assert_eq!(s.workload_by_ip("10.0.2.9".parse().unwrap()).unwrap().uid, "s1");
        assert!(s.workload_by_uid("s2").is_none());
        assert_eq!(
            s.resolve("10.96.0.1:80".parse().unwrap(), None, UNSPEC).unwrap_err(),
            LookupError::NoEndpoints("default/echo.default.svc.cluster.local".into())
        );
        // Removing the service by its name frees its VIP and hostname.
        s.apply(Delta {
            upserts: vec![],
            removes: vec![(Family::Address, "default/echo.default.svc.cluster.local".into())],
        });
        assert!(s.service_by_vip("10.96.0.1".parse().unwrap()).is_none());
        assert!(s.service_by_hostname("echo.default.svc.cluster.local").is_none());
        assert_eq!(s.counts(), Counts { workloads: 2, services: 0, policies: 0 });
    }

    #[test]
    fn replace_delta_removes_what_the_source_no_longer_has() {
        let s = store();
        let d =
            replace_delta(&s, vec![Resource::Workload(wl("c", "client", "x", "10.0.1.2", "a"))]);
        s.apply(d);
        assert_eq!(s.names(Family::Address), vec!["c".to_string()]);
        assert_eq!(s.local_identities().len(), 1);
        assert!(s
            .local_identities()
            .contains(&"spiffe://cluster.local/ns/default/sa/x".parse().unwrap()));
    }

    #[tokio::test]
    async fn connections_wait_for_both_families_then_are_refused_or_go_on() {
        let s = Arc::new(Store::new(StoreConfig {
            trust_domain: "cluster.local".into(),
            node_name: "a".into(),
            hbone_port: 15008,
            node_hbone: HashMap::new(),
            inpod: false,
            sync_timeout: Some(Duration::from_millis(20)),
        }));
        assert!(!s.is_synced());
        let e = s.wait_synced().await.unwrap_err();
        assert_eq!((e.missing, e.reason()), ("Address and Authorization", "xds_not_synced"));
        s.mark_synced(Family::Address);
        assert_eq!(s.wait_synced().await.unwrap_err().missing, "Authorization");
        // A waiter goes on once the second family arrives.
        let s2 = Store::new(StoreConfig {
            sync_timeout: Some(Duration::from_secs(60)),
            ..s.cfg.clone()
        });
        let s2 = Arc::new(s2);
        s2.mark_synced(Family::Policy);
        let w = tokio::spawn({
            let s2 = s2.clone();
            async move { s2.wait_synced().await }
        });
        tokio::task::yield_now().await;
        s2.mark_synced(Family::Address);
        assert_eq!(w.await.unwrap(), Ok(()));
        assert!(s2.is_synced());
        // The local file: synced from the start.
        assert!(store().is_synced());
    }

    #[test]
    fn inpod_serves_enrolled_pods_only() {
        let s = Store::new(StoreConfig {
            trust_domain: "cluster.local".into(),
            node_name: "a".into(),
            hbone_port: 15008,
            node_hbone: HashMap::new(),
            inpod: true,
            sync_timeout: None,
        });
        s.apply(Delta {
            upserts: vec![Resource::Workload(wl("c", "client", "default", "10.0.1.2", "a"))],
            removes: vec![],
        });
        let ip = "10.0.1.2".parse().unwrap();
        assert!(s.local_workload_by_ip(ip).is_none(), "node match alone is not enough in-pod");
        s.set_enrolled("c", true);
        assert_eq!(s.local_workload_by_ip(ip).unwrap().name, "client");
        assert_eq!(s.local_workloads().len(), 1);
        s.set_enrolled("c", false);
        assert!(s.local_workload_by_ip(ip).is_none());
    }
}
