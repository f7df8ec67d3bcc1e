//! mbtunnel: a node-level mTLS proxy for ambient service meshes whose TLS handshakes sign through
//! a shared batching signer running an AVX-512 IFMA multi-buffer RSA / ECDSA core.

pub mod admin;
pub mod app;
pub mod authz;
pub mod bench;
pub mod config;
pub mod cryptomb;
pub mod devtools;
pub mod dns;
pub mod grpc;
pub mod hbone;
pub mod identity;
pub mod inpod;
pub mod logbuf;
pub mod logfmt;
pub mod mb;
pub mod memtrim;
pub mod metrics;
pub mod net;
pub mod proto;
pub mod proxy;
pub mod ratelog;
pub mod redirect;
pub mod signer;
pub mod speed;
pub mod state;
pub mod tls;
pub mod xds;
