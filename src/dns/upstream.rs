//! The resolvers behind the proxy: what the mesh does not answer is asked of them, and hostname
//! workloads are resolved through them. hickory's resolver does the work (UDP with TCP on
//! truncation, retries across servers, a cache that honours each record's TTL); the servers are
//! the node's (`/etc/resolv.conf`) unless the configuration names others.
#![forbid(unsafe_code)]

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use hickory_proto::op::ResponseCode;
use hickory_proto::rr::{Name, Record, RecordType};
use hickory_proto::xfer::Protocol;
use hickory_resolver::config::{
    LookupIpStrategy, NameServerConfig, NameServerConfigGroup, ResolverConfig, ResolverOpts,
};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::{ResolveError, TokioResolver};

/// How long one upstream attempt waits (hickory's default is 5 s; a pod's own resolver gives up
/// after 5 s per try, so an answer after that is wasted).
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);

pub struct Upstream {
    /// `Err`: why there is none (every forward then fails with SERVFAIL).
    resolver: Result<TokioResolver, String>,
    servers: Vec<SocketAddr>,
}

impl Upstream {
    /// `servers` empty: the node's resolvers from `/etc/resolv.conf`. Without any, it is built
    /// anyway (with a warning): mesh names are still answered, the rest fails.
    pub fn new(servers: &[SocketAddr]) -> Upstream {
        match Self::build(servers) {
            Ok((resolver, servers)) => {
                tracing::info!(?servers, "upstream DNS resolvers");
                Upstream { resolver: Ok(resolver), servers }
            }
            Err(e) => {
                tracing::warn!(error = %e, "no upstream DNS resolver: names outside the mesh and hostname workloads will not resolve");
                Upstream { resolver: Err(e), servers: Vec::new() }
            }
        }
    }

    /// No resolver: every forward fails at once with SERVFAIL (fuzzing, benches of the local
    /// path).
    pub fn none(why: &str) -> Upstream {
        Upstream { resolver: Err(why.to_string()), servers: Vec::new() }
    }

    fn build(servers: &[SocketAddr]) -> Result<(TokioResolver, Vec<SocketAddr>), String> {
        let (group, mut opts) = if servers.is_empty() {
            let (cfg, opts) = hickory_resolver::system_conf::read_system_conf()
                .map_err(|e| format!("reading /etc/resolv.conf: {e}"))?;
            (NameServerConfigGroup::from(cfg.name_servers().to_vec()), opts)
        } else {
            let mut g = NameServerConfigGroup::new();
            for s in servers {
                g.push(NameServerConfig::new(*s, Protocol::Udp));
                g.push(NameServerConfig::new(*s, Protocol::Tcp));
            }
            (g, ResolverOpts::default())
        };
        if group.is_empty() {
            return Err("no upstream DNS servers (none in /etc/resolv.conf)".into());
        }
        let addrs: Vec<SocketAddr> = {
            let mut v: Vec<SocketAddr> = group.iter().map(|s| s.socket_addr).collect();
            v.dedup();
            v
        };
        // Names arrive fully qualified from the wire: no search list, no ndots rule.
        let cfg = ResolverConfig::from_parts(None, vec![], group);
        opts.cache_size = 4096;
        opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
        opts.timeout = ATTEMPT_TIMEOUT;
        opts.ndots = 0;
        let mut b = TokioResolver::builder_with_config(cfg, TokioConnectionProvider::default());
        *b.options_mut() = opts;
        Ok((b.build(), addrs))
    }

    pub fn servers(&self) -> &[SocketAddr] {
        &self.servers
    }

    /// Asks the upstream for `name`/`rtype`. `Err` carries the code to answer with: NXDOMAIN,
    /// NOERROR for a name without records of the type, SERVFAIL when no server answered.
    pub async fn forward(
        &self,
        name: &Name,
        rtype: RecordType,
    ) -> Result<Vec<Record>, ResponseCode> {
        let Ok(r) = &self.resolver else { return Err(ResponseCode::ServFail) };
        match r.lookup(name.clone(), rtype).await {
            Ok(l) => Ok(l.records().to_vec()),
            Err(e) => Err(code_of(&e)),
        }
    }

    /// The addresses of `host` (cached for their TTL).
    pub async fn lookup_ip(&self, host: &str) -> Result<Vec<IpAddr>, String> {
        let mut name =
            Name::from_utf8(host).map_err(|e| format!("'{host}' is not a DNS name: {e}"))?;
        name.set_fqdn(true);
        let r = self.resolver.as_ref().map_err(|e| e.clone())?;
        match r.lookup_ip(name).await {
            Ok(l) => Ok(l.iter().collect()),
            Err(e) => Err(e.to_string()),
        }
    }
}

fn code_of(e: &ResolveError) -> ResponseCode {
    if e.is_nx_domain() {
        ResponseCode::NXDomain
    } else if let Some(code) = no_records_code(e) {
        code
    } else {
        ResponseCode::ServFail
    }
}

fn no_records_code(e: &ResolveError) -> Option<ResponseCode> {
    use hickory_proto::ProtoErrorKind;
    use hickory_resolver::ResolveErrorKind;
    match e.kind() {
        ResolveErrorKind::Proto(p) => match p.kind() {
            ProtoErrorKind::NoRecordsFound { response_code, .. } => Some(*response_code),
            _ => None,
        },
        _ => None,
    }
}
