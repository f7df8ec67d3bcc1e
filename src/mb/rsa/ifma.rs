//! The IFMA build of the RSA-CRT kernels (`kernel.rs`): every kernel function is a
//! `#[target_feature(enable = "avx512f,avx512ifma,avx512vl")]` function over the AVX-512
//! [`U64x8`] of `mb::simd`. The portable model build of the same source is `rsa::model`.
//!
//! The only entry from outside is [`crt_batch`], a safe function that requires the
//! [`crate::mb::Ifma`] capability (proof that run-time detection found all three features).
//! See `kernel.rs` for the constant-time argument.

pub(crate) use crate::mb::simd::{U64x8, MASK52};

/// Which build this is (test output).
#[cfg(test)]
const BUILD: &str = "ifma";

/// Wraps one kernel function of the shared source: adds the IFMA target features.
macro_rules! kfn {
    ($(#[$m:meta])* $vis:vis fn $($rest:tt)*) => {
        $(#[$m])*
        #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
        $vis fn $($rest)*
    };
}

/// A call into a kernel function from the tests: `unsafe` in this build.
#[cfg(test)]
macro_rules! kcall {
    ($($t:tt)*) => {
        // SAFETY: the kernel tests call kernel functions only after `kernels_here` returned true,
        // i.e. after run-time detection of avx512f, avx512ifma and avx512vl.
        unsafe { $($t)* }
    };
}

/// The RSA-CRT private operation on eight lanes with the fault check (see `crt_batch_kernel`).
/// The capability argument is the proof that the CPU has the kernels' features.
pub(crate) fn crt_batch<const L: usize, const L2: usize, const L4: usize>(
    _cap: crate::mb::Ifma,
    keys: &[LaneKey<'_>; 8],
    em: &[&[u64]; 8],
    ebits: usize,
    w: usize,
    corrupt: u8,
) -> BatchOut<L2> {
    // SAFETY: an `Ifma` value exists only after run-time detection of avx512f, avx512ifma and
    // avx512vl, the features `crt_batch_kernel` is compiled with.
    unsafe { crt_batch_kernel::<L, L2, L4>(keys, em, ebits, w, corrupt) }
}

/// Whether the kernels of this build can run here; otherwise the skip is printed (and is a
/// failure under `REQUIRE_IFMA=1`).
#[cfg(test)]
fn kernels_here(what: &str) -> bool {
    crate::mb::require_ifma(&format!("{what} (IFMA build)")).is_some()
}

// The kernels, last: the source carries the test module (clippy: no items after it).
include!("kernel.rs");
