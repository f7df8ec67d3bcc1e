//! A control plane of our own for tests: delta ADS and Istio's certificate service over TLS
//! (tonic + BoringSSL), with a root → intermediate CA, resources pushed live by the test, and
//! switches for outages, token checks and holding back a type.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use boring::ssl::{SslAcceptor, SslMethod};
use mbtunnel::config::KeyAlgorithm;
use mbtunnel::identity::ca::{generate_key, BoringKey};
use mbtunnel::proto::ca::istio_certificate_service_server::{
    IstioCertificateService, IstioCertificateServiceServer,
};
use mbtunnel::proto::ca::{IstioCertificateRequest, IstioCertificateResponse};
use mbtunnel::proto::discovery::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use mbtunnel::proto::discovery::{DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource};
use mbtunnel::xds::{ADDRESS_TYPE, AUTHORIZATION_TYPE};
use prost::Message;
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, IsCa, Issuer, KeyUsagePurpose, SanType,
};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

pub const TOKEN: &str = "test-token";

/// What the control plane saw, for assertions.
#[derive(Clone, Debug)]
pub enum Seen {
    /// A stream's first request of a type, with the versions the client said it held.
    Initial {
        type_url: String,
        versions: BTreeMap<String, String>,
        has_node: bool,
    },
    Ack {
        type_url: String,
        nonce: String,
    },
    Nack {
        type_url: String,
        nonce: String,
        message: String,
    },
    Unauthenticated,
    /// A CSR: the identity in its SAN and the impersonated identity in its metadata.
    Csr {
        san: String,
        impersonated: String,
    },
}

#[derive(Clone)]
struct Push {
    type_url: String,
    upserts: Vec<Resource>,
    removed: Vec<String>,
}

pub struct Shared {
    resources: Mutex<BTreeMap<String, BTreeMap<String, Resource>>>,
    pub seen: Mutex<Vec<Seen>>,
    /// Control plane down: streams end, calls are refused.
    pub down: std::sync::atomic::AtomicBool,
    /// CA down only.
    pub ca_down: std::sync::atomic::AtomicBool,
    /// Certificate requests that passed the token check (answered or refused as CA down).
    pub ca_requests: std::sync::atomic::AtomicUsize,
    /// Authorization responses held back until released.
    pub hold_policies: std::sync::atomic::AtomicBool,
    pushes: broadcast::Sender<Push>,
    nonce: std::sync::atomic::AtomicU64,
    version: std::sync::atomic::AtomicU64,
    issuer: Issuer<'static, BoringKey>,
    pub root_pem: String,
    intermediate_pem: String,
}

pub struct ControlPlane {
    pub addr: SocketAddr,
    pub shared: Arc<Shared>,
    /// PEM of the root that verifies both the server and the workload certificates.
    pub root_pem: String,
}

fn serial() -> rcgen::SerialNumber {
    let mut b = [0u8; 16];
    boring::rand::rand_bytes(&mut b).unwrap();
    b[0] = (b[0] & 0x7f) | 1;
    rcgen::SerialNumber::from_slice(&b)
}

fn ca_params(cn: &str) -> CertificateParams {
    let mut p = CertificateParams::default();
    p.serial_number = Some(serial());
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    p
}

impl ControlPlane {
    pub async fn start() -> ControlPlane {
        let root_key = BoringKey::new(generate_key(KeyAlgorithm::Rsa2048).unwrap()).unwrap();
        let root = ca_params("test root").self_signed(&root_key).unwrap();
        let root_issuer = Issuer::new(ca_params("test root"), root_key);
        let int_key = BoringKey::new(generate_key(KeyAlgorithm::EcdsaP256).unwrap()).unwrap();
        let int_cert = ca_params("test intermediate").signed_by(&int_key, &root_issuer).unwrap();
        let issuer = Issuer::new(ca_params("test intermediate"), int_key);
        // The server certificate: for localhost and 127.0.0.1, from the intermediate.
        let srv_key = BoringKey::new(generate_key(KeyAlgorithm::EcdsaP256).unwrap()).unwrap();
        let mut sp = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        sp.subject_alt_names.push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
        sp.serial_number = Some(serial());
        let srv_cert = sp.signed_by(&srv_key, &issuer).unwrap();
        let mut acc = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls()).unwrap();
        acc.set_certificate(&boring::x509::X509::from_der(srv_cert.der()).unwrap()).unwrap();
        acc.add_extra_chain_cert(boring::x509::X509::from_der(int_cert.der()).unwrap()).unwrap();
        acc.set_private_key(srv_key.pkey()).unwrap();
        acc.set_alpn_select_callback(|_, client| {
            boring::ssl::select_next_proto(b"\x02h2", client).ok_or(boring::ssl::AlpnError::NOACK)
        });
        let acceptor = Arc::new(acc.build());
        let shared = Arc::new(Shared {
            resources: Mutex::new(
                [
                    (ADDRESS_TYPE.to_string(), BTreeMap::new()),
                    (AUTHORIZATION_TYPE.to_string(), BTreeMap::new()),
                ]
                .into(),
            ),
            seen: Mutex::new(Vec::new()),
            down: Default::default(),
            ca_down: Default::default(),
            ca_requests: Default::default(),
            hold_policies: Default::default(),
            pushes: broadcast::channel(64).0,
            nonce: Default::default(),
            version: Default::default(),
            issuer,
            root_pem: root.pem(),
            intermediate_pem: int_cert.pem(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let svc = Svc(shared.clone());
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else { return };
                let (acceptor, svc) = (acceptor.clone(), svc.clone());
                tokio::spawn(async move {
                    let Ok(tls) = tokio_boring::accept(&acceptor, tcp).await else { return };
                    let ads = AggregatedDiscoveryServiceServer::new(svc.clone());
                    let ca = IstioCertificateServiceServer::new(svc);
                    // Two gRPC services on one connection, dispatched by path.
                    let route = hyper::service::service_fn(
                        move |req: http::Request<hyper::body::Incoming>| {
                            let (mut ads, mut ca) = (ads.clone(), ca.clone());
                            async move {
                                if req.uri().path().starts_with("/envoy.") {
                                    tower::Service::call(&mut ads, req).await
                                } else {
                                    tower::Service::call(&mut ca, req).await
                                }
                            }
                        },
                    );
                    let _ = hyper::server::conn::http2::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), route)
                    .await;
                });
            }
        });
        let root_pem = shared.root_pem.clone();
        ControlPlane { addr, shared, root_pem }
    }

    pub fn url(&self) -> String {
        format!("https://localhost:{}", self.addr.port())
    }

    fn next_version(&self) -> String {
        self.shared.version.fetch_add(1, std::sync::atomic::Ordering::SeqCst).to_string()
    }

    /// Sets (and pushes) resources of `type_url`: `(name, payload type, encoded payload)`.
    pub fn upsert(&self, type_url: &str, items: Vec<(String, Vec<u8>)>) {
        let upserts: Vec<Resource> = items
            .into_iter()
            .map(|(name, value)| Resource {
                version: self.next_version(),
                resource: Some(prost_types::Any { type_url: type_url.to_string(), value }),
                name,
                aliases: vec![],
            })
            .collect();
        let mut all = self.shared.resources.lock().unwrap();
        for r in &upserts {
            all.get_mut(type_url).unwrap().insert(r.name.clone(), r.clone());
        }
        drop(all);
        let _ =
            self.shared.pushes.send(Push { type_url: type_url.into(), upserts, removed: vec![] });
    }

    pub fn remove(&self, type_url: &str, names: &[&str], push: bool) {
        let mut all = self.shared.resources.lock().unwrap();
        for n in names {
            all.get_mut(type_url).unwrap().remove(*n);
        }
        drop(all);
        if push {
            let removed = names.iter().map(|s| s.to_string()).collect();
            let _ = self.shared.pushes.send(Push {
                type_url: type_url.into(),
                upserts: vec![],
                removed,
            });
        }
    }

    /// Releases held-back authorization responses.
    pub fn release_policies(&self) {
        self.shared.hold_policies.store(false, std::sync::atomic::Ordering::SeqCst);
        let _ = self.shared.pushes.send(Push {
            type_url: AUTHORIZATION_TYPE.into(),
            upserts: vec![],
            removed: vec![],
        });
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.shared.seen.lock().unwrap().clone()
    }

    pub fn set_down(&self, down: bool) {
        self.shared.down.store(down, std::sync::atomic::Ordering::SeqCst);
        // Wake every stream so that it notices.
        let _ = self.shared.pushes.send(Push {
            type_url: String::new(),
            upserts: vec![],
            removed: vec![],
        });
    }
}

#[derive(Clone)]
struct Svc(Arc<Shared>);

fn check_token<T>(s: &Shared, req: &Request<T>) -> Result<(), Status> {
    use std::sync::atomic::Ordering::SeqCst;
    if s.down.load(SeqCst) {
        return Err(Status::unavailable("control plane down"));
    }
    let ok = req.metadata().get("authorization").and_then(|v| v.to_str().ok())
        == Some(&format!("Bearer {TOKEN}"))
        && req.metadata().get("clusterid").is_some();
    if !ok {
        s.seen.lock().unwrap().push(Seen::Unauthenticated);
        return Err(Status::unauthenticated("bad token"));
    }
    Ok(())
}

type RespStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Svc {
    type DeltaAggregatedResourcesStream = RespStream;

    async fn delta_aggregated_resources(
        &self,
        req: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<RespStream>, Status> {
        check_token(&self.0, &req)?;
        let shared = self.0.clone();
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let mut pushes = shared.pushes.subscribe();
        tokio::spawn(async move {
            use std::sync::atomic::Ordering::SeqCst;
            let mut subscribed: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
            let mut pending_policy_initial = false;
            let send = |type_url: &str, upserts: Vec<Resource>, removed: Vec<String>| {
                let nonce = shared.nonce.fetch_add(1, SeqCst).to_string();
                DeltaDiscoveryResponse {
                    system_version_info: "test".into(),
                    resources: upserts,
                    type_url: type_url.into(),
                    nonce,
                    removed_resources: removed,
                }
            };
            let full = |type_url: &str, held: &BTreeMap<String, String>| {
                let all = shared.resources.lock().unwrap();
                let have = &all[type_url];
                let removed =
                    held.keys().filter(|k| !have.contains_key(*k)).cloned().collect::<Vec<_>>();
                (have.values().cloned().collect::<Vec<_>>(), removed)
            };
            loop {
                tokio::select! {
                    m = inbound.message() => {
                        let Ok(Some(m)) = m else { return };
                        if !subscribed.contains_key(&m.type_url) && m.response_nonce.is_empty() {
                            shared.seen.lock().unwrap().push(Seen::Initial {
                                type_url: m.type_url.clone(),
                                versions: m.initial_resource_versions.clone().into_iter().collect(),
                                has_node: m.node.is_some(),
                            });
                            subscribed.insert(m.type_url.clone(), m.initial_resource_versions.clone().into_iter().collect());
                            if m.type_url == AUTHORIZATION_TYPE && shared.hold_policies.load(SeqCst) {
                                pending_policy_initial = true;
                                continue;
                            }
                            let (up, rm) = full(&m.type_url, &subscribed[&m.type_url]);
                            if tx.send(Ok(send(&m.type_url, up, rm))).await.is_err() { return }
                        } else if let Some(e) = m.error_detail {
                            shared.seen.lock().unwrap().push(Seen::Nack { type_url: m.type_url, nonce: m.response_nonce, message: e.message });
                        } else {
                            shared.seen.lock().unwrap().push(Seen::Ack { type_url: m.type_url, nonce: m.response_nonce });
                        }
                    }
                    p = pushes.recv() => {
                        let Ok(p) = p else { return };
                        if shared.down.load(SeqCst) {
                            let _ = tx.send(Err(Status::unavailable("control plane restarting"))).await;
                            return;
                        }
                        if pending_policy_initial && !shared.hold_policies.load(SeqCst) {
                            pending_policy_initial = false;
                            let (up, rm) = full(AUTHORIZATION_TYPE, &subscribed[AUTHORIZATION_TYPE]);
                            if tx.send(Ok(send(AUTHORIZATION_TYPE, up, rm))).await.is_err() { return }
                        }
                        let wanted = subscribed.contains_key(&p.type_url)
                            && !(p.upserts.is_empty() && p.removed.is_empty());
                        if wanted && tx.send(Ok(send(&p.type_url, p.upserts, p.removed))).await.is_err() {
                            return;
                        }
                    }
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

#[tonic::async_trait]
impl IstioCertificateService for Svc {
    async fn create_certificate(
        &self,
        req: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        check_token(&self.0, &req)?;
        self.0.ca_requests.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if self.0.ca_down.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Status::unavailable("CA down"));
        }
        let r = req.into_inner();
        let imp = r
            .metadata
            .as_ref()
            .and_then(|m| m.fields.get("ImpersonatedIdentity"))
            .and_then(|v| match &v.kind {
                Some(prost_types::value::Kind::StringValue(s)) => Some(s.clone()),
                _ => None,
            })
            .unwrap_or_default();
        let mut csr = CertificateSigningRequestParams::from_pem(&r.csr)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let san = match csr.params.subject_alt_names.first() {
            Some(SanType::URI(u)) => u.as_str().to_string(),
            _ => return Err(Status::invalid_argument("no URI SAN")),
        };
        self.0.seen.lock().unwrap().push(Seen::Csr { san: san.clone(), impersonated: imp.clone() });
        if san != imp {
            return Err(Status::permission_denied("SAN is not the impersonated identity"));
        }
        let now = time::OffsetDateTime::now_utc();
        csr.params.not_before = now - time::Duration::minutes(1);
        csr.params.not_after = now + time::Duration::seconds(r.validity_duration);
        csr.params.serial_number = Some(serial());
        let leaf = csr.signed_by(&self.0.issuer).map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(IstioCertificateResponse {
            cert_chain: vec![leaf.pem(), self.0.intermediate_pem.clone(), self.0.root_pem.clone()],
        }))
    }
}

/// An encoded `istio.workload.Address` holding a workload.
pub fn workload(
    uid: &str,
    name: &str,
    sa: &str,
    ip: std::net::IpAddr,
    node: &str,
    services: &[(&str, u32)],
) -> (String, Vec<u8>) {
    use mbtunnel::proto::workload as pb;
    let addr = match ip {
        std::net::IpAddr::V4(v) => v.octets().to_vec(),
        std::net::IpAddr::V6(v) => v.octets().to_vec(),
    };
    let w = pb::Workload {
        uid: uid.into(),
        name: name.into(),
        namespace: "demo".into(),
        addresses: vec![addr],
        tunnel_protocol: pb::TunnelProtocol::Hbone as i32,
        service_account: sa.into(),
        node: node.into(),
        canonical_name: name.into(),
        workload_name: name.into(),
        services: services
            .iter()
            .map(|(s, p)| {
                (
                    s.to_string(),
                    pb::PortList { ports: vec![pb::Port { service_port: *p, target_port: *p }] },
                )
            })
            .collect(),
        ..Default::default()
    };
    let a = pb::Address { r#type: Some(pb::address::Type::Workload(w)) };
    (uid.to_string(), a.encode_to_vec())
}

/// An encoded service with one VIP and one port.
pub fn service(name: &str, vip: std::net::IpAddr, port: u32) -> (String, Vec<u8>) {
    use mbtunnel::proto::workload as pb;
    let std::net::IpAddr::V4(v) = vip else { panic!("v4 only") };
    let host = format!("{name}.demo.svc.cluster.local");
    let s = pb::Service {
        name: name.into(),
        namespace: "demo".into(),
        hostname: host.clone(),
        addresses: vec![pb::NetworkAddress {
            network: String::new(),
            address: v.octets().to_vec(),
        }],
        ports: vec![pb::Port { service_port: port, target_port: port }],
        ..Default::default()
    };
    let a = pb::Address { r#type: Some(pb::address::Type::Service(s)) };
    (format!("demo/{host}"), a.encode_to_vec())
}

/// An encoded `istio.security.Authorization` with one rule of one clause of one match whose
/// principals are `principals` (or, when `strict`, a DENY of every peer without a principal, as
/// istiod derives from PeerAuthentication STRICT).
pub fn policy(
    name: &str,
    ns: &str,
    deny: bool,
    principals: &[&str],
    strict: bool,
) -> (String, Vec<u8>) {
    use mbtunnel::proto::security as pb;
    let presence = pb::StringMatch { match_type: Some(pb::string_match::MatchType::Presence(())) };
    let m = if strict {
        pb::Match { not_principals: vec![presence], ..Default::default() }
    } else {
        pb::Match {
            principals: principals
                .iter()
                .map(|p| pb::StringMatch {
                    match_type: Some(pb::string_match::MatchType::Exact(p.to_string())),
                })
                .collect(),
            ..Default::default()
        }
    };
    let a = pb::Authorization {
        name: name.into(),
        namespace: ns.into(),
        scope: pb::Scope::Namespace as i32,
        action: if deny { pb::Action::Deny } else { pb::Action::Allow } as i32,
        rules: vec![pb::Rule { clauses: vec![pb::Clause { matches: vec![m] }] }],
        dry_run: false,
    };
    (format!("{ns}/{name}"), a.encode_to_vec())
}

use super::{ip, pattern};
use mbtunnel::config::{env, Config};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// A node proxy's settings as a DaemonSet gives them: listener addresses plus the control plane's
/// environment. `ca_dir` points at a directory that must never be created.
pub fn node_config(
    net: u8,
    node: &str,
    cp: &ControlPlane,
    token: &str,
    never: &std::path::Path,
) -> Config {
    let me = if node == "node-a" { 2 } else { 3 };
    let mut c = Config {
        outbound_addr: if node == "node-a" {
            SocketAddr::new(ip(net, 50), 8080)
        } else {
            SocketAddr::new(ip(net, 3), 15001)
        },
        ca_dir: never.to_path_buf(),
        ..Config::default()
    };
    for (field, port) in [
        (&mut c.inbound_addr, 15008),
        (&mut c.inbound_plaintext_addr, 15006),
        (&mut c.metrics_addr, 15020),
        (&mut c.readiness_addr, 15021),
        (&mut c.admin_addr, 15000),
    ] {
        *field = SocketAddr::new(ip(net, me), port);
    }
    let root = cp.root_pem.clone();
    let url = cp.url();
    c.apply_env(|k| match k {
        env::XDS_ADDRESS => Some(url.clone()),
        env::XDS_ROOT_CA => Some(root.clone()),
        env::CA_ROOT_CA => Some(root.clone()),
        env::AUTH_TOKEN => Some(format!("{token}\n")),
        env::NODE_NAME => Some(node.to_string()),
        env::POD_NAME => Some(format!("mbtunnel-{node}")),
        env::POD_NAMESPACE => Some("istio-system".into()),
        env::INSTANCE_IP => Some(ip(net, me).to_string()),
        _ => None,
    })
    .unwrap();
    c
}

pub async fn from(net: u8, host: u8) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::new(ip(net, host), 0)).unwrap();
    s.connect(SocketAddr::new(ip(net, 50), 8080)).await.expect("connect to VIP")
}

/// One echo round trip from `host` through A; true when the bytes came back, false when the
/// connection was refused or cut.
pub async fn echo_ok(net: u8, host: u8) -> bool {
    let data = pattern(4096, host as u32);
    // A refusal is a reset, which may arrive before the connect completes on this side.
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind(SocketAddr::new(ip(net, host), 0)).unwrap();
    let s = match sock.connect(SocketAddr::new(ip(net, 50), 8080)).await {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return false,
        Err(e) => panic!("connect to VIP: {e}"),
    };
    let (mut r, mut w) = s.into_split();
    let sent = data.clone();
    let writer = tokio::spawn(async move {
        let _ = w.write_all(&sent).await;
        let _ = w.shutdown().await;
    });
    let mut back = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), r.read_to_end(&mut back)).await;
    let _ = writer.await;
    matches!(read, Ok(Ok(_))) && back == data
}

/// Starts node B then node A against `cp` (see `node_config`) and waits until both are ready.
pub async fn start_pair(
    net: u8,
    cp: &ControlPlane,
    never: &std::path::Path,
) -> (mbtunnel::app::Running, mbtunnel::app::Running) {
    let b = mbtunnel::app::start(node_config(net, "node-b", cp, TOKEN, never), None)
        .await
        .expect("start B");
    let a = mbtunnel::app::start(node_config(net, "node-a", cp, TOKEN, never), None)
        .await
        .expect("start A");
    let t = Duration::from_secs(20);
    assert!(a.wait_ready(t).await && b.wait_ready(t).await, "not ready: {:?}", cp.seen());
    (a, b)
}
