#![doc = include_str!("NOTES.md")]

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use boring::bn::{BigNum, BigNumContext, BigNumRef};
use boring::pkey::{PKey, Private, Public};
use boring::rsa::Rsa;
use boring::ssl::SslSignatureAlgorithm;

use crate::mb::{Backend, MbError, LANES};

#[cfg(target_arch = "x86_64")]
pub(crate) mod ifma;
pub(crate) mod model;
mod padding;
#[cfg(all(test, target_arch = "x86_64"))]
mod tests_cross;

pub use padding::Padding;

/// Modulus sizes the IFMA backend handles (bits).
pub const IFMA_SIZES: [usize; 3] = [2048, 3072, 4096];

/// The only public exponent the IFMA backend (and its batched fault check) handles.
pub const IFMA_EXPONENT: u32 = 65537;

static FAULT_CHECK_FAILURES: AtomicU64 = AtomicU64::new(0);

/// How many signatures failed the public-key re-check since the process started (each one was
/// withheld and its lane answered `MbError::FaultCheck`). Non-zero means faulty hardware or a bug.
pub fn fault_check_failures() -> u64 {
    FAULT_CHECK_FAILURES.load(Ordering::Relaxed)
}

thread_local! {
    static INJECT_FAULT: Cell<u8> = const { Cell::new(0) };
}

/// Test hook: the next IFMA batch run on this thread flips one bit of the signature in the lanes
/// of `lane_mask` (bit i = lane i of the internal 8-lane batch, which is request i of a call with
/// one key size) before the fault check. Not for production use.
#[doc(hidden)]
pub fn inject_fault_next_batch(lane_mask: u8) {
    INJECT_FAULT.with(|c| c.set(lane_mask));
}

/// Where a key's signatures are computed, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub backend: Backend,
    pub reason: String,
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.backend, self.reason)
    }
}

/// Per-lane key material of one batch, already in radix 2^52, for a modulus of `2·L` limbs split
/// into primes of `L` limbs. Scalar layout: `lanes[i]` is the material of lane `i`.
pub(crate) struct LaneKey<'a> {
    pub p: &'a [u64],
    pub q: &'a [u64],
    pub p_k0: u64,
    pub q_k0: u64,
    pub p_r2: &'a [u64],
    pub q_r2: &'a [u64],
    /// qInv · R mod p (radix 2^52, L limbs).
    pub qinv_r: &'a [u64],
    /// CRT exponents as little-endian 64-bit words.
    pub dp: &'a [u64],
    pub dq: &'a [u64],
    pub n: &'a [u64],
    pub n_k0: u64,
    pub n_r2: &'a [u64],
}

/// Output of one batch: the signature limbs (radix 2^52, `L2` limbs per lane) and the lanes whose
/// fault check passed.
pub(crate) struct BatchOut<const L2: usize> {
    pub sig: [[u64; L2]; 8],
    pub ok: u8,
}

/// Per-key constants of the IFMA backend (radix 2^52 limbs, little-endian limb order).
#[derive(Clone)]
struct Precomp {
    /// Limbs per prime: 20, 30 or 40.
    l: usize,
    p: Vec<u64>,
    q: Vec<u64>,
    p_k0: u64,
    q_k0: u64,
    p_r2: Vec<u64>,
    q_r2: Vec<u64>,
    qinv_r: Vec<u64>,
    dp: Vec<u64>,
    dq: Vec<u64>,
    n: Vec<u64>,
    n_k0: u64,
    n_r2: Vec<u64>,
}

impl Precomp {
    /// This key's material for one lane of a batch.
    fn lane_key(&self) -> LaneKey<'_> {
        LaneKey {
            p: &self.p,
            q: &self.q,
            p_k0: self.p_k0,
            q_k0: self.q_k0,
            p_r2: &self.p_r2,
            q_r2: &self.q_r2,
            qinv_r: &self.qinv_r,
            dp: &self.dp,
            dq: &self.dq,
            n: &self.n,
            n_k0: self.n_k0,
            n_r2: &self.n_r2,
        }
    }
}

/// An RSA private key with the per-key precomputation of the IFMA backend done once.
///
/// Keys of 2048, 3072 or 4096 bits with e = 65537 and balanced CRT primes run on IFMA; any other
/// key is accepted and signs through BoringSSL — [`RsaPrivateKey::route`] says which and why.
#[derive(Clone)]
pub struct RsaPrivateKey {
    rsa: Rsa<Private>,
    bits: usize,
    pre: Option<Precomp>,
    ineligible: Option<String>,
}

impl fmt::Debug for RsaPrivateKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RsaPrivateKey")
            .field("bits", &self.bits)
            .field("ifma_eligible", &self.pre.is_some())
            .finish_non_exhaustive()
    }
}

/// `x` as `limbs` 52-bit limbs (fixed width, so the length does not depend on the value).
fn bn_limbs52(x: &BigNumRef, limbs: usize) -> Result<Vec<u64>, MbError> {
    let mut out = vec![0u64; limbs];
    bytes_to_limbs52(&x.to_vec_padded((52 * limbs).div_ceil(8))?, &mut out);
    Ok(out)
}

/// `x` as `words` little-endian 64-bit words (fixed width).
fn bn_words64(x: &BigNumRef, words: usize) -> Result<Vec<u64>, MbError> {
    let be = x.to_vec_padded(8 * words)?;
    let mut out = vec![0u64; words];
    for (k, &b) in be.iter().rev().enumerate() {
        out[k / 8] |= (b as u64) << (8 * (k % 8));
    }
    Ok(out)
}

/// The lowest 64 bits of `x` (odd moduli and the public exponent here).
fn low_word(x: &BigNumRef) -> u64 {
    let be = x.to_vec();
    be.iter().rev().take(8).enumerate().fold(0, |acc, (k, &b)| acc | (b as u64) << (8 * k))
}

/// 2^bits mod m.
fn pow2_mod(bits: usize, m: &BigNumRef, ctx: &mut BigNumContext) -> Result<BigNum, MbError> {
    let mut r = BigNum::new()?;
    r.set_bit(bits as i32)?;
    let mut out = BigNum::new()?;
    out.nnmod(&r, m, ctx)?;
    Ok(out)
}

/// Big-endian bytes → 52-bit limbs (scalar helper, exposed to this module's users for tests).
pub(crate) fn bytes_to_limbs52(be: &[u8], out: &mut [u64]) {
    const M: u64 = (1 << 52) - 1;
    out.iter_mut().for_each(|x| *x = 0);
    for (k, &byte) in be.iter().rev().enumerate() {
        let (limb, sh) = ((8 * k) / 52, (8 * k) % 52);
        if limb < out.len() {
            out[limb] |= ((byte as u64) << sh) & M;
            if sh > 44 && limb + 1 < out.len() {
                out[limb + 1] |= (byte as u64) >> (52 - sh);
            }
        }
    }
}

/// 52-bit limbs → big-endian bytes filling `out`.
pub(crate) fn limbs52_to_bytes(limbs: &[u64], out: &mut [u8]) {
    for (k, o) in out.iter_mut().rev().enumerate() {
        let (limb, sh) = ((8 * k) / 52, (8 * k) % 52);
        let mut v = 0u64;
        if limb < limbs.len() {
            v = limbs[limb] >> sh;
            if sh > 44 && limb + 1 < limbs.len() {
                v |= limbs[limb + 1] << (52 - sh);
            }
        }
        *o = v as u8;
    }
}

impl RsaPrivateKey {
    /// Wraps a BoringSSL key, validating it (`RSA_check_key`) and precomputing the IFMA constants
    /// when the key is eligible.
    pub fn from_boring(rsa: &Rsa<Private>) -> Result<Self, MbError> {
        if !rsa.check_key()? {
            return Err(MbError::InvalidKey("RSA_check_key rejected the key".into()));
        }
        let bits = rsa.n().num_bits() as usize;
        let (pre, ineligible) = match precompute(rsa, bits)? {
            Ok(p) => (Some(p), None),
            Err(why) => (None, Some(why)),
        };
        Ok(RsaPrivateKey { rsa: rsa.clone(), bits, pre, ineligible })
    }

    /// Parses a DER private key (PKCS#1 `RSAPrivateKey` or PKCS#8).
    pub fn from_der(der: &[u8]) -> Result<Self, MbError> {
        let pkey = PKey::private_key_from_der(der)?;
        Self::from_boring(&pkey.rsa().map_err(|_| MbError::InvalidKey("not an RSA key".into()))?)
    }

    /// Parses a PEM private key (`RSA PRIVATE KEY` or `PRIVATE KEY`).
    pub fn from_pem(pem: &[u8]) -> Result<Self, MbError> {
        let pkey = PKey::private_key_from_pem(pem)?;
        Self::from_boring(&pkey.rsa().map_err(|_| MbError::InvalidKey("not an RSA key".into()))?)
    }

    /// Modulus size in bits.
    pub fn bits(&self) -> usize {
        self.bits
    }

    /// Signature (and modulus) size in bytes.
    pub fn size(&self) -> usize {
        self.bits.div_ceil(8)
    }

    /// The underlying BoringSSL key.
    pub fn boring(&self) -> &Rsa<Private> {
        &self.rsa
    }

    /// The public half, e.g. for verification.
    pub fn public_key(&self) -> Result<Rsa<Public>, MbError> {
        Ok(Rsa::from_public_components(self.rsa.n().to_owned()?, self.rsa.e().to_owned()?)?)
    }

    /// True when the key itself suits the IFMA kernels (size, exponent, CRT primes).
    pub fn ifma_eligible(&self) -> bool {
        self.pre.is_some()
    }

    /// Where this key's signatures go under the process-wide backend ([`crate::mb::backend`]).
    pub fn route(&self) -> Route {
        let choice = crate::mb::backend_choice();
        self.route_for(choice.backend, &choice.reason)
    }

    /// Where this key's signatures go on `backend` (a signer configured with its own backend).
    pub fn route_on(&self, backend: Backend) -> Route {
        self.route_for(backend, "configured")
    }

    fn route_for(&self, backend: Backend, backend_reason: &str) -> Route {
        match (&self.ineligible, backend) {
            (Some(why), _) => Route { backend: Backend::Scalar, reason: why.clone() },
            (None, Backend::Scalar) => Route {
                backend: Backend::Scalar,
                reason: format!("scalar backend selected: {backend_reason}"),
            },
            (None, Backend::Ifma) => Route {
                backend: Backend::Ifma,
                reason: format!("RSA-{} with e = 65537 on AVX-512 IFMA", self.bits),
            },
            (None, Backend::Model) => Route {
                backend: Backend::Model,
                reason: format!(
                    "RSA-{} with e = 65537 on the portable model of the IFMA kernels (test backend)",
                    self.bits
                ),
            },
        }
    }
}

/// The IFMA constants, or the reason the key must use the scalar backend.
fn precompute(rsa: &Rsa<Private>, bits: usize) -> Result<Result<Precomp, String>, MbError> {
    if !IFMA_SIZES.contains(&bits) {
        return Ok(Err(format!("RSA-{bits}: the IFMA backend handles 2048, 3072 and 4096 bits")));
    }
    let e = rsa.e();
    if e.num_bits() > 32 || low_word(e) != IFMA_EXPONENT as u64 {
        return Ok(Err(format!(
            "public exponent {} is not 65537 (the batched fault check assumes it)",
            e.to_dec_str().map(|s| s.to_string()).unwrap_or_default()
        )));
    }
    let (Some(p), Some(q), Some(dp), Some(dq), Some(qinv)) =
        (rsa.p(), rsa.q(), rsa.dmp1(), rsa.dmq1(), rsa.iqmp())
    else {
        return Ok(Err("key lacks CRT parameters (p, q, dp, dq, qInv)".into()));
    };
    let half = bits / 2;
    let ok_sizes = p.num_bits() as usize == half
        && q.num_bits() as usize == half
        && dp.num_bits() as usize <= half
        && dq.num_bits() as usize <= half
        && p.is_odd()
        && q.is_odd();
    if !ok_sizes {
        return Ok(Err(format!(
            "RSA-{bits} key with unbalanced primes: need two {half}-bit primes"
        )));
    }
    let mut ctx = BigNumContext::new()?;
    let mut pq = BigNum::new()?;
    pq.checked_mul(p, q, &mut ctx)?;
    if pq.ucmp(rsa.n()) != std::cmp::Ordering::Equal {
        return Err(MbError::InvalidKey("n != p·q".into()));
    }
    let l = half.div_ceil(52);
    let r_bits = 52 * l;
    let mut qinv_r_bn = BigNum::new()?;
    qinv_r_bn.lshift(qinv, r_bits as i32)?;
    let mut qinv_r = BigNum::new()?;
    qinv_r.nnmod(&qinv_r_bn, p, &mut ctx)?;
    let words = half.div_ceil(64);
    Ok(Ok(Precomp {
        l,
        p: bn_limbs52(p, l)?,
        q: bn_limbs52(q, l)?,
        p_k0: ifma_k0(low_word(p)),
        q_k0: ifma_k0(low_word(q)),
        p_r2: bn_limbs52(&*pow2_mod(2 * r_bits, p, &mut ctx)?, l)?,
        q_r2: bn_limbs52(&*pow2_mod(2 * r_bits, q, &mut ctx)?, l)?,
        qinv_r: bn_limbs52(&qinv_r, l)?,
        dp: bn_words64(dp, words)?,
        dq: bn_words64(dq, words)?,
        n: bn_limbs52(rsa.n(), 2 * l)?,
        n_k0: ifma_k0(low_word(rsa.n())),
        n_r2: bn_limbs52(&*pow2_mod(4 * r_bits, rsa.n(), &mut ctx)?, 2 * l)?,
    }))
}

/// −m⁻¹ mod 2^52 for odd `m0`.
pub(crate) fn ifma_k0(m0: u64) -> u64 {
    let mut x = m0;
    for _ in 0..5 {
        x = x.wrapping_mul(2u64.wrapping_sub(m0.wrapping_mul(x)));
    }
    x.wrapping_neg() & ((1 << 52) - 1)
}

/// IFMA instructions (`vpmadd52luq` + `vpmadd52huq`, eight lanes each) one IFMA batch of
/// `bits`-bit keys executes: both CRT exponentiations, the conversions in and out of the
/// Montgomery domain, Garner's recombination and the batched fault check. The kernels run one
/// fixed instruction sequence per size, so this is a constant; it is counted exactly with the
/// `ifma-count` feature (`simd_model::ifma_count`, which counts both builds) and checked by
/// `ifma_count_per_batch_is_exact`
/// below (`make test` runs it).
/// `mbtunnel speed` divides it by the measured IFMA rate to give the share of the peak.
pub fn ifma_per_batch(bits: usize) -> Option<u64> {
    match bits {
        2048 => Some(IFMA_PER_BATCH_2048),
        3072 => Some(IFMA_PER_BATCH_3072),
        4096 => Some(IFMA_PER_BATCH_4096),
        _ => None,
    }
}

const IFMA_PER_BATCH_2048: u64 = 3_361_906;
const IFMA_PER_BATCH_3072: u64 = 11_887_272;
const IFMA_PER_BATCH_4096: u64 = 27_523_200;

/// Batched RSA signing. Stateless; all methods are synchronous and run on the calling thread.
pub struct RsaBatch;

impl RsaBatch {
    /// Signs `msgs[i]` with `keys[i]` under `padding`, through the process-wide backend.
    /// Results are per lane: a failing lane never fails the others. See [`RsaBatch::sign_with`].
    pub fn sign(
        keys: &[&RsaPrivateKey],
        msgs: &[&[u8]],
        padding: Padding,
    ) -> Vec<Result<Vec<u8>, MbError>> {
        Self::sign_with(crate::mb::backend(), keys, msgs, padding)
    }

    /// As [`RsaBatch::sign`] with an explicit backend (tests, benches, `speed`).
    ///
    /// Up to [`LANES`] requests make one batch per key size; more are split into batches of
    /// eight. Keys of different sizes in one call are grouped by size internally; keys that are
    /// not IFMA-eligible (see [`RsaPrivateKey::route`]) sign through BoringSSL. Asking for
    /// `Backend::Ifma` on a CPU without AVX-512 IFMA fails every lane with `Unsupported`.
    pub fn sign_with(
        backend: Backend,
        keys: &[&RsaPrivateKey],
        msgs: &[&[u8]],
        padding: Padding,
    ) -> Vec<Result<Vec<u8>, MbError>> {
        let paddings = vec![padding; keys.len()];
        Self::sign_mixed_with(backend, keys, msgs, &paddings)
    }

    /// Per-lane paddings (a TLS signer batches handshakes that negotiated different schemes).
    pub fn sign_mixed_with(
        backend: Backend,
        keys: &[&RsaPrivateKey],
        msgs: &[&[u8]],
        paddings: &[Padding],
    ) -> Vec<Result<Vec<u8>, MbError>> {
        if keys.len() != msgs.len() || keys.len() != paddings.len() {
            let e = MbError::InvalidInput(format!(
                "{} keys, {} messages, {} paddings: lengths must match",
                keys.len(),
                msgs.len(),
                paddings.len()
            ));
            return vec![Err(e); keys.len().max(msgs.len())];
        }
        let mut out: Vec<Result<Vec<u8>, MbError>> = Vec::with_capacity(keys.len());
        let mut reps: Vec<Vec<u8>> = Vec::with_capacity(keys.len());
        for i in 0..keys.len() {
            match padding::encode(paddings[i], msgs[i], keys[i].bits) {
                Ok(em) => {
                    reps.push(em);
                    out.push(Ok(Vec::new()));
                }
                Err(e) => {
                    reps.push(Vec::new());
                    out.push(Err(e));
                }
            }
        }
        let todo: Vec<usize> = (0..keys.len()).filter(|&i| out[i].is_ok()).collect();
        let sub_keys: Vec<&RsaPrivateKey> = todo.iter().map(|&i| keys[i]).collect();
        let sub_reps: Vec<&[u8]> = todo.iter().map(|&i| reps[i].as_slice()).collect();
        for (r, &i) in private_op_with(backend, &sub_keys, &sub_reps).into_iter().zip(&todo) {
            out[i] = r;
        }
        out
    }

    /// The TLS entry point: what a BoringSSL `AsyncPrivateKeyMethod::sign` receives (the whole
    /// message and the negotiated scheme). Schemes other than RSA PKCS#1 / PSS-RSAE with
    /// SHA-256/384/512 fail that lane with `Unsupported`.
    pub fn sign_tls(
        keys: &[&RsaPrivateKey],
        msgs: &[&[u8]],
        algs: &[SslSignatureAlgorithm],
    ) -> Vec<Result<Vec<u8>, MbError>> {
        Self::sign_tls_with(crate::mb::backend(), keys, msgs, algs)
    }

    /// As [`RsaBatch::sign_tls`] with an explicit backend.
    pub fn sign_tls_with(
        backend: Backend,
        keys: &[&RsaPrivateKey],
        msgs: &[&[u8]],
        algs: &[SslSignatureAlgorithm],
    ) -> Vec<Result<Vec<u8>, MbError>> {
        if keys.len() != msgs.len() || keys.len() != algs.len() {
            let e = MbError::InvalidInput(format!(
                "{} keys, {} messages, {} algorithms: lengths must match",
                keys.len(),
                msgs.len(),
                algs.len()
            ));
            return vec![Err(e); keys.len().max(msgs.len()).max(algs.len())];
        }
        let pads: Vec<Option<Padding>> =
            algs.iter().map(|&a| Padding::from_ssl_algorithm(a)).collect();
        let ok: Vec<usize> = (0..pads.len()).filter(|&i| pads[i].is_some()).collect();
        if ok.len() == pads.len() {
            let pads: Vec<Padding> = pads.into_iter().flatten().collect();
            return Self::sign_mixed_with(backend, keys, msgs, &pads);
        }
        let mut out: Vec<Result<Vec<u8>, MbError>> = algs
            .iter()
            .map(|a| {
                Err(MbError::Unsupported(format!(
                    "signature scheme {a} is not RSA PKCS#1/PSS-RSAE"
                )))
            })
            .collect();
        let k: Vec<&RsaPrivateKey> = ok.iter().map(|&i| keys[i]).collect();
        let m: Vec<&[u8]> = ok.iter().map(|&i| msgs[i]).collect();
        let p: Vec<Padding> = ok.iter().map(|&i| pads[i].unwrap()).collect();
        for (r, &i) in Self::sign_mixed_with(backend, &k, &m, &p).into_iter().zip(&ok) {
            out[i] = r;
        }
        out
    }

    /// The raw private operation `rep^d mod n` on already-encoded representatives (each exactly
    /// `key.size()` bytes, below n), with the fault check on the IFMA path.
    pub fn private_op_with(
        backend: Backend,
        keys: &[&RsaPrivateKey],
        reps: &[&[u8]],
    ) -> Vec<Result<Vec<u8>, MbError>> {
        if keys.len() != reps.len() {
            let e = MbError::InvalidInput("keys and representatives differ in length".into());
            return vec![Err(e); keys.len().max(reps.len())];
        }
        let mut out: Vec<Result<Vec<u8>, MbError>> =
            reps.iter().map(|_| Err(MbError::InvalidInput("not computed".into()))).collect();
        let mut valid = Vec::new();
        for i in 0..keys.len() {
            let k = keys[i];
            if reps[i].len() != k.size() {
                out[i] = Err(MbError::InvalidInput(format!(
                    "representative of {} bytes for a {}-byte modulus",
                    reps[i].len(),
                    k.size()
                )));
            } else if reps[i] >= &k.rsa.n().to_vec_padded(k.size()).unwrap_or_default()[..] {
                out[i] = Err(MbError::InvalidInput("representative not below the modulus".into()));
            } else {
                valid.push(i);
            }
        }
        for (r, i) in private_op_with(
            backend,
            &valid.iter().map(|&i| keys[i]).collect::<Vec<_>>(),
            &valid.iter().map(|&i| reps[i]).collect::<Vec<_>>(),
        )
        .into_iter()
        .zip(valid)
        {
            out[i] = r;
        }
        out
    }
}

/// Private operation on valid representatives: multi-buffer groups by size (IFMA, or the model
/// when that backend is asked for), everything else scalar.
fn private_op_with(
    backend: Backend,
    keys: &[&RsaPrivateKey],
    reps: &[&[u8]],
) -> Vec<Result<Vec<u8>, MbError>> {
    let mut out: Vec<Result<Vec<u8>, MbError>> =
        reps.iter().map(|_| Err(MbError::InvalidInput("not computed".into()))).collect();
    let kernels = crate::mb::Kernels::for_backend(backend);
    let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
    for i in 0..keys.len() {
        match (backend, &keys[i].pre, kernels) {
            (Backend::Ifma, Some(_), None) => {
                out[i] = Err(MbError::Unsupported(
                    "IFMA backend requested on a CPU without AVX-512 IFMA".into(),
                ));
            }
            (_, Some(_), Some(_)) => match groups.iter_mut().find(|g| g.0 == keys[i].bits) {
                Some(g) => g.1.push(i),
                None => groups.push((keys[i].bits, vec![i])),
            },
            _ => out[i] = scalar_private_op(keys[i], reps[i]),
        }
    }
    for (_, idx) in groups {
        for chunk in idx.chunks(LANES) {
            let ks: Vec<&RsaPrivateKey> = chunk.iter().map(|&i| keys[i]).collect();
            let rs: Vec<&[u8]> = chunk.iter().map(|&i| reps[i]).collect();
            let k = kernels.expect("groups hold multi-buffer lanes only when kernels exist");
            for (r, &i) in mb_batch(k, &ks, &rs).into_iter().zip(chunk) {
                out[i] = r;
            }
        }
    }
    out
}

/// BoringSSL single operation (`RSA_private_encrypt` without padding: the representative is
/// already encoded). BoringSSL blinds and re-checks its CRT result itself.
fn scalar_private_op(key: &RsaPrivateKey, rep: &[u8]) -> Result<Vec<u8>, MbError> {
    let mut sig = vec![0u8; key.size()];
    let n = key.rsa.private_encrypt(rep, &mut sig, boring::rsa::Padding::NONE)?;
    sig.truncate(n);
    Ok(sig)
}

/// One multi-buffer batch of 1..=8 lanes, all keys of the same size and IFMA-eligible, on the
/// given build of the kernels (IFMA, or the portable model). Unused lanes repeat lane 0 and
/// their results are dropped.
fn mb_batch(
    kernels: crate::mb::Kernels,
    keys: &[&RsaPrivateKey],
    reps: &[&[u8]],
) -> Vec<Result<Vec<u8>, MbError>> {
    debug_assert!(!keys.is_empty() && keys.len() <= LANES);
    let pre: Vec<&Precomp> = keys.iter().map(|k| k.pre.as_ref().expect("eligible")).collect();
    let l = pre[0].l;
    let bits = keys[0].bits;
    let lane = |i: usize| if i < keys.len() { i } else { 0 };
    let lane_keys: [LaneKey<'_>; 8] = core::array::from_fn(|i| pre[lane(i)].lane_key());
    let em: Vec<Vec<u64>> = (0..LANES)
        .map(|i| {
            let mut v = vec![0u64; 2 * l];
            bytes_to_limbs52(reps[lane(i)], &mut v);
            v
        })
        .collect();
    let em_refs: [&[u64]; 8] = core::array::from_fn(|i| em[i].as_slice());
    let corrupt = INJECT_FAULT.with(|c| c.replace(0));
    let ebits = bits / 2;
    let w = if bits <= 2048 { 4 } else { 5 };
    // One call per (size, build): the sizes are const generics of the kernels.
    macro_rules! run {
        ($l:literal, $l2:literal, $l4:literal) => {{
            let o: BatchOut<$l2> = match kernels {
                #[cfg(target_arch = "x86_64")]
                crate::mb::Kernels::Ifma(cap) => {
                    ifma::crt_batch::<$l, $l2, $l4>(cap, &lane_keys, &em_refs, ebits, w, corrupt)
                }
                crate::mb::Kernels::Model => {
                    model::crt_batch::<$l, $l2, $l4>(&lane_keys, &em_refs, ebits, w, corrupt)
                }
            };
            (o.sig.iter().map(|s| s.to_vec()).collect::<Vec<Vec<u64>>>(), o.ok)
        }};
    }
    let (sigs, ok) = match l {
        20 => run!(20, 40, 80),
        30 => run!(30, 60, 120),
        40 => run!(40, 80, 160),
        _ => unreachable!("precompute only admits 20, 30 or 40 limbs"),
    };
    (0..keys.len())
        .map(|i| {
            if ok & (1 << i) == 0 {
                FAULT_CHECK_FAILURES.fetch_add(1, Ordering::Relaxed);
                return Err(MbError::FaultCheck);
            }
            let mut sig = vec![0u8; keys[i].size()];
            limbs52_to_bytes(&sigs[i], &mut sig);
            Ok(sig)
        })
        .collect()
}

#[cfg(all(test, feature = "ifma-count"))]
mod count_tests {
    use super::*;
    use crate::mb::simd_model::ifma_count;

    /// The exact count per batch, on the model (every CPU: it runs the same kernel source, so
    /// the same instruction sequence) and on the IFMA kernels where the CPU has them.
    #[test]
    fn ifma_count_per_batch_is_exact() {
        let pems: [(usize, &str); 3] = [
            (2048, include_str!("../../../tests/data/rsa2048-1.pem")),
            (3072, include_str!("../../../tests/data/rsa3072-1.pem")),
            (4096, include_str!("../../../tests/data/rsa4096-1.pem")),
        ];
        for backend in crate::mb::test_backends("IFMA count per RSA batch") {
            let mut counted = Vec::new();
            for (bits, pem) in pems {
                let key = RsaPrivateKey::from_pem(pem.as_bytes()).unwrap();
                let keys = vec![&key; LANES];
                let msgs: Vec<&[u8]> = vec![b"count"; LANES];
                ifma_count::take();
                let r = RsaBatch::sign_with(backend, &keys, &msgs, Padding::Pkcs1Sha256);
                let n = ifma_count::take();
                assert!(r.iter().all(|x| x.is_ok()));
                eprintln!("RSA-{bits} on {backend}: {n} IFMA per batch");
                // A batch with one lane filled runs the same sequence.
                ifma_count::take();
                let _ = RsaBatch::sign_with(backend, &keys[..1], &msgs[..1], Padding::Pkcs1Sha256);
                assert_eq!(ifma_count::take(), n, "RSA-{bits} on {backend}, one lane");
                counted.push((bits, n));
            }
            for (bits, n) in counted {
                assert_eq!(Some(n), ifma_per_batch(bits), "RSA-{bits} on {backend}");
            }
        }
    }
}
