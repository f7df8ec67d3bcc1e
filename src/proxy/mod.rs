//! Listeners and connection handling: outbound (15001), inbound HBONE (15008), inbound plaintext
//! (15006), drain on shutdown, and one metrics/access-log record per proxied connection.
#![forbid(unsafe_code)]

pub mod accept;
pub mod admission;
pub mod drain;
pub mod inbound;
pub mod outbound;
pub mod record;
pub mod registry;
pub mod relay;
pub mod target;

use std::net::SocketAddr;
use std::sync::Arc;

use crate::hbone::Pool;
use crate::metrics::Metrics;
use crate::net::Workers;
use crate::ratelog::RateLog;
use crate::state::State;
use crate::tls::TlsProvider;

pub use accept::{accept_backing_off, spawn_accept_loop};
pub use admission::{Pending, PendingHandshakes};
pub use drain::{drain_cut, Drain, DrainGuard};
pub use record::{ConnRecord, Ends};
pub use registry::{run_recheck, ConnRegistry, Registered};
pub use relay::{copy_both, relay, reset_on_close, Copied, Leg, Stop};

/// Everything a connection handler needs.
pub struct Ctx {
    pub state: Arc<State>,
    pub tls: Arc<TlsProvider>,
    pub pool: Arc<Pool>,
    pub metrics: Arc<Metrics>,
    pub drain: Drain,
    pub mark: u32,
    pub transparent: bool,
    /// The proxy's own listener addresses (connections to them are loops).
    pub own_addrs: Vec<SocketAddr>,
    /// Open inbound connections, re-checked when authorization changes.
    pub conns: Arc<ConnRegistry>,
    /// Timeouts and caps on the connection path.
    pub limits: crate::net::Limits,
    /// Inbound HBONE connections still in their TLS handshake (all 15008 listeners).
    pub pending: Arc<PendingHandshakes>,
    /// The threads connections run on.
    pub workers: Arc<Workers>,
    /// Per-connection lines a peer can cause (refusals, HTTP/2 errors): one a second per
    /// (site, reason), the rest at debug (see `crate::ratelog`).
    pub peer_logs: RateLog<(&'static str, &'static str)>,
    /// The DNS proxy (in-pod mode: opened in each pod), when enabled.
    pub dns: Option<Arc<crate::dns::Dns>>,
    /// The node's resolvers: hostname workloads are resolved through them.
    pub upstream: Arc<crate::dns::Upstream>,
}

impl Ctx {
    /// Options for a socket toward the network or an application.
    pub fn dial_opts<'a>(
        &self,
        source: Option<std::net::IpAddr>,
        netns: Option<&'a crate::net::netns::Netns>,
    ) -> crate::net::socket::DialOpts<'a> {
        crate::net::socket::DialOpts {
            mark: self.mark,
            source,
            netns,
            timeout: self.limits.dial_timeout,
        }
    }
}
