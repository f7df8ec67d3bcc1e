// `U64x8`: eight 64-bit lanes in one 512-bit register, the single wrapper around the AVX-512
// intrinsics used by the multi-buffer kernels.
//
// Invariant the caller keeps: every method is a `#[target_feature]` function, so it may only be
// reached from kernels that carry the same features (`avx512f,avx512ifma,avx512vl`), and those
// kernels are called only after `crate::mb` runtime detection confirmed the CPU has them. Inside
// such kernels the calls are safe and inline; outside, calling one needs `unsafe` and a reason.
//
// `mb::simd_model` is the portable model of this type (same names, same operations, on
// `[u64; 8]`); the kernels are compiled against each from one source.
//
// Lane `i` always belongs to request `i`; no method here moves data across lanes except the
// explicit transpose helpers, so lane-crossing bugs can only come from those.


use core::arch::x86_64::*;

/// Eight unsigned 64-bit lanes.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct U64x8(pub __m512i);

/// Per-lane boolean mask (bit `i` = lane `i`).
pub type Mask8 = __mmask8;

impl U64x8 {
    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn zero() -> Self {
        Self(_mm512_setzero_si512())
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn splat(x: u64) -> Self {
        Self(_mm512_set1_epi64(x as i64))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn from_array(a: [u64; 8]) -> Self {
        // SAFETY: `a` is 64 readable bytes; unaligned load.
        Self(unsafe { _mm512_loadu_si512(a.as_ptr() as *const _) })
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn to_array(self) -> [u64; 8] {
        let mut out = [0u64; 8];
        // SAFETY: `out` is 64 writable bytes; unaligned store.
        unsafe { _mm512_storeu_si512(out.as_mut_ptr() as *mut _, self.0) };
        out
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn add(self, b: Self) -> Self {
        Self(_mm512_add_epi64(self.0, b.0))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn sub(self, b: Self) -> Self {
        Self(_mm512_sub_epi64(self.0, b.0))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn and(self, b: Self) -> Self {
        Self(_mm512_and_si512(self.0, b.0))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn or(self, b: Self) -> Self {
        Self(_mm512_or_si512(self.0, b.0))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn xor(self, b: Self) -> Self {
        Self(_mm512_xor_si512(self.0, b.0))
    }

    /// Logical shift right of every lane by `N` bits.
    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn shr<const N: u32>(self) -> Self {
        Self(_mm512_srli_epi64::<N>(self.0))
    }

    /// Shift left of every lane by `N` bits.
    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn shl<const N: u32>(self) -> Self {
        Self(_mm512_slli_epi64::<N>(self.0))
    }

    /// Arithmetic shift right (sign-extending) of every lane by `N` bits.
    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn sra<const N: u32>(self) -> Self {
        Self(_mm512_srai_epi64::<N>(self.0))
    }

    /// `self + lo52(b * c)` per lane, with `b`, `c` taken as 52-bit values.
    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn madd52lo(self, b: Self, c: Self) -> Self {
        Self(_mm512_madd52lo_epu64(self.0, b.0, c.0))
    }

    /// `self + hi52(b * c)` per lane (bits 52..104 of the 104-bit product).
    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn madd52hi(self, b: Self, c: Self) -> Self {
        Self(_mm512_madd52hi_epu64(self.0, b.0, c.0))
    }

    /// Lanes where `self == b`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn eq_mask(self, b: Self) -> Mask8 {
        _mm512_cmpeq_epi64_mask(self.0, b.0)
    }

    /// Lanes where `self < b` (unsigned).
    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn lt_mask(self, b: Self) -> Mask8 {
        _mm512_cmplt_epu64_mask(self.0, b.0)
    }

    /// Per lane: `b` where the mask bit is set, `self` otherwise. Branch-free.
    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn select(self, m: Mask8, b: Self) -> Self {
        Self(_mm512_mask_blend_epi64(m, self.0, b.0))
    }
}

/// The instruction counter of the `ifma-count` feature lives with the portable model
/// (`mb::simd_model::ifma_count`), which counts its own `madd52lo` / `madd52hi` the same way, so
/// the exact count per batch is checked on both builds.

/// The limb mask and the aligned load source are shared with the portable model
/// (`mb::simd_model`), so data built for one build (e.g. the P-256 base table) serves both.
pub use super::simd_model::{Aligned8, MASK52};

// --- added for p256
impl U64x8 {
    /// Register-only table lookup: lane `i` gets element `idx[i] mod 16` of the 16-element table
    /// `lo ‖ hi` (`vpermi2q`). The instruction's timing does not depend on the indices, so this is
    /// a constant-time per-lane select over 16 public values.
    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn lookup16(lo: Self, idx: Self, hi: Self) -> Self {
        Self(_mm512_permutex2var_epi64(lo.0, idx.0, hi.0))
    }

    /// Logical shift right of every lane by `n` bits (`n` public, same for all lanes; ≥ 64
    /// gives 0).
    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn shr_by(self, n: u32) -> Self {
        Self(_mm512_srl_epi64(self.0, _mm_cvtsi32_si128(n as i32)))
    }

    /// Shift left of every lane by `n` bits (`n` public; ≥ 64 gives 0).
    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn shl_by(self, n: u32) -> Self {
        Self(_mm512_sll_epi64(self.0, _mm_cvtsi32_si128(n as i32)))
    }

    /// Loads eight lanes from a 64-byte-aligned group of words.
    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn load_aligned(a: &Aligned8) -> Self {
        // SAFETY: `Aligned8` is 64 readable, 64-byte-aligned bytes.
        Self(unsafe { _mm512_load_si512(a.0.as_ptr() as *const _) })
    }
}

