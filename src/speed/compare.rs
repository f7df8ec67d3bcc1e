//! `mbtunnel speed --compare crypto-mb`: our IFMA kernels against Intel's crypto_mb (loaded at
//! run time, [`crate::cryptomb`]), BoringSSL single-op and OpenSSL's own `openssl speed`, on the
//! same keys and messages, on one pinned core, in interleaved rounds; every figure is the median
//! over the rounds and every ratio is between figures of the same run.
//!
//! Equal work, stated per contender (also in the report's `work` field):
//! * **ours** — the public API: RSA `RsaBatch::sign_with(Ifma, 8 × PKCS#1 v1.5 SHA-256)` (hash,
//!   padding, byte↔limb conversion, CRT exponentiation, the batched public-key fault check);
//!   ECDSA `sign_batch_with(Ifma, 8 messages)` (SHA-256, hedged RFC 6979 nonces, DER).
//! * **ours, equal work** — what crypto_mb's call does, as close as our API allows: RSA
//!   `RsaBatch::private_op_with` on the already-encoded representatives (conversion and fault
//!   check still included; crypto_mb does neither check nor blinding); ECDSA `sign_digests_raw`
//!   with the digest and the nonce supplied, returning raw (r, s).
//! * **crypto_mb** — `mbx_rsa_private_crt_mb8` (raw CRT operation) and
//!   `mbx_nistp256_ecdsa_sign_mb8` (digest and nonce supplied, raw r, s).
//! * **BoringSSL** — one full signature at a time through our scalar backend.
//! * **OpenSSL** — `openssl speed` single-op sign (RSA PKCS#1 with blinding; ECDSA with nonce
//!   generation), one process started from the pinned thread.
//!
//! Before timing, crypto_mb's outputs are checked against ours: the RSA signature of the same
//! representative must be byte-identical to our PKCS#1 signature, and the ECDSA (r, s) for the
//! same key, digest and nonce identical to ours. A mismatch makes the row an error without a
//! crypto_mb figure (and `mbtunnel speed` exits non-zero), never a number.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use super::{measure_ops, median, openssl, share_of_peak, Pin, MESSAGE};
use crate::cryptomb::{CryptoMb, EcdsaInputs, EcdsaOutputs, RsaCrtKey};
use crate::mb::p256::{self, EcdsaKey, Nonces};
use crate::mb::rsa::{Padding, RsaBatch, RsaPrivateKey};
use crate::mb::{self, Backend, LANES};

/// What to compare.
#[derive(Clone, Debug)]
pub struct CompareOptions {
    /// Measuring time per contender and algorithm, split over the rounds.
    pub duration: Duration,
    /// Interleaved rounds (at least 3); every figure is the median over them.
    pub rounds: u32,
    pub rsa_bits: Vec<usize>,
    /// CPU to pin to (default: the last one the thread may use).
    pub cpu: Option<usize>,
    /// Explicit `libcrypto_mb.so` (else `MBTUNNEL_CRYPTO_MB_LIB`, pip prefixes, the loader).
    pub crypto_mb_lib: Option<PathBuf>,
    /// Run `openssl speed` in each round when an `openssl` binary is there.
    pub openssl: bool,
}

impl Default for CompareOptions {
    fn default() -> Self {
        CompareOptions {
            duration: Duration::from_secs(2),
            rounds: super::ROUNDS,
            rsa_bits: vec![2048, 3072, 4096],
            cpu: None,
            crypto_mb_lib: None,
            openssl: true,
        }
    }
}

/// One algorithm, all contenders. Signatures per second, medians over the rounds.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct CompareRow {
    pub algorithm: String,
    /// Our public API (full work, see the module docs).
    pub ours_ops_per_s: Option<f64>,
    /// Our call closest to crypto_mb's work.
    pub ours_equal_work_ops_per_s: Option<f64>,
    pub crypto_mb_ops_per_s: Option<f64>,
    /// `ours_ops_per_s / crypto_mb_ops_per_s` (ours does more work).
    pub ratio_vs_crypto_mb: Option<f64>,
    /// `ours_equal_work_ops_per_s / crypto_mb_ops_per_s`.
    pub ratio_equal_work_vs_crypto_mb: Option<f64>,
    pub boringssl_ops_per_s: f64,
    pub ratio_vs_boringssl: Option<f64>,
    /// `openssl speed` sign/s (single op, its own process on the same pinned core).
    pub openssl_ops_per_s: Option<f64>,
    pub ratio_vs_openssl: Option<f64>,
    /// Exact IFMA instructions per 8-lane batch of our kernel.
    pub ifma_per_batch: Option<u64>,
    /// Share of the measured IFMA peak reached by our equal-work figure.
    pub ifma_share_of_peak: Option<f64>,
    /// Output check of crypto_mb against ours (None when crypto_mb did not run).
    pub check: Option<String>,
    /// Set when something failed: a check mismatch or a crypto_mb error (then no crypto_mb
    /// figure is given).
    pub error: Option<String>,
    /// Every round's figure per contender (sig/s), in round order: the spread behind the medians.
    pub rounds: RoundFigures,
}

/// Per-round figures of one row.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct RoundFigures {
    pub ours: Vec<f64>,
    pub ours_equal_work: Vec<f64>,
    pub crypto_mb: Vec<f64>,
    pub boringssl: Vec<f64>,
    pub openssl: Vec<f64>,
}

/// The whole comparison.
#[derive(Clone, Debug, Serialize)]
pub struct CompareReport {
    pub cpu: String,
    pub pinned_cpu: Option<usize>,
    pub ifma_peak_per_s: Option<f64>,
    pub rounds: u32,
    pub seconds_per_contender: f64,
    /// Version and path of the crypto_mb that ran, or why none did and how to install it.
    pub crypto_mb: String,
    pub crypto_mb_loaded: bool,
    /// `openssl version`, or why there is no OpenSSL column.
    pub openssl: String,
    /// What each contender's call does.
    pub work: Vec<String>,
    pub rows: Vec<CompareRow>,
}

impl CompareReport {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("report serialises")
    }

    /// True when some row is an error (a mismatch between crypto_mb and ours, or a failed call).
    pub fn has_errors(&self) -> bool {
        self.rows.iter().any(|r| r.error.is_some())
    }
}

impl fmt::Display for CompareReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "cpu: {}", self.cpu)?;
        writeln!(f, "{}", super::pinned_line(self.pinned_cpu))?;
        writeln!(f, "{}", super::peak_line(self.ifma_peak_per_s))?;
        writeln!(f, "crypto_mb: {}", self.crypto_mb)?;
        writeln!(f, "openssl: {}", self.openssl)?;
        writeln!(
            f,
            "{} interleaved rounds, {:.2} s per contender and algorithm, medians; signatures/s, one core",
            self.rounds, self.seconds_per_contender
        )?;
        let o = |v: Option<f64>| v.map(|x| format!("{x:.0}")).unwrap_or_else(|| "-".into());
        let x = |v: Option<f64>| v.map(|x| format!("{x:.2}x")).unwrap_or_else(|| "-".into());
        let p =
            |v: Option<f64>| v.map(|x| format!("{:.1}%", 100.0 * x)).unwrap_or_else(|| "-".into());
        writeln!(
            f,
            "{:<20} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7}",
            "algorithm",
            "ours",
            "ours eq.",
            "crypto_mb",
            "boringssl",
            "openssl",
            "/cmb",
            "eq./cmb",
            "/boring",
            "/openssl",
            "of peak"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{:<20} {:>10} {:>10} {:>10} {:>9.0} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7}",
                r.algorithm,
                o(r.ours_ops_per_s),
                o(r.ours_equal_work_ops_per_s),
                o(r.crypto_mb_ops_per_s),
                r.boringssl_ops_per_s,
                o(r.openssl_ops_per_s),
                x(r.ratio_vs_crypto_mb),
                x(r.ratio_equal_work_vs_crypto_mb),
                x(r.ratio_vs_boringssl),
                x(r.ratio_vs_openssl),
                p(r.ifma_share_of_peak),
            )?;
            if let Some(e) = &r.error {
                writeln!(f, "  ERROR: {e}")?;
            } else if let Some(c) = &r.check {
                writeln!(f, "  check: {c}")?;
            }
        }
        for w in &self.work {
            writeln!(f, "* {w}")?;
        }
        Ok(())
    }
}

/// The work each column's call does (printed with the table).
fn work_notes() -> Vec<String> {
    vec![
        "ours: public API, 8 lanes: RSA = SHA-256 + PKCS#1 v1.5 padding + conversion + CRT \
         exponentiation + batched public-key fault check; ECDSA = SHA-256 + hedged RFC 6979 nonce \
         + sign + DER"
            .into(),
        "ours eq.: RSA = private operation on encoded representatives (conversion and fault \
         check included); ECDSA = digest and nonce given, raw (r, s)"
            .into(),
        "crypto_mb: mbx_rsa_private_crt_mb8 = raw CRT operation (no padding, blinding or check); \
         mbx_nistp256_ecdsa_sign_mb8 = digest and nonce given, raw (r, s)"
            .into(),
        "boringssl: one full signature at a time (our scalar backend)".into(),
        "openssl: `openssl speed` single-op sign (RSA PKCS#1 with blinding, ECDSA with nonce \
         generation), same pinned core"
            .into(),
        "of peak: IFMA per batch (exact count) x ours-eq. batches/s / measured IFMA peak".into(),
    ]
}

/// A contender measured in every round.
type Op<'a> = Box<dyn FnMut() + 'a>;

struct Contenders<'a> {
    ours: Option<Op<'a>>,
    ours_eq: Option<Op<'a>>,
    cmb: Option<Op<'a>>,
    boring: Op<'a>,
    openssl_key: &'static str,
    ifma_per_batch: Option<u64>,
}

#[derive(Default)]
struct Samples {
    ours: Vec<f64>,
    ours_eq: Vec<f64>,
    cmb: Vec<f64>,
    boring: Vec<f64>,
    openssl: Vec<f64>,
}

/// Runs the comparison on the calling thread (pinned for its duration).
pub fn run_compare(opts: &CompareOptions) -> CompareReport {
    let pin = Pin::current_thread(opts.cpu);
    let rounds = opts.rounds.max(3);
    let slice = opts.duration / rounds;
    let cap = mb::Ifma::detect();
    let peak = mb::ifma_peak_per_s(Duration::from_millis(200));
    let lib = CryptoMb::load(opts.crypto_mb_lib.as_deref());
    let crypto_mb = match &lib {
        Ok(l) => format!("{} ({})", l.version(), l.path().display()),
        Err(e) => format!("column skipped: {e}"),
    };
    let openssl_version = if opts.openssl { openssl::version() } else { None };
    let openssl_desc = match (&openssl_version, opts.openssl) {
        (Some(v), _) => format!("{v} (`openssl speed -seconds 1 -elapsed`, once per round)"),
        (None, true) => "column skipped: no `openssl` binary on PATH (or $MBTUNNEL_OPENSSL)".into(),
        (None, false) => "column skipped: not requested".into(),
    };

    // Inputs, and the output checks, before anything is timed.
    let mut rows = Vec::new();
    let rsa: Vec<RsaSetup> = opts.rsa_bits.iter().map(|&b| RsaSetup::new(b)).collect();
    let ec = EcSetup::new();
    let mut cmb_rsa = Vec::new();
    for s in &rsa {
        let mut row = empty_row(format!("RSA-{} pkcs1-sha256", s.bits));
        let batch = match (&lib, cap) {
            (Ok(l), Some(_)) => match s.check(l) {
                Ok((b, msg)) => {
                    row.check = Some(msg);
                    Some(b)
                }
                Err(e) => {
                    row.error = Some(e);
                    None
                }
            },
            _ => None,
        };
        cmb_rsa.push(batch);
        rows.push(row);
    }
    let mut ec_row = empty_row("ECDSA-P256 sha256".into());
    let ec_cmb = match (&lib, cap) {
        (Ok(l), Some(c)) => match ec.check(c, l) {
            Ok((inp, msg)) => {
                ec_row.check = Some(msg);
                Some((l, inp))
            }
            Err(e) => {
                ec_row.error = Some(e);
                None
            }
        },
        _ => None,
    };
    rows.push(ec_row);

    // The contenders of every row.
    let mut contenders: Vec<Contenders<'_>> = Vec::new();
    for (s, batch) in rsa.iter().zip(cmb_rsa) {
        contenders.push(s.contenders(cap.is_some(), batch));
    }
    contenders.push(ec.contenders(cap, ec_cmb));

    let openssl_algos: Vec<&'static str> = contenders.iter().map(|c| c.openssl_key).collect();
    let mut samples: Vec<Samples> = contenders.iter().map(|_| Samples::default()).collect();
    for _ in 0..rounds {
        for (c, s) in contenders.iter_mut().zip(samples.iter_mut()) {
            let run = |op: &mut Option<Op<'_>>, out: &mut Vec<f64>, per_call: usize| {
                if let Some(op) = op {
                    out.push(measure_ops(slice, per_call, op).0);
                }
            };
            run(&mut c.ours, &mut s.ours, LANES);
            run(&mut c.ours_eq, &mut s.ours_eq, LANES);
            run(&mut c.cmb, &mut s.cmb, LANES);
            s.boring.push(measure_ops(slice, 1, &mut c.boring).0);
        }
        if openssl_version.is_some() {
            if let Ok(m) = openssl::speed(&openssl_algos, 1) {
                for (c, s) in contenders.iter().zip(samples.iter_mut()) {
                    if let Some(v) = m.get(c.openssl_key) {
                        s.openssl.push(*v);
                    }
                }
            }
        }
    }
    for ((row, s), c) in rows.iter_mut().zip(&samples).zip(&contenders) {
        row.ours_ops_per_s = median(&s.ours);
        row.ours_equal_work_ops_per_s = median(&s.ours_eq);
        row.crypto_mb_ops_per_s = median(&s.cmb);
        row.boringssl_ops_per_s = median(&s.boring).unwrap_or(0.0);
        row.openssl_ops_per_s = median(&s.openssl);
        let ratio = |a: Option<f64>, b: Option<f64>| Some(a? / b.filter(|b| *b > 0.0)?);
        row.ratio_vs_crypto_mb = ratio(row.ours_ops_per_s, row.crypto_mb_ops_per_s);
        row.ratio_equal_work_vs_crypto_mb =
            ratio(row.ours_equal_work_ops_per_s, row.crypto_mb_ops_per_s);
        row.ratio_vs_boringssl = ratio(row.ours_ops_per_s, Some(row.boringssl_ops_per_s));
        row.ratio_vs_openssl = ratio(row.ours_ops_per_s, row.openssl_ops_per_s);
        row.ifma_per_batch = row.ours_equal_work_ops_per_s.and(c.ifma_per_batch);
        row.ifma_share_of_peak =
            share_of_peak(row.ifma_per_batch, row.ours_equal_work_ops_per_s, peak);
        let r = |v: &[f64]| v.iter().map(|x| x.round()).collect::<Vec<f64>>();
        row.rounds = RoundFigures {
            ours: r(&s.ours),
            ours_equal_work: r(&s.ours_eq),
            crypto_mb: r(&s.cmb),
            boringssl: r(&s.boring),
            openssl: r(&s.openssl),
        };
    }
    drop(contenders);
    CompareReport {
        cpu: mb::cpu_description(),
        pinned_cpu: pin.as_ref().map(Pin::cpu),
        ifma_peak_per_s: peak,
        rounds,
        seconds_per_contender: opts.duration.as_secs_f64(),
        crypto_mb,
        crypto_mb_loaded: lib.is_ok(),
        openssl: openssl_desc,
        work: work_notes(),
        rows,
    }
}

fn empty_row(algorithm: String) -> CompareRow {
    CompareRow {
        algorithm,
        ours_ops_per_s: None,
        ours_equal_work_ops_per_s: None,
        crypto_mb_ops_per_s: None,
        ratio_vs_crypto_mb: None,
        ratio_equal_work_vs_crypto_mb: None,
        boringssl_ops_per_s: 0.0,
        ratio_vs_boringssl: None,
        openssl_ops_per_s: None,
        ratio_vs_openssl: None,
        ifma_per_batch: None,
        ifma_share_of_peak: None,
        check: None,
        error: None,
        rounds: RoundFigures::default(),
    }
}

/// RSA keys (several, cycled over the eight lanes), the message, its representatives.
struct RsaSetup {
    bits: usize,
    keys: Vec<RsaPrivateKey>,
    cmb_keys: Vec<RsaCrtKey>,
    reps: Vec<Vec<u8>>,
}

impl RsaSetup {
    fn new(bits: usize) -> RsaSetup {
        let n_keys = if bits >= 4096 { 2 } else { 4 };
        let keys: Vec<RsaPrivateKey> = (0..n_keys).map(|_| super::bench_key(bits)).collect();
        let cmb_keys = keys.iter().map(|k| RsaCrtKey::from_key(k).expect("CRT key")).collect();
        let reps = (0..LANES)
            .map(|_| Padding::Pkcs1Sha256.encode(MESSAGE, bits).expect("encodes"))
            .collect();
        RsaSetup { bits, keys, cmb_keys, reps }
    }

    fn lane_keys(&self) -> Vec<&RsaPrivateKey> {
        (0..LANES).map(|i| &self.keys[i % self.keys.len()]).collect()
    }

    /// crypto_mb's output on our representatives must equal our signatures byte for byte.
    fn check<'a>(
        &'a self,
        lib: &'a CryptoMb,
    ) -> Result<(crate::cryptomb::RsaCrtBatch<'a>, String), String> {
        let lane_keys = self.lane_keys();
        let ours =
            RsaBatch::sign_with(Backend::Ifma, &lane_keys, &[MESSAGE; LANES], Padding::Pkcs1Sha256);
        let cmb_keys: [&RsaCrtKey; 8] =
            std::array::from_fn(|i| &self.cmb_keys[i % self.cmb_keys.len()]);
        let mut batch = lib.rsa_batch(cmb_keys).map_err(|e| format!("crypto_mb: {e}"))?;
        let input: [&[u8]; 8] = std::array::from_fn(|i| self.reps[i].as_slice());
        let mut out: [Vec<u8>; 8] = Default::default();
        batch.private_crt(&input, &mut out).map_err(|e| format!("crypto_mb: {e}"))?;
        for i in 0..LANES {
            let ours = ours[i].as_ref().map_err(|e| format!("ours, lane {i}: {e}"))?;
            if ours != &out[i] {
                return Err(format!(
                    "MISMATCH in lane {i}: crypto_mb's RSA-{} output differs from our signature \
                     of the same representative",
                    self.bits
                ));
            }
        }
        Ok((batch, "crypto_mb output = our PKCS#1 signature, byte for byte, 8/8 lanes".into()))
    }

    fn contenders<'a>(
        &'a self,
        ifma: bool,
        cmb: Option<crate::cryptomb::RsaCrtBatch<'a>>,
    ) -> Contenders<'a> {
        let lane_keys = self.lane_keys();
        let lk2 = lane_keys.clone();
        let reps: Vec<&[u8]> = self.reps.iter().map(|r| r.as_slice()).collect();
        let one = self.keys[0].clone();
        let ours: Option<Op<'a>> = ifma.then(|| -> Op<'a> {
            Box::new(move || {
                let r = RsaBatch::sign_with(
                    Backend::Ifma,
                    &lane_keys,
                    &[MESSAGE; LANES],
                    Padding::Pkcs1Sha256,
                );
                assert!(r.iter().all(|x| x.is_ok()));
            })
        });
        let ours_eq: Option<Op<'a>> = ifma.then(|| -> Op<'a> {
            Box::new(move || {
                let r = RsaBatch::private_op_with(Backend::Ifma, &lk2, &reps);
                assert!(r.iter().all(|x| x.is_ok()));
            })
        });
        let cmb: Option<Op<'a>> = cmb.map(|mut b| -> Op<'a> {
            let input: [&[u8]; 8] = std::array::from_fn(|i| self.reps[i].as_slice());
            let mut out: [Vec<u8>; 8] = Default::default();
            Box::new(move || {
                b.private_crt(&input, &mut out).expect("crypto_mb succeeded in the check");
            })
        });
        let boring: Op<'a> = Box::new(move || {
            let r = RsaBatch::sign_with(Backend::Scalar, &[&one], &[MESSAGE], Padding::Pkcs1Sha256);
            assert!(r[0].is_ok());
        });
        let openssl_key = match self.bits {
            2048 => "rsa2048",
            3072 => "rsa3072",
            4096 => "rsa4096",
            _ => "rsa2048",
        };
        Contenders {
            ours,
            ours_eq,
            cmb,
            boring,
            openssl_key,
            ifma_per_batch: mb::rsa::ifma_per_batch(self.bits),
        }
    }
}

/// P-256 keys, digests and nonces shared by both multi-buffer contenders.
struct EcSetup {
    keys: Vec<EcdsaKey>,
    d: [[u8; 32]; 8],
    digests: [[u8; 32]; 8],
    nonces: [[u8; 32]; 8],
}

impl EcSetup {
    fn new() -> EcSetup {
        let group = boring::ec::EcGroup::from_curve_name(boring::nid::Nid::X9_62_PRIME256V1)
            .expect("P-256 group");
        let keys: Vec<EcdsaKey> = (0..4)
            .map(|_| {
                let k = boring::ec::EcKey::generate(&group).expect("P-256 key generation");
                EcdsaKey::from_boring(&k).expect("generated key is valid")
            })
            .collect();
        let d = std::array::from_fn(|i| {
            let v = keys[i % keys.len()].ec_key().private_key().to_vec_padded(32).expect("32");
            v.try_into().expect("32 bytes")
        });
        // Digests of distinct messages per lane; nonces from RFC 6979 (valid, below n).
        let digests: [[u8; 32]; 8] = std::array::from_fn(|i| {
            let mut m = MESSAGE.to_vec();
            m.push(i as u8);
            boring::sha::sha256(&m)
        });
        let nonces = std::array::from_fn(|i| p256::rfc6979_nonce(&d[i], &digests[i], None));
        p256::prepare();
        EcSetup { keys, d, digests, nonces }
    }

    fn lane_keys(&self) -> Vec<&EcdsaKey> {
        (0..LANES).map(|i| &self.keys[i % self.keys.len()]).collect()
    }

    /// crypto_mb's (r, s) for the same key, digest and nonce must equal ours.
    fn check(&self, cap: mb::Ifma, lib: &CryptoMb) -> Result<(EcdsaInputs, String), String> {
        let inp = EcdsaInputs::new(&self.digests, &self.nonces, &self.d);
        let mut out = EcdsaOutputs::default();
        lib.ecdsa_p256_sign(&inp, &mut out).map_err(|e| format!("crypto_mb: {e}"))?;
        let cands: Vec<[[u8; 32]; 1]> = self.nonces.iter().map(|k| [*k]).collect();
        let cand_refs: Vec<&[[u8; 32]]> = cands.iter().map(|c| c.as_slice()).collect();
        let ours = p256::sign_digests_raw(
            cap,
            &self.lane_keys(),
            &self.digests,
            &Nonces::Injected(&cand_refs),
        );
        for (i, lane) in ours.iter().enumerate() {
            let (r, s) = lane.as_ref().map_err(|e| format!("ours, lane {i}: {e}"))?;
            if *r != out.r[i] || *s != out.s[i] {
                return Err(format!(
                    "MISMATCH in lane {i}: crypto_mb's ECDSA (r, s) differs from ours for the same \
                     key, digest and nonce"
                ));
            }
        }
        Ok((inp, "crypto_mb (r, s) = ours for the same key, digest and nonce, 8/8 lanes".into()))
    }

    fn contenders<'a>(
        &'a self,
        cap: Option<mb::Ifma>,
        cmb: Option<(&'a CryptoMb, EcdsaInputs)>,
    ) -> Contenders<'a> {
        let lane_keys = self.lane_keys();
        let lk2 = lane_keys.clone();
        let msgs = [MESSAGE; LANES];
        let ours: Option<Op<'a>> = cap.map(|_| -> Op<'a> {
            Box::new(move || {
                let r = p256::sign_batch_with(Backend::Ifma, &lane_keys, &msgs);
                assert!(r.iter().all(|x| x.is_ok()));
            })
        });
        let cands: Vec<[[u8; 32]; 1]> = self.nonces.iter().map(|k| [*k]).collect();
        let ours_eq: Option<Op<'a>> = cap.map(|cap| -> Op<'a> {
            Box::new(move || {
                let refs: Vec<&[[u8; 32]]> = cands.iter().map(|c| c.as_slice()).collect();
                let r = p256::sign_digests_raw(cap, &lk2, &self.digests, &Nonces::Injected(&refs));
                assert!(r.iter().all(|x| x.is_ok()));
            })
        });
        let cmb: Option<Op<'a>> = cmb.map(|(lib, inp)| -> Op<'a> {
            let mut out = EcdsaOutputs::default();
            Box::new(move || lib.ecdsa_p256_sign(&inp, &mut out).expect("checked before"))
        });
        let one = &self.keys[0];
        let boring: Op<'a> = Box::new(move || {
            assert!(p256::sign_batch_with(Backend::Scalar, &[one], &[MESSAGE])[0].is_ok())
        });
        Contenders {
            ours,
            ours_eq,
            cmb,
            boring,
            openssl_key: "ecdsap256",
            ifma_per_batch: Some(p256::IFMA_PER_BATCH),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_names_the_work_and_ratios() {
        let mut row = empty_row("RSA-2048 pkcs1-sha256".into());
        row.ours_ops_per_s = Some(16000.0);
        row.crypto_mb_ops_per_s = Some(15000.0);
        row.ratio_vs_crypto_mb = Some(16000.0 / 15000.0);
        row.boringssl_ops_per_s = 2000.0;
        row.check = Some("identical".into());
        let r = CompareReport {
            cpu: "Test CPU".into(),
            pinned_cpu: Some(1),
            ifma_peak_per_s: None,
            rounds: 3,
            seconds_per_contender: 1.0,
            crypto_mb: "x".into(),
            crypto_mb_loaded: true,
            openssl: "none".into(),
            work: work_notes(),
            rows: vec![row],
        };
        let t = r.to_string();
        assert!(t.contains("1.07x") && t.contains("raw CRT operation"), "{t}");
        let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert!((v["rows"][0]["ratio_vs_crypto_mb"].as_f64().unwrap() - 1.0667).abs() < 1e-3);
        assert!(!r.has_errors());
    }

    /// The whole comparison, briefly: with the library present the outputs must match ours (a
    /// mismatch is an error row); without it the column is skipped with the install hint.
    #[test]
    fn compare_runs_and_checks_or_skips() {
        let opts = CompareOptions {
            duration: Duration::from_millis(30),
            rounds: 3,
            rsa_bits: vec![2048],
            openssl: false,
            ..Default::default()
        };
        let r = run_compare(&opts);
        assert_eq!(r.rows.len(), 2);
        assert!(!r.has_errors(), "{r}");
        if r.crypto_mb_loaded && mb::Ifma::detect().is_some() {
            for row in &r.rows {
                assert!(row.crypto_mb_ops_per_s.is_some() && row.check.is_some(), "{r}");
            }
        } else {
            assert!(
                r.crypto_mb.contains("pip install")
                    || !r.crypto_mb_loaded
                    || r.rows[0].crypto_mb_ops_per_s.is_none()
            );
            assert!(r.rows.iter().all(|row| row.crypto_mb_ops_per_s.is_none()));
        }
    }
}
