// The RSA-CRT multi-buffer kernels, ONE source compiled twice (see `rsa/ifma.rs` and
// `rsa/model.rs`, which `include!` this file): eight independent operations, one per 64-bit
// lane, numbers in radix 2^52, limb-major (`[U64x8; L]`: vector `j` holds limb `j` of all eight
// lanes).
//
// Every function wrapped in `kfn!` is compiled with the IFMA target features (avx512f,
// avx512ifma, avx512vl) against `mb::simd::U64x8` in the IFMA build, and with no target
// feature against the portable `mb::simd_model::U64x8` in the model build. The including module
// brings `U64x8`, `MASK52` and `kfn!` into scope and defines the entry point `crt_batch`.
//
// Constant time: loops run over public bounds only (limb counts, window counts); secret values
// (exponents, intermediate results) only flow through arithmetic, shifts and per-lane masked
// blends. The exponent window value selects a table entry by comparing it with every index and
// blending, so every entry is read for every window.

use crate::mb::rsa::{BatchOut, LaneKey};

/// Expands `$body` once per index `0..80` with `$j` bound to that index, keeping only indices
/// below `$n` (a constant after monomorphisation, so the guards fold away). Used to fully unroll
/// limb loops so that the accumulator window of a Montgomery step lives in registers.
macro_rules! unroll80 {
    ($j:ident < $n:expr => $body:block) => {
        unroll80!(@go $j, $n, $body, [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63 64 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79])
    };
    (@go $j:ident, $n:expr, $body:block, [$($k:literal)*]) => {
        $({
            let $j: usize = $k;
            if $j < $n $body
        })*
    };
}

/// Numbers in radix 2^52, limb-major, eight lanes: `N52x8<L>[j]` = limb `j` of every lane.
pub(crate) type N52x8<const L: usize> = [U64x8; L];

/// The bits `[pos, pos + w)` of a little-endian word array (zero beyond its end). `pos` and `w`
/// are public; the value is not, and is only returned.
#[inline]
fn window_bits(e: &[u64], pos: usize, w: usize) -> u64 {
    let (word, sh) = (pos / 64, pos % 64);
    let mut v = if word < e.len() { e[word] >> sh } else { 0 };
    if sh + w > 64 && word + 1 < e.len() {
        v |= e[word + 1] << (64 - sh);
    }
    v & ((1u64 << w) - 1)
}

kfn! {
    /// Per lane, the exponent window starting at public bit `pos`.
    #[inline]
    fn window_index(exps: &[&[u64]; 8], pos: usize, w: usize) -> U64x8 {
        U64x8::from_array(core::array::from_fn(|i| window_bits(exps[i], pos, w)))
    }
}

kfn! {
    /// Transposes per-lane limb slices (lane `i` = `f(i)`, at least `L` limbs) into limb-major form.
    pub(crate) fn gather<'a, const L: usize>(f: impl Fn(usize) -> &'a [u64]) -> N52x8<L> {
        let lanes: [&[u64]; 8] = core::array::from_fn(&f);
        let mut out = [U64x8::zero(); L];
        for (j, o) in out.iter_mut().enumerate() {
            *o = U64x8::from_array(core::array::from_fn(|i| lanes[i][j]));
        }
        out
    }
}

kfn! {
    /// Transposes back: `out[i][j]` = limb `j` of lane `i`.
    pub(crate) fn scatter<const L: usize>(x: &N52x8<L>) -> [[u64; L]; 8] {
        let mut out = [[0u64; L]; 8];
        for (j, v) in x.iter().enumerate() {
            let a = v.to_array();
            for i in 0..8 {
                out[i][j] = a[i];
            }
        }
        out
    }
}

kfn! {
    /// Carry-propagates loose 64-bit limbs into 52-bit limbs. The carry out of the top limb is
    /// dropped: callers guarantee the value fits in `L` limbs.
    #[inline]
    fn normalize<const L: usize>(x: &mut N52x8<L>) {
        let mask = U64x8::splat(MASK52);
        let mut c = U64x8::zero();
        for v in x.iter_mut() {
            let t = v.add(c);
            c = t.shr::<52>();
            *v = t.and(mask);
        }
    }
}

/// Two rows of operand scanning on the rolling accumulator window: row A adds `a0·bA + uA·m`,
/// row B adds `a1·bB + uB·m` one limb up, then the window moves down two limbs. Only the two
/// lowest positions are made exact (they give the reduction factors `uA`, `uB`); every other
/// position takes eight IFMA in one pass, which halves the window traffic when `L` is too large
/// for the window to stay in registers. Digits of `bA`/`bB` below `s` are known to be zero and
/// skipped (`s` folds to a constant). `bA`/`bB` have `L + 1` meaningful digits.
macro_rules! pair_step {
    ($acc:ident, $a0:expr, $a1:expr, $ba:ident, $bb:ident, $m:ident, $k0:ident, $s:expr) => {{
        let (a0, a1, s) = ($a0, $a1, $s);
        let z = U64x8::zero();
        let mut t0 = $acc[0];
        if s == 0 {
            t0 = t0.madd52lo(a0, $ba[0]);
        }
        let ua = z.madd52lo(t0, $k0);
        let ca = t0.madd52lo(ua, $m[0]).shr::<52>();
        let mut t1 = $acc[1];
        if 1 >= s {
            t1 = t1.madd52lo(a0, $ba[1]);
        }
        if s == 0 {
            t1 = t1.madd52hi(a0, $ba[0]).madd52lo(a1, $bb[0]);
        }
        let t1 = t1.madd52lo(ua, $m[1]).madd52hi(ua, $m[0]).add(ca);
        let ub = z.madd52lo(t1, $k0);
        let cb = t1.madd52lo(ub, $m[0]).shr::<52>();
        unroll80!(q < L - 2 => {
            let p = q + 2;
            let mut v = $acc[p];
            if p >= s {
                v = v.madd52lo(a0, $ba[p]);
            }
            if p > s {
                v = v.madd52hi(a0, $ba[p - 1]).madd52lo(a1, $bb[p - 1]);
            }
            if p - 2 >= s {
                v = v.madd52hi(a1, $bb[p - 2]);
            }
            v = v.madd52lo(ua, $m[p]).madd52hi(ua, $m[p - 1]);
            $acc[q] = v.madd52lo(ub, $m[p - 1]).madd52hi(ub, $m[p - 2]);
        });
        $acc[L - 2] = z
            .madd52lo(a0, $ba[L])
            .madd52hi(a0, $ba[L - 1])
            .madd52lo(a1, $bb[L - 1])
            .madd52hi(a1, $bb[L - 2])
            .madd52hi(ua, $m[L - 1])
            .madd52lo(ub, $m[L - 1])
            .madd52hi(ub, $m[L - 2]);
        $acc[L - 1] = z.madd52lo(a1, $bb[L]).madd52hi(a1, $bb[L - 1]).madd52hi(ub, $m[L - 1]);
        $acc[0] = $acc[0].add(cb);
    }};
}

kfn! {
    /// Almost Montgomery multiplication: `a·b·R⁻¹ mod m`, R = 2^(52·L), result < 2m and normalised,
    /// for `a·b < 4m·m`-ish inputs (both below 2m, or one below 3m and the other below m) and 4m < R.
    /// `L` must be even; `L2 = 2·L` (scratch).
    ///
    /// Operand scanning with a rolling accumulator window of `L` loose 64-bit limbs, two rows per
    /// pass ([`pair_step!`]): per row `i` the products `a_i·b` and `u·m` are added (low halves at
    /// their position, high halves one limb up) and the window moves down one limb. Only the lowest
    /// limb's carry is made exact (it is what the next reduction factor needs); the other limbs
    /// absorb at most `4L` terms below 2^52 each, which fits the 12 spare bits for `L ≤ 80`. One
    /// carry propagation at the end. Up to 20 limbs the window lives in registers; larger sizes use
    /// [`amm_mem`].
    #[inline(never)]
    pub(crate) fn amm<const L: usize, const L2: usize>(
        a: &N52x8<L>,
        b: &N52x8<L>,
        m: &N52x8<L>,
        k0: U64x8,
    ) -> N52x8<L> {
        if L > 20 {
            // Beyond 20 limbs the register window spills; the memory-window form measured faster.
            return amm_mem::<L, L2>(a, b, m, k0);
        }
        let z = U64x8::zero();
        let mut bx = [z; L2];
        bx[..L].copy_from_slice(b);
        let mut acc = [z; L];
        for i in (0..L).step_by(2) {
            pair_step!(acc, a[i], a[i + 1], bx, bx, m, k0, 0usize);
        }
        normalize(&mut acc);
        acc
    }
}

kfn! {
    /// Almost half Montgomery multiplication: `a·b·R⁻¹ mod m` (R = 2^(52·L)) in `L/2` reduction
    /// rows instead of `L`, given `kb = b·2^(−26·L) mod m` alongside `b`. With `a = a_lo +
    /// a_hi·2^(26·L)`, `a·b·R⁻¹ = (a_lo·kb + a_hi·b)·2^(−26·L)`, so row `i` adds `a_i·kb +
    /// a_{i+L/2}·b + u_i·m` and drops one limb: `L/2` rows of `6L + 1` IFMA (1,210 at 20
    /// limbs) where [`amm`] does `L` rows of `4L` (1,640). The sum is below `2^(26L)·(kb + m)`,
    /// so for `a`, `b`, `kb` below `2m` and `4m < R` the result is normalised and below `4m`, which
    /// the next squaring takes (`16m < R`) and brings back below `2m`. The window exponentiation
    /// gets `b` and `kb` from tables of both (see [`Lookup`]). `L` even.
    #[inline(never)]
    pub(crate) fn ahmm<const L: usize>(
        a: &N52x8<L>,
        b: &N52x8<L>,
        kb: &N52x8<L>,
        m: &N52x8<L>,
        k0: U64x8,
    ) -> N52x8<L> {
        let z = U64x8::zero();
        let h = L / 2;
        let mut acc = [z; L];
        for i in 0..h {
            let (lo, hi) = (a[i], a[i + h]);
            // The row's products at position 0 first, apart from the window, so the chain from
            // one reduction factor to the next is one add and the two products by u below.
            let t0 = acc[0].add(z.madd52lo(lo, kb[0]).madd52lo(hi, b[0]));
            let u = z.madd52lo(t0, k0);
            let c = t0.madd52lo(u, m[0]).shr::<52>();
            unroll80!(j < L => {
                if j >= 1 {
                    let v = acc[j]
                        .madd52lo(lo, kb[j])
                        .madd52hi(lo, kb[j - 1])
                        .madd52lo(hi, b[j])
                        .madd52hi(hi, b[j - 1])
                        .madd52lo(u, m[j])
                        .madd52hi(u, m[j - 1]);
                    acc[j - 1] = if j == 1 { v.add(c) } else { v };
                }
            });
            acc[L - 1] = z.madd52hi(lo, kb[L - 1]).madd52hi(hi, b[L - 1]).madd52hi(u, m[L - 1]);
        }
        normalize(&mut acc);
        acc
    }
}

kfn! {
    /// The two-row step of [`pair_step!`] with the window kept in memory and a runtime limb loop:
    /// each position costs one load and one store for eight IFMA, and the operand digits slide
    /// through registers (three new loads per position). For windows too large for the register
    /// file (`L ≥ 40`). Operand digits below the block start `s` are zero and skipped where a whole
    /// position has none.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn pair_step_mem<const L: usize>(
        acc: &mut N52x8<L>,
        a0: U64x8,
        a1: U64x8,
        ba: &[U64x8],
        bb: &[U64x8],
        m: &N52x8<L>,
        k0: U64x8,
        s: usize,
    ) {
        let z = U64x8::zero();
        let t0 = acc[0].madd52lo(a0, ba[0]);
        let ua = z.madd52lo(t0, k0);
        let ca = t0.madd52lo(ua, m[0]).shr::<52>();
        let t1 = acc[1]
            .madd52lo(a0, ba[1])
            .madd52hi(a0, ba[0])
            .madd52lo(a1, bb[0])
            .madd52lo(ua, m[1])
            .madd52hi(ua, m[0])
            .add(ca);
        let ub = z.madd52lo(t1, k0);
        let cb = t1.madd52lo(ub, m[0]).shr::<52>();
        let x0 = s.clamp(2, L);
        for p in 2..x0 {
            let v = acc[p].madd52lo(ua, m[p]).madd52hi(ua, m[p - 1]);
            acc[p - 2] = v.madd52lo(ub, m[p - 1]).madd52hi(ub, m[p - 2]);
        }
        let (mut ba1, mut bb2, mut m1, mut m2) = (ba[x0 - 1], bb[x0 - 2], m[x0 - 1], m[x0 - 2]);
        for p in x0..L {
            let (bap, bb1, mp) = (ba[p], bb[p - 1], m[p]);
            let v = acc[p].madd52lo(a0, bap).madd52hi(a0, ba1).madd52lo(a1, bb1).madd52hi(a1, bb2);
            let w = z.madd52lo(ua, mp).madd52hi(ua, m1).madd52lo(ub, m1).madd52hi(ub, m2);
            acc[p - 2] = v.add(w);
            ba1 = bap;
            bb2 = bb1;
            m2 = m1;
            m1 = mp;
        }
        acc[L - 2] = z
            .madd52lo(a0, ba[L])
            .madd52hi(a0, ba[L - 1])
            .madd52lo(a1, bb[L - 1])
            .madd52hi(a1, bb[L - 2])
            .madd52hi(ua, m[L - 1])
            .madd52lo(ub, m[L - 1])
            .madd52hi(ub, m[L - 2]);
        acc[L - 1] = z.madd52lo(a1, bb[L]).madd52hi(a1, bb[L - 1]).madd52hi(ub, m[L - 1]);
        acc[0] = acc[0].add(cb);
    }
}

kfn! {
    /// Squaring with [`pair_step_mem`] (same row operands as [`amsqr`]). `L2 = 2·L`.
    #[inline(never)]
    pub(crate) fn amsqr_mem<const L: usize, const L2: usize>(
        a: &N52x8<L>,
        m: &N52x8<L>,
        k0: U64x8,
    ) -> N52x8<L> {
        let z = U64x8::zero();
        let mask = U64x8::splat(MASK52);
        let mut ba = [z; L2];
        ba[0] = a[0].shl::<1>().and(mask);
        for j in 1..L {
            ba[j] = a[j].shl::<1>().and(mask).add(a[j - 1].shr::<51>());
        }
        ba[L] = a[L - 1].shr::<51>();
        let mut bb = ba;
        let mut acc = [z; L];
        for k in 0..8 {
            let s = (k * L / 8) & !1;
            let e = if k == 7 { L } else { ((k + 1) * L / 8) & !1 };
            for i in (s..e).step_by(2) {
                if i >= 2 {
                    ba[i - 2] = z;
                    ba[i - 1] = z;
                    bb[i - 1] = z;
                }
                ba[i] = a[i];
                ba[i + 1] = a[i + 1].shl::<1>().and(mask);
                bb[i] = z;
                bb[i + 1] = a[i + 1];
                bb[i + 2] = if i + 2 < L { a[i + 2].shl::<1>().and(mask) } else { z };
                pair_step_mem(&mut acc, a[i], a[i + 1], &ba, &bb, m, k0, s);
            }
        }
        normalize(&mut acc);
        acc
    }
}

kfn! {
    /// AMM with [`pair_step_mem`]. `L2 = 2·L`.
    #[inline(never)]
    pub(crate) fn amm_mem<const L: usize, const L2: usize>(
        a: &N52x8<L>,
        b: &N52x8<L>,
        m: &N52x8<L>,
        k0: U64x8,
    ) -> N52x8<L> {
        let z = U64x8::zero();
        let mut bx = [z; L2];
        bx[..L].copy_from_slice(b);
        let mut acc = [z; L];
        for i in (0..L).step_by(2) {
            pair_step_mem(&mut acc, a[i], a[i + 1], &bx, &bx, m, k0, 0);
        }
        normalize(&mut acc);
        acc
    }
}

kfn! {
    /// Montgomery reduction of a `2L`-limb loose value `t < m·R`: returns `t·R⁻¹ mod m`, below 2m,
    /// normalised. `L2` must be `2·L`.
    #[inline]
    pub(crate) fn redc<const L: usize, const L2: usize>(t: &mut N52x8<L2>, m: &N52x8<L>, k0: U64x8) -> N52x8<L> {
        debug_assert_eq!(L2, 2 * L);
        let z = U64x8::zero();
        for i in 0..L {
            let u = z.madd52lo(t[i], k0);
            let carry = t[i].madd52lo(u, m[0]).shr::<52>();
            for j in 1..L {
                t[i + j] = t[i + j].madd52lo(u, m[j]).madd52hi(u, m[j - 1]);
            }
            t[i + L] = t[i + L].madd52hi(u, m[L - 1]);
            t[i + 1] = t[i + 1].add(carry);
        }
        let mut out = [z; L];
        out.copy_from_slice(&t[L..]);
        normalize(&mut out);
        out
    }
}

kfn! {
    /// Almost Montgomery squaring: `a²·R⁻¹ mod m`, result < 2m, for normalised `a < 2m`.
    ///
    /// At 20 limbs this is the column form of [`amsqr_cols_n`]; from 40 limbs the memory-window
    /// form [`amsqr_mem`]. In between (30 limbs): the same rolling window as [`amm`], with a
    /// row-dependent second operand: row `i` adds `a_i · B⁽ⁱ⁾` where `B⁽ⁱ⁾ = a_i·2^(52i) + 2·Σ_{j>i} a_j·2^(52j)` (digits: `a_i` at `i`, the
    /// un-carried `2a_{i+1} mod 2^52` at `i+1`, the normalised digits of `2a` above, zero below).
    /// Summed over the rows this is exactly `a²`, and each cross product is computed once. Rows run
    /// in four blocks; inside a block the digits below the block start are known zero at compile
    /// time and skipped, so the square costs about `1.25·L²` IFMA instead of `2L²` (plus `2L²` for
    /// the reduction). Four blocks, not eight: each block is a fully unrolled copy of the window
    /// code, and with eight the copies overflow the op cache of a Zen 5 — four issue ~3 % more IFMA
    /// and run 5 % faster at 30 limbs there. `L` even, `L2 = 2·L`.
    #[inline(never)]
    pub(crate) fn amsqr<const L: usize, const L2: usize>(
        a: &N52x8<L>,
        m: &N52x8<L>,
        k0: U64x8,
    ) -> N52x8<L> {
        if L == 20 {
            return amsqr_n::<L, L2>(a, m, k0, 1);
        }
        if L >= 40 {
            // The register window spills badly this large; the memory-window form measured faster.
            return amsqr_mem::<L, L2>(a, m, k0);
        }
        let z = U64x8::zero();
        let mask = U64x8::splat(MASK52);
        // Digits of 2a (normalised), L + 1 of them; row A of a pair reads `ba`, row B `bb`.
        let mut ba = [z; L2];
        ba[0] = a[0].shl::<1>().and(mask);
        for j in 1..L {
            ba[j] = a[j].shl::<1>().and(mask).add(a[j - 1].shr::<51>());
        }
        ba[L] = a[L - 1].shr::<51>();
        let mut bb = ba;
        let mut acc = [z; L];
        macro_rules! block {
            ($k:literal) => {{
                let s = ($k * L / 4) & !1;
                let e = if $k == 3 { L } else { (($k + 1) * L / 4) & !1 };
                for i in (s..e).step_by(2) {
                    if i >= 2 {
                        ba[i - 2] = z;
                        ba[i - 1] = z;
                        bb[i - 1] = z;
                    }
                    ba[i] = a[i];
                    ba[i + 1] = a[i + 1].shl::<1>().and(mask);
                    bb[i] = z;
                    bb[i + 1] = a[i + 1];
                    bb[i + 2] = if i + 2 < L { a[i + 2].shl::<1>().and(mask) } else { z };
                    pair_step!(acc, a[i], a[i + 1], ba, bb, m, k0, s);
                }
            }};
        }
        block!(0);
        block!(1);
        block!(2);
        block!(3);
        normalize(&mut acc);
        acc
    }
}

/// Column `c` of `a²` for `L`-limb `a` (`c < 2L`), before carries: the cross products
/// `a_i·a_{c−i}` (`i < c − i`) low halves and the cross products of column `c − 1` high halves,
/// doubled, plus the low (`c` even) or high (`c` odd) half of the diagonal square that lands here.
/// Two independent accumulation chains (low and high halves) keep the column's dependency chain
/// short. `c` and `L` are constants after unrolling, so the loops vanish.
macro_rules! sqr_column {
    ($a:ident, $c:expr, $l:expr) => {{
        let (c, l): (usize, usize) = ($c, $l);
        let z = U64x8::zero();
        let (mut lo, mut hi) = (z, z);
        let mut i = (c + 1).saturating_sub(l);
        while 2 * i < c {
            lo = lo.madd52lo($a[i], $a[c - i]);
            i += 1;
        }
        if c >= 1 {
            let mut i = c.saturating_sub(l);
            while 2 * i < c - 1 {
                hi = hi.madd52hi($a[i], $a[c - 1 - i]);
                i += 1;
            }
        }
        let s = lo.add(hi);
        let s = s.add(s);
        if c % 2 == 0 {
            if c / 2 < l {
                s.madd52lo($a[c / 2], $a[c / 2])
            } else {
                s
            }
        } else {
            s.madd52hi($a[(c - 1) / 2], $a[(c - 1) / 2])
        }
    }};
}

kfn! {
    /// `n` almost Montgomery squarings in a row (`a^(2^n)·R^(1−2^n) mod m`, result < 2m) for
    /// 20 limbs, the primes of RSA-2048 — every squaring of a window in one call, so the value
    /// stays in this function between them.
    ///
    /// Each squaring forms the `2L` columns of `a²` ([`sqr_column!`]: every cross product once,
    /// 420 IFMA at 20 limbs) and reduces them one row at a time: row `i` adds `u_i·m` at limb `i`
    /// and moves the carry of limb `i` into limb `i + 1`, and the next factor `u_{i+1}` is formed
    /// as soon as limb `i + 1` is exact (after the two products of row `i` that land there), so
    /// the rows overlap. The upper columns are formed just ahead of the row that first needs
    /// them rather than all up front, which keeps fewer of them live (2–3 % faster on the Xeon).
    /// 1,241 IFMA per squaring against 1,340 for the four-block row form it replaced, and a
    /// column needs only the low limbs of `a`, so a squaring starts while the carry propagation
    /// of the previous one is still on its way up. Measured on a Xeon
    /// (family 6 model 207): two 1024-bit exponentiations about 5.5 % faster than the row form
    /// (see `NOTES.md`). Generic so that out-of-range guards stay unevaluated, but called only with
    /// `L = 20`, `L2 = 40` (see [`amsqr_n`]); larger sizes would spill the `2L` columns badly.
    ///
    /// With `LK` (window exponentiation, `n = 4`) the same call also selects entry `idx` of the
    /// two 16-entry tables `tb` and `tk` ([`Lookup`]): squaring `s` reads entries `4s..4s + 4`,
    /// limb `i` of each in reduction row `i`, so the 640 loads and masked moves of the lookup fill
    /// the squarings' idle issue slots instead of running after them. Every entry is read for
    /// every lane whatever `idx` holds. Returns `(a^(2^n)…, tb[idx], tk[idx])` (zeros without
    /// `LK`).
    #[inline(never)]
    #[allow(unused_assignments)]
    fn amsqr_cols_n<const L: usize, const L2: usize, const LK: bool>(
        a: &N52x8<L>,
        m: &N52x8<L>,
        k0: U64x8,
        n: usize,
        look: Lookup<'_, L>,
    ) -> [N52x8<L>; 3] {
        let z = U64x8::zero();
        let mask = U64x8::splat(MASK52);
        let mut x = *a;
        let mut tb = [z; L];
        let mut tk = [z; L];
        let mut hits = [0u8; 16];
        if LK {
            assert!(n == 4 && look.tb.len() == 16 && look.tk.len() == 16, "window lookup shape");
            for (e, h) in hits.iter_mut().enumerate() {
                *h = look.idx.eq_mask(U64x8::splat(e as u64));
            }
        }
        for s in 0..n {
            // Columns up to L + 1 now; column L + 2 + i just before row i, which is two rows
            // before its first use, so that only about L + 2 columns are live at a time.
            let mut r = [z; L2];
            unroll80!(c < L + 2 => {
                r[c] = sqr_column!(x, c, L);
            });
            let mut u = z.madd52lo(r[0], k0);
            unroll80!(i < L => {
                if i + L + 2 < L2 {
                    r[i + L + 2] = sqr_column!(x, i + L + 2, L);
                }
                if LK {
                    for e4 in 0..4 {
                        let e = (4 * s + e4) & 15;
                        tb[i] = tb[i].select(hits[e], look.tb[e][i]);
                        tk[i] = tk[i].select(hits[e], look.tk[e][i]);
                    }
                }
                r[i] = r[i].madd52lo(u, m[0]);
                r[i + 1] = r[i + 1].madd52hi(u, m[0]).madd52lo(u, m[1]).add(r[i].shr::<52>());
                let next = z.madd52lo(r[i + 1], k0);
                unroll80!(j < L => {
                    if j >= 1 {
                        if j >= 2 {
                            r[i + j] = r[i + j].madd52lo(u, m[j]);
                        }
                        r[i + j + 1] = r[i + j + 1].madd52hi(u, m[j]);
                    }
                });
                u = next;
            });
            // The reduced value is r[L..2L] (the carry out of limb L − 1 is already in r[L]).
            let mut c = z;
            unroll80!(j < L => {
                let t = r[L + j].add(c);
                c = t.shr::<52>();
                x[j] = t.and(mask);
            });
        }
        [x, tb, tk]
    }
}

/// The tables a window's squarings select from on the way ([`amsqr_cols_n`] with `LK`): entry
/// `idx` (per lane) of `tb` and of `tk`.
#[derive(Clone, Copy)]
pub(crate) struct Lookup<'a, const L: usize> {
    tb: &'a [N52x8<L>],
    tk: &'a [N52x8<L>],
    idx: U64x8,
}

kfn! {
    /// `n` almost Montgomery squarings in a row. At 20 limbs all `n` run inside
    /// [`amsqr_cols_n`]; other sizes call [`amsqr`] `n` times.
    #[inline]
    pub(crate) fn amsqr_n<const L: usize, const L2: usize>(
        a: &N52x8<L>,
        m: &N52x8<L>,
        k0: U64x8,
        n: usize,
    ) -> N52x8<L> {
        if L == 20 {
            // The literal sizes keep the column form from being instantiated for other sizes.
            let a20: &N52x8<20> = a[..].try_into().expect("L is 20");
            let m20: &N52x8<20> = m[..].try_into().expect("L is 20");
            let none = Lookup { tb: &[], tk: &[], idx: U64x8::zero() };
            let [r, _, _] = amsqr_cols_n::<20, 40, false>(a20, m20, k0, n, none);
            let mut out = [U64x8::zero(); L];
            out.copy_from_slice(&r);
            return out;
        }
        let mut x = *a;
        for _ in 0..n {
            x = amsqr::<L, L2>(&x, m, k0);
        }
        x
    }
}

kfn! {
    /// Plain product `a·b` as `2L` normalised limbs. `L2` must be `2·L`.
    pub(crate) fn mul_wide<const L: usize, const L2: usize>(a: &N52x8<L>, b: &N52x8<L>) -> N52x8<L2> {
        let mut t = [U64x8::zero(); L2];
        for i in 0..L {
            for j in 0..L {
                t[i + j] = t[i + j].madd52lo(a[i], b[j]);
                t[i + j + 1] = t[i + j + 1].madd52hi(a[i], b[j]);
            }
        }
        normalize(&mut t);
        t
    }
}

kfn! {
    /// `x mod m` for normalised `x < 2m`: subtracts `m` and keeps the difference in the lanes where
    /// it did not borrow (per-lane masked blend, no branch).
    pub(crate) fn reduce_once<const L: usize>(x: &N52x8<L>, m: &N52x8<L>) -> N52x8<L> {
        let mask = U64x8::splat(MASK52);
        let mut d = [U64x8::zero(); L];
        let mut borrow = U64x8::zero(); // 0 or all-ones (−1)
        for j in 0..L {
            let t = x[j].sub(m[j]).add(borrow);
            borrow = t.sra::<52>();
            d[j] = t.and(mask);
        }
        let keep_x = borrow.eq_mask(U64x8::splat(u64::MAX)); // x < m
        let mut out = d;
        for j in 0..L {
            out[j] = d[j].select(keep_x, x[j]);
        }
        out
    }
}

kfn! {
    /// Reads every table entry and keeps, per lane, the one whose index equals that lane's `idx`.
    #[inline]
    pub(crate) fn lookup<const L: usize>(table: &[N52x8<L>], idx: U64x8) -> N52x8<L> {
        let mut r = [U64x8::zero(); L];
        for (k, e) in table.iter().enumerate() {
            let hit = idx.eq_mask(U64x8::splat(k as u64));
            for j in 0..L {
                r[j] = r[j].select(hit, e[j]);
            }
        }
        r
    }
}

kfn! {
    /// `x^e mod m` per lane with a fixed window of `w` bits over `ebits` exponent bits (the same
    /// sequence of squarings, lookups and multiplications for every exponent). `x_mont` is `x·R mod
    /// m` (below 2m); `exps[i]` is lane `i`'s exponent (little-endian words). Returns the canonical
    /// result (below m), out of the Montgomery domain.
    pub(crate) fn modexp<const L: usize, const L2: usize>(
        x_mont: &N52x8<L>,
        exps: &[&[u64]; 8],
        ebits: usize,
        w: usize,
        m: &N52x8<L>,
        k0: U64x8,
        r2: &N52x8<L>,
    ) -> N52x8<L> {
        let mut one = [U64x8::zero(); L];
        one[0] = U64x8::splat(1);
        let size = 1usize << w;
        let mut table: Vec<N52x8<L>> = Vec::with_capacity(size);
        table.push(amm::<L, L2>(r2, &one, m, k0)); // R mod m: Montgomery form of 1
        table.push(*x_mont);
        for k in 2..size {
            let e = if k % 2 == 0 {
                amsqr::<L, L2>(&table[k / 2], m, k0)
            } else {
                amm::<L, L2>(&table[k - 1], &table[1], m, k0)
            };
            table.push(e);
        }
        let windows = ebits.div_ceil(w);
        let mut acc = lookup(&table, window_index(exps, (windows - 1) * w, w));
        if L == 20 && w == 4 {
            // RSA-2048: each window's lookup rides in its squarings, and its multiplication is
            // the half-reduction one, fed from a second table of the entries times 2^(−520).
            let a20: &N52x8<20> = acc[..].try_into().expect("L is 20");
            let m20: &N52x8<20> = m[..].try_into().expect("L is 20");
            let tb: Vec<N52x8<20>> =
                table.iter().map(|e| e[..].try_into().expect("L is 20")).collect();
            let mut e10 = [U64x8::zero(); 20];
            e10[10] = U64x8::splat(1);
            let tk: Vec<N52x8<20>> = tb.iter().map(|e| amm::<20, 40>(e, &e10, m20, k0)).collect();
            let mut x = *a20;
            for win in (0..windows - 1).rev() {
                let idx = window_index(exps, win * w, w);
                let look = Lookup { tb: &tb, tk: &tk, idx };
                let [y, b, kb] = amsqr_cols_n::<20, 40, true>(&x, m20, k0, w, look);
                x = ahmm::<20>(&y, &b, &kb, m20, k0);
            }
            acc.copy_from_slice(&x);
            let r = amm::<L, L2>(&acc, &one, m, k0);
            return reduce_once(&r, m);
        }
        for win in (0..windows - 1).rev() {
            acc = amsqr_n::<L, L2>(&acc, m, k0, w);
            let e = lookup(&table, window_index(exps, win * w, w));
            acc = amm::<L, L2>(&acc, &e, m, k0);
        }
        let r = amm::<L, L2>(&acc, &one, m, k0);
        reduce_once(&r, m)
    }
}

kfn! {
    /// One CRT half: `c^d mod m` for the full-size `c`. `c mod m` is brought into the Montgomery
    /// domain as REDC(c) = c·R⁻¹, then two multiplications by R² (c·R⁻¹·R²·R⁻¹·R²·R⁻¹ = c·R).
    fn crt_half<const L: usize, const L2: usize>(
        c: &N52x8<L2>,
        m: &N52x8<L>,
        k0: U64x8,
        r2: &N52x8<L>,
        exps: &[&[u64]; 8],
        ebits: usize,
        w: usize,
    ) -> N52x8<L> {
        let mut t = *c;
        let x = redc::<L, L2>(&mut t, m, k0);
        let x = amm::<L, L2>(&x, r2, m, k0);
        let x = amm::<L, L2>(&x, r2, m, k0);
        modexp::<L, L2>(&x, exps, ebits, w, m, k0, r2)
    }
}

kfn! {
    /// The RSA-CRT private operation on eight lanes, each with its own key of the same size, followed
    /// by the public-key re-check (e = 65537). `em[i]` is lane `i`'s message representative in
    /// radix 2^52 (`L2` limbs, below that lane's n). `corrupt` flips a bit of the result in the given
    /// lanes before the check (test hook; 0 in production). `L2 = 2L`, `L4 = 4L`.
    fn crt_batch_kernel<const L: usize, const L2: usize, const L4: usize>(
        keys: &[LaneKey<'_>; 8],
        em: &[&[u64]; 8],
        ebits: usize,
        w: usize,
        corrupt: u8,
    ) -> BatchOut<L2> {
        let c: N52x8<L2> = gather(|i| em[i]);
        let p: N52x8<L> = gather(|i| keys[i].p);
        let q: N52x8<L> = gather(|i| keys[i].q);
        let pk0 = U64x8::from_array(core::array::from_fn(|i| keys[i].p_k0));
        let qk0 = U64x8::from_array(core::array::from_fn(|i| keys[i].q_k0));
        let p_r2: N52x8<L> = gather(|i| keys[i].p_r2);
        let q_r2: N52x8<L> = gather(|i| keys[i].q_r2);

        let dp: [&[u64]; 8] = core::array::from_fn(|i| keys[i].dp);
        let dq: [&[u64]; 8] = core::array::from_fn(|i| keys[i].dq);
        let mp = crt_half::<L, L2>(&c, &p, pk0, &p_r2, &dp, ebits, w);
        let mq = crt_half::<L, L2>(&c, &q, qk0, &q_r2, &dq, ebits, w);

        // Garner: h = (m_p − m_q)·qInv mod p, computed as (m_p + 2p − m_q)·(qInv·R)·R⁻¹ (the sum is
        // positive and below 3p because m_q < q < 2p); s = m_q + h·q.
        let mask = U64x8::splat(MASK52);
        let mut t = [U64x8::zero(); L];
        let mut carry = U64x8::zero();
        for j in 0..L {
            let v = mp[j].add(p[j]).add(p[j]).sub(mq[j]).add(carry);
            carry = v.sra::<52>();
            t[j] = v.and(mask);
        }
        let qinv_r: N52x8<L> = gather(|i| keys[i].qinv_r);
        let h = reduce_once(&amm::<L, L2>(&t, &qinv_r, &p, pk0), &p);
        let mut s: N52x8<L2> = mul_wide::<L, L2>(&h, &q);
        for j in 0..L {
            s[j] = s[j].add(mq[j]);
        }
        normalize(&mut s);

        let flip = U64x8::splat(1);
        s[0] = s[0].select(corrupt, s[0].xor(flip));

        // Fault check: s^65537 mod n must equal the representative.
        let n: N52x8<L2> = gather(|i| keys[i].n);
        let nk0 = U64x8::from_array(core::array::from_fn(|i| keys[i].n_k0));
        let n_r2: N52x8<L2> = gather(|i| keys[i].n_r2);
        let sm = amm::<L2, L4>(&s, &n_r2, &n, nk0);
        let mut y = sm;
        for _ in 0..16 {
            y = amsqr::<L2, L4>(&y, &n, nk0);
        }
        y = amm::<L2, L4>(&y, &sm, &n, nk0);
        let mut one = [U64x8::zero(); L2];
        one[0] = U64x8::splat(1);
        let y = reduce_once(&amm::<L2, L4>(&y, &one, &n, nk0), &n);
        let mut ok: u8 = 0xff;
        for j in 0..L2 {
            ok &= y[j].eq_mask(c[j]);
        }
        BatchOut { sig: scatter(&s), ok }
    }
}

// The tests call kernel functions through `kcall!`: a plain call in the model build (safe
// functions), an `unsafe` call in the IFMA build (after `kernels_here` found the features).
#[cfg(test)]
mod tests {
    //! Every kernel against `boring::bn::BigNum` with different random values in every lane, in
    //! both builds (`rsa::model::tests`, `rsa::ifma::tests`).
    use super::*;
    use crate::mb::rsa::{bytes_to_limbs52, ifma_k0, limbs52_to_bytes};
    use boring::bn::{BigNum, BigNumContext};
    use rand::{Rng, RngCore, SeedableRng};
    use rand_chacha::ChaCha20Rng;

    /// True where this build of the kernels can run: always for the model; for the IFMA build,
    /// the shared skip-or-fail helper (`require_ifma`: prints the skip, fails under
    /// `REQUIRE_IFMA=1`).
    fn kernels_here() -> bool {
        super::kernels_here("RSA kernel test")
    }

    fn rand_bn(rng: &mut ChaCha20Rng, bits: usize) -> BigNum {
        let mut b = vec![0u8; bits.div_ceil(8)];
        rng.fill_bytes(&mut b);
        let extra = 8 * b.len() - bits;
        b[0] &= 0xff >> extra;
        BigNum::from_slice(&b).unwrap()
    }

    /// A random odd modulus of exactly `bits` bits.
    fn rand_mod(rng: &mut ChaCha20Rng, bits: usize) -> BigNum {
        let mut m = rand_bn(rng, bits);
        m.set_bit(bits as i32 - 1).unwrap();
        m.set_bit(0).unwrap();
        m
    }

    fn below(rng: &mut ChaCha20Rng, m: &BigNum) -> BigNum {
        let mut ctx = BigNumContext::new().unwrap();
        let x = rand_bn(rng, m.num_bits() as usize + 8);
        let mut r = BigNum::new().unwrap();
        r.nnmod(&x, m, &mut ctx).unwrap();
        r
    }

    fn limbs(x: &BigNum, l: usize) -> Vec<u64> {
        let mut v = vec![0u64; l];
        bytes_to_limbs52(&x.to_vec(), &mut v);
        v
    }

    fn to_bn(l: &[u64]) -> BigNum {
        let mut b = vec![0u8; l.len() * 52 / 8 + 1];
        limbs52_to_bytes(l, &mut b);
        BigNum::from_slice(&b).unwrap()
    }

    fn pack<const L: usize>(xs: &[BigNum]) -> N52x8<L> {
        let v: Vec<Vec<u64>> = xs.iter().map(|x| limbs(x, L)).collect();
        kcall! { gather(|i| v[i].as_slice()) }
    }

    fn unpack<const L: usize>(x: &N52x8<L>) -> Vec<BigNum> {
        let s = kcall! { scatter(x) };
        s.iter().map(|l| to_bn(l)).collect()
    }

    fn k0s(ms: &[BigNum]) -> U64x8 {
        let k: Vec<u64> =
            ms.iter().map(|m| ifma_k0(limbs(m, 2)[0] | (limbs(m, 2)[1] << 52))).collect();
        kcall! { U64x8::from_array(k.try_into().unwrap()) }
    }

    fn r_mod(bits: usize, m: &BigNum) -> BigNum {
        let mut ctx = BigNumContext::new().unwrap();
        let mut r = BigNum::new().unwrap();
        r.set_bit(bits as i32).unwrap();
        let mut o = BigNum::new().unwrap();
        o.nnmod(&r, m, &mut ctx).unwrap();
        o
    }

    fn modmul(a: &BigNum, b: &BigNum, m: &BigNum) -> BigNum {
        let mut ctx = BigNumContext::new().unwrap();
        let mut o = BigNum::new().unwrap();
        o.mod_mul(a, b, m, &mut ctx).unwrap();
        o
    }

    fn eq_mod(a: &BigNum, b: &BigNum, m: &BigNum) -> bool {
        let mut ctx = BigNumContext::new().unwrap();
        let mut x = BigNum::new().unwrap();
        x.nnmod(a, m, &mut ctx).unwrap();
        let mut y = BigNum::new().unwrap();
        y.nnmod(b, m, &mut ctx).unwrap();
        x == y
    }

    #[test]
    fn radix52_roundtrip() {
        let mut rng = ChaCha20Rng::seed_from_u64(10);
        for _ in 0..500 {
            let len = rng.gen_range(1..520);
            let mut b = vec![0u8; len];
            rng.fill_bytes(&mut b);
            let l = (8 * len).div_ceil(52);
            let mut v = vec![0u64; l];
            bytes_to_limbs52(&b, &mut v);
            assert!(v.iter().all(|&x| x < 1 << 52));
            let mut back = vec![0u8; len];
            limbs52_to_bytes(&v, &mut back);
            assert_eq!(b, back);
            assert_eq!(to_bn(&v), BigNum::from_slice(&b).unwrap());
        }
    }

    #[test]
    fn transpose_keeps_lanes() {
        if !kernels_here() {
            return;
        }
        let mut rng = ChaCha20Rng::seed_from_u64(11);
        let lanes: Vec<Vec<u64>> =
            (0..8).map(|_| (0..30).map(|_| rng.gen::<u64>() & MASK52).collect()).collect();
        let x: N52x8<30> = kcall! { gather(|i| lanes[i].as_slice()) };
        let back = kcall! { scatter(&x) };
        for i in 0..8 {
            assert_eq!(&back[i][..], &lanes[i][..]);
        }
    }

    /// AMM, squaring, reduce_once against BigNum for `cases` batches of 8 random moduli.
    /// Below `m`, or below `2m` (a value below `m` doubled) half the time.
    fn two_m_below(rng: &mut ChaCha20Rng, m: &BigNum) -> BigNum {
        let mut x = below(rng, m);
        if rng.gen::<bool>() {
            let y = x.to_owned().unwrap();
            x.checked_add(&y, m).unwrap();
        }
        x
    }

    fn mont_ops<const L: usize, const L2: usize>(bits: usize, cases: usize, seed: u64) {
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        let rbits = 52 * L;
        for _ in 0..cases {
            let ms: Vec<BigNum> = (0..8).map(|_| rand_mod(&mut rng, bits)).collect();
            // inputs below 2m (the AMM contract), lane-distinct
            let a: Vec<BigNum> = ms.iter().map(|m| two_m_below(&mut rng, m)).collect();
            let b: Vec<BigNum> = ms.iter().map(|m| below(&mut rng, m)).collect();
            let (va, vb, vm, k0) = (pack::<L>(&a), pack::<L>(&b), pack::<L>(&ms), k0s(&ms));
            let prod = unpack(&kcall! { amm::<L, L2>(&va, &vb, &vm, k0) });
            let sq = unpack(&kcall! { amsqr::<L, L2>(&va, &vm, k0) });
            assert_eq!(prod, unpack(&kcall! { amm_mem::<L, L2>(&va, &vb, &vm, k0) }), "amm_mem");
            assert_eq!(sq, unpack(&kcall! { amsqr_mem::<L, L2>(&va, &vm, k0) }), "amsqr_mem");
            let red = unpack(&kcall! { reduce_once(&amm::<L, L2>(&va, &vb, &vm, k0), &vm) });
            for i in 0..8 {
                let m = &ms[i];
                let mut two_m = BigNum::new().unwrap();
                two_m.lshift1(m).unwrap();
                let r = r_mod(rbits, m);
                // x·R ≡ a·b  (mod m), x < 2m
                assert!(prod[i] < two_m, "amm bound lane {i}");
                assert!(
                    eq_mod(&modmul(&prod[i], &r, m), &modmul(&a[i], &b[i], m), m),
                    "amm lane {i}"
                );
                assert!(sq[i] < two_m, "sqr bound lane {i}");
                assert!(
                    eq_mod(&modmul(&sq[i], &r, m), &modmul(&a[i], &a[i], m), m),
                    "sqr lane {i}"
                );
                assert!(red[i] < *m && eq_mod(&red[i], &prod[i], m), "reduce lane {i}");
            }
        }
    }

    /// The half-reduction multiplication against `BigNum` (`a` below 2m, `b` and `kb` below m,
    /// lane-distinct), and the squarings with the stitched lookup against [`amsqr_n`] and
    /// [`lookup`] (20 limbs, the only size that has them).
    fn half_ops_20(bits: usize, cases: usize, seed: u64) {
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        let mut ctx = BigNumContext::new().unwrap();
        for _ in 0..cases {
            let ms: Vec<BigNum> = (0..8).map(|_| rand_mod(&mut rng, bits)).collect();
            let (vm, k0) = (pack::<20>(&ms), k0s(&ms));
            let a: Vec<BigNum> = ms.iter().map(|m| two_m_below(&mut rng, m)).collect();
            let kb: Vec<BigNum> = ms.iter().map(|m| below(&mut rng, m)).collect();
            // b = kb·2^520 mod m, so that kb = b·2^(−520) mod m
            let b: Vec<BigNum> = (0..8).map(|i| modmul(&kb[i], &r_mod(520, &ms[i]), &ms[i])).collect();
            let (va, vb, vkb) = (pack::<20>(&a), pack::<20>(&b), pack::<20>(&kb));
            let got = unpack(&kcall! { ahmm::<20>(&va, &vb, &vkb, &vm, k0) });
            for i in 0..8 {
                let m = &ms[i];
                let mut four_m = BigNum::new().unwrap();
                four_m.lshift(m, 2).unwrap();
                assert!(got[i] < four_m, "ahmm bound lane {i}");
                let r = r_mod(1040, m);
                let mut want = BigNum::new().unwrap();
                want.mod_mul(&a[i], &b[i], m, &mut ctx).unwrap();
                assert!(eq_mod(&modmul(&got[i], &r, m), &want, m), "ahmm lane {i}");
            }
            // 16-entry tables of lane-distinct values, a different index in every lane
            let tab = |rng: &mut ChaCha20Rng| -> Vec<N52x8<20>> {
                (0..16)
                    .map(|_| pack::<20>(&ms.iter().map(|m| below(rng, m)).collect::<Vec<_>>()))
                    .collect()
            };
            let (tb, tk) = (tab(&mut rng), tab(&mut rng));
            let lanes: [u64; 8] = core::array::from_fn(|_| rng.gen_range(0..16u64));
            let idx = kcall! { U64x8::from_array(lanes) };
            let look = Lookup { tb: &tb, tk: &tk, idx };
            let [y, gb, gk] = kcall! { amsqr_cols_n::<20, 40, true>(&va, &vm, k0, 4, look) };
            assert_eq!(unpack(&y), unpack(&kcall! { amsqr_n::<20, 40>(&va, &vm, k0, 4) }));
            assert_eq!(unpack(&gb), unpack(&kcall! { lookup(&tb, idx) }), "stitched lookup tb");
            assert_eq!(unpack(&gk), unpack(&kcall! { lookup(&tk, idx) }), "stitched lookup tk");
        }
    }

    #[test]
    fn montgomery_ops_20() {
        if kernels_here() {
            mont_ops::<20, 40>(1024, 600, 20);
            mont_ops::<20, 40>(1000, 200, 21);
            half_ops_20(1024, 300, 22);
            half_ops_20(1000, 100, 23);
        }
    }

    #[test]
    fn montgomery_ops_30() {
        if kernels_here() {
            mont_ops::<30, 60>(1536, 300, 30);
        }
    }

    #[test]
    fn montgomery_ops_40() {
        if kernels_here() {
            mont_ops::<40, 80>(2048, 200, 40);
        }
    }

    #[test]
    fn montgomery_ops_80() {
        if kernels_here() {
            mont_ops::<80, 160>(4096, 40, 80);
        }
    }

    /// REDC of a double-width value, the plain product and the masked lookup, lane-distinct.
    fn redc_mul_lookup<const L: usize, const L2: usize>(bits: usize, cases: usize, seed: u64) {
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        let mut ctx = BigNumContext::new().unwrap();
        for _ in 0..cases {
            let ms: Vec<BigNum> = (0..8).map(|_| rand_mod(&mut rng, bits)).collect();
            let k0 = k0s(&ms);
            let vm = pack::<L>(&ms);
            // t < m·R: a random value of bits + 52L − 1 bits
            let ts: Vec<BigNum> = (0..8).map(|_| rand_bn(&mut rng, bits + 52 * L - 1)).collect();
            let mut vt = pack::<L2>(&ts);
            let red = unpack(&kcall! { redc::<L, L2>(&mut vt, &vm, k0) });
            let a: Vec<BigNum> = ms.iter().map(|m| below(&mut rng, m)).collect();
            let b: Vec<BigNum> = (0..8).map(|_| rand_bn(&mut rng, 52 * L)).collect();
            let wide = unpack(&kcall! { mul_wide::<L, L2>(&pack::<L>(&a), &pack::<L>(&b)) });
            for i in 0..8 {
                let r = r_mod(52 * L, &ms[i]);
                assert!(eq_mod(&modmul(&red[i], &r, &ms[i]), &ts[i], &ms[i]), "redc lane {i}");
                let mut prod = BigNum::new().unwrap();
                prod.checked_mul(&a[i], &b[i], &mut ctx).unwrap();
                assert_eq!(wide[i], prod, "mul_wide lane {i}");
            }
            // lookup: 16 random entries, a random index per lane
            let table: Vec<N52x8<L>> = (0..16)
                .map(|_| {
                    let e: Vec<BigNum> = (0..8).map(|_| rand_bn(&mut rng, 52 * L)).collect();
                    pack::<L>(&e)
                })
                .collect();
            let idx: [u64; 8] = core::array::from_fn(|_| rng.gen_range(0..16));
            let got = kcall! { scatter(&lookup(&table, U64x8::from_array(idx))) };
            for i in 0..8 {
                let want = kcall! { scatter(&table[idx[i] as usize]) };
                assert_eq!(got[i], want[i], "lookup lane {i}");
            }
        }
    }

    #[test]
    fn redc_mul_wide_lookup() {
        if kernels_here() {
            redc_mul_lookup::<20, 40>(1024, 200, 60);
            redc_mul_lookup::<30, 60>(1536, 100, 61);
            redc_mul_lookup::<40, 80>(2048, 100, 62);
        }
    }

    fn modexp_case<const L: usize, const L2: usize>(
        bits: usize,
        w: usize,
        cases: usize,
        seed: u64,
    ) {
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        let mut ctx = BigNumContext::new().unwrap();
        for _ in 0..cases {
            let ms: Vec<BigNum> = (0..8).map(|_| rand_mod(&mut rng, bits)).collect();
            let xs: Vec<BigNum> = ms.iter().map(|m| below(&mut rng, m)).collect();
            let es: Vec<BigNum> = (0..8).map(|_| rand_bn(&mut rng, bits)).collect();
            let ew: Vec<Vec<u64>> = es
                .iter()
                .map(|e| {
                    let be = e.to_vec();
                    let mut w = vec![0u64; bits.div_ceil(64)];
                    for (k, &b) in be.iter().rev().enumerate() {
                        w[k / 8] |= (b as u64) << (8 * (k % 8));
                    }
                    w
                })
                .collect();
            let exps: [&[u64]; 8] = core::array::from_fn(|i| ew[i].as_slice());
            let r2: Vec<BigNum> = ms.iter().map(|m| r_mod(2 * 52 * L, m)).collect();
            let xm: Vec<BigNum> =
                (0..8).map(|i| modmul(&xs[i], &r_mod(52 * L, &ms[i]), &ms[i])).collect();
            let (vm, k0, vr2, vx) = (pack::<L>(&ms), k0s(&ms), pack::<L>(&r2), pack::<L>(&xm));
            let got = unpack(&kcall! { modexp::<L, L2>(&vx, &exps, bits, w, &vm, k0, &vr2) });
            for i in 0..8 {
                let mut want = BigNum::new().unwrap();
                want.mod_exp(&xs[i], &es[i], &ms[i], &mut ctx).unwrap();
                assert_eq!(got[i], want, "modexp lane {i}");
            }
        }
    }

    #[test]
    fn modexp_matches_bignum() {
        if kernels_here() {
            modexp_case::<20, 40>(1024, 4, 6, 50);
            modexp_case::<20, 40>(1024, 5, 2, 51);
            modexp_case::<30, 60>(1536, 5, 2, 52);
            modexp_case::<40, 80>(2048, 5, 2, 53);
            // exponent edge cases: short exponents (leading zero windows)
            modexp_case::<20, 40>(64, 4, 4, 54);
        }
    }

    #[test]
    fn window_extraction() {
        let e = [0x0123_4567_89ab_cdefu64, 0xfedc_ba98_7654_3210];
        assert_eq!(window_bits(&e, 0, 4), 0xf);
        assert_eq!(window_bits(&e, 60, 8), 0x00);
        assert_eq!(window_bits(&e, 62, 5), 0);
        assert_eq!(window_bits(&[u64::MAX << 62, 0b101], 62, 5), 0b10111);
        assert_eq!(window_bits(&e, 124, 5), 0xf);
        assert_eq!(window_bits(&e, 128, 5), 0);
    }

    /// Timing of the primitives (reports, does not assert): `cargo test --release --lib
    /// primitive_timings -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn primitive_timings() {
        if !kernels_here() {
            return;
        }
        fn t<const L: usize, const L2: usize>(bits: usize) {
            let mut rng = ChaCha20Rng::seed_from_u64(1);
            let ms: Vec<BigNum> = (0..8).map(|_| rand_mod(&mut rng, bits)).collect();
            let a: Vec<BigNum> = ms.iter().map(|m| below(&mut rng, m)).collect();
            let (mut va, vm, k0) = (pack::<L>(&a), pack::<L>(&ms), k0s(&ms));
            let n = 2000;
            let (mut tm, mut ts) = (f64::MAX, f64::MAX);
            let (mut tm3, mut ts3) = (f64::MAX, f64::MAX);
            for _ in 0..15 {
                let s = std::time::Instant::now();
                for _ in 0..n {
                    va = kcall! { amm::<L, L2>(&va, &va, &vm, k0) };
                }
                tm = tm.min(s.elapsed().as_secs_f64() / n as f64 * 1e6);
                let s = std::time::Instant::now();
                for _ in 0..n {
                    va = kcall! { amsqr::<L, L2>(&va, &vm, k0) };
                }
                ts = ts.min(s.elapsed().as_secs_f64() / n as f64 * 1e6);
                let s = std::time::Instant::now();
                for _ in 0..n {
                    va = kcall! { amm_mem::<L, L2>(&va, &va, &vm, k0) };
                }
                tm3 = tm3.min(s.elapsed().as_secs_f64() / n as f64 * 1e6);
                let s = std::time::Instant::now();
                for _ in 0..n {
                    va = kcall! { amsqr_mem::<L, L2>(&va, &vm, k0) };
                }
                ts3 = ts3.min(s.elapsed().as_secs_f64() / n as f64 * 1e6);
            }
            let gm = 4.0 * (L * L) as f64 / tm / 1e3;
            eprintln!("L={L}: amm {tm:.3} us ({gm:.2} G IFMA/s), amsqr {ts:.3} us; memory-window forms: amm {tm3:.3} us, amsqr {ts3:.3} us");
        }
        // The IFMA ceiling the kernels are compared with (`mb::peak`), where the CPU has it.
        match crate::mb::ifma_peak_per_s(std::time::Duration::from_millis(300)) {
            Some(g) => eprintln!("raw IFMA throughput: {:.2} G/s", g / 1e9),
            None => eprintln!("raw IFMA throughput: not measured (no AVX-512 IFMA)"),
        }
        eprintln!("{} build of the kernels:", super::BUILD);
        t::<20, 40>(1024);
        t::<30, 60>(1536);
        t::<40, 80>(2048);
    }
}
