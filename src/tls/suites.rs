//! TLS 1.3 cipher suites (`tls_ciphers`): the order a client offers them in and the order a
//! server picks them in.
//!
//! The default puts `TLS_AES_128_GCM_SHA256` first, strictly, on both sides. BoringSSL's own
//! default does so on a client but lets the client choose on a server, so a client that prefers
//! `TLS_AES_256_GCM_SHA384` (ztunnel, OpenSSL) got a handshake whose key schedule runs on
//! SHA-384: SHA-512 compressions, which no x86 CPU before the newest has instructions for,
//! about 7 % of a full handshake's server CPU, against ~1 % with SHA-256 on SHA-NI.
//! Why it is no weaker where it matters: `TLS_AES_128_GCM_SHA256` is the suite every TLS 1.3
//! implementation must support (RFC 8446 §9.1) and the one BoringSSL clients (and mbtunnel's,
//! with every server) already negotiate; 128-bit security is what the P-256 certificates and the
//! X25519 key exchange give. A mesh that requires AES-256 (e.g. CNSA) lists only
//! `TLS_AES_256_GCM_SHA384`; an empty list restores BoringSSL's defaults.
#![allow(unsafe_code)]

use boring::ssl::SslContextBuilder;

/// TLS 1.3 cipher suites `tls_ciphers` may name, with their protocol ids.
pub const SUITES: &[(&str, u16)] = &[
    ("TLS_AES_128_GCM_SHA256", 0x1301),
    ("TLS_AES_256_GCM_SHA384", 0x1302),
    ("TLS_CHACHA20_POLY1305_SHA256", 0x1303),
];

/// The default order: AES-128-GCM with SHA-256 first, then AES-256-GCM, then ChaCha20.
pub fn default_order() -> Vec<String> {
    SUITES.iter().map(|(n, _)| n.to_string()).collect()
}

/// The protocol ids of `names`, or which name is unknown (the config check and the contexts
/// share this).
pub fn ids(names: &[String]) -> Result<Vec<u16>, String> {
    names
        .iter()
        .map(|n| {
            SUITES.iter().find(|(s, _)| s == n).map(|&(_, id)| id).ok_or(format!(
                "unknown TLS 1.3 cipher suite '{n}' (known: {})",
                SUITES.iter().map(|(s, _)| *s).collect::<Vec<_>>().join(", ")
            ))
        })
        .collect()
}

/// Makes `names` (known names, see [`SUITES`]) the strict preference order of `b`'s TLS 1.3
/// suites; an empty list leaves BoringSSL's defaults.
pub fn apply(b: &mut SslContextBuilder, names: &[String]) -> Result<(), String> {
    if names.is_empty() {
        return Ok(());
    }
    let ids = ids(names)?;
    // SAFETY: `b` owns a valid SSL_CTX; `ids` is a valid array of `ids.len()` protocol ids and
    // no flags are passed (strict order). BoringSSL copies the list.
    let ok = unsafe {
        boring_sys::SSL_CTX_set1_tls13_ciphers(
            b.as_ptr(),
            ids.as_ptr(),
            std::ptr::null(),
            ids.len(),
        )
    };
    if ok == 1 {
        Ok(())
    } else {
        Err(format!("BoringSSL refused the TLS 1.3 cipher suites {names:?}"))
    }
}
