//! The peer's certificate: its chain verified against the mesh root, then the leaf's single
//! SPIFFE id checked against what this connection expects — with a cache of chains that
//! verified (`tls_verify_cache`, on by default).
//!
//! Every HBONE connection from a node presents the same workload certificate until it is
//! renewed, so a server (and a client dialling the same destination) verifies the same chain
//! over and over: a signature check per certificate, plus BoringSSL's chain building, about a
//! tenth of a full handshake's CPU. The cache remembers, per TLS context, the SHA-256 of each
//! chain (the exact bytes the peer sent) that BoringSSL's `X509_verify_cert` accepted, with the
//! window in which every certificate of the verified chain is valid. A handshake presenting the
//! same bytes within that window skips the chain's signature checks. What depends on the
//! connection is done on every handshake, cached or not:
//! - the peer proves it holds the leaf's private key (TLS 1.3 CertificateVerify, checked by
//!   BoringSSL with the public key of the certificate just received);
//! - the current time must be inside the chain's validity window;
//! - the leaf's SPIFFE id is checked against this connection's expectation (exactly the
//!   expected destination on the client, the trust domain on the server), and authorization
//!   runs on it afterwards, as for every connection.
//!
//! Only chains that verified are kept (no negative cache: a stranger cannot fill it with
//! anything but chains the mesh's roots vouch for). One cache per context, because a context
//! has one trust store and one purpose (a server verifies client certificates, a client server
//! certificates): a new certificate, a new trust bundle or the hourly ticket-key rotation
//! builds new contexts with empty caches. Bounded to [`MAX_CHAINS`] entries: when full,
//! expired entries go, then all of them (the next handshakes verify in full).
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use boring::asn1::Asn1Time;
use boring::ex_data::Index;
use boring::ssl::{Ssl, SslContextBuilder, SslRef};
use boring::stack::StackRef;
use boring::x509::{X509Ref, X509StoreContext, X509StoreContextRef, X509VerifyError, X509};
use foreign_types::ForeignTypeRef;

use super::{peer_identity_of, Refusal, TlsError};
use crate::identity::Identity;
use crate::metrics::Metrics;

/// Chains a context remembers at most.
pub const MAX_CHAINS: usize = 4096;

/// What the peer's leaf must name.
pub(super) enum Want {
    /// Server side: any identity of this trust domain (authorization decides the rest).
    TrustDomain(String),
    /// Client side: the destination's expected identity, or one of the others its service
    /// names (`subject_alt_names`); never empty.
    AnyOf(Vec<Identity>),
}

/// How a list of acceptable identities reads in an error.
pub(super) fn wanted(ids: &[Identity]) -> String {
    match ids {
        [one] => one.to_string(),
        _ => ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(" or "),
    }
}

/// One connection's expectation of its peer, and where a refusal's reason goes.
pub(super) struct PeerCheck {
    pub want: Want,
    pub refusal: Refusal,
    /// Server with tickets on: tickets for this session live no longer than the client's leaf.
    pub cap_tickets: bool,
}

impl PeerCheck {
    fn accept(&self, id: &Identity) -> Result<(), TlsError> {
        match &self.want {
            Want::TrustDomain(td) => super::in_trust_domain(id, td),
            Want::AnyOf(want) if want.contains(id) => Ok(()),
            Want::AnyOf(want) => {
                Err(TlsError::WrongIdentity { got: id.to_string(), want: wanted(want) })
            }
        }
    }

    fn refuse(&self, e: TlsError) {
        self.refusal.lock().unwrap().get_or_insert(e);
    }
}

fn check_index() -> Index<Ssl, Arc<PeerCheck>> {
    static INDEX: OnceLock<Index<Ssl, Arc<PeerCheck>>> = OnceLock::new();
    *INDEX.get_or_init(|| Ssl::new_ex_index().expect("SSL ex_data index"))
}

/// Sets what `ssl`'s peer must be. Every connection of a context built with [`install`] needs
/// one; a connection without one is refused.
pub(super) fn expect(ssl: &mut SslRef, check: PeerCheck) {
    ssl.set_ex_data(check_index(), Arc::new(check));
}

/// The window in which every certificate of a verified chain is valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub from: SystemTime,
    pub until: SystemTime,
}

impl Window {
    fn contains(&self, t: SystemTime) -> bool {
        self.from <= t && t <= self.until
    }
}

/// Chains that verified in one context, by the SHA-256 of their bytes.
#[derive(Default)]
pub struct ChainCache {
    map: Mutex<HashMap<[u8; 32], Window>>,
}

impl ChainCache {
    /// Whether the chain `key` verified and `now` is inside its window (an entry whose window
    /// has passed is dropped).
    pub fn get(&self, key: &[u8; 32], now: SystemTime) -> bool {
        let mut map = self.map.lock().unwrap();
        match map.get(key) {
            Some(w) if w.contains(now) => true,
            Some(w) if now > w.until => {
                map.remove(key);
                false
            }
            _ => false,
        }
    }

    /// Remembers that the chain `key` verified, valid in `w`.
    pub fn put(&self, key: [u8; 32], w: Window, now: SystemTime) {
        let mut map = self.map.lock().unwrap();
        if map.len() >= MAX_CHAINS && !map.contains_key(&key) {
            map.retain(|_, w| w.contains(now));
            if map.len() >= MAX_CHAINS {
                map.clear();
            }
        }
        map.insert(key, w);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.lock().unwrap().len()
    }
}

/// Replaces the context's chain verification by [`verify_peer`], with `cache` (`None`: every
/// chain verified in full).
pub(super) fn install(b: &mut SslContextBuilder, cache: Option<Arc<ChainCache>>, m: Arc<Metrics>) {
    b.set_cert_verify_callback(move |ctx| verify_peer(ctx, cache.as_deref(), &m));
}

/// The connection a store context verifies for.
fn ssl_of(ctx: &X509StoreContextRef) -> Option<&SslRef> {
    ctx.ex_data(X509StoreContext::ssl_idx().ok()?)
}

/// Chain verification of one handshake: the chain (from the cache or by `X509_verify_cert`),
/// then the leaf's identity. A refusal leaves its reason in the connection's [`PeerCheck`] and
/// a verification error in `ctx` (from which BoringSSL picks the alert: a refused identity is
/// answered with `certificate_unknown`, as ztunnel does).
fn verify_peer(ctx: &mut X509StoreContextRef, cache: Option<&ChainCache>, m: &Metrics) -> bool {
    let Some((check, key)) = ssl_of(ctx).and_then(|ssl| {
        let check = ssl.ex_data(check_index())?.clone();
        Some((check, cache.and_then(|_| chain_key(ssl))))
    }) else {
        ctx.set_error(Err(X509VerifyError::APPLICATION_VERIFICATION));
        return false;
    };
    let now = SystemTime::now();
    let cached = matches!((cache, &key), (Some(c), Some(k)) if c.get(k, now));
    if cached {
        count(m, "cached");
    } else {
        if !ctx.verify_cert().unwrap_or(false) {
            let e = ctx.verify_result().err();
            check.refuse(TlsError::Untrusted(
                e.map_or_else(|| "verification failed".into(), |e| e.to_string()),
            ));
            if e.is_none() {
                ctx.set_error(Err(X509VerifyError::UNSPECIFIED));
            }
            count(m, "refused");
            return false;
        }
        count(m, "verified");
        if let (Some(c), Some(k), Some(w)) = (cache, key, ctx.chain().and_then(window_of)) {
            c.put(k, w, now);
        }
    }
    let id = ctx.cert().ok_or(TlsError::NoPeerCert).and_then(peer_identity_of);
    if let Err(e) = id.and_then(|id| check.accept(&id)) {
        check.refuse(e);
        // Any error outside BoringSSL's alert table maps to certificate_unknown; this one says
        // "a name in the certificate is not permitted", which is what happened.
        ctx.set_error(Err(X509VerifyError::PERMITTED_VIOLATION));
        return false;
    }
    if check.cap_tickets {
        if let (Some(left), Some(ssl)) = (ctx.cert().map(super::resume::remaining_of), ssl_of(ctx))
        {
            super::resume::cap_lifetime(ssl, left);
        }
    }
    true
}

fn count(m: &Metrics, result: &'static str) {
    m.chain_checks.get_or_create(&crate::metrics::ChainCheckLabels { result }).inc();
}

/// SHA-256 over the certificates the peer sent, as sent (length-prefixed DER, leaf first).
fn chain_key(ssl: &SslRef) -> Option<[u8; 32]> {
    let mut h = boring::sha::Sha256::new();
    // SAFETY: `ssl` is valid; during verification `SSL_get0_peer_certificates` is the
    // handshake's new session's certificate list, a stack of CRYPTO_BUFFERs that outlives this
    // call, and each buffer's data is `CRYPTO_BUFFER_len` bytes long.
    unsafe {
        let sk = boring_sys::SSL_get0_peer_certificates(ssl.as_ptr());
        if sk.is_null() {
            return None;
        }
        let sk = sk.cast::<boring_sys::OPENSSL_STACK>();
        let n = boring_sys::OPENSSL_sk_num(sk);
        if n == 0 {
            return None;
        }
        for i in 0..n {
            let b = boring_sys::OPENSSL_sk_value(sk, i).cast::<boring_sys::CRYPTO_BUFFER>();
            let len = boring_sys::CRYPTO_BUFFER_len(b);
            h.update(&(len as u64).to_be_bytes());
            h.update(std::slice::from_raw_parts(boring_sys::CRYPTO_BUFFER_data(b), len));
        }
    }
    Some(h.finish())
}

/// Where every certificate of `chain` is valid; `None` if a time cannot be read.
fn window_of(chain: &StackRef<X509>) -> Option<Window> {
    let now_asn1 = Asn1Time::days_from_now(0).ok()?;
    let now = SystemTime::now();
    let mut w = Window { from: SystemTime::UNIX_EPOCH, until: now + Duration::from_secs(1 << 40) };
    for cert in chain {
        let (from, until) = validity(cert, &now_asn1, now)?;
        w.from = w.from.max(from);
        w.until = w.until.min(until);
    }
    Some(w)
}

/// A certificate's not-before and not-after as system times (`now_asn1` is `now`).
pub(super) fn validity(
    cert: &X509Ref,
    now_asn1: &Asn1Time,
    now: SystemTime,
) -> Option<(SystemTime, SystemTime)> {
    let offset = |t| {
        // `a.diff(b)` is b − a.
        let d = now_asn1.diff(t).ok()?;
        let secs = i64::from(d.days) * 86_400 + i64::from(d.secs);
        let abs = Duration::from_secs(secs.unsigned_abs());
        if secs >= 0 {
            now.checked_add(abs)
        } else {
            now.checked_sub(abs)
        }
    };
    Some((offset(cert.not_before())?, offset(cert.not_after())?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_holds_only_inside_its_window_and_a_full_cache_makes_room() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let w = Window { from: t0, until: t0 + Duration::from_secs(100) };
        let c = ChainCache::default();
        c.put([1; 32], w, t0);
        assert!(c.get(&[1; 32], t0));
        assert!(c.get(&[1; 32], t0 + Duration::from_secs(100)));
        assert!(!c.get(&[2; 32], t0), "another chain");
        assert!(!c.get(&[1; 32], t0 - Duration::from_secs(1)), "before not-before");
        assert!(
            c.get(&[1; 32], t0 + Duration::from_secs(50)),
            "a clock before the window misses but keeps it"
        );
        assert!(!c.get(&[1; 32], t0 + Duration::from_secs(101)), "past not-after");
        assert_eq!(c.len(), 0, "an expired entry is dropped");

        // Full of live entries: all go; full with expired ones: only those go.
        for i in 0..MAX_CHAINS {
            c.put((i as u64).to_be_bytes().repeat(4).try_into().unwrap(), w, t0);
        }
        assert_eq!(c.len(), MAX_CHAINS);
        c.put([9; 32], w, t0);
        assert_eq!(c.len(), 1, "cleared to make room");
        let old = Window { from: t0, until: t0 + Duration::from_secs(1) };
        for i in 0..MAX_CHAINS - 1 {
            c.put((i as u64).to_be_bytes().repeat(4).try_into().unwrap(), old, t0);
        }
        c.put([8; 32], w, t0 + Duration::from_secs(10));
        assert!(
            c.get(&[9; 32], t0 + Duration::from_secs(10))
                && c.get(&[8; 32], t0 + Duration::from_secs(10))
        );
        assert_eq!(c.len(), 2, "only the expired entries went");
    }
}
