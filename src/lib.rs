//! mbtunnel: a node-level mTLS proxy for ambient service meshes whose TLS handshakes sign through
//! a shared batching signer running an AVX-512 IFMA multi-buffer RSA / ECDSA core.

pub mod mb;
pub mod speed;
