//! Multi-buffer signing core: eight independent signatures per instruction stream, one per 64-bit
//! lane of 512-bit registers, radix 2^52 limbs with AVX-512 IFMA. Synchronous; no tokio, no proxy
//! types. The only home of `unsafe` SIMD in the crate.
//!
//! One dispatch point ([`backend`]) chooses, once, between the IFMA kernels and the scalar
//! BoringSSL single-op path; the choice and the reason are observable ([`backend_choice`]).
//! The kernels themselves can only be reached with a capability value ([`cpu::Ifma`] and its
//! siblings), which only run-time detection of every feature they are compiled with produces.
//!
//! The kernels are built twice from one source (`rsa/kernel.rs`, `p256/kernel.rs`): the IFMA
//! build over the AVX-512 wrapper [`simd`], and a portable model build over [`simd_model`]
//! (`[u64; 8]` lanes, each operation as the instruction defines it). The model runs the same
//! code path on every CPU, for tests, fuzzing and the `model` test backend ([`Backend::Model`]),
//! which is only ever used when forced and is never a production backend.

use std::fmt;
use std::sync::OnceLock;

pub mod cpu;
pub mod p256;
#[cfg(target_arch = "x86_64")]
pub mod peak;
pub mod rsa;
pub use cpu::{require_ifma, Ifma};
#[doc(hidden)]
pub mod timing;
pub use rsa::{RsaBatch, RsaPrivateKey};
#[cfg(target_arch = "x86_64")]
pub(crate) mod simd;
pub(crate) mod simd_model;

/// Number of lanes in one batch.
pub const LANES: usize = 8;

/// Environment variable that forces a backend (`scalar`, `ifma`, or the test backend `model`).
pub const BACKEND_ENV: &str = "MBTUNNEL_SIGNER_BACKEND";

/// Environment variable for tests: `1` hides AVX-512 IFMA from this process (detection reports
/// it absent, `auto` chooses `scalar`, IFMA tests skip or — under `REQUIRE_IFMA=1` — fail), so
/// that the path of a CPU without it can be exercised on one that has it.
pub const NO_IFMA_ENV: &str = "MBTUNNEL_MB_NO_IFMA";

/// Which implementation computes signatures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// AVX-512 IFMA multi-buffer kernels (8 lanes).
    Ifma,
    /// BoringSSL, one operation at a time.
    Scalar,
    /// Test backend: the portable model of the IFMA kernels (the same kernel source over
    /// `[u64; 8]` lanes), 8 lanes, on any CPU. Much slower than either production backend; only
    /// used when forced (`MBTUNNEL_SIGNER_BACKEND=model`), never chosen automatically.
    Model,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Ifma => "ifma",
            Backend::Scalar => "scalar",
            Backend::Model => "model",
        }
    }

    /// True for the backends that sign eight lanes per pass (IFMA and its model): the signer
    /// batches for these, and sends everything to BoringSSL single-op otherwise.
    pub fn is_multi_buffer(self) -> bool {
        matches!(self, Backend::Ifma | Backend::Model)
    }

    /// True for a backend that exists for tests only (the model).
    pub fn is_test_only(self) -> bool {
        self == Backend::Model
    }
}

/// Which build of the multi-buffer kernels runs a batch: the IFMA build (with the proof that
/// the CPU has the features) or the portable model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernels {
    #[cfg(target_arch = "x86_64")]
    Ifma(Ifma),
    Model,
}

impl Kernels {
    /// The kernels a backend runs: `None` for the scalar backend, and for IFMA on a CPU
    /// without it (never a fallback to the model).
    pub(crate) fn for_backend(backend: Backend) -> Option<Kernels> {
        match backend {
            Backend::Scalar => None,
            Backend::Model => Some(Kernels::Model),
            #[cfg(target_arch = "x86_64")]
            Backend::Ifma => Ifma::detect().map(Kernels::Ifma),
            #[cfg(not(target_arch = "x86_64"))]
            Backend::Ifma => None,
        }
    }
}

/// The multi-buffer backends a test should run on this machine: always the model; IFMA too
/// where the CPU has it. Where it does not, [`require_ifma`] prints that the IFMA part of
/// `what` is skipped (and panics under `REQUIRE_IFMA=1`), so the skip is never silent.
#[doc(hidden)]
pub fn test_backends(what: &str) -> Vec<Backend> {
    let mut v = vec![Backend::Model];
    if require_ifma(&format!("{what} (IFMA part; the model part runs)")).is_some() {
        v.push(Backend::Ifma);
    }
    v
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// CPU features relevant to the multi-buffer kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuFeatures {
    pub avx512f: bool,
    pub avx512ifma: bool,
    pub avx512vl: bool,
}

impl CpuFeatures {
    /// True when the IFMA kernels can run.
    pub fn ifma_capable(&self) -> bool {
        self.avx512f && self.avx512ifma && self.avx512vl
    }
}

impl fmt::Display for CpuFeatures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names = Vec::new();
        if self.avx512f {
            names.push("avx512f");
        }
        if self.avx512ifma {
            names.push("avx512ifma");
        }
        if self.avx512vl {
            names.push("avx512vl");
        }
        if names.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&names.join(","))
        }
    }
}

/// True when [`NO_IFMA_ENV`] is `1` (read once per process).
pub fn ifma_hidden() -> bool {
    static HIDDEN: OnceLock<bool> = OnceLock::new();
    *HIDDEN.get_or_init(|| std::env::var(NO_IFMA_ENV).as_deref() == Ok("1"))
}

/// Detects the CPU features at run time (AVX-512 IFMA reads as absent under [`NO_IFMA_ENV`]).
pub fn cpu_features() -> CpuFeatures {
    #[cfg(target_arch = "x86_64")]
    {
        CpuFeatures {
            avx512f: std::arch::is_x86_feature_detected!("avx512f"),
            avx512ifma: std::arch::is_x86_feature_detected!("avx512ifma") && !ifma_hidden(),
            avx512vl: std::arch::is_x86_feature_detected!("avx512vl"),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        CpuFeatures { avx512f: false, avx512ifma: false, avx512vl: false }
    }
}

/// The CPU's model name (`/proc/cpuinfo`), for naming the machine next to every figure.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// The CPU's family and model numbers (`/proc/cpuinfo`, decimal), e.g. `(26, 2)` for a Zen 5
/// EPYC: the model name alone ("AMD EPYC") does not tell the generations apart under KVM.
pub fn cpu_family_model() -> Option<(u32, u32)> {
    let s = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let field = |name: &str| -> Option<u32> {
        s.lines()
            .find(|l| l.split(':').next().map(str::trim) == Some(name))
            .and_then(|l| l.split_once(':'))
            .and_then(|(_, v)| v.trim().parse().ok())
    };
    Some((field("cpu family")?, field("model")?))
}

/// The CPU named as every figure should name it: model name plus family/model numbers.
pub fn cpu_description() -> String {
    match cpu_family_model() {
        Some((f, m)) => format!("{} (family {f} model {m})", cpu_model()),
        None => cpu_model(),
    }
}

/// Measured IFMA instructions per second on the calling thread's core ([`peak`]), or `None`
/// when the CPU lacks AVX-512 IFMA.
pub fn ifma_peak_per_s(duration: std::time::Duration) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if let Some(cap) = Ifma::detect() {
        return Some(peak::ifma_peak_per_s(cap, duration));
    }
    let _ = duration;
    None
}

/// The backend chosen at start-up and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendChoice {
    pub backend: Backend,
    pub features: CpuFeatures,
    pub reason: String,
}

/// Chooses a backend from a requested mode (`None`/`auto`, `ifma`, `scalar`, `model`) and the CPU
/// features. Asking for `ifma` on a CPU without it is an error, never a silent fallback. `auto`
/// never chooses `model`: that test backend is only ever used when asked for by name.
pub fn choose_backend(
    requested: Option<&str>,
    features: CpuFeatures,
) -> Result<BackendChoice, MbError> {
    let req = requested.map(|s| s.trim().to_ascii_lowercase());
    match req.as_deref() {
        None | Some("") | Some("auto") => Ok(if features.ifma_capable() {
            BackendChoice {
                backend: Backend::Ifma,
                features,
                reason: "CPU has avx512f, avx512ifma and avx512vl".into(),
            }
        } else {
            BackendChoice {
                backend: Backend::Scalar,
                features,
                reason: format!("CPU lacks AVX-512 IFMA (detected: {features}); using BoringSSL single-op"),
            }
        }),
        Some("scalar") => Ok(BackendChoice {
            backend: Backend::Scalar,
            features,
            reason: "forced by configuration".into(),
        }),
        Some("ifma") if features.ifma_capable() => Ok(BackendChoice {
            backend: Backend::Ifma,
            features,
            reason: "forced by configuration".into(),
        }),
        Some("ifma") => Err(MbError::Unsupported(format!(
            "backend 'ifma' requested but the CPU lacks AVX-512 IFMA (detected: {features}); use 'scalar' or 'auto'"
        ))),
        Some("model") => Ok(BackendChoice {
            backend: Backend::Model,
            features,
            reason: MODEL_REASON.into(),
        }),
        Some(other) => Err(MbError::Unsupported(format!(
            "unknown signer backend '{other}': expected auto, ifma or scalar (or the test backend model)"
        ))),
    }
}

/// The reason given when the model backend is forced (start-up log, doctor, metrics info).
pub const MODEL_REASON: &str = "forced by configuration: TEST BACKEND (portable model of the IFMA \
     kernels, scalar code, much slower; never for production)";

static CHOICE: OnceLock<BackendChoice> = OnceLock::new();

/// Fixes the process-wide backend from a configured mode. The first call wins; later calls return
/// the choice already made. Without a call, [`backend_choice`] uses `MBTUNNEL_SIGNER_BACKEND`.
pub fn init_backend(requested: Option<&str>) -> Result<&'static BackendChoice, MbError> {
    if let Some(c) = CHOICE.get() {
        return Ok(c);
    }
    let choice = choose_backend(requested, cpu_features())?;
    Ok(CHOICE.get_or_init(|| choice))
}

/// The process-wide backend choice (made on first use from `MBTUNNEL_SIGNER_BACKEND`, or `auto`
/// when that is unset or invalid — an invalid value is reported in the reason).
pub fn backend_choice() -> &'static BackendChoice {
    CHOICE.get_or_init(|| {
        let env = std::env::var(BACKEND_ENV).ok();
        match choose_backend(env.as_deref(), cpu_features()) {
            Ok(c) => c,
            Err(e) => {
                let mut c = choose_backend(None, cpu_features()).expect("auto never fails");
                c.reason = format!("{e}; fell back to auto: {}", c.reason);
                c
            }
        }
    })
}

/// The process-wide backend.
pub fn backend() -> Backend {
    backend_choice().backend
}

/// Errors of the multi-buffer core. Per lane where a batch is involved.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MbError {
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("invalid key: {0}")]
    InvalidKey(String),
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("RSA fault check failed: signature did not verify with the public key")]
    FaultCheck,
    #[error("BoringSSL: {0}")]
    Boring(String),
}

impl From<boring::error::ErrorStack> for MbError {
    fn from(e: boring::error::ErrorStack) -> Self {
        MbError::Boring(e.to_string())
    }
}

/// Evaluates `$e` with `$k` bound to the model build (`super::model` where it is used), then (in
/// `unsafe`: the caller checked the capability) to the IFMA build (`super::ifma`), and asserts
/// the two results are equal. The kernels' cross tests (`rsa`, `p256`) share it.
#[cfg(test)]
macro_rules! both {
    ($what:expr, $k:ident => $e:expr) => {{
        let model = {
            use super::model as $k;
            $e
        };
        // SAFETY: every test obtains the `Ifma` capability before calling this.
        #[allow(unused_unsafe)]
        let ifma = unsafe {
            use super::ifma as $k;
            $e
        };
        assert!(model == ifma, "{}: model and IFMA builds differ", $what);
        model
    }};
}
#[cfg(test)]
pub(crate) use both;

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: CpuFeatures = CpuFeatures { avx512f: true, avx512ifma: true, avx512vl: true };
    const NONE: CpuFeatures = CpuFeatures { avx512f: false, avx512ifma: false, avx512vl: false };

    #[test]
    fn auto_follows_cpu() {
        assert_eq!(choose_backend(None, ALL).unwrap().backend, Backend::Ifma);
        assert_eq!(choose_backend(Some("auto"), NONE).unwrap().backend, Backend::Scalar);
    }

    /// The model is never an automatic choice, whatever the CPU.
    #[test]
    fn auto_never_chooses_the_model() {
        for f in [ALL, NONE, CpuFeatures { avx512f: true, avx512ifma: false, avx512vl: true }] {
            for req in [None, Some(""), Some("auto"), Some(" AUTO ")] {
                let c = choose_backend(req, f).unwrap();
                assert_ne!(c.backend, Backend::Model, "{req:?} on {f}");
                assert!(!c.backend.is_test_only());
            }
        }
        assert!(Backend::Model.is_multi_buffer() && Backend::Ifma.is_multi_buffer());
        assert!(!Backend::Scalar.is_multi_buffer());
    }

    #[test]
    fn forced_modes() {
        assert_eq!(choose_backend(Some("scalar"), ALL).unwrap().backend, Backend::Scalar);
        assert!(choose_backend(Some("ifma"), NONE).is_err());
        for f in [ALL, NONE] {
            let c = choose_backend(Some("model"), f).unwrap();
            assert_eq!(c.backend, Backend::Model);
            assert!(c.reason.contains("TEST BACKEND"), "{}", c.reason);
        }
        let e = choose_backend(Some("gpu"), ALL).unwrap_err().to_string();
        assert!(e.contains("gpu"), "{e}");
    }
}
