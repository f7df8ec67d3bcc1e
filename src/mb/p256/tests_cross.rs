//! The model build of the P-256 kernels against the IFMA build, bit for bit, lane by lane, on
//! random inputs with a different value in every lane (including out-of-contract ones: both
//! builds compute the same instruction semantics, so they agree on any input). Needs a CPU with
//! AVX-512 IFMA; elsewhere each test prints that it is skipped (and fails under
//! `REQUIRE_IFMA=1`) — the model itself is tested against BoringSSL in `tests_model`.
#![allow(clippy::needless_range_loop)]

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

use super::limbs::{bytes_to_limbs, MASK52_LIMBS};

use crate::mb::both;

fn ifma_here(what: &str) -> bool {
    crate::mb::require_ifma(&format!("P-256 model vs IFMA: {what}")).is_some()
}

/// Random limbs: mostly normalised 52-bit values up to `top_bits` in the top limb, sometimes
/// edge values, sometimes unnormalised (bits above 52 set).
fn limbs(rng: &mut ChaCha20Rng, top_bits: u32) -> [u64; 5] {
    let mut l: [u64; 5] = std::array::from_fn(|_| rng.gen::<u64>() & MASK52_LIMBS);
    l[4] &= (1u64 << top_bits) - 1;
    match rng.gen_range(0..20) {
        0 => l = [0; 5],
        1 => l = [MASK52_LIMBS; 5],
        2 => l[rng.gen_range(0..5)] |= rng.gen::<u64>() << 52,
        _ => {}
    }
    l
}

fn lanes(rng: &mut ChaCha20Rng, top_bits: u32) -> [[u64; 5]; 8] {
    std::array::from_fn(|_| limbs(rng, top_bits))
}

#[test]
fn field_ops_agree() {
    if !ifma_here("field and scalar operations") {
        return;
    }
    let mut rng = ChaCha20Rng::seed_from_u64(0xc505);
    for _ in 0..3000 {
        let (a, b, c) = (lanes(&mut rng, 50), lanes(&mut rng, 50), lanes(&mut rng, 49));
        let m: u8 = rng.gen();
        both!("fp_mul", k => k::store(&k::fp_mul(&k::load(&a), &k::load(&b))));
        both!("fp_sqr", k => k::store(&k::fp_sqr(&k::load(&a))));
        both!("fp_add", k => k::store(&k::fp_add(&k::load(&a), &k::load(&c))));
        both!("fp_sub", k => k::store(&k::fp_sub(&k::load(&a), &k::load(&c))));
        both!("fp_sub_sub2", k => k::store(&k::fp_sub_sub2(&k::load(&a), &k::load(&b), &k::load(&c))));
        both!("fp_canon", k => k::store(&k::fp_canon(&k::load(&c))));
        both!("fp_from_mont", k => k::store(&k::fp_from_mont(&k::load(&a))));
        both!("fn_mul", k => k::store(&k::fn_mul(&k::load(&a), &k::load(&b))));
        both!("fn_canon", k => k::store(&k::fn_canon(&k::load(&c))));
        both!("add_raw", k => k::store(&k::add_raw(&k::load(&c), &k::load(&b))));
        both!("select", k => k::store(&k::select(&k::load(&a), m, &k::load(&b))));
        both!("half_scalar", k => k::store(&k::half_scalar(&k::load(&c))));
        let (abs, neg) = both!("recode8", k => {
            let (abs, neg) = k::recode8(&k::load(&c));
            (abs.map(|v| v.to_array()), neg)
        });
        assert_eq!(abs.len(), neg.len());
    }
    for _ in 0..30 {
        let (a, b) = (lanes(&mut rng, 48), lanes(&mut rng, 48));
        both!("dual_inv", k => k::store(&k::dual_inv(&k::load(&a))));
        both!("batch_invert", k => {
            let (x, y) = k::batch_invert(&k::load(&a), &k::load(&b));
            (k::store(&x), k::store(&y))
        });
    }
}

#[test]
fn point_ops_agree() {
    if !ifma_here("point addition and base-point multiplication") {
        return;
    }
    let mut rng = ChaCha20Rng::seed_from_u64(0xc506);
    for _ in 0..500 {
        let (x, y, z) = (lanes(&mut rng, 48), lanes(&mut rng, 48), lanes(&mut rng, 48));
        let (x2, y2) = (lanes(&mut rng, 48), lanes(&mut rng, 48));
        both!("point_add_mixed", k => {
            let p = k::Jac52x8 { x: k::load(&x), y: k::load(&y), z: k::load(&z) };
            let r = k::point_add_mixed(&p, &k::load(&x2), &k::load(&y2));
            (k::store(&r.x), k::store(&r.y), k::store(&r.z))
        });
    }
    for _ in 0..40 {
        let ks: [[u8; 32]; 8] = std::array::from_fn(|_| rng.gen());
        let kl: [[u64; 5]; 8] = std::array::from_fn(|i| bytes_to_limbs(&ks[i]));
        both!("base_mul", k => {
            let (abs, neg) = k::recode8(&k::half_scalar(&k::load(&kl)));
            let r = k::base_mul(&abs, &neg);
            (k::store(&r.x), k::store(&r.y), k::store(&r.z))
        });
    }
}

/// The whole pass: eight (d, e, k) triples, all different, including the edge scalars.
#[test]
fn sign8_agrees() {
    let Some(cap) = crate::mb::require_ifma("P-256 model vs IFMA: sign8") else { return };
    let mut rng = ChaCha20Rng::seed_from_u64(0xc507);
    let n_minus_1: [u8; 32] = {
        let mut v = super::nonce::N_BE;
        v[31] -= 1;
        v
    };
    for case in 0..200 {
        let pick = |rng: &mut ChaCha20Rng| -> [u8; 32] {
            let mut v: [u8; 32] = rng.gen();
            match rng.gen_range(0..16) {
                0 => v = n_minus_1,
                1 => {
                    v = [0; 32];
                    v[31] = 1;
                }
                2 => v[0] &= 0x7f,
                _ => {
                    if !super::nonce::lt_be(&v, &super::nonce::N_BE) {
                        v[0] &= 0x7f;
                    }
                }
            }
            v
        };
        let d: [[u8; 32]; 8] = std::array::from_fn(|_| pick(&mut rng));
        let k: [[u8; 32]; 8] = std::array::from_fn(|_| pick(&mut rng));
        let e: [[u8; 32]; 8] = std::array::from_fn(|_| rng.gen());
        let m = super::model::sign8(&d, &e, &k);
        let i = super::ifma::sign8(cap, &d, &e, &k);
        for lane in 0..8 {
            assert_eq!(m.0[lane], i.0[lane], "case {case} lane {lane}: r differs");
            assert_eq!(m.1[lane], i.1[lane], "case {case} lane {lane}: s differs");
        }
    }
}
