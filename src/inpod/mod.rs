//! In-pod mode: istio-cni enrols pods over ZDS (a Unix SOCK_SEQPACKET socket), handing over each
//! pod's network namespace; the proxy opens the pod's 15001 / 15006 / 15008 listeners inside that
//! namespace and opens its own sockets for the pod there too (marked `SO_MARK` 0x539 so the pod's
//! redirect rules let them through). See `proto/zds.proto` and the README.

pub mod client;
pub mod netns;
pub mod sys;
pub mod uds;
pub mod zds;

mod pods;

pub use client::run_client;
pub use pods::{InPod, PodError};

/// Outbound, inbound plaintext and inbound HBONE ports of the listeners in each pod.
pub const OUTBOUND_PORT: u16 = 15001;
pub const INBOUND_PLAINTEXT_PORT: u16 = 15006;
pub const INBOUND_PORT: u16 = 15008;
/// The proxy's ports inside a pod: a tunnelled or passed-through connection to one of them is a
/// loop and is refused.
pub const PROXY_PORTS: [u16; 3] = [OUTBOUND_PORT, INBOUND_PLAINTEXT_PORT, INBOUND_PORT];
