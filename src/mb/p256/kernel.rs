// The P-256 multi-buffer kernels, ONE source compiled twice (see `p256/ifma.rs` and
// `p256/model.rs`, which `include!` this file): 8 lanes, radix 2^52, 5 limbs, limb-major.
//
// Every function wrapped in `kfn!` is compiled with the IFMA target features (avx512f,
// avx512ifma, avx512vl) against `mb::simd::U64x8` in the IFMA build, and with no target
// feature against the portable `mb::simd_model::U64x8` in the model build. The including module
// brings `U64x8`, `Mask8`, `MASK52` and `kfn!` into scope and defines the entry point `sign8`.
// Constants, byte conversion and the base-point table are plain data (`p256/limbs.rs`).
// See the module notes (`NOTES.md`) for the representation, bounds and constant-time argument.

use super::limbs::*;

/// Five 52-bit limbs, limb-major: `0[j]` holds limb `j` of all eight lanes.
/// Values are "loose": below 2^257 unless a function says otherwise, limbs normalised (< 2^52).
#[derive(Clone, Copy)]
pub(crate) struct L52x8(pub(crate) [U64x8; 5]);


kfn! {
    #[inline]
    pub(crate) fn splat5(c: &[u64; 5]) -> L52x8 {
        L52x8([
            U64x8::splat(c[0]),
            U64x8::splat(c[1]),
            U64x8::splat(c[2]),
            U64x8::splat(c[3]),
            U64x8::splat(c[4]),
        ])
    }
}

kfn! {
    /// Unsigned carry propagation: limbs 0..4 become < 2^52, limb 4 keeps the overflow.
    #[inline]
    fn carry(t: [U64x8; 5]) -> L52x8 {
        let m = U64x8::splat(MASK52);
        let t1 = t[1].add(t[0].shr::<52>());
        let t2 = t[2].add(t1.shr::<52>());
        let t3 = t[3].add(t2.shr::<52>());
        let t4 = t[4].add(t3.shr::<52>());
        L52x8([t[0].and(m), t1.and(m), t2.and(m), t3.and(m), t4])
    }
}

kfn! {
    /// Signed carry propagation (limbs are two's complement i64); the total must be non-negative.
    #[inline]
    fn carry_signed(t: [U64x8; 5]) -> L52x8 {
        let m = U64x8::splat(MASK52);
        let t1 = t[1].add(t[0].sra::<52>());
        let t2 = t[2].add(t1.sra::<52>());
        let t3 = t[3].add(t2.sra::<52>());
        let t4 = t[4].add(t3.sra::<52>());
        L52x8([t[0].and(m), t1.and(m), t2.and(m), t3.and(m), t4])
    }
}

kfn! {
    /// Folds bits 256 and up back with 2^256 ≡ 2^224 - 2^192 - 2^96 + 1 (mod p), then propagates
    /// carries once.
    ///
    /// Input: limb-wise sums/differences of loose values — limbs 0..3 in (-3*2^52, 2^53), limb 4 in
    /// [2^48, 2^51) for a - b + 4p, in (2^49, 2^51 + 2^49) for a - b - 2c + 8p, or [0, 2^50) for
    /// a + b — not normalised. With h = limb4 >> 48 (0..9) the result is ≥ 0 (when h = 0 every
    /// limb is non-negative; when h ≥ 1 the folded 2^224 term, at least 2^223, outweighs the
    /// negative low limbs, below 2^210) and below 2^256 + 9*2^224 + 2^211 < 2^257: loose,
    /// normalised, same class mod p.
    #[inline]
    fn fold_p(t: [U64x8; 5]) -> L52x8 {
        let [t0, t1, t2, t3, t4] = t;
        let h = t4.shr::<48>();
        let t4 = t4.and(U64x8::splat((1 << 48) - 1));
        carry_signed([
            t0.add(h),
            t1.sub(h.shl::<44>()),
            t2,
            t3.sub(h.shl::<36>()),
            t4.add(h.shl::<16>()),
        ])
    }
}

/// One Montgomery reduction step mod p at column `$i` (u = low 52 bits of the column since
/// -p^-1 = 1 mod 2^52). p's limb 0 is 2^52 - 1, so `t_i + u*p_0` carries exactly
/// `(t_i >> 52) + u` into column i+1 (no multiply); limb 2 is zero and is skipped.
macro_rules! red_p_step {
    ($t:ident, $i:literal, $mask:ident, $m:ident) => {{
        let u = $t[$i].and($mask);
        let c = $t[$i].shr::<52>().add(u);
        $t[$i + 1] = $t[$i + 1].madd52lo(u, $m.0[1]).add(c);
        $t[$i + 2] = $t[$i + 2].madd52hi(u, $m.0[1]);
        $t[$i + 3] = $t[$i + 3].madd52lo(u, $m.0[3]);
        $t[$i + 4] = $t[$i + 4].madd52hi(u, $m.0[3]).madd52lo(u, $m.0[4]);
        $t[$i + 5] = $t[$i + 5].madd52hi(u, $m.0[4]);
    }};
}

/// One Montgomery reduction step with a generic modulus at column `$i`. The carry out of
/// column i is `(t_i >> 52) + [t_i mod 2^52 != 0]` (the low product makes the column ≡ 0), which
/// is computed from t_i directly instead of waiting for `lo(u*m_0)`.
macro_rules! red_step {
    ($t:ident, $i:literal, $mask:ident, $m:ident, $k0:ident, $z:ident) => {{
        let u = $z.madd52lo($t[$i], $k0);
        let c = $t[$i].shr::<52>().add($t[$i].and($mask).add($mask).shr::<52>());
        let h0 = $z.madd52hi(u, $m.0[0]);
        $t[$i + 1] = $t[$i + 1].madd52lo(u, $m.0[1]).add(h0).add(c);
        $t[$i + 2] = $t[$i + 2].madd52hi(u, $m.0[1]).madd52lo(u, $m.0[2]);
        $t[$i + 3] = $t[$i + 3].madd52hi(u, $m.0[2]).madd52lo(u, $m.0[3]);
        $t[$i + 4] = $t[$i + 4].madd52hi(u, $m.0[3]).madd52lo(u, $m.0[4]);
        $t[$i + 5] = $t[$i + 5].madd52hi(u, $m.0[4]);
    }};
}

kfn! {
    /// Montgomery reduction mod p of a 10-column product (columns < 2^60): T / 2^260 mod p,
    /// normalised limbs.
    #[inline]
    fn reduce_p(mut t: [U64x8; 10]) -> L52x8 {
        let mask = U64x8::splat(MASK52);
        let m = splat5(&P);
        red_p_step!(t, 0, mask, m);
        red_p_step!(t, 1, mask, m);
        red_p_step!(t, 2, mask, m);
        red_p_step!(t, 3, mask, m);
        red_p_step!(t, 4, mask, m);
        carry([t[5], t[6], t[7], t[8], t[9]])
    }
}

kfn! {
    /// Montgomery reduction mod n (generic constant k0 = -n^-1 mod 2^52).
    #[inline]
    fn reduce_n(mut t: [U64x8; 10]) -> L52x8 {
        let mask = U64x8::splat(MASK52);
        let m = splat5(&N);
        let k0 = U64x8::splat(N_K0);
        let z = U64x8::zero();
        red_step!(t, 0, mask, m, k0, z);
        red_step!(t, 1, mask, m, k0, z);
        red_step!(t, 2, mask, m, k0, z);
        red_step!(t, 3, mask, m, k0, z);
        red_step!(t, 4, mask, m, k0, z);
        carry([t[5], t[6], t[7], t[8], t[9]])
    }
}

kfn! {
    /// Full 10-column product of two 5-limb numbers (inputs limbs < 2^52).
    #[inline]
    fn mul_wide(a: &L52x8, b: &L52x8) -> [U64x8; 10] {
        let z = U64x8::zero();
        let mut t = [z; 10];
        for i in 0..5 {
            for j in 0..5 {
                t[i + j] = t[i + j].madd52lo(a.0[i], b.0[j]);
                t[i + j + 1] = t[i + j + 1].madd52hi(a.0[i], b.0[j]);
            }
        }
        t
    }
}

kfn! {
    /// Full 10-column square, each cross product computed once and doubled.
    #[inline]
    fn sqr_wide(a: &L52x8) -> [U64x8; 10] {
        let z = U64x8::zero();
        let mut t = [z; 10];
        for i in 0..5 {
            for j in (i + 1)..5 {
                t[i + j] = t[i + j].madd52lo(a.0[i], a.0[j]);
                t[i + j + 1] = t[i + j + 1].madd52hi(a.0[i], a.0[j]);
            }
        }
        for c in 1..9 {
            t[c] = t[c].shl::<1>();
        }
        for i in 0..5 {
            t[2 * i] = t[2 * i].madd52lo(a.0[i], a.0[i]);
            t[2 * i + 1] = t[2 * i + 1].madd52hi(a.0[i], a.0[i]);
        }
        t
    }
}

kfn! {
    /// Constant-time conditional subtraction: `t - m` where that is non-negative, else `t`.
    #[inline]
    fn cond_sub(t: &L52x8, m: &L52x8) -> L52x8 {
        let d = carry_signed([
            t.0[0].sub(m.0[0]),
            t.0[1].sub(m.0[1]),
            t.0[2].sub(m.0[2]),
            t.0[3].sub(m.0[3]),
            t.0[4].sub(m.0[4]),
        ]);
        let neg: Mask8 = d.0[4].shr::<63>().eq_mask(U64x8::splat(1));
        select(&d, neg, t)
    }
}

kfn! {
    /// Per lane: `b` where the mask bit is set, else `a`.
    #[inline]
    pub(crate) fn select(a: &L52x8, m: Mask8, b: &L52x8) -> L52x8 {
        L52x8([
            a.0[0].select(m, b.0[0]),
            a.0[1].select(m, b.0[1]),
            a.0[2].select(m, b.0[2]),
            a.0[3].select(m, b.0[3]),
            a.0[4].select(m, b.0[4]),
        ])
    }
}

kfn! {
    /// Limb-wise addition with carry propagation, no reduction (a + b must fit 2^260).
    #[inline]
    pub(crate) fn add_raw(a: &L52x8, b: &L52x8) -> L52x8 {
        carry([
            a.0[0].add(b.0[0]),
            a.0[1].add(b.0[1]),
            a.0[2].add(b.0[2]),
            a.0[3].add(b.0[3]),
            a.0[4].add(b.0[4]),
        ])
    }
}

// ---------------------------------------------------------------------------------------------
// Field mod p (Montgomery, R = 2^260)

kfn! {
    /// Montgomery product a*b/2^260 mod p. Inputs < 2^258, output < 2^257.
    #[inline]
    pub(crate) fn fp_mul(a: &L52x8, b: &L52x8) -> L52x8 {
        reduce_p(mul_wide(a, b))
    }
}

kfn! {
    /// Montgomery square. Input < 2^258, output < 2^257.
    #[inline]
    pub(crate) fn fp_sqr(a: &L52x8) -> L52x8 {
        reduce_p(sqr_wide(a))
    }
}

kfn! {
    /// a + b mod p (loose). Inputs < 2^257, output < 2^257.
    #[cfg(test)]
    #[inline]
    pub(crate) fn fp_add(a: &L52x8, b: &L52x8) -> L52x8 {
        fold_p([
            a.0[0].add(b.0[0]),
            a.0[1].add(b.0[1]),
            a.0[2].add(b.0[2]),
            a.0[3].add(b.0[3]),
            a.0[4].add(b.0[4]),
        ])
    }
}

kfn! {
    /// a - b mod p (loose). Inputs < 2^257, output < 2^257.
    #[inline]
    pub(crate) fn fp_sub(a: &L52x8, b: &L52x8) -> L52x8 {
        let q = splat5(&P4);
        fold_p([
            a.0[0].sub(b.0[0]).add(q.0[0]),
            a.0[1].sub(b.0[1]).add(q.0[1]),
            a.0[2].sub(b.0[2]).add(q.0[2]),
            a.0[3].sub(b.0[3]).add(q.0[3]),
            a.0[4].sub(b.0[4]).add(q.0[4]),
        ])
    }
}

kfn! {
    /// a - b - 2c mod p (loose) with a single fold. Inputs < 2^257, output < 2^257.
    #[inline]
    pub(crate) fn fp_sub_sub2(a: &L52x8, b: &L52x8, c: &L52x8) -> L52x8 {
        let q = splat5(&P8);
        fold_p(std::array::from_fn(|l| a.0[l].sub(b.0[l]).sub(c.0[l].shl::<1>()).add(q.0[l])))
    }
}

kfn! {
    /// Canonical representative in [0, p). Input < 2^257 (< 3p).
    #[inline]
    pub(crate) fn fp_canon(a: &L52x8) -> L52x8 {
        let p = splat5(&P);
        cond_sub(&cond_sub(a, &p), &p)
    }
}

kfn! {
    /// Leaves the Montgomery domain: a / 2^260 mod p, canonical.
    #[inline]
    pub(crate) fn fp_from_mont(a: &L52x8) -> L52x8 {
        let mut t = [U64x8::zero(); 10];
        t[..5].copy_from_slice(&a.0);
        fp_canon(&reduce_p(t))
    }
}

// ---------------------------------------------------------------------------------------------
// Scalars mod n (Montgomery, R = 2^260, generic k0)

kfn! {
    /// Montgomery product a*b/2^260 mod n. Inputs < 2^258, output < 2^257.
    #[inline(never)]
    pub(crate) fn fn_mul(a: &L52x8, b: &L52x8) -> L52x8 {
        reduce_n(mul_wide(a, b))
    }
}

kfn! {
    /// Canonical representative in [0, n). Input < 2^257 (< 3n).
    #[inline]
    pub(crate) fn fn_canon(a: &L52x8) -> L52x8 {
        let n = splat5(&N);
        cond_sub(&cond_sub(a, &n), &n)
    }
}

// ---------------------------------------------------------------------------------------------
// Both inversions of a batch in one exponentiation (Montgomery's trick across lanes)


/// Per-lane modulus: lanes 0..3 n, lanes 4..7 p (limbs, -m^-1 mod 2^52, Montgomery one).
struct DualMod {
    m: L52x8,
    k0: U64x8,
    one: L52x8,
}

kfn! {
    #[inline]
    fn dual_mod() -> DualMod {
        DualMod {
            m: select(&splat5(&N), P_LANES, &splat5(&P)),
            k0: U64x8::splat(N_K0).select(P_LANES, U64x8::splat(1)),
            one: select(&splat5(&ONE_N), P_LANES, &splat5(&ONE_P)),
        }
    }
}

kfn! {
    /// Montgomery product with a per-lane modulus (generic reduction step; valid for p with k0 = 1).
    #[inline]
    fn dual_mul(a: &L52x8, b: &L52x8, dm: &DualMod) -> L52x8 {
        let mut t = mul_wide(a, b);
        let mask = U64x8::splat(MASK52);
        let (m, k0, z) = (&dm.m, dm.k0, U64x8::zero());
        red_step!(t, 0, mask, m, k0, z);
        red_step!(t, 1, mask, m, k0, z);
        red_step!(t, 2, mask, m, k0, z);
        red_step!(t, 3, mask, m, k0, z);
        red_step!(t, 4, mask, m, k0, z);
        carry([t[5], t[6], t[7], t[8], t[9]])
    }
}

kfn! {
    /// Montgomery square with a per-lane modulus.
    #[inline]
    fn dual_sqr(a: &L52x8, dm: &DualMod) -> L52x8 {
        let mut t = sqr_wide(a);
        let mask = U64x8::splat(MASK52);
        let (m, k0, z) = (&dm.m, dm.k0, U64x8::zero());
        red_step!(t, 0, mask, m, k0, z);
        red_step!(t, 1, mask, m, k0, z);
        red_step!(t, 2, mask, m, k0, z);
        red_step!(t, 3, mask, m, k0, z);
        red_step!(t, 4, mask, m, k0, z);
        carry([t[5], t[6], t[7], t[8], t[9]])
    }
}

kfn! {
    /// Fermat inversion with a per-lane modulus: lanes 0..3 get a^(n-2) mod n, lanes 4..7
    /// a^(p-2) mod p (Montgomery in and out). Fixed 4-bit windows over a table a^0..a^15: every
    /// window does four squarings and one multiplication in every lane; the table entry is chosen
    /// by the public exponent digits (one for the n lanes, one for the p lanes) and merged with a
    /// constant lane mask. Input 0 gives 0.
    pub(crate) fn dual_inv(a: &L52x8) -> L52x8 {
        let dm = dual_mod();
        let mut tab = [dm.one; 16];
        tab[1] = *a;
        tab[2] = dual_sqr(a, &dm);
        for i in 3..16 {
            tab[i] = dual_mul(&tab[i - 1], a, &dm);
        }
        let digit = |e: &[u64; 4], w: usize| ((e[3 - w / 16] >> (4 * (w % 16))) & 0xf) as usize;
        let mut t = select(&tab[digit(&N_MINUS_2, 63)], P_LANES, &tab[digit(&P_MINUS_2, 63)]);
        for w in (0..63).rev() {
            for _ in 0..4 {
                t = dual_sqr(&t, &dm);
            }
            let (dn, dp) = (digit(&N_MINUS_2, w), digit(&P_MINUS_2, w));
            if dn != 0 || dp != 0 {
                // Both digits zero (7 windows of p - 2's zero run) would multiply by one: skipped.
                t = dual_mul(&t, &select(&tab[dn], P_LANES, &tab[dp]), &dm);
            }
        }
        t
    }
}

kfn! {
    /// Moves lanes: lane i of the result is lane `idx[i]` of `a` (idx in 0..8, public).
    #[inline]
    fn permute(a: &L52x8, idx: &[u64; 8]) -> L52x8 {
        let i = U64x8::from_array(*idx);
        L52x8(std::array::from_fn(|l| U64x8::lookup16(a.0[l], i, a.0[l])))
    }
}

kfn! {
    /// Montgomery's trick across the 8 lanes of `a` (all nonzero): returns (P, O) with every lane
    /// of P the product of all lanes and O_i the product of all lanes but i, so a_i^-1 = P^-1 O_i.
    /// Three levels of lane swaps (i^1, i^2, i^4); `MOD_P` picks the modulus.
    #[inline]
    fn lane_products<const MOD_P: bool>(a: &L52x8) -> (L52x8, L52x8) {
        // Closures inherit the enclosing function's target features.
        let mul = |x: &L52x8, y: &L52x8| if MOD_P { fp_mul(x, y) } else { fn_mul(x, y) };
        let s1 = permute(a, &[1, 0, 3, 2, 5, 4, 7, 6]);
        let b = mul(a, &s1);
        let s2 = permute(&b, &[2, 3, 0, 1, 6, 7, 4, 5]);
        let c = mul(&b, &s2);
        let s4 = permute(&c, &[4, 5, 6, 7, 0, 1, 2, 3]);
        let all = mul(&c, &s4);
        let others = mul(&mul(&s1, &s2), &s4);
        (all, others)
    }
}

kfn! {
    /// k^-1 mod n and Z^-1 mod p for all lanes with a single exponentiation: the products of the
    /// eight k and of the eight Z share one vector (n lanes 0..3, p lanes 4..7) for [`dual_inv`].
    /// Every k and Z is nonzero by construction (k in [1, n), Z ≠ 0, see NOTES.md).
    pub(crate) fn batch_invert(k: &L52x8, z: &L52x8) -> (L52x8, L52x8) {
        let (pk, ok) = lane_products::<false>(k);
        let (pz, oz) = lane_products::<true>(z);
        let inv = dual_inv(&select(&pk, P_LANES, &pz));
        let kinv = fn_mul(&permute(&inv, &[0; 8]), &ok);
        let zinv = fp_mul(&permute(&inv, &[4; 8]), &oz);
        (kinv, zinv)
    }
}

// ---------------------------------------------------------------------------------------------
// Conversion between per-lane big-endian bytes and limb-major vectors


kfn! {
    /// Transposes 8 lanes of limbs into limb-major vectors.
    #[inline]
    pub(crate) fn load(lanes: &[[u64; 5]; 8]) -> L52x8 {
        let mut v = [U64x8::zero(); 5];
        for j in 0..5 {
            v[j] = U64x8::from_array(std::array::from_fn(|i| lanes[i][j]));
        }
        L52x8(v)
    }
}

kfn! {
    /// Inverse of [`load`].
    #[inline]
    pub(crate) fn store(v: &L52x8) -> [[u64; 5]; 8] {
        let cols: [[u64; 8]; 5] = std::array::from_fn(|j| v.0[j].to_array());
        std::array::from_fn(|i| std::array::from_fn(|j| cols[j][i]))
    }
}

// ---------------------------------------------------------------------------------------------
// Points

/// Jacobian point (X/Z^2, Y/Z^3), coordinates in the Montgomery domain mod p.
#[derive(Clone, Copy)]
pub(crate) struct Jac52x8 {
    pub(crate) x: L52x8,
    pub(crate) y: L52x8,
    pub(crate) z: L52x8,
}

kfn! {
    /// Mixed addition Jacobian + affine (add-1998-cmo-2 shape, 8M + 3S). Requires P1 ≠ ±P2 and
    /// P1 ≠ O; the base-point multiplication guarantees both by construction or masks the result.
    #[inline]
    pub(crate) fn point_add_mixed(p1: &Jac52x8, x2: &L52x8, y2: &L52x8) -> Jac52x8 {
        let z1z1 = fp_sqr(&p1.z);
        let u2 = fp_mul(x2, &z1z1);
        let z1z1z1 = fp_mul(&p1.z, &z1z1);
        let s2 = fp_mul(y2, &z1z1z1);
        let h = fp_sub(&u2, &p1.x);
        let r = fp_sub(&s2, &p1.y);
        let hh = fp_sqr(&h);
        let z3 = fp_mul(&p1.z, &h);
        let hhh = fp_mul(&h, &hh);
        let v = fp_mul(&p1.x, &hh);
        let rr = fp_sqr(&r);
        let y1hhh = fp_mul(&p1.y, &hhh);
        let x3 = fp_sub_sub2(&rr, &hhh, &v); // r^2 - h^3 - 2v
        let y3 = fp_sub(&fp_mul(&r, &fp_sub(&v, &x3)), &y1hhh);
        Jac52x8 { x: x3, y: y3, z: z3 }
    }
}

kfn! {
    #[inline]
    fn select_point(a: &Jac52x8, m: Mask8, b: &Jac52x8) -> Jac52x8 {
        Jac52x8 { x: select(&a.x, m, &b.x), y: select(&a.y, m, &b.y), z: select(&a.z, m, &b.z) }
    }
}


kfn! {
    /// kk = k where k < 2^255, else n - k, per lane, by a masked blend (k in [1, n), limbs
    /// normalised). kk*G = ±k*G has the same x coordinate. (A scalar version of this selection was
    /// compiled into a branch on k's top bit; in vector registers it stays a blend.)
    #[inline]
    pub(crate) fn half_scalar(k: &L52x8) -> L52x8 {
        let n = splat5(&N);
        let nk = carry_signed(std::array::from_fn(|l| n.0[l].sub(k.0[l])));
        let top = k.0[4].shr::<47>().eq_mask(U64x8::splat(1)); // bit 255 = limb 4, bit 47
        select(k, top, &nk)
    }
}

kfn! {
    /// Signed W-bit recoding of eight scalars below 2^255 held as limb vectors: |d| per lane and
    /// the sign masks, per window. Bit positions and shift counts are public; the data flows only
    /// through vector arithmetic (no branch, no table index).
    #[inline]
    pub(crate) fn recode8(kk: &L52x8) -> ([U64x8; WINDOWS], [Mask8; WINDOWS]) {
        let chunk_mask = U64x8::splat((1 << W) - 1);
        let bias = U64x8::splat((1 << (W - 1)) - 1);
        let zero = U64x8::zero();
        let mut carry = zero;
        let mut abs = [zero; WINDOWS];
        let mut neg: [Mask8; WINDOWS] = [0; WINDOWS];
        for i in 0..WINDOWS {
            let bit = W * i;
            let (limb, off) = (bit / 52, (bit % 52) as u32);
            let mut chunk = kk.0[limb].shr_by(off);
            if limb + 1 < 5 && off as usize + W > 52 {
                chunk = chunk.or(kk.0[limb + 1].shl_by(52 - off));
            }
            let v = chunk.and(chunk_mask).add(carry);
            let c = v.add(bias).shr::<{ W as u32 }>(); // 1 iff v > 2^(W-1)
            let d = v.sub(c.shl::<{ W as u32 }>());
            carry = c;
            let s = d.sra::<63>();
            abs[i] = d.xor(s).sub(s);
            neg[i] = s.eq_mask(U64x8::splat(u64::MAX));
        }
        (abs, neg)
    }
}

kfn! {
    /// k*G for eight secret scalars (each < 2^255), as Jacobian points in the Montgomery domain.
    ///
    /// Per window: read all 8 table entries with broadcast loads and keep the wanted one by
    /// per-lane compare + masked blend; negate y by masked blend; one mixed addition; the result
    /// is kept by masked blend where the digit is 0 and replaced by the table point where the
    /// accumulator is still the point at infinity. No branch or address depends on the scalar.
    pub(crate) fn base_mul(digits_abs: &[U64x8; WINDOWS], digits_neg: &[Mask8; WINDOWS]) -> Jac52x8 {
        let table = base_table();
        let one = U64x8::splat(1);
        let p = splat5(&P);
        let one_m = splat5(&ONE_P);
        let mut acc = Jac52x8 { x: one_m, y: one_m, z: one_m };
        let mut inf: Mask8 = 0xff;
        for w in 0..WINDOWS {
            let a = digits_abs[w];
            let negm = digits_neg[w];
            let zero_d = a.eq_mask(U64x8::zero());
            let z = U64x8::zero();
            // Per-lane lookup of entry |d| - 1 (|d| = 0 reads some entry; the result is discarded
            // below): vpermi2q over 16 entries held in two registers, then masked blends between
            // the 16-entry groups. Every entry of the window is loaded; nothing depends on d but
            // register contents.
            let idx = a.sub(one);
            let row = &table.0[w];
            let group = idx.shr::<4>();
            let gm: [Mask8; ENTRIES / 16] =
                std::array::from_fn(|g| group.eq_mask(U64x8::splat(g as u64)));
            let mut c = [z; 10];
            for l in 0..10 {
                let mut v = z;
                for g in 0..ENTRIES / 16 {
                    let lo = U64x8::load_aligned(&row.c[l][2 * g]);
                    let hi = U64x8::load_aligned(&row.c[l][2 * g + 1]);
                    let r = U64x8::lookup16(lo, idx, hi);
                    v = if g == 0 { r } else { v.select(gm[g], r) };
                }
                c[l] = v;
            }
            let x = L52x8([c[0], c[1], c[2], c[3], c[4]]);
            let y = L52x8([c[5], c[6], c[7], c[8], c[9]]);
            // -y = p - y (y canonical, so the limbs subtract without going negative overall).
            let ny = carry_signed([
                p.0[0].sub(y.0[0]),
                p.0[1].sub(y.0[1]),
                p.0[2].sub(y.0[2]),
                p.0[3].sub(y.0[3]),
                p.0[4].sub(y.0[4]),
            ]);
            let y = select(&y, negm, &ny);
            let fresh = Jac52x8 { x, y, z: one_m };
            let next = if w == 0 {
                // `w` is public: the accumulator is O in every lane before the first window.
                fresh
            } else {
                let sum = point_add_mixed(&acc, &x, &y);
                select_point(&sum, inf, &fresh)
            };
            acc = select_point(&next, zero_d, &acc);
            inf &= zero_d;
        }
        acc
    }
}

kfn! {
    /// One batch of eight ECDSA signatures: (r, s) per lane, big-endian, canonical; r or s may
    /// be 0 (the caller retries those lanes). `d`: private scalars in [1, n); `e`: bits2int(H(m))
    /// (any 256-bit value); `k`: nonces in [1, n).
    pub(crate) fn sign8_kernel(
        d: &[[u8; 32]; 8],
        e: &[[u8; 32]; 8],
        k: &[[u8; 32]; 8],
    ) -> ([[u8; 32]; 8], [[u8; 32]; 8]) {
        let lanes =
            |b: &[[u8; 32]; 8]| -> [[u64; 5]; 8] { std::array::from_fn(|i| bytes_to_limbs(&b[i])) };
        let kv = load(&lanes(k));
        // kk = k if k < 2^255 else n - k: kk*G = ±k*G has the same x, and kk fits the windows.
        let (abs, neg) = recode8(&half_scalar(&kv));
        let rrn = splat5(&RR_N);
        let q = base_mul(&abs, &neg);
        let (kinv, zi) = batch_invert(&fn_mul(&kv, &rrn), &q.z); // k^-1 R mod n, Z^-1 R mod p
        let zi2 = fp_sqr(&zi);
        let x = fp_from_mont(&fp_mul(&q.x, &zi2));
        let nn = splat5(&N);
        let r = cond_sub(&x, &nn); // x < p < 2n

        let dv = load(&lanes(d));
        let ev = load(&lanes(e));
        let rd = fn_mul(&r, &fn_mul(&dv, &rrn)); // r*d (plain)
        let t = add_raw(&ev, &rd); // < 2^256 + 2^257 < 2^258
        let s = fn_canon(&fn_mul(&t, &kinv)); // (e + r d) / k mod n

        let rl = store(&r);
        let sl = store(&s);
        (
            std::array::from_fn(|i| limbs_to_bytes(&rl[i])),
            std::array::from_fn(|i| limbs_to_bytes(&sl[i])),
        )
    }
}

