//! The IFMA build of the P-256 kernels (`kernel.rs`): every kernel function is a
//! `#[target_feature(enable = "avx512f,avx512ifma,avx512vl")]` function over the AVX-512
//! [`U64x8`] of `mb::simd`. The portable model build of the same source is `p256::model`.
//!
//! The only entry from outside is [`sign8`], a safe function that requires the
//! [`crate::mb::Ifma`] capability (proof that run-time detection found avx512f, avx512ifma and
//! avx512vl). The unit tests (`p256/tests.rs`) call the inner kernels directly, each after
//! obtaining that capability. See `NOTES.md` for the representation, bounds and constant-time
//! argument.
#![allow(clippy::needless_range_loop)]

pub(crate) use crate::mb::simd::{Mask8, U64x8, MASK52};

/// Wraps one kernel function of the shared source: adds the IFMA target features.
macro_rules! kfn {
    ($(#[$m:meta])* $vis:vis fn $($rest:tt)*) => {
        $(#[$m])*
        #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
        $vis fn $($rest)*
    };
}

include!("kernel.rs");

/// One batch of eight ECDSA signatures (see `sign8_kernel`). The capability argument is the
/// proof that the CPU has the kernels' features.
pub(crate) fn sign8(
    _cap: crate::mb::Ifma,
    d: &[[u8; 32]; 8],
    e: &[[u8; 32]; 8],
    k: &[[u8; 32]; 8],
) -> ([[u8; 32]; 8], [[u8; 32]; 8]) {
    // SAFETY: an `Ifma` value exists only after run-time detection of avx512f, avx512ifma and
    // avx512vl, the features `sign8_kernel` is compiled with.
    unsafe { sign8_kernel(d, e, k) }
}
