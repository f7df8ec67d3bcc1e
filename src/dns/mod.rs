//! The DNS proxy, as ztunnel's: a pod's DNS queries (captured from port 53 to 15053 in its
//! namespace) are answered from the mesh state when they name a mesh service — Kubernetes
//! services by full or short name, ServiceEntry hosts (also wildcard ones) with their
//! auto-allocated addresses — and forwarded to the node's resolvers otherwise. Messages are
//! hickory's (`hickory-proto`); forwarding and hostname workloads use hickory's resolver
//! ([`upstream`]).
//!
//! What is answered here (ztunnel's rules, see [`names`]):
//! - only A and AAAA; every other type is forwarded;
//! - a service with addresses answers its VIPs; one without (headless) its endpoints' addresses,
//!   one per endpoint; none of the asked family → NOERROR without records (authoritative);
//! - a service whose `ip_families` excludes the family, or IPv6 when the proxy has it off →
//!   NOERROR without records;
//! - a name found after taking a search domain off gets a CNAME to the shorter name first;
//! - records carry a 30 s TTL; local answers are authoritative, forwarded ones are not;
//! - an unparseable query gets FORMERR (one shorter than a DNS header gets nothing), a response
//!   sent as a query FORMERR, an opcode other than QUERY NOTIMP; a query from a source that is
//!   not a workload of this proxy SERVFAIL.

pub mod names;
pub mod server;
pub mod tools;
pub mod upstream;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use hickory_proto::op::{Edns, Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA, CNAME};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::state::{IpFamilies, Service, Store, Workload};
use names::{Alias, Domains};
pub use server::Clients;
pub use upstream::Upstream;

/// ztunnel's port for the DNS proxy.
pub const DNS_PORT: u16 = 15053;
/// TTL of the records answered from the mesh state.
pub const TTL_SECS: u32 = 30;

/// The DNS proxy's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnsConfig {
    /// `DNS_CAPTURE` / `ISTIO_META_DNS_CAPTURE` (default on, as ztunnel).
    pub enabled: bool,
    /// `DNS_PROXY_ADDR`: where it listens (UDP and TCP), in each pod's namespace in in-pod mode,
    /// in the proxy's own otherwise.
    pub addr: SocketAddr,
    /// Upstream resolvers; empty: `/etc/resolv.conf`'s.
    pub upstreams: Vec<SocketAddr>,
    /// `CLUSTER_DOMAIN`.
    pub cluster_domain: String,
    /// `DNS_PREFERRED_NAMESPACE`: among services sharing a hostname, the one to answer when the
    /// client's namespace has none.
    pub preferred_namespace: Option<String>,
    /// Whether AAAA records are answered from the mesh state.
    pub ipv6: bool,
}

impl Default for DnsConfig {
    fn default() -> Self {
        DnsConfig {
            enabled: true,
            addr: SocketAddr::from(([127, 0, 0, 1], DNS_PORT)),
            upstreams: Vec::new(),
            cluster_domain: "cluster.local".into(),
            preferred_namespace: None,
            ipv6: true,
        }
    }
}

/// The transport a query came over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Udp,
    Tcp,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DnsLabels {
    pub request_query_type: String,
    pub request_protocol: &'static str,
    pub source_canonical_service: String,
    pub source_canonical_revision: String,
}

/// ztunnel's DNS series (`istio_dns_*`) and the proxy's own (`mbtunnel_dns_*`).
#[derive(Clone)]
pub struct DnsMetrics {
    pub requests: Family<DnsLabels, Counter>,
    pub upstream_requests: Family<DnsLabels, Counter>,
    pub upstream_failures: Family<DnsLabels, Counter>,
    pub upstream_duration: Family<DnsLabels, Histogram>,
    /// Packets that were not a DNS query (answered FORMERR, or dropped when too short).
    pub malformed: Counter,
}

impl DnsMetrics {
    pub fn register(registry: &mut Registry) -> DnsMetrics {
        let m = DnsMetrics {
            requests: Family::default(),
            upstream_requests: Family::default(),
            upstream_failures: Family::default(),
            upstream_duration: Family::new_with_constructor(|| {
                Histogram::new([0.0005, 0.001, 0.01, 0.1, 1.0, 5.0])
            }),
            malformed: Counter::default(),
        };
        let istio = registry.sub_registry_with_prefix("istio");
        istio.register(
            "dns_requests",
            "Total number of DNS requests (unstable)",
            m.requests.clone(),
        );
        istio.register(
            "dns_upstream_requests",
            "Total number of DNS requests forwarded to upstream (unstable)",
            m.upstream_requests.clone(),
        );
        istio.register(
            "dns_upstream_failures",
            "Total number of DNS requests that failed to forward upstream (unstable)",
            m.upstream_failures.clone(),
        );
        istio.register_with_unit(
            "dns_upstream_request_duration",
            "Total time in seconds Istio takes to get DNS response from upstream (unstable)",
            Unit::Seconds,
            m.upstream_duration.clone(),
        );
        registry.sub_registry_with_prefix("mbtunnel").register(
            "dns_malformed",
            "Packets to the DNS proxy that were not a DNS query (answered FORMERR or dropped)",
            m.malformed.clone(),
        );
        m
    }
}

/// Answers DNS queries for this proxy's workloads.
pub struct Dns {
    state: Arc<Store>,
    upstream: Arc<Upstream>,
    domains: Domains,
    preferred: Option<String>,
    ipv6: bool,
    /// Where it listens (in each pod in in-pod mode).
    pub addr: SocketAddr,
    pub metrics: DnsMetrics,
}

/// What a query resolved to, before it is written.
struct Reply {
    code: ResponseCode,
    answers: Vec<Record>,
    authoritative: bool,
}

impl Reply {
    fn code(code: ResponseCode) -> Reply {
        Reply { code, answers: Vec::new(), authoritative: false }
    }
}

impl Dns {
    pub fn new(
        cfg: &DnsConfig,
        state: Arc<Store>,
        upstream: Arc<Upstream>,
        metrics: DnsMetrics,
    ) -> Result<Dns, String> {
        Ok(Dns {
            state,
            upstream,
            domains: Domains::new(&cfg.cluster_domain)?,
            preferred: cfg.preferred_namespace.clone(),
            ipv6: cfg.ipv6,
            addr: cfg.addr,
            metrics,
        })
    }

    /// The answer to one query packet from `client` (`None`: not a workload of this proxy), or
    /// nothing when the packet is too short to answer. A UDP answer larger than the client
    /// accepts is sent truncated (TC set, no records) so that it retries over TCP.
    pub async fn answer(
        &self,
        client: Option<&Workload>,
        packet: &[u8],
        transport: Transport,
    ) -> Option<Vec<u8>> {
        let req = match Message::from_vec(packet) {
            Ok(m) => m,
            Err(e) => {
                self.metrics.malformed.inc();
                tracing::debug!(error = %e, len = packet.len(), "DNS: unparseable query");
                return formerr(packet);
            }
        };
        if req.message_type() != MessageType::Query || req.queries().len() != 1 {
            self.metrics.malformed.inc();
            return Some(error(&req, ResponseCode::FormErr));
        }
        if req.op_code() != OpCode::Query {
            return Some(error(&req, ResponseCode::NotImp));
        }
        let q = &req.queries()[0];
        let labels = labels(q.query_type(), transport, client);
        self.metrics.requests.get_or_create(&labels).inc();
        let reply = match client {
            None => {
                tracing::debug!("DNS: query from a source that is not a workload here");
                Reply::code(ResponseCode::ServFail)
            }
            Some(c) => match self.local(c, q.name(), q.query_type()) {
                Some(r) => r,
                None => self.forward(q.name(), q.query_type(), &labels).await,
            },
        };
        let (src_workload, src_namespace) = match client {
            Some(w) => (w.name.as_str(), w.namespace.as_str()),
            None => ("unknown", "unknown"),
        };
        tracing::event!(target: "dns", tracing::Level::DEBUG, src.workload = src_workload, src.namespace = src_namespace,
            query = %q.query_type(), domain = %q.name(), result = %reply.code,
            answers = reply.answers.len(), authoritative = reply.authoritative, "dns request");
        let max = match transport {
            Transport::Tcp => usize::from(u16::MAX),
            Transport::Udp => {
                req.extensions().as_ref().map_or(512, |e| e.max_payload().max(512)).into()
            }
        };
        let mut resp = response(&req, reply);
        let bytes = resp.to_vec().ok()?;
        if bytes.len() <= max {
            return Some(bytes);
        }
        resp.take_answers();
        resp.set_truncated(true);
        resp.to_vec().ok()
    }

    /// The answer from the mesh state, or `None` to forward: the query's type is not A/AAAA, or
    /// it names no mesh service.
    fn local(&self, client: &Workload, name: &Name, rtype: RecordType) -> Option<Reply> {
        if !matches!(rtype, RecordType::A | RecordType::AAAA) {
            return None;
        }
        let (svc, found, alias) = self.find(client, name)?;
        let mut reply =
            Reply { code: ResponseCode::NoError, answers: Vec::new(), authoritative: true };
        let v6 = rtype == RecordType::AAAA;
        let family_ok = (!v6 || self.ipv6)
            && match svc.ip_families {
                IpFamilies::Ipv4Only => !v6,
                IpFamilies::Ipv6Only => v6,
                _ => true,
            };
        if !family_ok {
            return Some(reply);
        }
        let mut addrs = self.addresses(client, &svc, v6);
        if addrs.is_empty() {
            return Some(reply);
        }
        shuffle(&mut addrs);
        let mut owner = name.clone();
        if let Some(short) = alias.stripped.filter(|_| !found.is_wildcard()) {
            reply.answers.push(Record::from_rdata(
                name.clone(),
                TTL_SECS,
                RData::CNAME(CNAME(short.clone())),
            ));
            owner = short;
        }
        for ip in addrs {
            let rdata = match ip {
                IpAddr::V4(a) => RData::A(A(a)),
                IpAddr::V6(a) => RData::AAAA(AAAA(a)),
            };
            reply.answers.push(Record::from_rdata(owner.clone(), TTL_SECS, rdata));
        }
        Some(reply)
    }

    /// The service a client means by `name`: each alias, then its wildcards, against the
    /// services' hostnames; a service without addresses counts only when it is a Kubernetes
    /// service (a headless one). Returns the service, the name that matched and the alias.
    fn find(&self, client: &Workload, name: &Name) -> Option<(Arc<Service>, Name, Alias)> {
        // The name as asked is the first alias and its own first candidate: a full name is
        // found without building the others.
        if let Some(svc) = self.service_named(client, name) {
            return Some((svc, name.clone(), Alias { name: name.clone(), stripped: None }));
        }
        for alias in self.domains.aliases(&client.namespace, name) {
            for candidate in names::wildcards(&alias.name) {
                if let Some(svc) = self.service_named(client, &candidate) {
                    return Some((svc, candidate, alias));
                }
            }
        }
        None
    }

    /// The service whose hostname is `name` for this client, if it may be answered.
    fn service_named(&self, client: &Workload, name: &Name) -> Option<Arc<Service>> {
        let host = names::host_key(name);
        let svc =
            self.state.service_for_host(&host, &client.namespace, self.preferred.as_deref())?;
        (!svc.vips.is_empty() || self.domains.is_kube_service(&host)).then_some(svc)
    }

    /// The service's VIPs of the family; without VIPs, one address of the family per endpoint.
    fn addresses(&self, client: &Workload, svc: &Service, v6: bool) -> Vec<IpAddr> {
        let _ = client; // VIPs carry no network here: every VIP is the client's network's.
        if !svc.vips.is_empty() {
            return svc.vips.iter().copied().filter(|ip| ip.is_ipv6() == v6).collect();
        }
        self.state
            .endpoints_of(svc)
            .iter()
            .filter_map(|w| w.ips.iter().copied().find(|ip| ip.is_ipv6() == v6))
            .collect()
    }

    async fn forward(&self, name: &Name, rtype: RecordType, labels: &DnsLabels) -> Reply {
        self.metrics.upstream_requests.get_or_create(labels).inc();
        let start = Instant::now();
        let r = self.upstream.forward(name, rtype).await;
        self.metrics.upstream_duration.get_or_create(labels).observe(start.elapsed().as_secs_f64());
        match r {
            Ok(answers) => Reply { code: ResponseCode::NoError, answers, authoritative: false },
            Err(code) => {
                // As ztunnel counts it: every lookup that did not return records, NXDOMAIN too.
                self.metrics.upstream_failures.get_or_create(labels).inc();
                Reply::code(code)
            }
        }
    }
}

fn labels(rtype: RecordType, transport: Transport, client: Option<&Workload>) -> DnsLabels {
    let or_unknown = |s: Option<&str>| match s {
        Some(s) if !s.is_empty() => s.to_string(),
        _ => "unknown".to_string(),
    };
    DnsLabels {
        request_query_type: rtype.to_string().to_lowercase(),
        request_protocol: match transport {
            Transport::Udp => "udp",
            Transport::Tcp => "tcp",
        },
        source_canonical_service: or_unknown(client.map(|w| w.canonical_name.as_str())),
        source_canonical_revision: or_unknown(client.map(|w| w.canonical_revision.as_str())),
    }
}

/// The response header for `req`: its id, opcode, RD and CD, its question; RA set (the proxy
/// recurses); EDNS answered when asked.
fn response(req: &Message, reply: Reply) -> Message {
    let mut m = Message::new();
    m.set_id(req.id())
        .set_message_type(MessageType::Response)
        .set_op_code(req.op_code())
        .set_recursion_desired(req.recursion_desired())
        .set_checking_disabled(req.checking_disabled())
        .set_recursion_available(true)
        .set_authoritative(reply.authoritative)
        .set_response_code(reply.code);
    m.add_queries(req.queries().iter().cloned());
    m.add_answers(reply.answers);
    if let Some(e) = req.extensions() {
        let mut out = Edns::new();
        out.set_max_payload(e.max_payload().max(512));
        out.set_version(e.version());
        out.set_dnssec_ok(e.flags().dnssec_ok);
        m.set_edns(out);
    }
    m
}

fn error(req: &Message, code: ResponseCode) -> Vec<u8> {
    let mut m = response(req, Reply::code(code));
    m.set_recursion_available(true);
    m.to_vec().unwrap_or_else(|_| header_only(req.id(), code))
}

/// FORMERR for a packet hickory could not parse: its id from the first two bytes, nothing else
/// (the question may be what is broken). Nothing for a packet shorter than a header.
fn formerr(packet: &[u8]) -> Option<Vec<u8>> {
    if packet.len() < 12 {
        return None;
    }
    Some(header_only(u16::from_be_bytes([packet[0], packet[1]]), ResponseCode::FormErr))
}

fn header_only(id: u16, code: ResponseCode) -> Vec<u8> {
    let mut m = Message::error_msg(id, OpCode::Query, code);
    m.set_recursion_available(true);
    m.to_vec().expect("a header encodes")
}

/// Rotates answers by a counter (ztunnel shuffles them) so that clients taking the first spread
/// over them.
fn shuffle(v: &mut [IpAddr]) {
    static TURN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    if !v.is_empty() {
        v.rotate_left(TURN.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % v.len());
    }
}

#[cfg(test)]
mod tests;
