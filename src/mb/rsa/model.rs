//! The portable model build of the RSA-CRT kernels (`kernel.rs`): the same source as
//! `rsa::ifma`, compiled with no target feature over `mb::simd_model`'s [`U64x8`] (`[u64; 8]`,
//! each operation computed as the AVX-512 instruction defines it). It runs on every CPU: the
//! multi-buffer tests and the `model` test backend use it where AVX-512 IFMA is absent, and
//! compare it with the IFMA build bit for bit where it is present. Never a production backend.
#![forbid(unsafe_code)]

pub(crate) use crate::mb::simd_model::{U64x8, MASK52};

/// Which build this is (test output).
#[cfg(test)]
const BUILD: &str = "model";

/// Wraps one kernel function of the shared source: no target feature.
macro_rules! kfn {
    ($(#[$m:meta])* $vis:vis fn $($rest:tt)*) => {
        $(#[$m])*
        $vis fn $($rest)*
    };
}

/// A call into a kernel function from the tests: a plain call in this build.
#[cfg(test)]
macro_rules! kcall {
    ($($t:tt)*) => {
        { $($t)* }
    };
}

/// The RSA-CRT private operation on eight lanes with the fault check (see `crt_batch_kernel`),
/// on the model. Runs on any CPU.
pub(crate) fn crt_batch<const L: usize, const L2: usize, const L4: usize>(
    keys: &[LaneKey<'_>; 8],
    em: &[&[u64]; 8],
    ebits: usize,
    w: usize,
    corrupt: u8,
) -> BatchOut<L2> {
    crt_batch_kernel::<L, L2, L4>(keys, em, ebits, w, corrupt)
}

/// The model runs everywhere.
#[cfg(test)]
fn kernels_here(_what: &str) -> bool {
    true
}

// The kernels, last: the source carries the test module (clippy: no items after it).
include!("kernel.rs");
