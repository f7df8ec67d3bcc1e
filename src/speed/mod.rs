//! `mbtunnel speed` and `mbtunnel doctor` as library functions.
//!
//! [`run_speed`] measures, per algorithm, the IFMA backend (full batches of eight) and the
//! BoringSSL single-op path in the same run, on the calling thread pinned to one core, in
//! interleaved rounds, and reports the median ops/s of each, their ratio and the latency of one
//! batch, with the CPU named, the measured IFMA rate of the core ([`crate::mb::peak`]) and the
//! share of it each kernel reaches. Rows are a flat list so other algorithms add rows through
//! [`measure_ops`] without changing the report format. [`compare`] adds Intel's crypto_mb and
//! OpenSSL's own figures (`mbtunnel speed --compare crypto-mb`).

pub mod chart;
pub mod compare;
mod openssl;

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
    /// Interleaved rounds; each figure is the median over them.
    pub rounds: u32,
    /// CPU to pin the measuring thread to (default: the last one it may run on).
    pub cpu: Option<usize>,
}

impl Default for SpeedOptions {
    fn default() -> Self {
        SpeedOptions {
            duration: Duration::from_secs(2),
            rsa_bits: vec![2048, 3072, 4096],
            rsa_padding: Padding::Pkcs1Sha256,
            ifma: true,
            rounds: ROUNDS,
            cpu: None,
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
    /// Wall time of one full IFMA batch call (eight signatures), microseconds (median round).
    pub batch_latency_us: Option<f64>,
    /// IFMA instructions one batch executes (exact, see `mb::rsa::ifma_per_batch`).
    pub ifma_per_batch: Option<u64>,
    /// `ifma_per_batch · batches/s ÷ ifma_peak_per_s`: the share of the core's measured IFMA
    /// rate this row's IFMA figure reaches (everything outside the kernel counts as time too).
    pub ifma_share_of_peak: Option<f64>,
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
    /// The CPU (`/proc/cpuinfo` model name, family, model).
    pub cpu: String,
    /// The core the measuring thread was pinned to (None: pinning failed).
    pub pinned_cpu: Option<usize>,
    /// Measured IFMA instructions per second on that core (None: no IFMA).
    pub ifma_peak_per_s: Option<f64>,
    /// Backend the process would use (`ifma` or `scalar`) and why.
    pub backend: String,
    pub backend_reason: String,
    pub cpu_features: String,
    pub seconds_per_measurement: f64,
    /// Interleaved rounds; every figure is the median over them.
    pub rounds: u32,
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
        writeln!(f, "cpu: {}", self.cpu)?;
        writeln!(f, "{}", pinned_line(self.pinned_cpu))?;
        writeln!(f, "{}", peak_line(self.ifma_peak_per_s))?;
        writeln!(f, "backend: {} ({})", self.backend, self.backend_reason)?;
        writeln!(f, "cpu features: {}", self.cpu_features)?;
        writeln!(
            f,
            "{:.2} s per measurement in {} interleaved rounds, medians",
            self.seconds_per_measurement, self.rounds
        )?;
        writeln!(
            f,
            "{:<24} {:>12} {:>14} {:>8} {:>16} {:>10} {:>12} {:>8}",
            "algorithm",
            "ifma ops/s",
            "boring ops/s",
            "ratio",
            "batch-8 latency",
            "crossover",
            "IFMA/batch",
            "of peak"
        )?;
        let opt = |v: Option<f64>, prec: usize, suffix: &str| match v {
            Some(x) => format!("{x:.prec$}{suffix}"),
            None => "-".to_string(),
        };
        for r in &self.rows {
            writeln!(
                f,
                "{:<24} {:>12} {:>14.0} {:>8} {:>16} {:>10} {:>12} {:>8}",
                r.algorithm,
                opt(r.ifma_ops_per_s, 0, ""),
                r.scalar_ops_per_s,
                opt(r.ratio, 2, "x"),
                opt(r.batch_latency_us, 0, " us"),
                r.crossover_batch.map(|c| c.to_string()).unwrap_or_else(|| "-".into()),
                r.ifma_per_batch.map(|c| c.to_string()).unwrap_or_else(|| "-".into()),
                opt(r.ifma_share_of_peak.map(|x| 100.0 * x), 1, "%"),
            )?;
        }
        Ok(())
    }
}

/// "pinned to CPU n" or why not.
fn pinned_line(cpu: Option<usize>) -> String {
    match cpu {
        Some(c) => format!("measuring thread pinned to CPU {c}"),
        None => "measuring thread NOT pinned (sched_setaffinity failed)".into(),
    }
}

/// The measured IFMA rate, or that there is none.
fn peak_line(peak: Option<f64>) -> String {
    match peak {
        Some(p) => format!(
            "IFMA peak (measured, {} independent vpmadd52luq chains, 512-bit): {:.2} G/s on this core",
            IFMA_PROBE_CHAINS,
            p / 1e9
        ),
        None => "IFMA peak: - (CPU lacks AVX-512 IFMA)".into(),
    }
}

#[cfg(target_arch = "x86_64")]
const IFMA_PROBE_CHAINS: usize = crate::mb::peak::CHAINS;
#[cfg(not(target_arch = "x86_64"))]
const IFMA_PROBE_CHAINS: usize = 0;

/// Share of the IFMA peak: `per_batch` IFMA per 8 signatures at `ops_per_s` signatures/s.
pub fn share_of_peak(
    per_batch: Option<u64>,
    ops_per_s: Option<f64>,
    peak: Option<f64>,
) -> Option<f64> {
    Some(per_batch? as f64 * ops_per_s? / LANES as f64 / peak?)
}

/// Keeps the calling thread on one CPU until dropped, then restores its previous affinity.
/// Threads and processes started from it meanwhile inherit the pin.
pub struct Pin {
    cpu: usize,
    old: libc::cpu_set_t,
    /// Not `Send`: it must be dropped on the thread it pinned.
    _thread: std::marker::PhantomData<*const ()>,
}

impl Pin {
    /// Pins to `cpu`, or by default to the last CPU the thread may run on now (CPU 0 takes most
    /// interrupts). `None` when the call fails.
    pub fn current_thread(cpu: Option<usize>) -> Option<Pin> {
        // SAFETY: cpu_set_t is plain data; sched_{get,set}affinity(0, ..) act on the calling
        // thread and only read/write the set passed by pointer with its exact size.
        unsafe {
            let mut old: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut old) != 0 {
                return None;
            }
            let allowed: Vec<usize> =
                (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &old)).collect();
            let cpu = match cpu {
                Some(c) => c,
                None => *allowed.last()?,
            };
            if cpu >= libc::CPU_SETSIZE as usize {
                return None;
            }
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return None;
            }
            Some(Pin { cpu, old, _thread: std::marker::PhantomData })
        }
    }

    pub fn cpu(&self) -> usize {
        self.cpu
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        // SAFETY: restores the mask read in `current_thread`, on the same thread (`Pin` is not
        // `Send`).
        unsafe {
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.old);
        }
    }
}

/// Median of `v` (the mean of the middle two for an even count); `None` when empty.
pub fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    Some(if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 })
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

/// Default alternating measurement rounds per algorithm (each side's median is reported).
pub const ROUNDS: u32 = 5;

/// A key for benchmarking (generated by BoringSSL, e = 65537).
fn bench_key(bits: usize) -> RsaPrivateKey {
    let rsa = boring::rsa::Rsa::generate(bits as u32).expect("RSA key generation");
    RsaPrivateKey::from_boring(&rsa).expect("generated key is valid")
}

/// Measures one RSA size: IFMA batches of eight (lanes cycle over several keys) and BoringSSL
/// single-op, alternating, `duration` each in total.
pub fn rsa_row(
    bits: usize,
    padding: Padding,
    duration: Duration,
    rounds: u32,
    ifma: bool,
) -> SpeedRow {
    let n_keys = if bits >= 4096 { 2 } else { 4 };
    let keys: Vec<RsaPrivateKey> = (0..n_keys).map(|_| bench_key(bits)).collect();
    let lane_keys: Vec<&RsaPrivateKey> = (0..LANES).map(|i| &keys[i % keys.len()]).collect();
    let msg: &[u8] = MESSAGE;
    let msgs = vec![msg; LANES];
    alternating_row(
        format!("RSA-{bits} {}", padding.name()),
        duration,
        rounds,
        ifma,
        crate::mb::rsa::ifma_per_batch(bits),
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
/// in alternating short rounds, reporting each side's median round — on a shared machine this
/// compares the two under the same conditions instead of whichever ran while another process had
/// the core.
fn alternating_row(
    algorithm: String,
    duration: Duration,
    rounds: u32,
    ifma: bool,
    ifma_per_batch: Option<u64>,
    mut scalar_op: impl FnMut(),
    mut ifma_op: impl FnMut(),
) -> SpeedRow {
    let run_ifma = ifma && mb::cpu_features().ifma_capable();
    let rounds = rounds.max(1);
    let slice = duration / rounds;
    let (mut scalar, mut ifma_ops, mut lat) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let (s, _) = measure_ops(slice, 1, &mut scalar_op);
        scalar.push(s);
        if run_ifma {
            let (o, l) = measure_ops(slice, LANES, &mut ifma_op);
            ifma_ops.push(o);
            lat.push(l.as_secs_f64() * 1e6);
        }
    }
    let scalar = median(&scalar).unwrap_or(0.0);
    let (ifma_ops, lat) = (median(&ifma_ops), median(&lat));
    SpeedRow {
        algorithm,
        ifma_ops_per_s: ifma_ops,
        scalar_ops_per_s: scalar,
        ratio: ifma_ops.map(|x| x / scalar),
        batch_latency_us: lat,
        crossover_batch: lat.map(|l| crossover(l, scalar)),
        ifma_per_batch: ifma_ops.and(ifma_per_batch),
        ifma_share_of_peak: None,
    }
}

/// Measures ECDSA P-256 signing (SHA-256, hedged nonces) the same way as RSA.
pub fn p256_row(duration: Duration, rounds: u32, ifma: bool) -> SpeedRow {
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
        rounds,
        ifma,
        Some(crate::mb::p256::IFMA_PER_BATCH),
        || assert!(sign_batch_with(Backend::Scalar, &lane_keys[..1], &msgs[..1])[0].is_ok()),
        || assert!(sign_batch_with(Backend::Ifma, &lane_keys, &msgs).iter().all(|r| r.is_ok())),
    )
}

/// Measures every configured algorithm on the calling thread, pinned to one core for the
/// duration. Takes about `2 · duration` per algorithm plus key generation and the IFMA probe.
pub fn run_speed(opts: &SpeedOptions) -> SpeedReport {
    let choice = mb::backend_choice();
    let pin = Pin::current_thread(opts.cpu);
    // A forced scalar backend measures the scalar path only: that is what the process would run.
    let ifma = opts.ifma && choice.backend == Backend::Ifma;
    let peak = mb::ifma_peak_per_s(Duration::from_millis(200));
    let mut rows: Vec<SpeedRow> = opts
        .rsa_bits
        .iter()
        .map(|&bits| rsa_row(bits, opts.rsa_padding, opts.duration, opts.rounds, ifma))
        .collect();
    rows.push(p256_row(opts.duration, opts.rounds, ifma));
    for r in &mut rows {
        r.ifma_share_of_peak = share_of_peak(r.ifma_per_batch, r.ifma_ops_per_s, peak);
    }
    SpeedReport {
        cpu: mb::cpu_description(),
        pinned_cpu: pin.as_ref().map(Pin::cpu),
        ifma_peak_per_s: peak,
        backend: choice.backend.to_string(),
        backend_reason: choice.reason.clone(),
        cpu_features: mb::cpu_features().to_string(),
        seconds_per_measurement: opts.duration.as_secs_f64(),
        rounds: opts.rounds.max(1),
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
    s.push_str(routes(c.backend));
    s.push_str(
        "RSA fault-check failures of a running proxy: mbtunnel_signer_fault_check_failures_total \
         on its :15020/metrics\n",
    );
    s
}

/// How the signer signs each kind of key on `backend` (what `doctor` prints).
fn routes(backend: mb::Backend) -> &'static str {
    match backend {
        mb::Backend::Ifma => {
            "keys:\n  \
             RSA 2048/3072/4096-bit, e = 65537: IFMA batches of up to 8, each signature checked \
             against the public key before it is released (fault check)\n  \
             ECDSA P-256: IFMA batches of up to 8\n  \
             (a batch of at most the crossover, or signer_scalar_below, and a cheap request on \
             an idle signer sign with BoringSSL instead: README, \"The signer\")\n  \
             other keys: BoringSSL, one signature at a time\n"
        }
        mb::Backend::Scalar => {
            "keys:\n  \
             every key: BoringSSL, one signature at a time (the scalar backend makes no batches)\n"
        }
        mb::Backend::Model => {
            "WARNING: model is a TEST backend (the portable model of the IFMA kernels, scalar \
             code, many times slower than BoringSSL); never use it in production\n\
             keys:\n  \
             RSA 2048/3072/4096-bit, e = 65537: model batches of up to 8, each signature checked \
             against the public key before it is released (fault check)\n  \
             ECDSA P-256: model batches of up to 8\n  \
             other keys: BoringSSL, one signature at a time\n"
        }
    }
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
    fn doctor_claims_batches_only_on_the_ifma_backend() {
        let (ifma, scalar) = (routes(mb::Backend::Ifma), routes(mb::Backend::Scalar));
        assert!(ifma.contains("RSA 2048/3072/4096-bit, e = 65537: IFMA batches"), "{ifma}");
        assert!(ifma.contains("ECDSA P-256: IFMA batches"), "{ifma}");
        assert!(!scalar.contains("IFMA batches") && !scalar.contains("lanes"), "{scalar}");
        assert!(scalar.contains("every key: BoringSSL, one signature at a time"), "{scalar}");
        let model = routes(mb::Backend::Model);
        assert!(model.contains("TEST backend") && model.contains("model batches"), "{model}");
        // A fresh process has signed nothing: it names where a running proxy's count is instead.
        assert!(doctor().contains("mbtunnel_signer_fault_check_failures_total"));
    }

    #[test]
    fn report_renders_as_table_and_json() {
        let r = SpeedReport {
            cpu: "Test CPU (family 26 model 2)".into(),
            pinned_cpu: Some(1),
            ifma_peak_per_s: Some(8.0e9),
            backend: "ifma".into(),
            backend_reason: "test".into(),
            cpu_features: "avx512f".into(),
            seconds_per_measurement: 1.0,
            rounds: 5,
            rows: vec![
                SpeedRow {
                    algorithm: "RSA-2048 pkcs1-sha256".into(),
                    ifma_ops_per_s: Some(10000.0),
                    scalar_ops_per_s: 1250.0,
                    ratio: Some(8.0),
                    batch_latency_us: Some(800.0),
                    crossover_batch: Some(2),
                    ifma_per_batch: Some(3_600_000),
                    ifma_share_of_peak: Some(0.5625),
                },
                SpeedRow {
                    algorithm: "RSA-4096 pkcs1-sha256".into(),
                    ifma_ops_per_s: None,
                    scalar_ops_per_s: 175.0,
                    ratio: None,
                    batch_latency_us: None,
                    crossover_batch: None,
                    ifma_per_batch: None,
                    ifma_share_of_peak: None,
                },
            ],
        };
        let t = r.to_string();
        assert!(t.contains("RSA-2048 pkcs1-sha256") && t.contains("8.00x"), "{t}");
        assert!(t.contains("cpu: Test CPU (family 26 model 2)") && t.contains("8.00 G/s"), "{t}");
        assert!(t.contains("56.2%"), "{t}");
        let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!(v["rows"][0]["ratio"], 8.0);
        assert!(v["rows"][1]["ifma_ops_per_s"].is_null());
    }

    #[test]
    fn medians_and_shares() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
        // 10,000 sig/s = 1,250 batches/s × 3.2 M IFMA = 4 G/s of an 8 G/s peak.
        let s = share_of_peak(Some(3_200_000), Some(10_000.0), Some(8e9)).unwrap();
        assert!((s - 0.5).abs() < 1e-12, "{s}");
        assert_eq!(share_of_peak(None, Some(1.0), Some(1.0)), None);
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
            rounds: 3,
            ..Default::default()
        };
        let r = run_speed(&opts);
        assert!(!r.cpu.is_empty());
        assert_eq!(r.ifma_peak_per_s.is_some(), crate::mb::cpu_features().ifma_capable());
        assert_eq!(r.rows.len(), 2, "RSA-2048 and ECDSA P-256");
        assert!(r.rows[1].algorithm.starts_with("ECDSA-P256"));
        for row in &r.rows {
            assert!(row.scalar_ops_per_s > 0.0);
            assert_eq!(row.ifma_ops_per_s.is_some(), crate::mb::backend() == Backend::Ifma);
        }
    }
}
