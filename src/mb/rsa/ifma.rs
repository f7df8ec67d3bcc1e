//! AVX-512 IFMA kernels for the RSA-CRT private operation: eight independent operations, one per
//! 64-bit lane, numbers in radix 2^52, limb-major (`[U64x8; L]`: vector `j` holds limb `j` of all
//! eight lanes).
//!
//! Every function here is a `#[target_feature(enable = "avx512f,avx512ifma,avx512vl")]` function.
//! The only entry from outside is [`crt_batch`], reached from `super` after the runtime feature
//! check (`crate::mb::cpu_features().ifma_capable()`).
//!
//! Constant time: loops run over public bounds only (limb counts, window counts); secret values
//! (exponents, intermediate results) only flow through arithmetic, shifts and per-lane masked
//! blends. The exponent window value selects a table entry by comparing it with every index and
//! blending, so every entry is read for every window.

use crate::mb::simd::{U64x8, MASK52};

/// Numbers in radix 2^52, limb-major, eight lanes: `N52x8<L>[j]` = limb `j` of every lane.
pub(crate) type N52x8<const L: usize> = [U64x8; L];

/// Per-lane key material of one batch, already in radix 2^52, for a modulus of `2·L` limbs split
/// into primes of `L` limbs. Scalar layout: `lanes[i]` is the material of lane `i`.
pub(crate) struct LaneKey<'a> {
    pub p: &'a [u64],
    pub q: &'a [u64],
    pub p_k0: u64,
    pub q_k0: u64,
    pub p_r2: &'a [u64],
    pub q_r2: &'a [u64],
    /// qInv · R mod p (radix 2^52, L limbs).
    pub qinv_r: &'a [u64],
    /// CRT exponents as little-endian 64-bit words.
    pub dp: &'a [u64],
    pub dq: &'a [u64],
    pub n: &'a [u64],
    pub n_k0: u64,
    pub n_r2: &'a [u64],
}

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

/// Per lane, the exponent window starting at public bit `pos`.
#[inline]
#[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
fn window_index(exps: &[&[u64]; 8], pos: usize, w: usize) -> U64x8 {
    U64x8::from_array(core::array::from_fn(|i| window_bits(exps[i], pos, w)))
}

/// Transposes per-lane limb slices (lane `i` = `f(i)`, at least `L` limbs) into limb-major form.
#[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
pub(crate) fn gather<'a, const L: usize>(f: impl Fn(usize) -> &'a [u64]) -> N52x8<L> {
    let lanes: [&[u64]; 8] = core::array::from_fn(&f);
    let mut out = [U64x8::zero(); L];
    for (j, o) in out.iter_mut().enumerate() {
        *o = U64x8::from_array(core::array::from_fn(|i| lanes[i][j]));
    }
    out
}

/// Transposes back: `out[i][j]` = limb `j` of lane `i`.
#[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
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

/// Carry-propagates loose 64-bit limbs into 52-bit limbs. The carry out of the top limb is
/// dropped: callers guarantee the value fits in `L` limbs.
#[inline]
#[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
fn normalize<const L: usize>(x: &mut N52x8<L>) {
    let mask = U64x8::splat(MASK52);
    let mut c = U64x8::zero();
    for v in x.iter_mut() {
        let t = v.add(c);
        c = t.shr::<52>();
        *v = t.and(mask);
    }
}

/// Almost Montgomery multiplication: `a·b·R⁻¹ mod m`, R = 2^(52·L), result < 2m and normalised,
/// for `a·b < 4m·m`-ish inputs (both below 2m, or one below 3m and the other below m) and 4m < R.
///
/// Operand scanning with a rolling accumulator window of `L` loose 64-bit limbs: per step `i`
/// the products `a_i·b` and `u·m` are added (low halves at their position, high halves one limb
/// up) and the window moves down one limb. Only the lowest limb's carry is made exact (it is what
/// the next reduction factor needs); the other limbs absorb at most `4L` terms below 2^52 each,
/// which fits the 12 spare bits for `L ≤ 80`. One carry propagation at the end.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
pub(crate) fn amm<const L: usize>(a: &N52x8<L>, b: &N52x8<L>, m: &N52x8<L>, k0: U64x8) -> N52x8<L> {
    let z = U64x8::zero();
    let mut acc = [z; L];
    for &ai in a.iter() {
        let t0 = acc[0].madd52lo(ai, b[0]);
        let u = z.madd52lo(t0, k0);
        let carry = t0.madd52lo(u, m[0]).shr::<52>();
        for j in 0..L - 1 {
            acc[j] = acc[j + 1]
                .madd52lo(ai, b[j + 1])
                .madd52hi(ai, b[j])
                .madd52lo(u, m[j + 1])
                .madd52hi(u, m[j]);
        }
        acc[L - 1] = z.madd52hi(ai, b[L - 1]).madd52hi(u, m[L - 1]);
        acc[0] = acc[0].add(carry);
    }
    normalize(&mut acc);
    acc
}

/// Montgomery reduction of a `2L`-limb loose value `t < m·R`: returns `t·R⁻¹ mod m`, below 2m,
/// normalised. `L2` must be `2·L`.
#[inline]
#[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
fn redc<const L: usize, const L2: usize>(t: &mut N52x8<L2>, m: &N52x8<L>, k0: U64x8) -> N52x8<L> {
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

/// Almost Montgomery squaring: `a²·R⁻¹ mod m`, result < 2m. Each cross product `a_i·a_j`
/// (`i < j`) is computed once and the sum doubled, then the diagonal is added: `L² + L` IFMA for
/// the square instead of `2L²`, plus `2L²` for the reduction. `L2` must be `2·L`.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
pub(crate) fn amsqr<const L: usize, const L2: usize>(
    a: &N52x8<L>,
    m: &N52x8<L>,
    k0: U64x8,
) -> N52x8<L> {
    let z = U64x8::zero();
    let mut t = [z; L2];
    for i in 0..L - 1 {
        let ai = a[i];
        // slot i+j gets lo(a_i a_j) and hi(a_i a_{j-1}), for i < j-1, j < L.
        t[2 * i + 1] = t[2 * i + 1].madd52lo(ai, a[i + 1]);
        for j in i + 2..L {
            t[i + j] = t[i + j].madd52lo(ai, a[j]).madd52hi(ai, a[j - 1]);
        }
        t[i + L] = t[i + L].madd52hi(ai, a[L - 1]);
    }
    for i in 0..L {
        let ai = a[i];
        t[2 * i] = t[2 * i].add(t[2 * i]).madd52lo(ai, ai);
        t[2 * i + 1] = t[2 * i + 1].add(t[2 * i + 1]).madd52hi(ai, ai);
    }
    redc::<L, L2>(&mut t, m, k0)
}

/// Plain product `a·b` as `2L` normalised limbs. `L2` must be `2·L`.
#[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
fn mul_wide<const L: usize, const L2: usize>(a: &N52x8<L>, b: &N52x8<L>) -> N52x8<L2> {
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

/// `x mod m` for normalised `x < 2m`: subtracts `m` and keeps the difference in the lanes where
/// it did not borrow (per-lane masked blend, no branch).
#[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
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

/// Reads every table entry and keeps, per lane, the one whose index equals that lane's `idx`.
#[inline]
#[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
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

/// `x^e mod m` per lane with a fixed window of `w` bits over `ebits` exponent bits (the same
/// sequence of squarings, lookups and multiplications for every exponent). `x_mont` is `x·R mod
/// m` (below 2m); `exps[i]` is lane `i`'s exponent (little-endian words). Returns the canonical
/// result (below m), out of the Montgomery domain.
#[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
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
    table.push(amm(r2, &one, m, k0)); // R mod m: Montgomery form of 1
    table.push(*x_mont);
    for k in 2..size {
        let e = if k % 2 == 0 {
            amsqr::<L, L2>(&table[k / 2], m, k0)
        } else {
            amm(&table[k - 1], &table[1], m, k0)
        };
        table.push(e);
    }
    let windows = ebits.div_ceil(w);
    let mut acc = lookup(&table, window_index(exps, (windows - 1) * w, w));
    for win in (0..windows - 1).rev() {
        for _ in 0..w {
            acc = amsqr::<L, L2>(&acc, m, k0);
        }
        let e = lookup(&table, window_index(exps, win * w, w));
        acc = amm(&acc, &e, m, k0);
    }
    let r = amm(&acc, &one, m, k0);
    reduce_once(&r, m)
}

/// One CRT half: `c^d mod m` for the full-size `c`. `c mod m` is brought into the Montgomery
/// domain as REDC(c) = c·R⁻¹, then two multiplications by R² (c·R⁻¹·R²·R⁻¹·R²·R⁻¹ = c·R).
#[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
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
    let x = amm(&x, r2, m, k0);
    let x = amm(&x, r2, m, k0);
    modexp::<L, L2>(&x, exps, ebits, w, m, k0, r2)
}

/// Output of one batch: the signature limbs (radix 2^52, `L2` limbs per lane) and the lanes whose
/// fault check passed.
pub(crate) struct BatchOut<const L2: usize> {
    pub sig: [[u64; L2]; 8],
    pub ok: u8,
}

/// The RSA-CRT private operation on eight lanes, each with its own key of the same size, followed
/// by the public-key re-check (e = 65537). `em[i]` is lane `i`'s message representative in
/// radix 2^52 (`L2` limbs, below that lane's n). `corrupt` flips a bit of the result in the given
/// lanes before the check (test hook; 0 in production). `L2 = 2L`, `L4 = 4L`.
///
/// # Safety
/// The CPU must support avx512f, avx512ifma and avx512vl.
#[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
pub(crate) unsafe fn crt_batch<const L: usize, const L2: usize, const L4: usize>(
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
    let h = reduce_once(&amm(&t, &qinv_r, &p, pk0), &p);
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
    let sm = amm(&s, &n_r2, &n, nk0);
    let mut y = sm;
    for _ in 0..16 {
        y = amsqr::<L2, L4>(&y, &n, nk0);
    }
    y = amm(&y, &sm, &n, nk0);
    let mut one = [U64x8::zero(); L2];
    one[0] = U64x8::splat(1);
    let y = reduce_once(&amm(&y, &one, &n, nk0), &n);
    let mut ok: u8 = 0xff;
    for j in 0..L2 {
        ok &= y[j].eq_mask(c[j]);
    }
    BatchOut { sig: scatter(&s), ok }
}
