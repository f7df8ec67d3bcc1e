//! Start-up calibration: the signer measures, on the CPU it runs on, what its rules depend on
//! instead of trusting constants measured once on one VM.
//!
//! - **Hand-off** `h`: the round trip a queued request pays on top of its signature, through the
//!   same mechanisms: a parked thread woken through a condition variable (the signer thread),
//!   which answers through a `tokio` oneshot that wakes a parked runtime thread (the handshake).
//! - **Inline thresholds**: a key whose single op costs `c ≤ 50·h` would pay more than 2 % for the
//!   hand-off (queueing could not stay within 0.98× of inline). On an idle signer such a request
//!   is signed on the calling thread when `c ≤ T_idle = min(50·h, 2 ms)`: a request that finds
//!   the signer idle would be a batch of one, i.e. the same single op, so only the runtime worker
//!   it blocks is at stake, and at idle that worker has little else to do (the cap bounds it).
//!   Classes that cannot batch at all (scalar backend, keys the multi-buffer core does not take)
//!   sign inline also when the signer is busy, if `c ≤ T_busy = min(50·h, 250 µs)`: there,
//!   queueing only adds the hand-off, but a busy runtime must not lose a worker for long.
//! - **Single op** `c` per key kind (BoringSSL, the fastest of a few runs): P-256 at start-up with
//!   a fresh key, other kinds when the first key of that kind is registered.
//! - **Multi-buffer pass** `b` per class (IFMA backend only, the fastest of a few 8-lane passes,
//!   measured when the first key of the class registers). Crossover: batches of at most
//!   `⌊b / c⌋` (1..=7) requests use single ops. Fill bound: `6·b` for classes above the inline
//!   threshold, off for the cheap ones (a lone cheap request is signed inline anyway).
//!
//! Everything is logged, in the signer's `dump()` (`calibration`, in `/config_dump`) and in the
//! `mbtunnel_signer_calibrated_*`, `mbtunnel_signer_scalar_below` and
//! `mbtunnel_signer_fill_wait_seconds` metrics.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use boring::pkey::{PKey, Private};
use boring::ssl::SslSignatureAlgorithm;
use serde::Serialize;

/// Hand-off multiple below which a single op is signed inline (hand-off > 2 % of the op).
pub const INLINE_HANDOFF_FACTOR: u32 = 50;
/// The longest a single op may keep a handshake's worker thread on an idle signer.
pub const INLINE_CAP_IDLE: Duration = Duration::from_millis(2);
/// The longest a single op may keep a handshake's worker thread on a busy signer.
pub const INLINE_CAP_BUSY: Duration = Duration::from_micros(250);
/// Fill bound in batch times.
pub const FILL_BATCHES: u32 = 6;

/// What the calibration measured and derived (microseconds unless named otherwise).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Calibration {
    /// Median round trip of two thread hand-offs.
    pub handoff_us: f64,
    /// Keys whose single op costs at most this sign inline on an idle signer.
    pub inline_max_us: f64,
    /// Keys of classes that cannot batch sign inline also on a busy signer below this.
    pub inline_busy_max_us: f64,
    /// BoringSSL single-op cost per key kind.
    pub single_op_us: BTreeMap<String, f64>,
    /// 8-lane multi-buffer pass per class (IFMA backend only).
    pub batch_us: BTreeMap<String, f64>,
    /// Derived crossover per class (batches of at most this many use single ops).
    pub scalar_below: BTreeMap<String, usize>,
    /// Derived adaptive-fill bound per class (0 = off).
    pub fill_wait_us: BTreeMap<String, u64>,
    /// Time spent measuring, in milliseconds.
    pub took_ms: f64,
}

/// The inline threshold on an idle signer for a measured hand-off.
pub fn inline_max(handoff: Duration) -> Duration {
    (handoff * INLINE_HANDOFF_FACTOR).min(INLINE_CAP_IDLE)
}

/// The inline threshold on a busy signer (classes that cannot batch).
pub fn inline_busy_max(handoff: Duration) -> Duration {
    (handoff * INLINE_HANDOFF_FACTOR).min(INLINE_CAP_BUSY)
}

/// The crossover: the largest batch that is cheaper as single ops than as one pass (1..=7).
pub fn crossover(batch: Duration, single: Duration) -> usize {
    let k = batch.as_secs_f64() / single.as_secs_f64().max(1e-9);
    (k.floor() as usize).clamp(1, crate::mb::LANES - 1)
}

/// The adaptive-fill bound: six passes for classes too expensive to sign inline, else off.
pub fn fill_bound(batch: Duration, single: Duration, inline_max: Duration) -> Duration {
    if single <= inline_max {
        Duration::ZERO
    } else {
        batch * FILL_BATCHES
    }
}

/// Median round trip of `rounds` hand-offs (see the module notes), measured on a thread of its
/// own (so that it works from inside a runtime too).
pub fn measure_handoff(rounds: usize) -> Duration {
    std::thread::scope(|s| {
        s.spawn(|| handoff_rounds(rounds))
            .join()
            .ok()
            .flatten()
            .unwrap_or(Duration::from_micros(50))
    })
}

fn handoff_rounds(rounds: usize) -> Option<Duration> {
    type Slot = (Option<tokio::sync::oneshot::Sender<()>>, bool);
    let pair: Arc<(Mutex<Slot>, Condvar)> = Arc::new((Mutex::new((None, false)), Condvar::new()));
    let p2 = pair.clone();
    let helper = std::thread::Builder::new()
        .name("mbt-calibrate".into())
        .spawn(move || {
            let (m, c) = &*p2;
            let mut g = m.lock().unwrap();
            loop {
                while g.0.is_none() && !g.1 {
                    g = c.wait(g).unwrap();
                }
                if g.1 {
                    return;
                }
                let tx = g.0.take().expect("a request");
                drop(g);
                let _ = tx.send(());
                g = m.lock().unwrap();
            }
        })
        .ok()?;
    let rt = tokio::runtime::Builder::new_current_thread().build().ok()?;
    let (m, c) = &*pair;
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let t = Instant::now();
        m.lock().unwrap().0 = Some(tx);
        c.notify_one();
        rt.block_on(rx).ok()?;
        times.push(t.elapsed());
    }
    m.lock().unwrap().1 = true;
    c.notify_one();
    let _ = helper.join();
    times.sort();
    times.get(times.len() / 2).copied()
}

/// A TLS 1.3 `CertificateVerify` input's size (64 spaces, context string, 0, transcript hash).
const MSG: [u8; 130] = [0x20; 130];

/// The TLS 1.3 scheme a key of this kind signs with, if the signer supports one.
pub fn tls13_alg(pkey: &PKey<Private>) -> Option<SslSignatureAlgorithm> {
    match pkey.id() {
        boring::pkey::Id::RSA => Some(SslSignatureAlgorithm::RSA_PSS_RSAE_SHA256),
        boring::pkey::Id::EC => Some(SslSignatureAlgorithm::ECDSA_SECP256R1_SHA256),
        _ => None,
    }
}

/// The fastest of a few BoringSSL single ops with `pkey` (at least two, at most seven, stopping
/// after ~3 ms), or `None` if the key cannot sign a TLS 1.3 scheme here.
pub fn measure_single_op(pkey: &PKey<Private>) -> Option<Duration> {
    let alg = tls13_alg(pkey)?;
    let start = Instant::now();
    let mut best: Option<Duration> = None;
    for n in 0..7 {
        let t = Instant::now();
        super::sign_one(pkey, &MSG, alg).ok()?;
        let d = t.elapsed();
        best = Some(best.map_or(d, |b| b.min(d)));
        if n >= 1 && start.elapsed() > Duration::from_millis(3) {
            break;
        }
    }
    best
}

/// The fastest of a few 8-lane passes on the multi-buffer `backend` (IFMA, or the forced model
/// test backend) with `key` in every lane.
pub(crate) fn measure_batch(
    backend: crate::mb::Backend,
    key: &super::KeyEntry,
) -> Option<Duration> {
    use super::keys::MbKey;
    let alg = tls13_alg(&key.pkey)?;
    let msgs: [&[u8]; 8] = [&MSG; 8];
    let start = Instant::now();
    let mut best: Option<Duration> = None;
    for n in 0..5 {
        let t = Instant::now();
        let ok = match &key.mb {
            MbKey::Rsa(k) => {
                let keys = [&**k; 8];
                let out = crate::mb::rsa::RsaBatch::sign_tls_with(backend, &keys, &msgs, &[alg; 8]);
                out.iter().all(|r| r.is_ok())
            }
            MbKey::Ec(k) => {
                let keys = [k; 8];
                let out = crate::mb::p256::sign_batch_with(backend, &keys, &msgs);
                out.iter().all(|r| r.is_ok())
            }
            MbKey::None => return None,
        };
        if !ok {
            return None;
        }
        let d = t.elapsed();
        best = Some(best.map_or(d, |b| b.min(d)));
        if n >= 1 && start.elapsed() > Duration::from_millis(3) {
            break;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn derivations_reproduce_the_old_constants_from_their_measurements() {
        // The Zen 4 figures the constants came from (rsa/NOTES.md, p256/NOTES.md).
        assert_eq!(crossover(1218 * US, 558 * US), 2); // RSA-2048
        assert_eq!(crossover(4160 * US, 1711 * US), 2); // RSA-3072
        assert_eq!(crossover(28 * US, 17 * US), 1); // ECDSA P-256
        assert_eq!(crossover(100 * US, US), 7, "clamped below a full batch");
        assert_eq!(inline_max(20 * US), 1000 * US);
        assert_eq!(inline_max(100 * US), 2000 * US, "capped on an idle signer");
        let t = inline_busy_max(10 * US);
        assert_eq!(t, 250 * US, "capped on a busy signer");
        assert_eq!(inline_busy_max(2 * US), 100 * US);
        assert_eq!(fill_bound(28 * US, 17 * US, t), Duration::ZERO, "cheap class: off");
        assert_eq!(fill_bound(1218 * US, 558 * US, t), 7308 * US, "six passes");
    }

    #[test]
    fn handoff_and_single_op_measure_something_plausible() {
        let h = measure_handoff(9);
        assert!(h > Duration::ZERO && h < Duration::from_secs(1), "{h:?}");
        let k = crate::identity::ca::generate_key(crate::config::KeyAlgorithm::EcdsaP256).unwrap();
        let c = measure_single_op(&k).expect("P-256 signs");
        assert!(c > Duration::ZERO && c < Duration::from_secs(1), "{c:?}");
    }
}
