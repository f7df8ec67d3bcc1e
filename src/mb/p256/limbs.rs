//! P-256 in radix 2^52 for the multi-buffer kernels: the constants, the byte ↔ limb conversion,
//! the precomputed base-point table and the scalar references the tests use. Plain data and
//! scalar code, shared by both builds of the kernels (`p256::ifma`, `p256::model`), so the
//! base-point table is computed once per process whichever build uses it.
#![forbid(unsafe_code)]
#![allow(clippy::needless_range_loop)]

use std::sync::OnceLock;

use crate::mb::simd_model::{Aligned8, Mask8, MASK52};

/// The 52-bit limb mask (for the tests of both builds).
#[cfg(test)]
pub(crate) const MASK52_LIMBS: u64 = MASK52;

/// p = 2^256 - 2^224 + 2^192 + 2^96 - 1 in radix 2^52.
pub(crate) const P: [u64; 5] = [0xfffffffffffff, 0xfffffffffff, 0x0, 0x1000000000, 0xffffffff0000];
/// 4p, used to keep subtraction non-negative.
pub(crate) const P4: [u64; 5] =
    [0xffffffffffffc, 0x3fffffffffff, 0x0, 0x4000000000, 0x3fffffffc0000];
/// 8p, for a - b - 2c.
pub(crate) const P8: [u64; 5] =
    [0xffffffffffff8, 0x7fffffffffff, 0x0, 0x8000000000, 0x7fffffff80000];
/// 2^260 mod p: Montgomery one.
pub(crate) const ONE_P: [u64; 5] =
    [0x10, 0xf000000000000, 0xfffffffffffff, 0xffeffffffffff, 0xfffff];
/// 2^520 mod p: converts into the Montgomery domain (the table is built with BigNum instead).
#[cfg(test)]
pub(crate) const RR_P: [u64; 5] =
    [0x300, 0xffffffff00000, 0xffffefffffffb, 0xfdfffffffffff, 0x4ffffff];
/// n, the order of the base point.
pub(crate) const N: [u64; 5] =
    [0x9cac2fc632551, 0xada7179e84f3b, 0xfffffffbce6fa, 0xfffffffff, 0xffffffff0000];
/// -n^-1 mod 2^52.
pub(crate) const N_K0: u64 = 0x1c8aaee00bc4f;
/// 2^520 mod n.
pub(crate) const RR_N: [u64; 5] =
    [0x5cc0dea6dc3ba, 0x192a067d8a084, 0xbec59615571bb, 0x1fc245b2392b6, 0xe12d9559d956];

/// 2^260 mod n: Montgomery one mod n.
pub(crate) const ONE_N: [u64; 5] =
    [0x353d039cdaaf0, 0x258e8617b0c46, 0x4319055, 0xfff0000000000, 0xfffff];
/// p - 2 and n - 2, big-endian 64-bit words (public exponents).
pub(crate) const P_MINUS_2: [u64; 4] =
    [0xffffffff00000001, 0x0000000000000000, 0x00000000ffffffff, 0xfffffffffffffffd];
pub(crate) const N_MINUS_2: [u64; 4] =
    [0xffffffff00000000, 0xffffffffffffffff, 0xbce6faada7179e84, 0xf3b9cac2fc63254f];
/// Lanes 4..7 of a dual vector work mod p, lanes 0..3 mod n.
pub(crate) const P_LANES: Mask8 = 0xf0;

/// 32 big-endian bytes → 5 little-endian 52-bit limbs.
pub(crate) fn bytes_to_limbs(b: &[u8; 32]) -> [u64; 5] {
    let w = |i: usize| u64::from_be_bytes(b[32 - 8 * (i + 1)..32 - 8 * i].try_into().unwrap());
    let (w0, w1, w2, w3) = (w(0), w(1), w(2), w(3));
    [
        w0 & MASK52,
        ((w0 >> 52) | (w1 << 12)) & MASK52,
        ((w1 >> 40) | (w2 << 24)) & MASK52,
        ((w2 >> 28) | (w3 << 36)) & MASK52,
        w3 >> 16,
    ]
}

/// 5 normalised limbs of a value < 2^256 → 32 big-endian bytes.
pub(crate) fn limbs_to_bytes(l: &[u64; 5]) -> [u8; 32] {
    let w0 = l[0] | (l[1] << 52);
    let w1 = (l[1] >> 12) | (l[2] << 40);
    let w2 = (l[2] >> 24) | (l[3] << 28);
    let w3 = (l[3] >> 36) | (l[4] << 16);
    let mut out = [0u8; 32];
    for (i, w) in [w3, w2, w1, w0].iter().enumerate() {
        out[8 * i..8 * i + 8].copy_from_slice(&w.to_be_bytes());
    }
    out
}

/// Window width in bits (signed digits in [-2^(W-1), 2^(W-1)]).
pub(crate) const W: usize = 7;
/// Table entries per window: multiples 1..2^(W-1).
pub(crate) const ENTRIES: usize = 1 << (W - 1);
/// Number of windows: scalars are below 2^255 after the sign trick (see NOTES.md); the top
/// window holds at most W-1 bits of the scalar, so it absorbs the last carry (W*(WINDOWS-1) >=
/// 256 - W).
pub(crate) const WINDOWS: usize = 256usize.div_ceil(W);

/// One window of the table, coordinate-limb-major: `c[l][g].0[i]` is limb `l` (x0..x4, y0..y4)
/// of entry `8g + i`, i.e. of (8g + i + 1) * 2^(W*w) * G. Sixteen consecutive entries of one limb
/// fill two registers, which `vpermi2q` indexes per lane.
#[repr(C, align(64))]
pub(crate) struct TableRow {
    pub(crate) c: [[Aligned8; ENTRIES / 8]; 10],
}

/// Precomputed public table of affine multiples j * 2^(W*w) * G (j = 1..ENTRIES), Montgomery
/// domain, canonical limbs.
pub(crate) struct BaseTable(pub(crate) Vec<TableRow>);

impl BaseTable {
    /// Entry for multiple `j` (1-based) of window `w` as `[x0..x4, y0..y4]`.
    #[cfg(test)]
    pub(crate) fn entry(&self, w: usize, j: usize) -> [u64; 10] {
        std::array::from_fn(|l| self.0[w].c[l][(j - 1) / 8].0[(j - 1) % 8])
    }
}

static TABLE: OnceLock<BaseTable> = OnceLock::new();

/// The base-point table, computed once with BoringSSL's point arithmetic (public data).
pub(crate) fn base_table() -> &'static BaseTable {
    TABLE.get_or_init(|| build_table().expect("P-256 base table"))
}

pub(crate) fn build_table() -> Result<BaseTable, boring::error::ErrorStack> {
    use boring::bn::{BigNum, BigNumContext};
    use boring::ec::{EcGroup, EcPoint};
    use boring::nid::Nid;

    let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1)?;
    let mut ctx = BigNumContext::new()?;
    let p = BigNum::from_slice(&limbs_to_bytes(&P))?;
    let mut r = BigNum::new()?;
    r.set_bit(260)?;
    let mut base = group.generator().to_owned(&group)?;
    let mut rows = Vec::with_capacity(WINDOWS);
    let (mut x, mut y, mut t) = (BigNum::new()?, BigNum::new()?, BigNum::new()?);
    for _ in 0..WINDOWS {
        let mut row = [[0u64; 10]; ENTRIES];
        let mut acc = base.to_owned(&group)?;
        for j in 0..ENTRIES {
            if j > 0 {
                let mut next = EcPoint::new(&group)?;
                next.add(&group, &acc, &base, &mut ctx)?;
                acc = next;
            }
            acc.affine_coordinates_gfp(&group, &mut x, &mut y, &mut ctx)?;
            for (k, c) in [&x, &y].into_iter().enumerate() {
                t.mod_mul(c, &r, &p, &mut ctx)?;
                let mut b = [0u8; 32];
                let v = t.to_vec();
                b[32 - v.len()..].copy_from_slice(&v);
                row[j][5 * k..5 * k + 5].copy_from_slice(&bytes_to_limbs(&b));
            }
        }
        let mut t = TableRow { c: [[Aligned8::default(); ENTRIES / 8]; 10] };
        for (j, e) in row.iter().enumerate() {
            for l in 0..10 {
                t.c[l][j / 8].0[j % 8] = e[l];
            }
        }
        rows.push(t);
        // base <- 2^W * base
        for _ in 0..W {
            let mut d = EcPoint::new(&group)?;
            d.add(&group, &base, &base, &mut ctx)?;
            base = d;
        }
    }
    Ok(BaseTable(rows))
}

/// Scalar reference for [`recode8`] (tests). Signed W-bit recoding of a scalar below 2^255:
/// WINDOWS digits in [-2^(W-1), 2^(W-1)] as
/// (|d|, sign) per window. Branch-free integer arithmetic; loop bounds and bit positions are
/// public.
#[cfg(test)]
pub(crate) fn recode(k: &[u8; 32]) -> ([u64; WINDOWS], [u64; WINDOWS]) {
    let words: [u64; 4] =
        std::array::from_fn(|i| u64::from_be_bytes(k[24 - 8 * i..32 - 8 * i].try_into().unwrap()));
    let mut abs = [0u64; WINDOWS];
    let mut neg = [0u64; WINDOWS];
    let mut carry = 0i64;
    for i in 0..WINDOWS {
        let bit = W * i;
        let lo = words[bit / 64] as u128;
        let hi = if bit / 64 + 1 < 4 { words[bit / 64 + 1] as u128 } else { 0 };
        let chunk = (((hi << 64) | lo) >> (bit % 64)) as i64 & ((1 << W) - 1);
        let v = chunk + carry;
        let c = (v + (1 << (W - 1)) - 1) >> W; // 1 iff v > 2^(W-1)
        let d = v - (c << W);
        carry = c;
        let s = d >> 63;
        abs[i] = ((d ^ s) - s) as u64;
        neg[i] = (s & 1) as u64;
    }
    (abs, neg)
}

/// n as four little-endian 64-bit words.
#[cfg(test)]
pub(crate) const N_WORDS: [u64; 4] =
    [0xf3b9cac2fc632551, 0xbce6faada7179e84, 0xffffffffffffffff, 0xffffffff00000000];

/// Scalar reference for [`half_scalar`] (tests only: the compiler turns this selection into a
/// branch on k's top bit, which is why the kernel does it in vector registers).
#[cfg(test)]
pub(crate) fn min_k(k: &[u8; 32]) -> [u8; 32] {
    let w: [u64; 4] =
        std::array::from_fn(|i| u64::from_be_bytes(k[24 - 8 * i..32 - 8 * i].try_into().unwrap()));
    let mut nk = [0u64; 4];
    let mut borrow = 0u64;
    for i in 0..4 {
        let (a, b1) = N_WORDS[i].overflowing_sub(w[i]);
        let (a, b2) = a.overflowing_sub(borrow);
        nk[i] = a;
        borrow = (b1 | b2) as u64;
    }
    let mask = 0u64.wrapping_sub(w[3] >> 63);
    let mut out = [0u8; 32];
    for i in 0..4 {
        let v = (w[i] & !mask) | (nk[i] & mask);
        out[24 - 8 * i..32 - 8 * i].copy_from_slice(&v.to_be_bytes());
    }
    out
}
