// SIMD primitives against BoringSSL `BigNum` / `EcPoint`, with a different random value in every
// lane (seeded ChaCha), lane by lane. ONE source, included by `tests_model` (the portable model
// build of the kernels, every CPU) and `tests_ifma` (the IFMA build, where the CPU has it; the
// skip is printed, and fails under `REQUIRE_IFMA=1`): the including module brings the kernels
// (`use super::model::*` or `use super::ifma::*`), `BUILD` and `kernels_here`.

use boring::bn::{BigNum, BigNumContext, BigNumRef};
use boring::ec::{EcGroup, EcPoint};
use boring::nid::Nid;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

use super::limbs::*;

/// Whether this build of the kernels can run here (always for the model).
fn runnable() -> bool {
    kernels_here("P-256 kernel test")
}

/// One `sign8` pass of this build's kernel, after [`ifma`] said yes.
fn sign8_here(d: &[[u8; 32]; 8], e: &[[u8; 32]; 8], k: &[[u8; 32]; 8]) -> ([[u8; 32]; 8], [[u8; 32]; 8]) {
    // SAFETY: only reached after `kernels_here` (for the IFMA build: run-time detection of the
    // kernels' features); the model's kernel is a safe function.
    unsafe { sign8_kernel(d, e, k) }
}

fn bn_from_limbs(l: &[u64; 5]) -> BigNum {
    let mut le = Vec::with_capacity(40);
    let (mut acc, mut bits) = (0u128, 0u32);
    for &x in l {
        acc |= (x as u128) << bits;
        bits += 52;
        while bits >= 8 {
            le.push(acc as u8);
            acc >>= 8;
            bits -= 8;
        }
    }
    le.push(acc as u8);
    le.reverse();
    BigNum::from_slice(&le).unwrap()
}

fn bn_to_limbs(b: &BigNumRef) -> [u64; 5] {
    let v = b.to_vec_padded(32).unwrap();
    bytes_to_limbs(&v.try_into().unwrap())
}

/// Random loose value below 2^`bits` (bits ≤ 258), normalised limbs.
fn rand_limbs(rng: &mut ChaCha20Rng, bits: u32) -> [u64; 5] {
    let mut l: [u64; 5] = std::array::from_fn(|_| rng.gen::<u64>() & MASK52);
    l[4] &= (1u64 << (bits - 208)) - 1;
    // Sprinkle edge values so all-zero and all-ones limbs occur.
    match rng.gen_range(0..16) {
        0 => l = [0; 5],
        1 => {
            l = [MASK52; 5];
            l[4] = (1u64 << (bits - 208)) - 1;
        }
        _ => {}
    }
    l
}

fn bn(hex: &[u64; 5]) -> BigNum {
    bn_from_limbs(hex)
}

struct Ctx {
    ctx: BigNumContext,
    p: BigNum,
    n: BigNum,
    rinv_p: BigNum,
    rinv_n: BigNum,
}

fn ctx() -> Ctx {
    let mut ctx = BigNumContext::new().unwrap();
    let p = bn(&P);
    let n = bn(&N);
    let mut r = BigNum::new().unwrap();
    r.set_bit(260).unwrap();
    let mut rinv_p = BigNum::new().unwrap();
    rinv_p.mod_inverse(&r, &p, &mut ctx).unwrap();
    let mut rinv_n = BigNum::new().unwrap();
    rinv_n.mod_inverse(&r, &n, &mut ctx).unwrap();
    Ctx { ctx, p, n, rinv_p, rinv_n }
}

fn below(l: &[u64; 5], bits: u32) -> bool {
    l[..4].iter().all(|&x| x <= MASK52) && l[4] < (1u64 << (bits - 208))
}

#[test]
fn constants_match_bignum() {
    let mut c = ctx();
    let mut r = BigNum::new().unwrap();
    r.set_bit(260).unwrap();
    let mut t = BigNum::new().unwrap();
    t.nnmod(&r, &c.p, &mut c.ctx).unwrap();
    assert_eq!(bn_to_limbs(&t), ONE_P);
    let mut rr = BigNum::new().unwrap();
    rr.set_bit(520).unwrap();
    t.nnmod(&rr, &c.p, &mut c.ctx).unwrap();
    assert_eq!(bn_to_limbs(&t), RR_P);
    t.nnmod(&rr, &c.n, &mut c.ctx).unwrap();
    assert_eq!(bn_to_limbs(&t), RR_N);
    let g = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).unwrap();
    let mut order = BigNum::new().unwrap();
    g.order(&mut order, &mut c.ctx).unwrap();
    assert_eq!(order, c.n);
    // k0 * n ≡ -1 mod 2^52
    assert_eq!(N_K0.wrapping_mul(N[0]) & MASK52, MASK52);
}

#[test]
fn radix52_conversion_roundtrip() {
    if !runnable() {
        return;
    }
    let mut rng = ChaCha20Rng::seed_from_u64(1);
    for _ in 0..2000 {
        let bytes: [[u8; 32]; 8] = std::array::from_fn(|_| rng.gen());
        let limbs: [[u64; 5]; 8] = std::array::from_fn(|i| bytes_to_limbs(&bytes[i]));
        for i in 0..8 {
            assert_eq!(bn_from_limbs(&limbs[i]).to_vec_padded(32).unwrap(), bytes[i].to_vec());
        }
        // SAFETY: IFMA detected above.
        let back = unsafe { store(&load(&limbs)) };
        assert_eq!(back, limbs);
        for i in 0..8 {
            assert_eq!(limbs_to_bytes(&back[i]), bytes[i]);
        }
    }
}

type Op = unsafe fn(&L52x8, &L52x8) -> L52x8;

/// Runs `op` on random lanes and checks every lane against `reference` (canonical results).
fn check_binary(
    seed: u64,
    cases: usize,
    in_bits: u32,
    out_bits: u32,
    op: Op,
    mut reference: impl FnMut(&mut Ctx, &BigNum, &BigNum) -> BigNum,
    modulus_is_p: bool,
) {
    if !runnable() {
        return;
    }
    let mut c = ctx();
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    for _ in 0..cases {
        let a: [[u64; 5]; 8] = std::array::from_fn(|_| rand_limbs(&mut rng, in_bits));
        let b: [[u64; 5]; 8] = std::array::from_fn(|_| rand_limbs(&mut rng, in_bits));
        // SAFETY: IFMA detected above.
        let (raw, canon) = unsafe {
            let r = op(&load(&a), &load(&b));
            let cn = if modulus_is_p { fp_canon(&r) } else { fn_canon(&r) };
            (store(&r), store(&cn))
        };
        for i in 0..8 {
            assert!(below(&raw[i], out_bits), "lane {i}: output not below 2^{out_bits}");
            let want = reference(&mut c, &bn_from_limbs(&a[i]), &bn_from_limbs(&b[i]));
            assert_eq!(bn_from_limbs(&canon[i]), want, "lane {i}");
        }
    }
}

fn mont_ref(c: &mut Ctx, a: &BigNum, b: &BigNum, is_p: bool) -> BigNum {
    let (m, rinv) = if is_p { (&c.p, &c.rinv_p) } else { (&c.n, &c.rinv_n) };
    let mut t = BigNum::new().unwrap();
    t.mod_mul(a, b, m, &mut c.ctx).unwrap();
    let mut u = BigNum::new().unwrap();
    u.mod_mul(&t, rinv, m, &mut c.ctx).unwrap();
    u
}

#[test]
fn fp_mul_matches_bignum() {
    check_binary(2, 3000, 258, 257, fp_mul, |c, a, b| mont_ref(c, a, b, true), true);
}

#[test]
fn fp_sqr_matches_bignum() {
    unsafe fn sqr(a: &L52x8, _b: &L52x8) -> L52x8 {
        fp_sqr(a)
    }
    check_binary(3, 3000, 258, 257, sqr, |c, a, _| mont_ref(c, a, a, true), true);
}

#[test]
fn fp_add_sub_match_bignum() {
    check_binary(
        4,
        3000,
        257,
        257,
        fp_add,
        |c, a, b| {
            let mut t = BigNum::new().unwrap();
            t.mod_add(a, b, &c.p, &mut c.ctx).unwrap();
            t
        },
        true,
    );
    check_binary(
        5,
        3000,
        257,
        257,
        fp_sub,
        |c, a, b| {
            let mut t = BigNum::new().unwrap();
            t.mod_sub(a, b, &c.p, &mut c.ctx).unwrap();
            t
        },
        true,
    );
}

#[test]
fn fp_sub_sub2_matches_bignum() {
    if !runnable() {
        return;
    }
    let mut c = ctx();
    let mut rng = ChaCha20Rng::seed_from_u64(15);
    for _ in 0..3000 {
        let a: [[u64; 5]; 8] = std::array::from_fn(|_| rand_limbs(&mut rng, 257));
        let b: [[u64; 5]; 8] = std::array::from_fn(|_| rand_limbs(&mut rng, 257));
        let d: [[u64; 5]; 8] = std::array::from_fn(|_| rand_limbs(&mut rng, 257));
        // SAFETY: IFMA detected above.
        let (raw, canon) = unsafe {
            let r = fp_sub_sub2(&load(&a), &load(&b), &load(&d));
            (store(&r), store(&fp_canon(&r)))
        };
        for i in 0..8 {
            assert!(below(&raw[i], 257), "lane {i}: output not below 2^257");
            let mut t = BigNum::new().unwrap();
            t.mod_sub(&bn_from_limbs(&a[i]), &bn_from_limbs(&b[i]), &c.p, &mut c.ctx).unwrap();
            let mut t2 = BigNum::new().unwrap();
            t2.mod_sub(&t, &bn_from_limbs(&d[i]), &c.p, &mut c.ctx).unwrap();
            t.mod_sub(&t2, &bn_from_limbs(&d[i]), &c.p, &mut c.ctx).unwrap();
            assert_eq!(bn_from_limbs(&canon[i]), t, "lane {i}");
        }
    }
}

#[test]
fn fn_mul_matches_bignum() {
    check_binary(6, 3000, 258, 257, fn_mul, |c, a, b| mont_ref(c, a, b, false), false);
}

/// Montgomery in and out: inv(aR) = a^-1 R, i.e. canonical result = R^2 / a_mont (0 for 0).
fn inv_ref(c: &mut Ctx, a: &BigNum, is_p: bool) -> BigNum {
    let m = if is_p { &c.p } else { &c.n };
    let mut a_red = BigNum::new().unwrap();
    a_red.nnmod(a, m, &mut c.ctx).unwrap();
    if a_red.num_bits() == 0 {
        return BigNum::new().unwrap();
    }
    let mut r2 = BigNum::new().unwrap();
    r2.set_bit(520).unwrap();
    let mut ai = BigNum::new().unwrap();
    ai.mod_inverse(&a_red, m, &mut c.ctx).unwrap();
    let mut t = BigNum::new().unwrap();
    t.mod_mul(&ai, &r2, m, &mut c.ctx).unwrap();
    t
}

/// The dual-modulus Fermat inversion (lanes 0..3 mod n, 4..7 mod p), and the batch inversion
/// through lane products, against BigNum with a different value in every lane.
#[test]
fn inversions_match_bignum() {
    if !runnable() {
        return;
    }
    let mut c = ctx();
    let mut rng = ChaCha20Rng::seed_from_u64(8);
    for case in 0..60 {
        let a: [[u64; 5]; 8] = std::array::from_fn(|_| rand_limbs(&mut rng, 257));
        let mut k: [[u64; 5]; 8] = std::array::from_fn(|_| rand_limbs(&mut rng, 257));
        let mut z: [[u64; 5]; 8] = std::array::from_fn(|_| rand_limbs(&mut rng, 257));
        if case == 0 {
            k[2] = ONE_N; // Montgomery 1 (an unused lane's k)
            z[5] = P; // ≡ 0 would break the trick; never produced, so replace by p + 1
            z[5][0] += 1;
        }
        for v in k.iter_mut().chain(z.iter_mut()) {
            // Lane products need nonzero residues (k in [1, n), Z ≠ 0 by construction).
            if bn_from_limbs(v).num_bits() == 0 || *v == N || *v == P {
                v[0] = 7;
            }
        }
        // SAFETY: IFMA detected above.
        let (d, kc, zc) = unsafe {
            let d = dual_inv(&load(&a));
            let dn = store(&fn_canon(&d));
            let dp = store(&fp_canon(&d));
            let (ki, zi) = batch_invert(&load(&k), &load(&z));
            let d: [[u64; 5]; 8] = std::array::from_fn(|i| if i < 4 { dn[i] } else { dp[i] });
            (d, store(&fn_canon(&ki)), store(&fp_canon(&zi)))
        };
        for i in 0..8 {
            let want = inv_ref(&mut c, &bn_from_limbs(&a[i]), i >= 4);
            assert_eq!(bn_from_limbs(&d[i]), want, "dual lane {i}");
            let want = inv_ref(&mut c, &bn_from_limbs(&k[i]), false);
            assert_eq!(bn_from_limbs(&kc[i]), want, "k lane {i}");
            let want = inv_ref(&mut c, &bn_from_limbs(&z[i]), true);
            assert_eq!(bn_from_limbs(&zc[i]), want, "z lane {i}");
        }
    }
}

fn group() -> EcGroup {
    EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).unwrap()
}

fn rand_scalar(rng: &mut ChaCha20Rng, n: &BigNum) -> BigNum {
    let b: [u8; 32] = rng.gen();
    let mut k = BigNum::from_slice(&b).unwrap();
    let mut ctx = BigNumContext::new().unwrap();
    let t = k.to_owned().unwrap();
    k.nnmod(&t, n, &mut ctx).unwrap();
    if k.num_bits() == 0 {
        k = BigNum::from_u32(1).unwrap();
    }
    k
}

fn to_mont(c: &mut Ctx, v: &BigNum) -> [u64; 5] {
    let mut r = BigNum::new().unwrap();
    r.set_bit(260).unwrap();
    let mut t = BigNum::new().unwrap();
    t.mod_mul(v, &r, &c.p, &mut c.ctx).unwrap();
    bn_to_limbs(&t)
}

/// Affine coordinates of a Jacobian lane (Montgomery limbs), via BigNum.
fn jac_to_affine(c: &mut Ctx, x: &[u64; 5], y: &[u64; 5], z: &[u64; 5]) -> (BigNum, BigNum) {
    let from = |c: &mut Ctx, v: &[u64; 5]| {
        let mut t = BigNum::new().unwrap();
        t.mod_mul(&bn_from_limbs(v), &c.rinv_p, &c.p, &mut c.ctx).unwrap();
        t
    };
    let (x, y, z) = (from(c, x), from(c, y), from(c, z));
    let mut zi = BigNum::new().unwrap();
    zi.mod_inverse(&z, &c.p, &mut c.ctx).unwrap();
    let mut zi2 = BigNum::new().unwrap();
    zi2.mod_sqr(&zi, &c.p, &mut c.ctx).unwrap();
    let mut zi3 = BigNum::new().unwrap();
    zi3.mod_mul(&zi2, &zi, &c.p, &mut c.ctx).unwrap();
    let mut ax = BigNum::new().unwrap();
    ax.mod_mul(&x, &zi2, &c.p, &mut c.ctx).unwrap();
    let mut ay = BigNum::new().unwrap();
    ay.mod_mul(&y, &zi3, &c.p, &mut c.ctx).unwrap();
    (ax, ay)
}

fn affine(c: &mut Ctx, g: &EcGroup, p: &EcPoint) -> (BigNum, BigNum) {
    let (mut x, mut y) = (BigNum::new().unwrap(), BigNum::new().unwrap());
    p.affine_coordinates_gfp(g, &mut x, &mut y, &mut c.ctx).unwrap();
    (x, y)
}

#[test]
fn point_add_mixed_matches_ecpoint() {
    if !runnable() {
        return;
    }
    let g = group();
    let mut c = ctx();
    let mut rng = ChaCha20Rng::seed_from_u64(10);
    for _ in 0..40 {
        let mut p1 = [([0u64; 5], [0u64; 5], [0u64; 5]); 8];
        let mut p2 = [([0u64; 5], [0u64; 5]); 8];
        let mut want = Vec::new();
        for lane in 0..8 {
            let n = c.n.to_owned().unwrap();
            let a = rand_scalar(&mut rng, &n);
            let b = rand_scalar(&mut rng, &n);
            let mut pa = EcPoint::new(&g).unwrap();
            pa.mul_generator(&g, &a, &mut c.ctx).unwrap();
            let mut pb = EcPoint::new(&g).unwrap();
            pb.mul_generator(&g, &b, &mut c.ctx).unwrap();
            let mut sum = EcPoint::new(&g).unwrap();
            sum.add(&g, &pa, &pb, &mut c.ctx).unwrap();
            want.push(affine(&mut c, &g, &sum));
            // Jacobian with a random Z: (x z^2, y z^3, z).
            let (ax, ay) = affine(&mut c, &g, &pa);
            let z = rand_scalar(&mut rng, &n);
            let mut z2 = BigNum::new().unwrap();
            z2.mod_sqr(&z, &c.p, &mut c.ctx).unwrap();
            let mut z3 = BigNum::new().unwrap();
            z3.mod_mul(&z2, &z, &c.p, &mut c.ctx).unwrap();
            let mut jx = BigNum::new().unwrap();
            jx.mod_mul(&ax, &z2, &c.p, &mut c.ctx).unwrap();
            let mut jy = BigNum::new().unwrap();
            jy.mod_mul(&ay, &z3, &c.p, &mut c.ctx).unwrap();
            p1[lane] = (to_mont(&mut c, &jx), to_mont(&mut c, &jy), to_mont(&mut c, &z));
            let (bx, by) = affine(&mut c, &g, &pb);
            p2[lane] = (to_mont(&mut c, &bx), to_mont(&mut c, &by));
        }
        // SAFETY: IFMA detected above.
        let (x, y, z) = unsafe {
            let j = Jac52x8 {
                x: load(&std::array::from_fn(|i| p1[i].0)),
                y: load(&std::array::from_fn(|i| p1[i].1)),
                z: load(&std::array::from_fn(|i| p1[i].2)),
            };
            let r = point_add_mixed(
                &j,
                &load(&std::array::from_fn(|i| p2[i].0)),
                &load(&std::array::from_fn(|i| p2[i].1)),
            );
            (store(&r.x), store(&r.y), store(&r.z))
        };
        for lane in 0..8 {
            let got = jac_to_affine(&mut c, &x[lane], &y[lane], &z[lane]);
            assert_eq!(got.0, want[lane].0, "x lane {lane}");
            assert_eq!(got.1, want[lane].1, "y lane {lane}");
        }
    }
}

#[test]
fn base_table_matches_ecpoint() {
    let g = group();
    let mut c = ctx();
    let t = base_table();
    for (w, j) in
        [(0usize, 1usize), (0, ENTRIES), (1, 3), (17, 5), (WINDOWS - 1, ENTRIES), (WINDOWS - 1, 1)]
    {
        let j_bn = BigNum::from_u32(j as u32).unwrap();
        let mut k = BigNum::new().unwrap();
        k.lshift(&j_bn, (W * w) as i32).unwrap();
        let mut pt = EcPoint::new(&g).unwrap();
        pt.mul_generator(&g, &k, &mut c.ctx).unwrap();
        let (x, y) = affine(&mut c, &g, &pt);
        let e = t.entry(w, j);
        assert_eq!(to_mont(&mut c, &x), e[..5], "x of {j}*2^(W*{w})*G");
        assert_eq!(to_mont(&mut c, &y), e[5..], "y of {j}*2^(W*{w})*G");
    }
}

#[test]
fn recode_reconstructs_scalar() {
    let mut rng = ChaCha20Rng::seed_from_u64(11);
    for case in 0..3000 {
        let mut k: [u8; 32] = rng.gen();
        k[0] &= 0x7f;
        if case == 0 {
            k = [0x77; 32];
        } else if case == 1 {
            k = [0x88; 32];
            k[0] = 0x7f;
        } else if case == 2 {
            k = [0xff; 32]; // 2^255 - 1: carries through every window
            k[0] = 0x7f;
        } else if case == 3 {
            k = [0; 32];
        }
        let (abs, neg) = recode(&k);
        // Σ d_i 2^(W i) as a BigNum (with signs).
        let mut acc = BigNum::new().unwrap();
        for i in (0..WINDOWS).rev() {
            let t = acc.to_owned().unwrap();
            acc.lshift(&t, W as i32).unwrap();
            assert!(abs[i] <= ENTRIES as u64 && neg[i] <= 1);
            if neg[i] == 1 {
                acc.sub_word(abs[i] as u32).unwrap();
            } else {
                acc.add_word(abs[i] as u32).unwrap();
            }
        }
        assert_eq!(acc.to_vec_padded(32).unwrap(), k.to_vec());
    }
}

/// The 8-lane vector recoding against the scalar one, lane by lane, different scalars per lane.
#[test]
fn recode8_matches_recode() {
    if !runnable() {
        return;
    }
    let mut rng = ChaCha20Rng::seed_from_u64(14);
    for case in 0..1000 {
        let ks: [[u8; 32]; 8] = std::array::from_fn(|lane| {
            let mut k: [u8; 32] = rng.gen();
            k[0] &= 0x7f;
            match (case, lane) {
                (0, 0) => k = [0; 32],
                (0, 1) => {
                    k = [0xff; 32];
                    k[0] = 0x7f;
                }
                _ => {}
            }
            k
        });
        // SAFETY: IFMA detected above.
        let (abs, neg) =
            unsafe { recode8(&load(&std::array::from_fn(|l| bytes_to_limbs(&ks[l])))) };
        for (lane, k) in ks.iter().enumerate() {
            let (a, s) = recode(k);
            for w in 0..WINDOWS {
                // SAFETY: IFMA detected above.
                assert_eq!(
                    unsafe { abs[w].to_array() }[lane],
                    a[w],
                    "case {case} lane {lane} w {w}"
                );
                assert_eq!((neg[w] >> lane) as u64 & 1, s[w], "case {case} lane {lane} w {w}");
            }
        }
    }
}

#[test]
fn base_mul_matches_ecpoint() {
    if !runnable() {
        return;
    }
    let g = group();
    let mut c = ctx();
    let mut rng = ChaCha20Rng::seed_from_u64(12);
    for case in 0..40 {
        let mut ks = [[0u8; 32]; 8];
        for (lane, k) in ks.iter_mut().enumerate() {
            let n = c.n.to_owned().unwrap();
            let v = match (case, lane) {
                (0, 0) => BigNum::from_u32(1).unwrap(),
                (0, 1) => BigNum::from_u32(16).unwrap(),
                (0, 2) => {
                    let mut t = n.to_owned().unwrap();
                    t.sub_word(1).unwrap();
                    t
                }
                (0, 3) => BigNum::from_u32(0x88888888).unwrap(),
                _ => rand_scalar(&mut rng, &n),
            };
            *k = v.to_vec_padded(32).unwrap().try_into().unwrap();
        }
        let kks: [[u8; 32]; 8] = std::array::from_fn(|lane| min_k(&ks[lane]));
        assert!(kks.iter().all(|kk| kk[0] < 0x80));
        // SAFETY: IFMA detected above.
        let (x, y, z) = unsafe {
            let kv = load(&std::array::from_fn(|l| bytes_to_limbs(&ks[l])));
            let hv = half_scalar(&kv);
            assert_eq!(store(&hv), std::array::from_fn(|l| bytes_to_limbs(&kks[l])));
            let (abs, neg) = recode8(&hv);
            let q = base_mul(&abs, &neg);
            (store(&q.x), store(&q.y), store(&q.z))
        };
        for lane in 0..8 {
            let kk = BigNum::from_slice(&kks[lane]).unwrap();
            let mut pt = EcPoint::new(&g).unwrap();
            pt.mul_generator(&g, &kk, &mut c.ctx).unwrap();
            let want = affine(&mut c, &g, &pt);
            let got = jac_to_affine(&mut c, &x[lane], &y[lane], &z[lane]);
            assert_eq!(got, want, "case {case} lane {lane}");
            // ±k*G: same x as k*G.
            let k = BigNum::from_slice(&ks[lane]).unwrap();
            pt.mul_generator(&g, &k, &mut c.ctx).unwrap();
            assert_eq!(affine(&mut c, &g, &pt).0, want.0);
        }
    }
}

#[test]
fn der_matches_boring() {
    let mut rng = ChaCha20Rng::seed_from_u64(13);
    for case in 0..2000 {
        let mut r: [u8; 32] = rng.gen();
        let mut s: [u8; 32] = rng.gen();
        match case % 5 {
            0 => r[0] = 0,
            1 => {
                s[..5].fill(0);
                s[5] = 0x80;
            }
            2 => r[..31].fill(0),
            3 => s[0] |= 0x80,
            _ => {}
        }
        if r == [0u8; 32] || s == [0u8; 32] {
            continue;
        }
        let sig = boring::ecdsa::EcdsaSig::from_private_components(
            BigNum::from_slice(&r).unwrap(),
            BigNum::from_slice(&s).unwrap(),
        )
        .unwrap();
        assert_eq!(super::der_signature(&r, &s), sig.to_der().unwrap());
    }
}

/// Best-of-many timing of `f` (ns per call): the minimum filters out preemption on a shared box.
fn best_ns(calls: usize, mut f: impl FnMut()) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..200 {
        let t = std::time::Instant::now();
        for _ in 0..calls {
            f();
        }
        best = best.min(t.elapsed().as_nanos() as f64 / calls as f64);
    }
    best
}

/// Timing probe for the kernels (reports only): `taskset -c 1 cargo test --release --lib --
/// --ignored --nocapture perf_probe`.
#[test]
#[ignore]
fn perf_probe() {
    if !runnable() {
        return;
    }
    use std::hint::black_box as bb;
    println!("{BUILD} build of the kernels:");
    let t = std::time::Instant::now();
    bb(build_table().unwrap());
    println!("table build       {:8.1} ns", t.elapsed().as_nanos() as f64);
    let mut rng = ChaCha20Rng::seed_from_u64(99);
    let a: [[u64; 5]; 8] = std::array::from_fn(|_| rand_limbs(&mut rng, 256));
    // SAFETY (all blocks): IFMA detected above.
    let mut x = unsafe { load(&a) };
    let mut y = x;
    let r = best_ns(200, || x = unsafe { fp_mul(&x, &x) });
    println!("fp_mul chain      {r:8.1} ns");
    let r = best_ns(200, || x = unsafe { fp_sqr(&x) });
    println!("fp_sqr chain      {r:8.1} ns");
    let r = best_ns(200, || unsafe {
        x = fp_mul(&x, &x);
        y = fp_mul(&y, &y);
    });
    println!("fp_mul 2 chains   {r:8.1} ns per pair");
    let r = best_ns(200, || x = unsafe { fn_mul(&x, &x) });
    println!("fn_mul chain      {r:8.1} ns");
    let r = best_ns(2, || x = unsafe { dual_inv(&x) });
    println!("dual_inv          {r:8.1} ns");
    let r = best_ns(2, || unsafe { (x, y) = batch_invert(&x, &y) });
    println!("batch_invert      {r:8.1} ns");
    let mut j = Jac52x8 { x, y, z: x };
    let r = best_ns(20, || j = unsafe { point_add_mixed(&j, &x, &y) });
    println!("point_add_mixed   {r:8.1} ns");
    let (abs, neg) = unsafe { recode8(&load(&[bytes_to_limbs(&[0x35u8; 32]); 8])) };
    let r = best_ns(1, || j = unsafe { base_mul(&abs, &neg) });
    println!("base_mul          {r:8.1} ns");
    let d = [[7u8; 32]; 8];
    let r = best_ns(1, || {
        bb(sign8_here(&d, &d, &d));
    });
    println!("sign8             {r:8.1} ns");
    let kr: [[u8; 32]; 8] = std::array::from_fn(|_| {
        let mut k: [u8; 32] = rng.gen();
        k[0] &= 0x7f;
        k
    });
    let r = best_ns(1, || {
        bb(sign8_here(&d, &d, &kr));
    });
    println!("sign8 random k    {r:8.1} ns");
    let h = [9u8; 32];
    let r = best_ns(1, || {
        let mut g = super::nonce::Rfc6979::new(&d[0], &h, Some(&h));
        bb(g.next_k());
    });
    println!("rfc6979 nonce     {r:8.1} ns");
    let xs = [d[0]; 8];
    let hs = [h; 8];
    let r = best_ns(1, || {
        bb(super::nonce::Rfc6979::new_lanes(&xs, &hs, Some(&hs)));
    });
    println!("rfc6979 x8 lanes  {:8.1} ns per lane", r / 8.0);
    let big = vec![5u8; 64 * 1024];
    let r = best_ns(1, || {
        bb(boring::sha::sha256(&big));
    });
    println!("sha256 per block  {:8.1} ns", r / 1024.0);
    let msg = [0x20u8; 130];
    let r = best_ns(100, || {
        bb(boring::sha::sha256(&msg));
    });
    println!("sha256 130 bytes  {r:8.1} ns");
    let mut rb = [0u8; 256];
    let r = best_ns(100, || {
        boring::rand::rand_bytes(&mut rb).unwrap();
        bb(rb);
    });
    println!("rand_bytes 256    {r:8.1} ns");
    let mut st = super::sha::IV;
    let r = best_ns(1, || {
        super::sha::compress(&mut st, &big);
    });
    println!("own compress/blk  {:8.1} ns", r / 1024.0);
    bb(st);
    let hm = super::sha::Hmac::new(&h);
    let r = best_ns(100, || {
        bb(hm.mac(&[&h, &[0], &h, &h, &h]));
    });
    println!("hmac 129 bytes    {r:8.1} ns");
    let r = best_ns(100, || {
        bb(super::sha::Hmac::new(&h));
    });
    println!("hmac key setup    {r:8.1} ns");
    bb((x, y, j.x));
}

/// Runs only the batch kernel, for `perf record`.
#[test]
#[ignore]
fn perf_sign8_loop() {
    if !runnable() {
        return;
    }
    let d = [[7u8; 32]; 8];
    for _ in 0..20_000 {
        std::hint::black_box(sign8_here(&d, &d, &d));
    }
}

/// Runs only the lockstep nonce DRBG, for `perf record`.
#[test]
#[ignore]
fn perf_nonce_loop() {
    let xs = [[7u8; 32]; 8];
    for _ in 0..20_000 {
        std::hint::black_box(super::nonce::Rfc6979::new_lanes(&xs, &xs, Some(&xs)));
    }
}

/// dudect-style timing report for the kernel alone: `sign8` with a fixed private key in every
/// lane against random keys, both classes with random nonces (the nonce is secret too, but it is
/// random in production, so it is not the variable under test here). Welch's t on the timings
/// after cropping the slow tail as dudect does; the verdict printed follows |t|, and with
/// `MBTUNNEL_DUDECT_ASSERT=1` the test asserts |t| < 4.5.
/// Run: `taskset -c 1 cargo test --release --lib -- --ignored --nocapture dudect_kernel`.
#[test]
#[ignore]
fn dudect_kernel() {
    if !runnable() {
        return;
    }
    let mut rng = ChaCha20Rng::seed_from_u64(24);
    let n = ctx().n;
    let fixed_d = [[0x42u8; 32]; 8];
    let e = [[0x17u8; 32]; 8];
    // All inputs are generated before any measurement, so that both classes see the same
    // activity (and cache state) between measurements.
    type Input = (usize, [[u8; 32]; 8], [[u8; 32]; 8]);
    let r = |rng: &mut ChaCha20Rng| -> [u8; 32] {
        rand_scalar(rng, &n).to_vec_padded(32).unwrap().try_into().unwrap()
    };
    let inputs: Vec<Input> = (0..40_000)
        .map(|_| {
            let class = rng.gen_range(0..2usize);
            let k: [[u8; 32]; 8] = std::array::from_fn(|_| r(&mut rng));
            let d = if class == 0 { fixed_d } else { std::array::from_fn(|_| r(&mut rng)) };
            (class, d, k)
        })
        .collect();
    let mut obs: Vec<(usize, f64)> = Vec::with_capacity(inputs.len());
    for (i, (class, d, k)) in inputs.iter().enumerate() {
        let t0 = std::time::Instant::now();
        std::hint::black_box(sign8_here(d, &e, k));
        let dt = t0.elapsed().as_nanos() as f64;
        if i >= 2000 {
            obs.push((*class, dt));
        }
    }
    crate::mb::timing::report_cropped(
        "kernel dudect, fixed vs random key",
        &obs,
        &[10, 50, 90, 100],
    );
}
