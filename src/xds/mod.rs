//! Delta xDS client for istiod: one aggregated stream carrying Istio's two node-proxy types
//! (`istio.workload.Address`, `istio.security.Authorization`) with wildcard subscriptions,
//! applied to the mesh-state store as they arrive. Each response is ACKed, or NACKed with a
//! message naming each refused resource — the good resources of the same response still apply.
//! On a broken stream the proxy keeps serving the state it holds and reconnects with jittered
//! backoff, telling the server which versions it holds (`initial_resource_versions`).
#![forbid(unsafe_code)]

pub mod convert;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

pub use convert::{ADDRESS_TYPE, AUTHORIZATION_TYPE};

use crate::grpc::Endpoints;
use crate::proto::discovery::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use crate::proto::discovery::{DeltaDiscoveryRequest, DeltaDiscoveryResponse, Node, Status};
use crate::state::{Delta, Family as StateFamily, Store};

/// Reconnect backoff: doubling from the first to the last, with jitter.
pub const BACKOFF_FIRST: Duration = Duration::from_millis(20);
pub const BACKOFF_MAX: Duration = Duration::from_secs(15);

/// Who this proxy is, for the first request of each type.
#[derive(Clone, Debug, Default)]
pub struct NodeInfo {
    pub pod_name: String,
    pub pod_namespace: String,
    pub instance_ip: String,
    pub node_name: String,
    pub cluster_id: String,
}

impl NodeInfo {
    /// The node in ztunnel's shape: `ztunnel~<ip>~<pod>.<ns>~<ns>.svc.cluster.local`.
    pub fn node(&self) -> Node {
        let s = |v: &str| prost_types::Value {
            kind: Some(prost_types::value::Kind::StringValue(v.to_string())),
        };
        let fields: BTreeMap<String, prost_types::Value> = [
            ("NAME", s(&self.pod_name)),
            ("NAMESPACE", s(&self.pod_namespace)),
            ("INSTANCE_IPS", s(&self.instance_ip)),
            ("NODE_NAME", s(&self.node_name)),
            ("CLUSTER_ID", s(&self.cluster_id)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        Node {
            id: format!(
                "ztunnel~{}~{}.{}~{}.svc.cluster.local",
                self.instance_ip, self.pod_name, self.pod_namespace, self.pod_namespace
            ),
            cluster: self.cluster_id.clone(),
            metadata: Some(prost_types::Struct { fields }),
            user_agent_name: "mbtunnel".into(),
            user_agent_version: env!("CARGO_PKG_VERSION").into(),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MessageLabels {
    pub type_url: &'static str,
    /// `ack` or `nack`.
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceLabels {
    /// `workload`, `service` or `authorization`.
    pub r#type: &'static str,
}

/// xDS metrics.
#[derive(Clone, Default)]
pub struct XdsMetrics {
    /// 1 while a stream is open.
    pub connection_state: Gauge,
    pub messages: Family<MessageLabels, Counter>,
    pub resources: Family<ResourceLabels, Gauge>,
    pub reconnects: Counter,
    /// Policies held as fail-closed stand-ins (refused, or with fields unknown here).
    pub policies_failed_closed: Gauge,
    /// Workloads held at an older version, denied to all, because their newest was refused.
    pub workloads_failed_closed: Gauge,
    /// ztunnel's `istio_xds_connection_terminations_total{reason}`.
    pub terminations: Family<TerminationLabels, Counter>,
    /// ztunnel's `istio_xds_message_total{url}`: responses received, by type URL.
    pub message_count: Family<UrlLabels, Counter>,
    /// ztunnel's `istio_xds_message_bytes_total{url}`: resource bytes received, by type URL.
    pub message_bytes: Family<UrlLabels, Counter>,
}

/// Why an xDS stream ended, in ztunnel's words: `ConnectionError` (it never opened), `Error`,
/// `Reconnect` (the server went away to be reconnected to), `Complete` (ended cleanly).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TerminationLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UrlLabels {
    pub url: String,
}

impl XdsMetrics {
    pub fn register(registry: &mut Registry) -> XdsMetrics {
        let m = XdsMetrics::default();
        let r = registry.sub_registry_with_prefix("mbtunnel_xds");
        r.register(
            "connection_state",
            "1 while the xDS stream to the control plane is open, 0 otherwise",
            m.connection_state.clone(),
        );
        r.register(
            "messages",
            "xDS responses received, by type and ack or nack",
            m.messages.clone(),
        );
        r.register("resources", "Resources held from xDS, by type", m.resources.clone());
        r.register("reconnects", "xDS streams opened after the first", m.reconnects.clone());
        r.register(
            "policies_failed_closed",
            "Authorization policies enforced fail-closed (a DENY denies its whole scope, an ALLOW \
             allows nothing) because their xDS version was refused or carries fields this proxy \
             does not know; 0 when every policy is enforced as written",
            m.policies_failed_closed.clone(),
        );
        r.register(
            "workloads_failed_closed",
            "Workloads whose newest xDS version was refused: the older version is kept and every \
             connection to them is denied until a good version arrives",
            m.workloads_failed_closed.clone(),
        );
        // ztunnel's series, under its names, for dashboards built for it.
        let istio = registry.sub_registry_with_prefix("istio");
        istio.register(
            "xds_connection_terminations",
            "The total number of completed connections to xds server (unstable)",
            m.terminations.clone(),
        );
        istio.register(
            "xds_message",
            "Total number of messages received (unstable)",
            m.message_count.clone(),
        );
        istio.register_with_unit(
            "xds_message",
            "Total number of bytes received (unstable)",
            prometheus_client::registry::Unit::Bytes,
            m.message_bytes.clone(),
        );
        m
    }

    /// Counts one response as ztunnel does: the message, and its resources' bytes.
    fn received(&self, resp: &DeltaDiscoveryResponse) {
        let url = UrlLabels { url: resp.type_url.clone() };
        self.message_count.get_or_create(&url).inc();
        let bytes: usize =
            resp.resources.iter().filter_map(|r| r.resource.as_ref()).map(|a| a.value.len()).sum();
        self.message_bytes.get_or_create(&url).inc_by(bytes as u64);
    }
}

/// Per-type bookkeeping, also shown in the config dump.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct TypeStatus {
    pub last_nonce: String,
    pub system_version_info: String,
    pub responses: u64,
    pub nacks: u64,
    pub last_nack: Option<String>,
    /// Resource name → version, as held (what a reconnect announces).
    #[serde(skip)]
    pub versions: HashMap<String, String>,
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ClientStatus {
    pub address: String,
    pub connected: bool,
    pub streams_opened: u64,
    pub last_error: Option<String>,
    pub types: BTreeMap<&'static str, TypeStatus>,
}

/// The xDS client.
pub struct Client {
    endpoints: Endpoints,
    node: NodeInfo,
    store: Arc<Store>,
    metrics: XdsMetrics,
    status: Mutex<ClientStatus>,
    ready: watch::Sender<bool>,
}

const TYPES: [&str; 2] = [ADDRESS_TYPE, AUTHORIZATION_TYPE];

fn family_of(type_url: &str) -> Option<StateFamily> {
    match type_url {
        ADDRESS_TYPE => Some(StateFamily::Address),
        AUTHORIZATION_TYPE => Some(StateFamily::Policy),
        _ => None,
    }
}

impl Client {
    pub fn new(
        endpoints: Endpoints,
        node: NodeInfo,
        store: Arc<Store>,
        metrics: XdsMetrics,
    ) -> Client {
        let status = ClientStatus {
            address: endpoints.address.clone(),
            types: TYPES.iter().map(|t| (*t, TypeStatus::default())).collect(),
            ..Default::default()
        };
        Client {
            endpoints,
            node,
            store,
            metrics,
            status: Mutex::new(status),
            ready: watch::channel(false).0,
        }
    }

    /// True once one response of each type has been applied (and stays true).
    pub fn ready(&self) -> watch::Receiver<bool> {
        self.ready.subscribe()
    }

    pub fn status(&self) -> ClientStatus {
        self.status.lock().unwrap().clone()
    }

    /// Runs the stream forever, reconnecting.
    pub async fn run(self: Arc<Self>) {
        let channel = match self.endpoints.channel() {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, "xDS: cannot set up the control-plane channel");
                return;
            }
        };
        let mut backoff = BACKOFF_FIRST;
        let mut first = true;
        loop {
            if !first {
                self.metrics.reconnects.inc();
            }
            first = false;
            let (got_response, err) = self.stream_once(channel.clone()).await;
            let reason = match &err {
                None => "Complete",
                Some(_) if !self.status.lock().unwrap().connected => "ConnectionError",
                Some(e) if e.contains("received prior goaway") => "Reconnect",
                Some(_) => "Error",
            };
            self.metrics.terminations.get_or_create(&TerminationLabels { reason }).inc();
            self.metrics.connection_state.set(0);
            self.status.lock().unwrap().connected = false;
            if got_response {
                backoff = BACKOFF_FIRST;
            }
            let Some(err) = err else {
                tracing::info!(address = %self.endpoints.address, "xDS: the server ended the stream; reopening");
                continue;
            };
            self.status.lock().unwrap().last_error = Some(err.clone());
            let mut b = [0u8; 2];
            let _ = boring::rand::rand_bytes(&mut b);
            let wait = backoff.mul_f64(0.5 + u16::from_le_bytes(b) as f64 / 65535.0 / 2.0 + 0.25);
            tracing::warn!(address = %self.endpoints.address, error = %err, retry_in_ms = wait.as_millis() as u64,
                "xDS: stream failed; serving the last state held and retrying");
            tokio::time::sleep(wait).await;
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    fn initial_requests(&self) -> Vec<DeltaDiscoveryRequest> {
        let status = self.status.lock().unwrap();
        TYPES
            .iter()
            .map(|t| DeltaDiscoveryRequest {
                node: Some(self.node.node()),
                type_url: t.to_string(),
                initial_resource_versions: status.types[t]
                    .versions
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
                ..Default::default()
            })
            .collect()
    }

    /// One stream: returns whether any response arrived, and the error that ended it (`None`:
    /// the server closed it cleanly).
    async fn stream_once(&self, channel: tonic::transport::Channel) -> (bool, Option<String>) {
        let (tx, rx) = mpsc::channel::<DeltaDiscoveryRequest>(16);
        for r in self.initial_requests() {
            let _ = tx.send(r).await;
        }
        let mut req = tonic::Request::new(ReceiverStream::new(rx));
        if let Err(e) = self.endpoints.decorate(req.metadata_mut()) {
            return (false, Some(e));
        }
        let mut client = AggregatedDiscoveryServiceClient::new(channel)
            .max_decoding_message_size(64 * 1024 * 1024);
        let mut stream = match client.delta_aggregated_resources(req).await {
            Ok(r) => r.into_inner(),
            Err(s) => return (false, Some(status_text(&s))),
        };
        {
            let mut st = self.status.lock().unwrap();
            st.connected = true;
            st.streams_opened += 1;
            st.last_error = None;
        }
        self.metrics.connection_state.set(1);
        tracing::info!(address = %self.endpoints.address, "xDS: stream open");
        let mut got = false;
        loop {
            match stream.message().await {
                Ok(Some(resp)) => {
                    got = true;
                    self.metrics.received(&resp);
                    let reply = self.handle(resp);
                    if tx.send(reply).await.is_err() {
                        return (got, Some("request stream closed".into()));
                    }
                }
                Ok(None) => return (got, None),
                Err(s) => return (got, Some(status_text(&s))),
            }
        }
    }

    /// Applies one response and returns its ACK or NACK.
    pub fn handle(&self, resp: DeltaDiscoveryResponse) -> DeltaDiscoveryRequest {
        let type_url = resp.type_url.clone();
        let Some(family) = family_of(&type_url) else {
            tracing::warn!(type_url = %type_url, "xDS: response of a type this proxy never asked for");
            return DeltaDiscoveryRequest {
                type_url,
                response_nonce: resp.nonce,
                error_detail: Some(Status {
                    code: 0,
                    message: "unsupported type".into(),
                    details: vec![],
                }),
                ..Default::default()
            };
        };
        let mut errors = Vec::new();
        let mut delta = Delta::default();
        let mut versions = Vec::new();
        let mut refused = Vec::new();
        for r in resp.resources {
            let decoded = match &r.resource {
                None => Err("resource has no payload".to_string()),
                Some(any) if any.type_url != type_url => {
                    Err(format!("payload of type {} in a {type_url} response", any.type_url))
                }
                Some(any) if family == StateFamily::Address => convert::address(&any.value),
                Some(any) => convert::authorization(&any.value),
            };
            match decoded {
                Ok(res) => {
                    // The name istiod uses is the key; a payload that names itself otherwise is
                    // still stored under its own key, so removals must use that key.
                    if res.name() != r.name && !r.name.is_empty() {
                        tracing::debug!(resource = %r.name, key = %res.name(), "xDS: resource name differs from its key");
                    }
                    versions.push((res.name(), r.version.clone()));
                    delta.upserts.push(res);
                }
                Err(e) => {
                    if let Some(stand_in) = self.fail_closed(family, &r, &e) {
                        delta.upserts.push(stand_in);
                    } else {
                        tracing::warn!(type_url = %type_url, resource = %r.name, error = %e,
                            "xDS: resource refused (NACKed); the version held before, if any, stays in use");
                    }
                    refused.push(r.name.clone());
                    errors.push(format!("{}: {e}", r.name));
                }
            }
        }
        for name in &resp.removed_resources {
            delta.removes.push((family, name.clone()));
        }
        let (n_up, n_rm) = (delta.upserts.len(), delta.removes.len());
        self.store.apply(delta);
        // A response of a wildcard subscription holds the whole family: connections waiting
        // for the first sync go on once both families have one.
        self.store.mark_synced(family);
        let nack = !errors.is_empty();
        {
            let mut st = self.status.lock().unwrap();
            let ts = st
                .types
                .entry(if family == StateFamily::Address {
                    ADDRESS_TYPE
                } else {
                    AUTHORIZATION_TYPE
                })
                .or_default();
            ts.last_nonce = resp.nonce.clone();
            ts.system_version_info = resp.system_version_info.clone();
            ts.responses += 1;
            for (n, v) in versions {
                ts.versions.insert(n, v);
            }
            for n in resp.removed_resources.iter().chain(&refused) {
                ts.versions.remove(n);
            }
            if nack {
                ts.nacks += 1;
                ts.last_nack = Some(errors.join("; "));
            }
            if !*self.ready.borrow() && st.types.values().all(|t| t.responses > 0) {
                self.ready.send_replace(true);
                tracing::info!("xDS: first response of each type applied");
            }
        }
        let (failed_policies, failed_workloads) = self.store.failed_closed();
        self.metrics.policies_failed_closed.set(failed_policies as i64);
        self.metrics.workloads_failed_closed.set(failed_workloads as i64);
        let counts = self.store.counts();
        for (t, n) in [
            ("workload", counts.workloads),
            ("service", counts.services),
            ("authorization", counts.policies),
        ] {
            self.metrics.resources.get_or_create(&ResourceLabels { r#type: t }).set(n as i64);
        }
        let type_label =
            if family == StateFamily::Address { ADDRESS_TYPE } else { AUTHORIZATION_TYPE };
        self.metrics
            .messages
            .get_or_create(&MessageLabels {
                type_url: type_label,
                result: if nack { "nack" } else { "ack" },
            })
            .inc();
        tracing::debug!(type_url = %type_url, nonce = %resp.nonce, upserts = n_up, removes = n_rm, nack, "xDS: response applied");
        DeltaDiscoveryRequest {
            type_url,
            response_nonce: resp.nonce,
            error_detail: nack.then(|| Status {
                code: 0,
                message: errors.join("; "),
                details: vec![],
            }),
            ..Default::default()
        }
    }
}

impl Client {
    /// What stands for refused resource `r` (`why`) until a good version arrives, so that a
    /// refusal never widens access (docs/DESIGN.md, "Refused xDS resources"): an Authorization
    /// becomes a DENY matching everything or an ALLOW matching nothing, in the scope as far as
    /// it can be read; a Workload or Service refused for its waypoint or network gateway is held
    /// without them, marked fail-closed (connections addressed to it are refused, never sent
    /// direct); another Workload whose older version is held keeps it, marked so that every
    /// connection to it is denied (the policies it lists may have changed). `None`: nothing is
    /// held for it (a new Workload, or a Service, whose held version stays as it is).
    fn fail_closed(
        &self,
        family: StateFamily,
        r: &crate::proto::discovery::Resource,
        why: &str,
    ) -> Option<crate::state::Resource> {
        match family {
            StateFamily::Policy => {
                let held = self.store.policy(&r.name);
                let p = convert::authorization_fail_closed(
                    &r.name,
                    r.resource.as_ref().map(|a| &a.value[..]),
                    held.as_deref(),
                    why,
                );
                tracing::warn!(resource = %r.name, error = %why, policy = %p.key(), scope = ?p.scope,
                    action = ?p.action, "xDS: authorization policy refused (NACKed); enforced fail-closed until \
                    a good version arrives: a DENY denies every connection in its scope, an ALLOW allows nothing");
                Some(crate::state::Resource::Policy(p))
            }
            StateFamily::Address => {
                // Refused for its waypoint or gateway: the resource without them, fail-closed
                // (a new one too: unknown, its address would be passed through direct).
                if let Some(stand_in) =
                    r.resource.as_ref().and_then(|a| convert::address_stand_in(&a.value, why))
                {
                    tracing::warn!(resource = %r.name, error = %why, "xDS: address resource refused \
                        (NACKed); it is held fail-closed until a good version arrives: every \
                        connection addressed to it is refused, none goes direct");
                    return Some(stand_in);
                }
                let mut w = (*self.store.workload_by_uid(&r.name)?).clone();
                tracing::warn!(resource = %r.name, error = %why, "xDS: new version of a workload refused \
                    (NACKed); its held version is kept and every connection to it is denied until a good \
                    version arrives (the policies it lists may have changed)");
                w.fail_closed = Some(format!("its newest xDS version was refused: {why}"));
                Some(crate::state::Resource::Workload(w))
            }
        }
    }
}

fn status_text(s: &tonic::Status) -> String {
    match s.code() {
        tonic::Code::Unauthenticated => format!(
            "the control plane refused our token (Unauthenticated): {}; check the token file and its audience",
            s.message()
        ),
        c => format!("{c:?}: {}", s.message()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::discovery::Resource as XdsResource;
    use crate::proto::{security as pb_sec, workload as pb};
    use crate::state::StoreConfig;
    use prost::Message;

    fn client() -> Client {
        let store = Arc::new(Store::new(StoreConfig {
            trust_domain: "cluster.local".into(),
            node_name: "n".into(),
            hbone_port: 15008,
            node_hbone: HashMap::new(),
            inpod: false,
            sync_timeout: None,
        }));
        let ep = Endpoints {
            address: "https://cp.invalid:15012".into(),
            roots_pem: vec![],
            token: crate::grpc::TokenSource::None,
            cluster_id: "Kubernetes".into(),
            headers: BTreeMap::new(),
        };
        Client::new(ep, NodeInfo::default(), store, XdsMetrics::default())
    }

    fn res(type_url: &str, name: &str, value: Vec<u8>) -> XdsResource {
        XdsResource {
            name: name.into(),
            version: "1".into(),
            resource: Some(prost_types::Any { type_url: type_url.into(), value }),
            aliases: vec![],
        }
    }

    fn push(c: &Client, type_url: &str, r: XdsResource) -> DeltaDiscoveryRequest {
        c.handle(DeltaDiscoveryResponse {
            type_url: type_url.into(),
            nonce: "n".into(),
            resources: vec![r],
            ..Default::default()
        })
    }

    /// A NAMESPACE policy of `demo`: `principal` exact, or with `bad_cidr` a source block of
    /// /33 (refused).
    fn policy(name: &str, action: pb_sec::Action, principal: &str, bad_cidr: bool) -> Vec<u8> {
        let m = pb_sec::Match {
            principals: vec![pb_sec::StringMatch {
                match_type: Some(pb_sec::string_match::MatchType::Exact(principal.into())),
            }],
            source_ips: if bad_cidr {
                vec![pb_sec::Address { address: vec![10, 0, 0, 0], length: 33 }]
            } else {
                vec![]
            },
            ..Default::default()
        };
        pb_sec::Authorization {
            name: name.into(),
            namespace: "demo".into(),
            scope: pb_sec::Scope::Namespace as i32,
            action: action as i32,
            rules: vec![pb_sec::Rule { clauses: vec![pb_sec::Clause { matches: vec![m] }] }],
            dry_run: false,
        }
        .encode_to_vec()
    }

    fn workload(tunnel_protocol: i32) -> Vec<u8> {
        let w = pb::Workload {
            uid: "d".into(),
            name: "echo".into(),
            namespace: "demo".into(),
            addresses: vec![vec![10, 0, 0, 9]],
            tunnel_protocol,
            node: "n".into(),
            ..Default::default()
        };
        pb::Address { r#type: Some(pb::address::Type::Workload(w)) }.encode_to_vec()
    }

    /// The decision for a connection from `sa` (namespace demo) to workload `d`.
    fn decide_from(c: &Client, sa: &str) -> crate::authz::Decision {
        let id: crate::identity::Identity =
            format!("spiffe://cluster.local/ns/demo/sa/{sa}").parse().unwrap();
        let p = crate::authz::principal_of(&id);
        let conn = crate::authz::Conn {
            src: Some(&id),
            principal: Some(&p),
            src_ip: "10.1.0.1".parse().unwrap(),
            dst_ip: "10.0.0.9".parse().unwrap(),
            dst_port: 80,
        };
        crate::authz::decide(&c.store, &c.store.workload_by_uid("d").unwrap(), &conn, None)
    }

    #[test]
    fn a_refused_new_version_of_a_deny_still_denies_its_whole_scope() {
        let c = client();
        push(&c, ADDRESS_TYPE, res(ADDRESS_TYPE, "d", workload(1)));
        let deny = |bad| policy("d", pb_sec::Action::Deny, "cluster.local/ns/demo/sa/bad", bad);
        push(&c, AUTHORIZATION_TYPE, res(AUTHORIZATION_TYPE, "demo/d", deny(false)));
        assert!(!decide_from(&c, "bad").allowed());
        assert!(decide_from(&c, "good").allowed());
        // A new version the proxy refuses: NACKed, not announced on reconnect, and enforced
        // as a DENY of everything in namespace demo.
        let ack = push(&c, AUTHORIZATION_TYPE, res(AUTHORIZATION_TYPE, "demo/d", deny(true)));
        assert!(ack.error_detail.unwrap().message.contains("demo/d:"));
        assert!(!c.status().types[AUTHORIZATION_TYPE].versions.contains_key("demo/d"));
        assert!(!decide_from(&c, "bad").allowed());
        assert!(!decide_from(&c, "good").allowed(), "the refused DENY must deny its whole scope");
        assert_eq!(c.metrics.policies_failed_closed.get(), 1);
        // A good version replaces the stand-in.
        push(&c, AUTHORIZATION_TYPE, res(AUTHORIZATION_TYPE, "demo/d", deny(false)));
        assert!(decide_from(&c, "good").allowed());
        assert_eq!(c.metrics.policies_failed_closed.get(), 0);
    }

    #[test]
    fn a_refused_only_allow_allows_nothing() {
        let c = client();
        push(&c, ADDRESS_TYPE, res(ADDRESS_TYPE, "d", workload(1)));
        let allow = policy("a", pb_sec::Action::Allow, "cluster.local/ns/demo/sa/good", true);
        let ack = push(&c, AUTHORIZATION_TYPE, res(AUTHORIZATION_TYPE, "demo/a", allow));
        assert!(ack.error_detail.is_some());
        assert!(
            matches!(decide_from(&c, "good"), crate::authz::Decision::NoAllowMatched),
            "a refused ALLOW exists and matches nothing"
        );
        assert_eq!(c.metrics.policies_failed_closed.get(), 1);
        // Its removal removes the stand-in.
        c.handle(DeltaDiscoveryResponse {
            type_url: AUTHORIZATION_TYPE.into(),
            removed_resources: vec!["demo/a".into()],
            ..Default::default()
        });
        assert!(decide_from(&c, "good").allowed());
        assert_eq!(c.metrics.policies_failed_closed.get(), 0);
    }

    #[test]
    fn a_refused_new_version_of_a_workload_keeps_the_old_one_denied_to_all() {
        let c = client();
        push(&c, ADDRESS_TYPE, res(ADDRESS_TYPE, "d", workload(1)));
        assert!(decide_from(&c, "good").allowed());
        let nack = push(&c, ADDRESS_TYPE, res(ADDRESS_TYPE, "d", workload(7)));
        assert!(nack.error_detail.unwrap().message.contains("tunnel_protocol 7"));
        let w = c.store.workload_by_uid("d").expect("the held version is kept");
        assert_eq!(w.ips, vec!["10.0.0.9".parse::<std::net::IpAddr>().unwrap()]);
        assert!(matches!(
            decide_from(&c, "good"),
            crate::authz::Decision::DestinationFailedClosed(_)
        ));
        assert_eq!(c.metrics.workloads_failed_closed.get(), 1);
        // A refused workload never held before is not added.
        let mut other = workload(7);
        other = {
            let mut a = pb::Address::decode(&other[..]).unwrap();
            if let Some(pb::address::Type::Workload(w)) = &mut a.r#type {
                w.uid = "new".into();
            }
            a.encode_to_vec()
        };
        push(&c, ADDRESS_TYPE, res(ADDRESS_TYPE, "new", other));
        assert!(c.store.workload_by_uid("new").is_none());
        push(&c, ADDRESS_TYPE, res(ADDRESS_TYPE, "d", workload(1)));
        assert!(decide_from(&c, "good").allowed());
        assert_eq!(c.metrics.workloads_failed_closed.get(), 0);
    }
}
