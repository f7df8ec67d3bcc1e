//! The portable model of [`U64x8`]: the same type name and the same operations as the AVX-512
//! wrapper (`mb::simd`), on a plain `[u64; 8]`, computed exactly as the instructions define
//! them. The kernels (`rsa/kernel.rs`, `p256/kernel.rs`) are compiled twice from one source:
//! once against `mb::simd` with the IFMA target features (the IFMA build), once against this module
//! with no target feature at all (the model build, `rsa::model`, `p256::model`). The model runs
//! on every CPU, so the kernels' own code path is tested where AVX-512 IFMA is absent, and on a
//! CPU that has it the two builds are compared bit for bit.
//!
//! The model is a test and verification tool: the `model` signer backend is never chosen
//! automatically (see `mb::choose_backend`).
//!
//! Constant time: the model keeps the kernels' property that no branch and no memory index
//! depends on lane values. Comparisons and blends are computed with masks and arithmetic, and
//! [`U64x8::lookup16`] reads all sixteen elements and keeps the wanted one by masking, where the
//! instruction indexes registers. Shift counts, like the instructions' immediates, are public.
//!
//! Lane `i` always belongs to request `i`; only `lookup16` moves data across lanes.
#![allow(dead_code)]
#![forbid(unsafe_code)]

/// The 52-bit limb mask.
pub const MASK52: u64 = (1u64 << 52) - 1;

/// Eight words aligned to a cache line, for `U64x8::load_aligned`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C, align(64))]
pub struct Aligned8(pub [u64; 8]);

/// Per-lane boolean mask (bit `i` = lane `i`), the same type as AVX-512's `__mmask8`.
pub type Mask8 = u8;

/// Eight unsigned 64-bit lanes, portable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct U64x8(pub [u64; 8]);

/// All-ones where `x` is nonzero, else zero, without a branch.
#[inline(always)]
fn nonzero_mask(x: u64) -> u64 {
    0u64.wrapping_sub((x | x.wrapping_neg()) >> 63)
}

/// The 64-bit mask of lane `i` of a [`Mask8`] (all ones or zero), without a branch.
#[inline(always)]
fn lane_mask(m: Mask8, i: usize) -> u64 {
    0u64.wrapping_sub(((m >> i) & 1) as u64)
}

impl U64x8 {
    #[inline(always)]
    fn map(self, f: impl Fn(u64) -> u64) -> Self {
        Self(core::array::from_fn(|i| f(self.0[i])))
    }

    #[inline(always)]
    fn zip(self, b: Self, f: impl Fn(u64, u64) -> u64) -> Self {
        Self(core::array::from_fn(|i| f(self.0[i], b.0[i])))
    }

    #[inline(always)]
    fn mask_of(self, b: Self, f: impl Fn(u64, u64) -> u64) -> Mask8 {
        let mut m = 0u8;
        for i in 0..8 {
            m |= (f(self.0[i], b.0[i]) as u8) << i;
        }
        m
    }

    #[inline(always)]
    pub fn zero() -> Self {
        Self([0; 8])
    }

    #[inline(always)]
    pub fn splat(x: u64) -> Self {
        Self([x; 8])
    }

    #[inline(always)]
    pub fn from_array(a: [u64; 8]) -> Self {
        Self(a)
    }

    #[inline(always)]
    pub fn to_array(self) -> [u64; 8] {
        self.0
    }

    #[inline(always)]
    pub fn add(self, b: Self) -> Self {
        self.zip(b, u64::wrapping_add)
    }

    #[inline(always)]
    pub fn sub(self, b: Self) -> Self {
        self.zip(b, u64::wrapping_sub)
    }

    #[inline(always)]
    pub fn and(self, b: Self) -> Self {
        self.zip(b, |x, y| x & y)
    }

    #[inline(always)]
    pub fn or(self, b: Self) -> Self {
        self.zip(b, |x, y| x | y)
    }

    #[inline(always)]
    pub fn xor(self, b: Self) -> Self {
        self.zip(b, |x, y| x ^ y)
    }

    /// Logical shift right by `N` (`vpsrlq` with an immediate: 64 or more gives 0).
    #[inline(always)]
    pub fn shr<const N: u32>(self) -> Self {
        self.shr_by(N)
    }

    /// Shift left by `N` (`vpsllq`: 64 or more gives 0).
    #[inline(always)]
    pub fn shl<const N: u32>(self) -> Self {
        self.shl_by(N)
    }

    /// Arithmetic shift right by `N` (`vpsraq`: 64 or more fills with the sign bit).
    #[inline(always)]
    pub fn sra<const N: u32>(self) -> Self {
        let n = if N > 63 { 63 } else { N };
        self.map(|x| ((x as i64) >> n) as u64)
    }

    /// `self + lo52(b[51:0] · c[51:0])` per lane (`vpmadd52luq`): the low 52 bits of the 104-bit
    /// product of the low 52 bits of `b` and `c`, added to the full 64-bit lane, wrapping.
    #[inline(always)]
    pub fn madd52lo(self, b: Self, c: Self) -> Self {
        #[cfg(feature = "ifma-count")]
        ifma_count::bump();
        Self(core::array::from_fn(|i| {
            let p = (b.0[i] & MASK52) as u128 * (c.0[i] & MASK52) as u128;
            self.0[i].wrapping_add(p as u64 & MASK52)
        }))
    }

    /// `self + hi52(b[51:0] · c[51:0])` per lane (`vpmadd52huq`): bits 52..103 of that product,
    /// added to the full 64-bit lane, wrapping.
    #[inline(always)]
    pub fn madd52hi(self, b: Self, c: Self) -> Self {
        #[cfg(feature = "ifma-count")]
        ifma_count::bump();
        Self(core::array::from_fn(|i| {
            let p = (b.0[i] & MASK52) as u128 * (c.0[i] & MASK52) as u128;
            self.0[i].wrapping_add((p >> 52) as u64)
        }))
    }

    /// Lanes where `self == b`.
    #[inline(always)]
    pub fn eq_mask(self, b: Self) -> Mask8 {
        self.mask_of(b, |x, y| 1 ^ ((x ^ y) | (x ^ y).wrapping_neg()) >> 63)
    }

    /// Lanes where `self < b` (unsigned): the borrow out of `self − b`.
    #[inline(always)]
    pub fn lt_mask(self, b: Self) -> Mask8 {
        self.mask_of(b, |x, y| ((x as u128).wrapping_sub(y as u128) >> 127) as u64)
    }

    /// Per lane: `b` where the mask bit is set, `self` otherwise (masks, no branch).
    #[inline(always)]
    pub fn select(self, m: Mask8, b: Self) -> Self {
        Self(core::array::from_fn(|i| {
            let k = lane_mask(m, i);
            (self.0[i] & !k) | (b.0[i] & k)
        }))
    }

    /// Lane `i` gets element `idx[i] mod 16` of the sixteen elements `lo ‖ hi` (`vpermi2q`: bits
    /// 0..2 of the index pick the element, bit 3 the table, higher bits are ignored). The index
    /// may be secret, so every element is read and the wanted one kept by masking.
    #[inline(always)]
    pub fn lookup16(lo: Self, idx: Self, hi: Self) -> Self {
        Self(core::array::from_fn(|i| {
            let want = idx.0[i] & 15;
            let mut r = 0u64;
            for j in 0..8 {
                r |= lo.0[j] & !nonzero_mask(want ^ j as u64);
                r |= hi.0[j] & !nonzero_mask(want ^ (j as u64 + 8));
            }
            r
        }))
    }

    /// Logical shift right by `n` (public, same for all lanes; 64 or more gives 0), as
    /// `vpsrlq` with a count register.
    #[inline(always)]
    pub fn shr_by(self, n: u32) -> Self {
        self.map(|x| x.checked_shr(n).unwrap_or(0))
    }

    /// Shift left by `n` (public; 64 or more gives 0).
    #[inline(always)]
    pub fn shl_by(self, n: u32) -> Self {
        self.map(|x| x.checked_shl(n).unwrap_or(0))
    }

    /// Loads eight lanes from a 64-byte-aligned group of words.
    #[inline(always)]
    pub fn load_aligned(a: &Aligned8) -> Self {
        Self(a.0)
    }
}

/// With the `ifma-count` feature only (never in a product or timing build: a thread-local
/// increment per IFMA would distort every timing): counts every `madd52lo` / `madd52hi` executed
/// on this thread, by the IFMA wrapper (`mb::simd`) and by this model alike, so tests can check
/// the exact IFMA count per batch that `mbtunnel speed`
/// divides by (the kernels run a fixed instruction sequence per key size, so the count is a
/// constant). `cargo test --release --lib --features ifma-count ifma_count` (run by `make test`).
#[cfg(feature = "ifma-count")]
pub(crate) mod ifma_count {
    use std::cell::Cell;

    thread_local! {
        static N: Cell<u64> = const { Cell::new(0) };
    }

    #[inline(always)]
    pub fn bump() {
        N.with(|n| n.set(n.get() + 1));
    }

    /// The count since the last `take` on this thread, and reset it.
    pub fn take() -> u64 {
        N.with(|n| n.replace(0))
    }
}

#[cfg(test)]
mod tests {
    //! Known answers for the model's operations. The comparison with the instructions
    //! themselves is in `mb::simd` (it needs `unsafe`, which this module forbids).
    use super::*;

    #[test]
    fn madd52_known_answers() {
        let a = U64x8::from_array([0, 1, u64::MAX, 5, 0, 7, 1 << 63, 3]);
        let m = MASK52;
        // b, c with bits above 51 set: those bits are ignored.
        let b = U64x8::from_array([m, m, m, 1 << 52, 3 | (1 << 60), 0, 2, u64::MAX]);
        let c = U64x8::from_array([m, 1 << 51, 1, 9, 5, u64::MAX, 1 << 51, u64::MAX]);
        // (2^52 - 1)^2 = 2^104 - 2^53 + 1: lo = 1, hi = 2^52 - 2.
        assert_eq!(
            a.madd52lo(b, c).to_array(),
            [1, 1 + (1 << 51), u64::MAX.wrapping_add(m), 5, 15, 7, 1 << 63, 3 + 1]
        );
        assert_eq!(
            a.madd52hi(b, c).to_array(),
            [m - 1, 1 + (m >> 1), u64::MAX, 5, 0, 7, (1 << 63) + 1, 3 + (m - 1)]
        );
    }

    #[test]
    fn masks_shifts_lookup_known_answers() {
        let a = U64x8::from_array([0, 1, 2, 3, u64::MAX, 5, 1 << 63, 7]);
        let b = U64x8::from_array([0, 2, 2, 1, 0, 5, 0, 8]);
        assert_eq!(a.eq_mask(b), 0b0010_0101);
        assert_eq!(a.lt_mask(b), 0b1000_0010);
        assert_eq!(a.select(0b1000_0001, b).to_array(), [0, 1, 2, 3, u64::MAX, 5, 1 << 63, 8]);
        assert_eq!(a.sra::<63>().to_array()[4], u64::MAX);
        assert_eq!(a.sra::<63>().to_array()[7], 0);
        assert_eq!(a.sra::<1>().to_array()[6], 3 << 62);
        assert_eq!(a.shr::<63>().to_array()[6], 1);
        assert_eq!(a.shr_by(64).to_array(), [0; 8]);
        assert_eq!(a.shl_by(200).to_array(), [0; 8]);
        assert_eq!(a.shl::<1>().to_array()[6], 0);
        let lo = U64x8::from_array(core::array::from_fn(|i| 100 + i as u64));
        let hi = U64x8::from_array(core::array::from_fn(|i| 200 + i as u64));
        let idx = U64x8::from_array([0, 7, 8, 15, 16, 31, 9 | (1 << 40), 3]);
        assert_eq!(
            U64x8::lookup16(lo, idx, hi).to_array(),
            [100, 107, 200, 207, 100, 207, 201, 103]
        );
    }
}
