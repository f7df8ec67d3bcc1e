//! `U64x8`: eight 64-bit lanes in one 512-bit register, the single wrapper around the AVX-512
//! intrinsics used by the multi-buffer kernels.
//!
//! Invariant the caller keeps: every method is a `#[target_feature]` function, so it may only be
//! reached from kernels that carry the same features (`avx512f,avx512ifma,avx512vl`), and those
//! kernels are called only after `crate::mb` runtime detection confirmed the CPU has them. Inside
//! such kernels the calls are safe and inline; outside, calling one needs `unsafe` and a reason.
//!
//! `mb::simd_model` is the portable model of this type (same names, same operations, on
//! `[u64; 8]`); the kernels are compiled against each from one source.
//!
//! Lane `i` always belongs to request `i`; no method here moves data across lanes except the
//! explicit transpose helpers, so lane-crossing bugs can only come from those.
#![allow(dead_code)]

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
        #[cfg(feature = "ifma-count")]
        ifma_count::bump();
        Self(_mm512_madd52lo_epu64(self.0, b.0, c.0))
    }

    /// `self + hi52(b * c)` per lane (bits 52..104 of the 104-bit product).
    #[inline]
    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
    pub fn madd52hi(self, b: Self, c: Self) -> Self {
        #[cfg(feature = "ifma-count")]
        ifma_count::bump();
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
#[cfg(feature = "ifma-count")]
pub(crate) use super::simd_model::ifma_count;

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

#[cfg(test)]
mod model_tests {
    //! The portable model (`mb::simd_model`) against the instructions, operation by operation,
    //! lane by lane, on random lanes that differ from each other, with edge values sprinkled in.
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha20Rng;

    const MASK52: u64 = super::MASK52;

    fn lane(rng: &mut ChaCha20Rng) -> u64 {
        match rng.gen_range(0..12) {
            0 => 0,
            1 => u64::MAX,
            2 => MASK52,
            3 => 1 << 52,
            4 => 1 << 63,
            5 => rng.gen::<u64>() & MASK52,
            _ => rng.gen(),
        }
    }

    fn vec(rng: &mut ChaCha20Rng) -> [u64; 8] {
        core::array::from_fn(|_| lane(rng))
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn model_ops_match_the_instructions() {
        use super::{Aligned8 as A8, U64x8 as V};
        let Some(_cap) = crate::mb::require_ifma("model vs AVX-512 IFMA, lane operations") else {
            return;
        };
        type M = crate::mb::simd_model::U64x8;
        let mut rng = ChaCha20Rng::seed_from_u64(0x5eed);
        // SAFETY (every `unsafe` below): the capability above proves the CPU has avx512f,
        // avx512ifma and avx512vl, the features of `mb::simd`'s methods.
        macro_rules! same {
            ($name:literal, $m:expr, $v:expr) => {{
                let (m, v) = ($m, unsafe { $v });
                assert_eq!(m, v, "{}", $name);
            }};
        }
        for _ in 0..20_000 {
            let (a, b, c) = (vec(&mut rng), vec(&mut rng), vec(&mut rng));
            let (ma, mb, mc) = (M::from_array(a), M::from_array(b), M::from_array(c));
            let (va, vb, vc) = unsafe { (V::from_array(a), V::from_array(b), V::from_array(c)) };
            let n: u32 = rng.gen_range(0..70);
            let k: u8 = rng.gen();
            same!("madd52lo", ma.madd52lo(mb, mc).0, va.madd52lo(vb, vc).to_array());
            same!("madd52hi", ma.madd52hi(mb, mc).0, va.madd52hi(vb, vc).to_array());
            same!("add", ma.add(mb).0, va.add(vb).to_array());
            same!("sub", ma.sub(mb).0, va.sub(vb).to_array());
            same!("and", ma.and(mb).0, va.and(vb).to_array());
            same!("or", ma.or(mb).0, va.or(vb).to_array());
            same!("xor", ma.xor(mb).0, va.xor(vb).to_array());
            same!("shr_by", ma.shr_by(n).0, va.shr_by(n).to_array());
            same!("shl_by", ma.shl_by(n).0, va.shl_by(n).to_array());
            same!("shr", ma.shr::<52>().0, va.shr::<52>().to_array());
            same!("shr51", ma.shr::<51>().0, va.shr::<51>().to_array());
            same!("shl", ma.shl::<1>().0, va.shl::<1>().to_array());
            same!("shl44", ma.shl::<44>().0, va.shl::<44>().to_array());
            same!("sra52", ma.sra::<52>().0, va.sra::<52>().to_array());
            same!("sra63", ma.sra::<63>().0, va.sra::<63>().to_array());
            same!("eq_mask", ma.eq_mask(mb), va.eq_mask(vb));
            same!("eq_mask self", ma.eq_mask(ma.select(k, mb)), va.eq_mask(va.select(k, vb)));
            same!("lt_mask", ma.lt_mask(mb), va.lt_mask(vb));
            same!("select", ma.select(k, mb).0, va.select(k, vb).to_array());
            same!("lookup16", M::lookup16(ma, mb, mc).0, V::lookup16(va, vb, vc).to_array());
            let small = M::from_array(core::array::from_fn(|i| b[i] & 31));
            let vsmall = unsafe { V::from_array(small.0) };
            same!(
                "lookup16 small",
                M::lookup16(ma, small, mc).0,
                V::lookup16(va, vsmall, vc).to_array()
            );
            same!("splat", M::splat(a[0]).0, V::splat(a[0]).to_array());
            same!("zero", M::zero().0, V::zero().to_array());
            let al = A8(a);
            same!("load_aligned", M::load_aligned(&A8(a)).0, V::load_aligned(&al).to_array());
        }
    }
}
