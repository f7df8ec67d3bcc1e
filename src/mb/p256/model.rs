//! The portable model build of the P-256 kernels (`kernel.rs`): the same source as
//! `p256::ifma`, compiled with no target feature over `mb::simd_model`'s [`U64x8`] (`[u64; 8]`,
//! each operation computed as the AVX-512 instruction defines it). It runs on every CPU: the
//! multi-buffer tests and the `model` test backend use it where AVX-512 IFMA is absent, and
//! compare it with the IFMA build bit for bit where it is present. Never a production backend.
#![forbid(unsafe_code)]
#![allow(clippy::needless_range_loop)]

pub(crate) use crate::mb::simd_model::{Mask8, U64x8, MASK52};

/// Wraps one kernel function of the shared source: no target feature.
macro_rules! kfn {
    ($(#[$m:meta])* $vis:vis fn $($rest:tt)*) => {
        $(#[$m])*
        $vis fn $($rest)*
    };
}

include!("kernel.rs");

/// One batch of eight ECDSA signatures (see `sign8_kernel`) on the model. Runs on any CPU.
pub(crate) fn sign8(
    d: &[[u8; 32]; 8],
    e: &[[u8; 32]; 8],
    k: &[[u8; 32]; 8],
) -> ([[u8; 32]; 8], [[u8; 32]; 8]) {
    sign8_kernel(d, e, k)
}
