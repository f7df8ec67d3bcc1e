//! CPU capabilities as values. Every function of `crate::mb` compiled with
//! `#[target_feature(enable = …)]` is reachable only through an entry point that takes one of
//! these types as a parameter, and each type can only be built by its `detect()`, which checks
//! *every* feature in its `FEATURES` list at run time. A unit test below reads the sources of
//! `crate::mb` and fails if some `#[target_feature(enable = …)]` enables a feature that no
//! capability checks, so a kernel cannot start using a new instruction set without its detector
//! learning about it.
//!
//! | type | features checked | entry points |
//! |---|---|---|
//! | [`Ifma`] | avx512f, avx512ifma, avx512vl | `rsa::ifma::crt_batch`, `p256::ifma::sign8` |
//! | [`ShaNi`] | sha, sse2, ssse3, sse4.1 | `p256::sha` one-lane SHA-256 compression |
//! | [`Avx512Vl`] | avx2, avx512f, avx512vl | `p256::sha` eight-lane SHA-256 compression |
//!
//! The fields are private and there is no other constructor, so holding a value is a proof that
//! detection succeeded in this process (the values are `Copy`: pass them down freely).

/// Proof that the CPU has AVX-512 F, IFMA and VL: everything the IFMA kernels
/// (`mb::simd`, `mb::rsa::ifma`, `mb::p256::ifma`) are compiled with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ifma(());

/// Proof that the CPU has the SHA extensions and the SSE levels the SHA-NI compression uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShaNi(());

/// Proof that the CPU has AVX2, AVX-512F and AVX-512VL (eight SHA-256 lanes in a ymm register).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Avx512Vl(());

#[cfg(target_arch = "x86_64")]
macro_rules! all_detected {
    ($($f:tt),+) => { true $(&& std::arch::is_x86_feature_detected!($f))+ };
}

impl Ifma {
    /// The features checked, exactly those the IFMA kernels' `target_feature` attributes enable.
    pub const FEATURES: &'static [&'static str] = &["avx512f", "avx512ifma", "avx512vl"];

    /// `Some` only if the CPU has every feature in [`Ifma::FEATURES`] (and the test switch
    /// `MBTUNNEL_MB_NO_IFMA=1`, [`crate::mb::NO_IFMA_ENV`], does not hide it).
    pub fn detect() -> Option<Ifma> {
        #[cfg(target_arch = "x86_64")]
        if all_detected!("avx512f", "avx512ifma", "avx512vl") && !crate::mb::ifma_hidden() {
            return Some(Ifma(()));
        }
        None
    }
}

impl ShaNi {
    pub const FEATURES: &'static [&'static str] = &["sha", "sse2", "ssse3", "sse4.1"];

    /// `Some` only if the CPU has every feature in [`ShaNi::FEATURES`].
    pub fn detect() -> Option<ShaNi> {
        #[cfg(target_arch = "x86_64")]
        if all_detected!("sha", "sse2", "ssse3", "sse4.1") {
            return Some(ShaNi(()));
        }
        None
    }
}

impl Avx512Vl {
    pub const FEATURES: &'static [&'static str] = &["avx2", "avx512f", "avx512vl"];

    /// `Some` only if the CPU has every feature in [`Avx512Vl::FEATURES`].
    pub fn detect() -> Option<Avx512Vl> {
        #[cfg(target_arch = "x86_64")]
        if all_detected!("avx2", "avx512f", "avx512vl") {
            return Some(Avx512Vl(()));
        }
        None
    }
}

/// Environment variable: when `1`, a test that needs IFMA and finds none fails instead of
/// skipping (CI sets it on machines whose CPU has the features).
pub const REQUIRE_IFMA_ENV: &str = "REQUIRE_IFMA";

/// The one helper tests use to get an [`Ifma`] capability: `Some` when the CPU has it; otherwise
/// prints that `what` is skipped and returns `None` — unless `REQUIRE_IFMA=1`, in which case it
/// panics, so that a skip cannot pass silently on a machine that was meant to run the kernels.
#[doc(hidden)]
pub fn require_ifma(what: &str) -> Option<Ifma> {
    let cap = Ifma::detect();
    if cap.is_none() {
        let detected = crate::mb::cpu_features();
        if std::env::var(REQUIRE_IFMA_ENV).as_deref() == Ok("1") {
            panic!(
                "{REQUIRE_IFMA_ENV}=1 but the CPU lacks AVX-512 IFMA (detected: {detected}): \
                 {what} cannot run"
            );
        }
        eprintln!("skipped: {what} needs AVX-512 IFMA; the CPU has {detected}");
    }
    cap
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `.rs` file under `src/mb`, read at test time (a new file is scanned without
    /// anyone listing it).
    fn sources() -> Vec<(String, String)> {
        fn walk(dir: &std::path::Path, out: &mut Vec<(String, String)>) {
            for e in std::fs::read_dir(dir).expect("src/mb readable") {
                let p = e.unwrap().path();
                if p.is_dir() {
                    walk(&p, out);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    out.push((p.display().to_string(), std::fs::read_to_string(&p).unwrap()));
                }
            }
        }
        let mut out = Vec::new();
        walk(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/mb"), &mut out);
        out
    }

    /// The feature lists of every `target_feature` attribute with an `enable` list in `src`.
    fn enabled_sets(src: &str) -> Vec<Vec<String>> {
        let pat = concat!("#[target_feature(", "enable = \"");
        src.match_indices(pat)
            .map(|(i, _)| {
                let rest = &src[i + pat.len()..];
                let list = &rest[..rest.find('"').expect("closing quote")];
                list.split(',').map(|f| f.trim().to_string()).collect()
            })
            .collect()
    }

    #[test]
    fn every_target_feature_set_is_checked_by_one_capability() {
        let caps: [(&str, &[&str]); 3] = [
            ("Ifma", Ifma::FEATURES),
            ("ShaNi", ShaNi::FEATURES),
            ("Avx512Vl", Avx512Vl::FEATURES),
        ];
        let mut seen = 0;
        for (file, src) in sources() {
            for set in enabled_sets(&src) {
                seen += 1;
                let covered = caps
                    .iter()
                    .any(|(_, checked)| set.iter().all(|f| checked.contains(&f.as_str())));
                assert!(
                    covered,
                    "{file}: #[target_feature(enable = \"{}\")] enables a feature that no \
                     capability type checks",
                    set.join(",")
                );
            }
        }
        // simd.rs (21 wrapped intrinsics), the two `kfn!` macros of the IFMA kernel builds,
        // peak.rs and sha.rs.
        assert!(seen > 25, "the scan found the kernels ({seen} attributes)");
        // The shared kernel sources and the portable model carry no target feature: the model
        // build of the kernels must run on any CPU (the IFMA build gets its features from the
        // `kfn!` wrapper of `rsa/ifma.rs` and `p256/ifma.rs`).
        let attr = concat!("#[target_", "feature");
        let mut model_files = 0;
        for (file, src) in sources() {
            if ["kernel.rs", "model.rs", "simd_model.rs", "limbs.rs"]
                .iter()
                .any(|f| file.ends_with(f))
            {
                model_files += 1;
                assert!(!src.contains(attr), "{file} must not enable target features");
            }
            if file.ends_with("ifma.rs") && src.contains("include!(\"kernel.rs\")") {
                assert!(
                    src.contains(concat!(
                        "#[target_feature(",
                        "enable = \"avx512f,avx512ifma,avx512vl\")]"
                    )),
                    "{file}"
                );
            }
        }
        assert!(model_files >= 6, "kernel sources and model files found ({model_files})");
        // The scanner itself sees through a set that no capability covers.
        let bad = concat!("#[target_feature(", "enable = \"avx512f,gfni\")]");
        let sets = enabled_sets(bad);
        assert!(!caps.iter().any(|(_, c)| sets[0].iter().all(|f| c.contains(&f.as_str()))));
    }

    #[test]
    fn detection_agrees_with_the_feature_flags() {
        let f = crate::mb::cpu_features();
        assert_eq!(Ifma::detect().is_some(), f.ifma_capable());
        #[cfg(target_arch = "x86_64")]
        {
            let sha = std::arch::is_x86_feature_detected!("sha")
                && std::arch::is_x86_feature_detected!("sse2")
                && std::arch::is_x86_feature_detected!("ssse3")
                && std::arch::is_x86_feature_detected!("sse4.1");
            assert_eq!(ShaNi::detect().is_some(), sha);
        }
    }
}
