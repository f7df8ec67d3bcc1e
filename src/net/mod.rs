//! The socket layer every other module stands on: socket options, listen and dial (with marks,
//! transparent source addresses and timeouts), original-destination recovery, and network
//! namespaces (a thread inside a pod's namespace that makes its sockets), and the worker threads
//! connections run on. Imports nothing of the proxy's own.

pub mod gate;
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
    /// Accepted inbound connections, all listeners together, that have not finished their TLS
    /// handshake. Over it, the oldest one that waits on its peer from the source with the most
    /// pending is dropped (counted): see `proxy::admission`. Connections waiting on us (queued
    /// for a CPU turn) are never dropped, so a storm of real handshakes is queued, not cut.
    pub max_pending_handshakes: usize,
    /// The same budget for one source address.
    pub max_pending_handshakes_per_source: usize,
    /// TLS handshakes computing at once per proxy (each side); later ones wait in arrival order,
    /// so a storm's early connections finish early instead of all finishing at the end. A
    /// handshake holds its turn only while it has bytes to work on, never while it waits on
    /// its peer (see `net::gate`).
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
            max_pending_handshakes: 4096,
            max_pending_handshakes_per_source: 512,
            max_concurrent_handshakes: 32 * cpus,
            pool_idle_timeout: Duration::from_secs(300),
            pool_max_streams: 100,
        }
    }
}
