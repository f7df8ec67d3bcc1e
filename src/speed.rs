//! `mbtunnel speed` and `mbtunnel doctor` as library functions.
//!
//! [`run_speed`] measures, per algorithm, the IFMA backend (full batches of eight) and the
//! BoringSSL single-op path in the same run, on the calling thread, and reports ops/s, their
//! ratio and the latency of one batch. Rows are a flat list so other algorithms (ECDSA P-256)
//! add rows through [`measure_ops`] without changing the report format.

use std::fmt;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::mb::rsa::{Padding, RsaBatch, RsaPrivateKey};
use crate::mb::{self, Backend, LANES};

/// What to measure.
#[derive(Clone, Debug)]
pub struct SpeedOptions {
    /// Measuring time per algorithm and backend.
    pub duration: Duration,
    /// RSA modulus sizes to measure (2048, 3072, 4096).
    pub rsa_bits: Vec<usize>,
    /// RSA padding used for the measurement (PKCS#1 v1.5 by default; PSS costs the same private
    /// operation plus a few hashes).
    pub rsa_padding: Padding,
    /// Also measure the IFMA backend (skipped anyway when the CPU lacks it).
    pub ifma: bool,
}

impl Default for SpeedOptions {
    fn default() -> Self {
        SpeedOptions {
            duration: Duration::from_secs(2),
            rsa_bits: vec![2048, 3072, 4096],
            rsa_padding: Padding::Pkcs1Sha256,
            ifma: true,
        }
    }
}

impl SpeedOptions {
    /// Default options with `seconds` per measurement (the `--seconds N` flag).
    pub fn with_seconds(seconds: f64) -> Self {
        SpeedOptions { duration: Duration::from_secs_f64(seconds.max(0.05)), ..Default::default() }
    }
}

/// One measured algorithm.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct SpeedRow {
    /// e.g. `RSA-2048 pkcs1-sha256`, `ECDSA-P256 sha256`.
    pub algorithm: String,
    /// Signatures per second with the IFMA backend in batches of eight (None: not measured).
    pub ifma_ops_per_s: Option<f64>,
    /// Signatures per second with BoringSSL, one at a time.
    pub scalar_ops_per_s: f64,
    /// `ifma_ops_per_s / scalar_ops_per_s`.
    pub ratio: Option<f64>,
    /// Wall time of one full IFMA batch call (eight signatures), microseconds (best round).
    pub batch_latency_us: Option<f64>,
    /// Smallest number of queued requests for which one IFMA batch finishes sooner than that many
    /// BoringSSL single operations (a batch costs the same with 1 or 8 lanes filled); below it a
    /// signer should use the single-op path.
    pub crossover_batch: Option<usize>,
}

/// Smallest `k` with `k` single operations slower than one batch.
pub fn crossover(batch_latency_us: f64, scalar_ops_per_s: f64) -> usize {
    let single_us = 1e6 / scalar_ops_per_s;
    ((batch_latency_us / single_us).floor() as usize + 1).max(1)
}

/// The result of [`run_speed`].
#[derive(Clone, Debug, Serialize)]
pub struct SpeedReport {
    /// Backend the process would use (`ifma` or `scalar`) and why.
    pub backend: String,
    pub backend_reason: String,
    pub cpu_features: String,
    pub seconds_per_measurement: f64,
    pub rows: Vec<SpeedRow>,
}

impl SpeedReport {
    /// Pretty JSON (`--json`).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("report serialises")
    }
}

impl fmt::Display for SpeedReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "backend: {} ({})", self.backend, self.backend_reason)?;
        writeln!(f, "cpu features: {}", self.cpu_features)?;
        writeln!(f, "{:.2} s per measurement, one thread", self.seconds_per_measurement)?;
        writeln!(
            f,
            "{:<24} {:>12} {:>14} {:>8} {:>16} {:>10}",
            "algorithm", "ifma ops/s", "boring ops/s", "ratio", "batch-8 latency", "crossover"
        )?;
        let opt = |v: Option<f64>, prec: usize, suffix: &str| match v {
            Some(x) => format!("{x:.prec$}{suffix}"),
            None => "-".to_string(),
        };
        for r in &self.rows {
            writeln!(
                f,
                "{:<24} {:>12} {:>14.0} {:>8} {:>16} {:>10}",
                r.algorithm,
                opt(r.ifma_ops_per_s, 0, ""),
                r.scalar_ops_per_s,
                opt(r.ratio, 2, "x"),
                opt(r.batch_latency_us, 0, " us"),
                r.crossover_batch.map(|c| c.to_string()).unwrap_or_else(|| "-".into()),
            )?;
        }
        Ok(())
    }
}

/// Runs `op` (which performs `ops_per_call` operations) repeatedly for about `duration` after
/// one warm-up call; returns operations per second and the mean time of one call.
pub fn measure_ops(
    duration: Duration,
    ops_per_call: usize,
    mut op: impl FnMut(),
) -> (f64, Duration) {
    op();
    let start = Instant::now();
    let mut calls = 0u64;
    while calls == 0 || start.elapsed() < duration {
        op();
        calls += 1;
    }
    let el = start.elapsed();
    ((calls as f64 * ops_per_call as f64) / el.as_secs_f64(), el / calls as u32)
}

/// Alternating measurement rounds per algorithm (the best round of each side is reported).
pub const ROUNDS: u32 = 5;

/// A key for benchmarking (generated by BoringSSL, e = 65537).
fn bench_key(bits: usize) -> RsaPrivateKey {
    let rsa = boring::rsa::Rsa::generate(bits as u32).expect("RSA key generation");
    RsaPrivateKey::from_boring(&rsa).expect("generated key is valid")
}

/// Measures one RSA size: IFMA batches of eight (lanes cycle over several keys) and BoringSSL
/// single-op, alternating, `duration` each in total.
pub fn rsa_row(bits: usize, padding: Padding, duration: Duration, ifma: bool) -> SpeedRow {
    let n_keys = if bits >= 4096 { 2 } else { 4 };
    let keys: Vec<RsaPrivateKey> = (0..n_keys).map(|_| bench_key(bits)).collect();
    let lane_keys: Vec<&RsaPrivateKey> = (0..LANES).map(|i| &keys[i % keys.len()]).collect();
    let msg: &[u8] = MESSAGE;
    let msgs = vec![msg; LANES];
    alternating_row(
        format!("RSA-{bits} {}", padding.name()),
        duration,
        ifma,
        || {
            let r = RsaBatch::sign_with(Backend::Scalar, &lane_keys[..1], &msgs[..1], padding);
            assert!(r[0].is_ok());
        },
        || {
            let r = RsaBatch::sign_with(Backend::Ifma, &lane_keys, &msgs, padding);
            assert!(r.iter().all(|x| x.is_ok()));
        },
    )
}

/// What the benchmarks sign.
const MESSAGE: &[u8] = b"mbtunnel speed: TLS 1.3 CertificateVerify stand-in message";

/// Measures one algorithm: a single BoringSSL operation against one full IFMA batch of eight,
/// in alternating short rounds, keeping each side's best round — on a shared machine this
/// compares the two under the same conditions instead of whichever ran while another process had
/// the core.
fn alternating_row(
    algorithm: String,
    duration: Duration,
    ifma: bool,
    mut scalar_op: impl FnMut(),
    mut ifma_op: impl FnMut(),
) -> SpeedRow {
    let run_ifma = ifma && mb::cpu_features().ifma_capable();
    let slice = duration / ROUNDS;
    let (mut scalar, mut ifma_ops, mut lat) = (0f64, None::<f64>, None::<f64>);
    for _ in 0..ROUNDS {
        let (s, _) = measure_ops(slice, 1, &mut scalar_op);
        scalar = scalar.max(s);
        if run_ifma {
            let (o, l) = measure_ops(slice, LANES, &mut ifma_op);
            ifma_ops = Some(ifma_ops.unwrap_or(0.0).max(o));
            let l = l.as_secs_f64() * 1e6;
            lat = Some(lat.unwrap_or(f64::MAX).min(l));
        }
    }
    SpeedRow {
        algorithm,
        ifma_ops_per_s: ifma_ops,
        scalar_ops_per_s: scalar,
        ratio: ifma_ops.map(|x| x / scalar),
        batch_latency_us: lat,
        crossover_batch: lat.map(|l| crossover(l, scalar)),
    }
}

/// Measures ECDSA P-256 signing (SHA-256, hedged nonces) the same way as RSA.
pub fn p256_row(duration: Duration, ifma: bool) -> SpeedRow {
    use crate::mb::p256::{sign_batch_with, EcdsaKey};
    let group = boring::ec::EcGroup::from_curve_name(boring::nid::Nid::X9_62_PRIME256V1)
        .expect("P-256 group");
    let keys: Vec<EcdsaKey> = (0..4)
        .map(|_| {
            let k = boring::ec::EcKey::generate(&group).expect("P-256 key generation");
            EcdsaKey::from_boring(&k).expect("generated key is valid")
        })
        .collect();
    let lane_keys: Vec<&EcdsaKey> = (0..LANES).map(|i| &keys[i % keys.len()]).collect();
    let msgs = vec![MESSAGE; LANES];
    crate::mb::p256::prepare();
    alternating_row(
        "ECDSA-P256 sha256".into(),
        duration,
        ifma,
        || assert!(sign_batch_with(Backend::Scalar, &lane_keys[..1], &msgs[..1])[0].is_ok()),
        || assert!(sign_batch_with(Backend::Ifma, &lane_keys, &msgs).iter().all(|r| r.is_ok())),
    )
}

/// Measures every configured algorithm. Takes about `2 · duration` per algorithm plus key
/// generation.
pub fn run_speed(opts: &SpeedOptions) -> SpeedReport {
    let choice = mb::backend_choice();
    // A forced scalar backend measures the scalar path only: that is what the process would run.
    let ifma = opts.ifma && choice.backend == Backend::Ifma;
    let mut rows: Vec<SpeedRow> = opts
        .rsa_bits
        .iter()
        .map(|&bits| rsa_row(bits, opts.rsa_padding, opts.duration, ifma))
        .collect();
    rows.push(p256_row(opts.duration, ifma));
    SpeedReport {
        backend: choice.backend.to_string(),
        backend_reason: choice.reason.clone(),
        cpu_features: mb::cpu_features().to_string(),
        seconds_per_measurement: opts.duration.as_secs_f64(),
        rows,
    }
}

/// `mbtunnel doctor`: CPU features, the chosen backend and why, and how RSA keys are routed.
pub fn doctor() -> String {
    let f = mb::cpu_features();
    let c = mb::backend_choice();
    let mut s = String::new();
    s.push_str(&format!("cpu features: {f}\n"));
    s.push_str(&format!(
        "  avx512f: {}  avx512ifma: {}  avx512vl: {}  -> IFMA kernels {}\n",
        yes(f.avx512f),
        yes(f.avx512ifma),
        yes(f.avx512vl),
        if f.ifma_capable() { "can run" } else { "cannot run" }
    ));
    s.push_str(&format!("signer backend: {}\n", c.backend));
    s.push_str(&format!("  why: {}\n", c.reason));
    let env = std::env::var(mb::BACKEND_ENV).unwrap_or_else(|_| "(unset)".into());
    s.push_str(&format!("  {}={env}\n", mb::BACKEND_ENV));
    s.push_str(&format!(
        "RSA: {} for 2048/3072/4096-bit keys with e = 65537 (8 lanes, fault-checked); other keys \
         use BoringSSL single-op\n",
        c.backend
    ));
    s.push_str(&format!(
        "RSA fault-check failures since start: {}\n",
        mb::rsa::fault_check_failures()
    ));
    s
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_renders_as_table_and_json() {
        let r = SpeedReport {
            backend: "ifma".into(),
            backend_reason: "test".into(),
            cpu_features: "avx512f".into(),
            seconds_per_measurement: 1.0,
            rows: vec![
                SpeedRow {
                    algorithm: "RSA-2048 pkcs1-sha256".into(),
                    ifma_ops_per_s: Some(10000.0),
                    scalar_ops_per_s: 1250.0,
                    ratio: Some(8.0),
                    batch_latency_us: Some(800.0),
                    crossover_batch: Some(2),
                },
                SpeedRow {
                    algorithm: "RSA-4096 pkcs1-sha256".into(),
                    ifma_ops_per_s: None,
                    scalar_ops_per_s: 175.0,
                    ratio: None,
                    batch_latency_us: None,
                    crossover_batch: None,
                },
            ],
        };
        let t = r.to_string();
        assert!(t.contains("RSA-2048 pkcs1-sha256") && t.contains("8.00x"), "{t}");
        let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!(v["rows"][0]["ratio"], 8.0);
        assert!(v["rows"][1]["ifma_ops_per_s"].is_null());
    }

    #[test]
    fn crossover_counts_single_ops() {
        // batch 1000 us, single op 400 us: 2 singles (800 us) beat a batch, 3 (1200 us) do not
        assert_eq!(crossover(1000.0, 2500.0), 3);
        assert_eq!(crossover(100.0, 1000.0), 1);
    }

    #[test]
    fn doctor_names_backend_and_reason() {
        let d = doctor();
        assert!(d.contains("signer backend:") && d.contains("why:"), "{d}");
    }

    #[test]
    fn speed_runs_briefly() {
        let opts = SpeedOptions {
            duration: Duration::from_millis(30),
            rsa_bits: vec![2048],
            ..Default::default()
        };
        let r = run_speed(&opts);
        assert_eq!(r.rows.len(), 2, "RSA-2048 and ECDSA P-256");
        assert!(r.rows[1].algorithm.starts_with("ECDSA-P256"));
        for row in &r.rows {
            assert!(row.scalar_ops_per_s > 0.0);
            assert_eq!(row.ifma_ops_per_s.is_some(), crate::mb::backend() == Backend::Ifma);
        }
    }
}
