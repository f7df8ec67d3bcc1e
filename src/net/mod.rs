//! The socket layer every other module stands on: socket options, listen and dial (with marks,
//! transparent source addresses and timeouts), original-destination recovery, and network
//! namespaces (a thread inside a pod's namespace that makes its sockets), and the worker threads
//! connections run on. Imports nothing of the proxy's own.

pub mod io;
pub mod netns;
pub mod socket;
pub mod sys;
pub mod workers;

pub use workers::Workers;

use std::time::Duration;

/// Timeouts and caps on the connection path. Every field has a production default
/// ([`Limits::default`]); the config file and environment override them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// TCP connect toward a peer or an application (ztunnel uses 10 s).
    pub dial_timeout: Duration,
    /// A whole TLS handshake, either side, from the first byte to the peer's Finished.
    pub handshake_timeout: Duration,
    /// Accepted connections per listener that have not finished their TLS handshake. When a
    /// new one arrives at the cap, the oldest pending one is dropped (counted), so silent
    /// connections cannot lock legitimate clients out.
    pub max_pending_handshakes: usize,
    /// TLS handshakes computing at once per proxy (each side); later ones wait in arrival order,
    /// so a storm's early connections finish early instead of all finishing at the end.
    pub max_concurrent_handshakes: usize,
    /// A pooled HBONE connection with no stream for this long is closed.
    pub pool_idle_timeout: Duration,
    /// Streams the pool opens on one HBONE connection before it opens another.
    pub pool_max_streams: usize,
}

impl Default for Limits {
    fn default() -> Self {
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        Limits {
            dial_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            max_pending_handshakes: 1024,
            max_concurrent_handshakes: 32 * cpus,
            pool_idle_timeout: Duration::from_secs(300),
            pool_max_streams: 100,
        }
    }
}
