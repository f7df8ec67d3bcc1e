#![doc = include_str!("NOTES.md")]

use boring::ec::{EcKey, EcKeyRef};
use boring::nid::Nid;
use boring::pkey::{PKey, Private};

use crate::mb::{Backend, MbError, LANES};

#[cfg(target_arch = "x86_64")]
pub(crate) mod ifma;
pub(crate) mod limbs;
pub(crate) mod model;
mod nonce;
mod sha;
// One test source, compiled against each build of the kernels (`tests.rs`): the model's run on
// every CPU, the IFMA build's where the CPU has it; `tests_cross.rs` compares the two.
#[cfg(test)]
#[allow(unused_unsafe)]
mod tests_model {
    use super::model::*;
    const BUILD: &str = "model";
    /// The model runs everywhere.
    fn kernels_here(_what: &str) -> bool {
        true
    }
    include!("tests.rs");
}
#[cfg(all(test, target_arch = "x86_64"))]
mod tests_ifma {
    use super::ifma::*;
    const BUILD: &str = "ifma";
    /// The shared skip-or-fail helper (prints the skip; fails under `REQUIRE_IFMA=1`).
    fn kernels_here(what: &str) -> bool {
        crate::mb::require_ifma(&format!("{what} (IFMA build)")).is_some()
    }
    include!("tests.rs");
}
#[cfg(all(test, target_arch = "x86_64"))]
mod tests_cross;
#[cfg(all(test, feature = "ifma-count"))]
mod count_tests {
    use crate::mb::simd_model::ifma_count;
    use crate::mb::Backend;

    /// The exact IFMA count of one `sign8` pass, on the model (every CPU: the same kernel
    /// source, so the same instruction sequence) and on the IFMA kernels where the CPU has them.
    #[test]
    fn ifma_count_per_batch_is_exact() {
        let mut one = [0u8; 32];
        one[31] = 1;
        let d: [[u8; 32]; 8] = std::array::from_fn(|i| {
            let mut x = one;
            x[31] = 3 + i as u8;
            x[0] = 0x11 * i as u8;
            x
        });
        let k: [[u8; 32]; 8] = std::array::from_fn(|i| {
            let mut x = one;
            x[5] = 7 + i as u8;
            x
        });
        let e = [[0x42u8; 32]; 8];
        for backend in crate::mb::test_backends("IFMA count per P-256 batch") {
            let sign8 = |d: &[[u8; 32]; 8], k: &[[u8; 32]; 8]| match backend {
                #[cfg(target_arch = "x86_64")]
                Backend::Ifma => {
                    let cap = crate::mb::Ifma::detect().expect("test_backends checked");
                    super::ifma::sign8(cap, d, &e, k)
                }
                _ => super::model::sign8(d, &e, k),
            };
            ifma_count::take();
            let _ = sign8(&d, &k);
            let n = ifma_count::take();
            eprintln!("P-256 on {backend}: {n} IFMA per sign8");
            assert_eq!(n, super::IFMA_PER_BATCH, "{backend}");
            // Other inputs, same count.
            let _ = sign8(&k, &d);
            assert_eq!(ifma_count::take(), n, "{backend}");
        }
    }
}

/// An ECDSA P-256 private key ready for batch signing.
///
/// Holds the BoringSSL key (scalar backend, public point for checks) and the private scalar `d`
/// as 32 big-endian bytes for the IFMA kernels; the copy is zeroed on drop.
pub struct EcdsaKey {
    key: EcKey<Private>,
    d: [u8; 32],
}

impl std::fmt::Debug for EcdsaKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EcdsaKey").field("curve", &"P-256").finish_non_exhaustive()
    }
}

/// Overwrites secret bytes in a way the optimiser keeps.
fn wipe(bytes: &mut [u8]) {
    for b in bytes.iter_mut() {
        // SAFETY: `b` is a valid, aligned, exclusive reference; volatile keeps the wipe.
        unsafe { std::ptr::write_volatile(b, 0) };
    }
}

impl Drop for EcdsaKey {
    fn drop(&mut self) {
        wipe(&mut self.d);
    }
}

impl EcdsaKey {
    /// Loads a DER private key: PKCS#8 `PrivateKeyInfo` or SEC1 `ECPrivateKey`.
    pub fn from_der(der: &[u8]) -> Result<Self, MbError> {
        match PKey::private_key_from_der(der) {
            Ok(pk) => Self::from_pkey(pk),
            Err(_) => {
                let ec = EcKey::private_key_from_der(der)
                    .map_err(|e| MbError::InvalidKey(format!("not a P-256 private key: {e}")))?;
                Self::from_boring(&ec)
            }
        }
    }

    /// Loads a PEM private key (`PRIVATE KEY` or `EC PRIVATE KEY`).
    pub fn from_pem(pem: &[u8]) -> Result<Self, MbError> {
        let pk = PKey::private_key_from_pem(pem)
            .map_err(|e| MbError::InvalidKey(format!("not a PEM private key: {e}")))?;
        Self::from_pkey(pk)
    }

    fn from_pkey(pk: PKey<Private>) -> Result<Self, MbError> {
        let ec =
            pk.ec_key().map_err(|_| MbError::InvalidKey("not an EC private key".to_string()))?;
        Self::from_boring(&ec)
    }

    /// Wraps a BoringSSL key; fails unless it is a consistent P-256 key with 0 < d < n.
    pub fn from_boring(key: &EcKeyRef<Private>) -> Result<Self, MbError> {
        if key.group().curve_name() != Some(Nid::X9_62_PRIME256V1) {
            return Err(MbError::InvalidKey("curve is not P-256".to_string()));
        }
        key.check_key().map_err(|e| MbError::InvalidKey(format!("key check failed: {e}")))?;
        let mut v = key.private_key().to_vec();
        if v.is_empty() || v.len() > 32 {
            wipe(&mut v);
            return Err(MbError::InvalidKey("private scalar out of range".to_string()));
        }
        let mut d = [0u8; 32];
        d[32 - v.len()..].copy_from_slice(&v);
        wipe(&mut v);
        if !nonce::lt_be(&d, &nonce::N_BE) || d == [0u8; 32] {
            wipe(&mut d);
            return Err(MbError::InvalidKey("private scalar out of range".to_string()));
        }
        let key = EcKey::from_private_components(key.group(), key.private_key(), key.public_key())?;
        Ok(EcdsaKey { key, d })
    }

    /// The BoringSSL key (for verification and the scalar backend).
    pub fn ec_key(&self) -> &EcKeyRef<Private> {
        &self.key
    }
}

/// Signs up to eight messages (SHA-256, then ECDSA P-256) with the process-wide backend
/// ([`crate::mb::backend`]). Lane `i` uses `keys[i]` and `msgs[i]`; each result is a DER
/// `ECDSA-Sig-Value`, as TLS `CertificateVerify` carries it. More than eight requests are
/// processed eight at a time.
pub fn sign_batch(keys: &[&EcdsaKey], msgs: &[&[u8]]) -> Vec<Result<Vec<u8>, MbError>> {
    sign_batch_with(crate::mb::backend(), keys, msgs)
}

/// [`sign_batch`] with an explicit backend (tests, benches, `speed`). Asking for
/// [`Backend::Ifma`] on a CPU without AVX-512 IFMA fails every lane; it never falls back.
pub fn sign_batch_with(
    backend: Backend,
    keys: &[&EcdsaKey],
    msgs: &[&[u8]],
) -> Vec<Result<Vec<u8>, MbError>> {
    if keys.len() != msgs.len() {
        let e = MbError::InvalidInput(format!("{} keys for {} messages", keys.len(), msgs.len()));
        return vec![Err(e); keys.len().max(msgs.len())];
    }
    let digests: Vec<[u8; 32]> = msgs.iter().map(|m| sha256(m)).collect();
    sign_digests(backend, keys, &digests, &Nonces::Hedged)
}

/// SHA-256 of the message (BoringSSL's one-shot `SHA256`, no EVP context allocation).
/// Builds the IFMA kernels' precomputed base-point table now (185 KiB, computed once per
/// process with BoringSSL's point arithmetic, ~10–15 ms here) so that the first batch does not
/// pay for it.
/// Does nothing on a CPU without AVX-512 IFMA unless the model backend is in use. Safe to call
/// more than once.
pub fn prepare() {
    if crate::mb::Ifma::detect().is_some() || crate::mb::backend() == Backend::Model {
        limbs::base_table();
    }
}

fn sha256(m: &[u8]) -> [u8; 32] {
    boring::sha::sha256(m)
}

/// Where nonces come from. Only `Hedged` is used outside tests.
#[doc(hidden)]
pub enum Nonces<'a> {
    /// RFC 6979 with 32 fresh random bytes as additional input (production).
    Hedged,
    /// Plain RFC 6979 (known-answer tests).
    Deterministic,
    /// Per lane, the candidates to use in order (first attempt, then retries).
    Injected(&'a [&'a [[u8; 32]]]),
}

/// IFMA instructions (`vpmadd52luq` + `vpmadd52huq`, eight lanes each) one 8-lane signing pass
/// (`ifma::sign8`: base-point multiplication, the shared inversion, r and s) executes. A fixed
/// sequence, so a constant; counted exactly and checked by
/// `count_tests::ifma_count_per_batch_is_exact`. (A lane whose r or s is zero reruns the
/// pass, probability ~2^-255.) Counted with the `ifma-count` feature.
pub const IFMA_PER_BATCH: u64 = 58_310;

/// Maximum attempts per lane before giving up (r = 0 or s = 0 has probability ~2^-255).
const MAX_ATTEMPTS: usize = 8;

/// Signs SHA-256 digests. Hidden: the test and bench entry for nonce injection.
#[doc(hidden)]
pub fn sign_digests(
    backend: Backend,
    keys: &[&EcdsaKey],
    digests: &[[u8; 32]],
    nonces: &Nonces<'_>,
) -> Vec<Result<Vec<u8>, MbError>> {
    let n = keys.len();
    if digests.len() != n || matches!(nonces, Nonces::Injected(v) if v.len() != n) {
        return vec![Err(MbError::InvalidInput("batch length mismatch".to_string())); n];
    }
    match backend {
        Backend::Scalar => match nonces {
            Nonces::Hedged => keys.iter().zip(digests).map(|(k, h)| sign_scalar(k, h)).collect(),
            _ => {
                vec![
                    Err(MbError::Unsupported("the scalar backend draws its own nonces".to_string()));
                    n
                ]
            }
        },
        Backend::Ifma | Backend::Model => {
            let Some(kernels) = crate::mb::Kernels::for_backend(backend) else {
                let e = MbError::Unsupported(format!(
                    "IFMA backend requested but the CPU lacks AVX-512 IFMA (detected: {})",
                    crate::mb::cpu_features()
                ));
                return vec![Err(e); n];
            };
            sign_digests_raw_on(kernels, keys, digests, nonces)
                .into_iter()
                .map(|r| r.map(|(r, s)| der_signature(&r, &s)))
                .collect()
        }
    }
}

/// An ECDSA signature as (r, s), each 32 big-endian bytes.
pub type RawSig = ([u8; 32], [u8; 32]);

/// The IFMA path of [`sign_digests`] without the DER encoding: `(r, s)` per lane, big-endian.
/// Hidden: the timing report measures this, so that DER encoding (which branches on the public
/// r and s) stays outside the timed region.
#[doc(hidden)]
pub fn sign_digests_raw(
    cap: crate::mb::Ifma,
    keys: &[&EcdsaKey],
    digests: &[[u8; 32]],
    nonces: &Nonces<'_>,
) -> Vec<Result<RawSig, MbError>> {
    #[cfg(target_arch = "x86_64")]
    return sign_digests_raw_on(crate::mb::Kernels::Ifma(cap), keys, digests, nonces);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (cap, digests, nonces);
        vec![Err(MbError::Unsupported("IFMA backend needs x86_64".into())); keys.len()]
    }
}

/// [`sign_digests_raw`] on the portable model of the kernels (tests, fuzzing). Hidden.
#[doc(hidden)]
pub fn sign_digests_raw_model(
    keys: &[&EcdsaKey],
    digests: &[[u8; 32]],
    nonces: &Nonces<'_>,
) -> Vec<Result<RawSig, MbError>> {
    sign_digests_raw_on(crate::mb::Kernels::Model, keys, digests, nonces)
}

fn sign_digests_raw_on(
    kernels: crate::mb::Kernels,
    keys: &[&EcdsaKey],
    digests: &[[u8; 32]],
    nonces: &Nonces<'_>,
) -> Vec<Result<RawSig, MbError>> {
    let n = keys.len();
    if digests.len() != n || matches!(nonces, Nonces::Injected(v) if v.len() != n) {
        return vec![Err(MbError::InvalidInput("batch length mismatch".to_string())); n];
    }
    let mut out = Vec::with_capacity(n);
    for start in (0..n).step_by(LANES) {
        let end = (start + LANES).min(n);
        let inj = match nonces {
            Nonces::Injected(v) => Nonces::Injected(&v[start..end]),
            Nonces::Hedged => Nonces::Hedged,
            Nonces::Deterministic => Nonces::Deterministic,
        };
        out.extend(sign_chunk(kernels, &keys[start..end], &digests[start..end], &inj));
    }
    out
}

fn sign_scalar(key: &EcdsaKey, digest: &[u8; 32]) -> Result<Vec<u8>, MbError> {
    let sig = boring::ecdsa::EcdsaSig::sign(digest, &key.key)?;
    Ok(sig.to_der()?)
}

fn sign_chunk(
    kernels: crate::mb::Kernels,
    keys: &[&EcdsaKey],
    digests: &[[u8; 32]],
    nonces: &Nonces<'_>,
) -> Vec<Result<RawSig, MbError>> {
    let n = keys.len();
    debug_assert!(n <= LANES);
    // Unused lanes compute a harmless dummy signature (d = 1, k = 1, e = 0) that is discarded.
    let mut one = [0u8; 32];
    one[31] = 1;
    let mut d = [one; LANES];
    let mut e = [[0u8; 32]; LANES];
    let mut k = [one; LANES];
    for i in 0..n {
        d[i] = keys[i].d;
        e[i] = digests[i];
    }
    let mut extra = [0u8; 32 * LANES];
    if matches!(nonces, Nonces::Hedged) && boring::rand::rand_bytes(&mut extra[..32 * n]).is_err() {
        return vec![Err(MbError::Boring("rand_bytes failed".to_string())); n];
    }
    // Nonce generators, advanced in lockstep for the first candidate of every lane.
    let (mut drbg, first): (Vec<Option<nonce::Rfc6979>>, Vec<[u8; 32]>) = match nonces {
        Nonces::Hedged | Nonces::Deterministic => {
            // All eight lanes run (unused ones on the dummy key); only the first n are kept.
            let extra: [[u8; 32]; LANES] =
                std::array::from_fn(|i| extra[32 * i..32 * i + 32].try_into().unwrap());
            let hedge = matches!(nonces, Nonces::Hedged).then_some(&extra);
            let (g, k) = nonce::Rfc6979::new_lanes(&d, &e, hedge);
            (g.into_iter().take(n).map(Some).collect(), k[..n].to_vec())
        }
        Nonces::Injected(_) => ((0..n).map(|_| None).collect(), Vec::new()),
    };
    let mut out: Vec<Option<Result<RawSig, MbError>>> = vec![None; n];
    for attempt in 0..MAX_ATTEMPTS {
        for i in 0..n {
            if out[i].is_some() {
                continue;
            }
            match (&mut drbg[i], nonces) {
                (Some(_), _) if attempt == 0 => k[i] = first[i],
                (Some(g), _) => k[i] = g.next_k(),
                (None, Nonces::Injected(v)) => match v[i].get(attempt) {
                    Some(c) if nonce::valid(c) => k[i] = *c,
                    Some(_) => {
                        out[i] = Some(Err(MbError::InvalidInput("nonce not in [1, n)".into())))
                    }
                    None => {
                        out[i] = Some(Err(MbError::InvalidInput(
                            "injected nonces exhausted (r or s was 0)".into(),
                        )))
                    }
                },
                (None, _) => unreachable!("DRBG exists unless nonces are injected"),
            }
            if out[i].is_some() {
                k[i] = one;
            }
        }
        if out.iter().all(Option::is_some) {
            break;
        }
        let (r, s) = match kernels {
            #[cfg(target_arch = "x86_64")]
            crate::mb::Kernels::Ifma(cap) => ifma::sign8(cap, &d, &e, &k),
            crate::mb::Kernels::Model => model::sign8(&d, &e, &k),
        };
        for i in 0..n {
            // r and s are public outputs; testing them for zero leaks nothing about d or k.
            if out[i].is_none() && r[i] != [0u8; 32] && s[i] != [0u8; 32] {
                out[i] = Some(Ok((r[i], s[i])));
            }
        }
    }
    out.into_iter()
        .map(|o| o.unwrap_or_else(|| Err(MbError::InvalidInput("no valid nonce found".into()))))
        .collect()
}

/// DER `ECDSA-Sig-Value ::= SEQUENCE { r INTEGER, s INTEGER }` from 32-byte big-endian r, s.
pub(crate) fn der_signature(r: &[u8; 32], s: &[u8; 32]) -> Vec<u8> {
    fn integer(out: &mut Vec<u8>, v: &[u8; 32]) {
        let skip = v.iter().take_while(|&&b| b == 0).count().min(31);
        let body = &v[skip..];
        let pad = body[0] & 0x80 != 0;
        out.push(0x02);
        out.push((body.len() + pad as usize) as u8);
        if pad {
            out.push(0);
        }
        out.extend_from_slice(body);
    }
    let mut inner = Vec::with_capacity(70);
    integer(&mut inner, r);
    integer(&mut inner, s);
    let mut out = Vec::with_capacity(72);
    out.push(0x30);
    out.push(inner.len() as u8);
    out.extend_from_slice(&inner);
    out
}

/// RFC 6979 nonce for key `d` and digest `h` (with `extra` as the hedging input), first
/// candidate. Hidden: known-answer tests.
#[doc(hidden)]
pub fn rfc6979_nonce(d: &[u8; 32], h: &[u8; 32], extra: Option<&[u8; 32]>) -> [u8; 32] {
    nonce::Rfc6979::new(d, h, extra).next_k()
}
