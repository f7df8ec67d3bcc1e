//! The model build of the RSA kernels against the IFMA build, bit for bit, lane by lane, on
//! random inputs with a different value in every lane (random limbs, also outside the kernels'
//! input contract: both builds compute the same instruction semantics, so they agree on any
//! input). Needs a CPU with AVX-512 IFMA; elsewhere each test prints that it is skipped (and
//! fails under `REQUIRE_IFMA=1`) — the model itself is tested against BoringSSL in
//! `rsa::model::tests`.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

use super::{BatchOut, LaneKey};

const M52: u64 = (1 << 52) - 1;

use crate::mb::both;

fn ifma_here(what: &str) -> bool {
    crate::mb::require_ifma(&format!("RSA model vs IFMA: {what}")).is_some()
}

/// Eight lanes of `l` random limbs: normalised 52-bit limbs, sometimes with edge values or
/// unnormalised limbs.
fn lanes(rng: &mut ChaCha20Rng, l: usize) -> Vec<Vec<u64>> {
    (0..8)
        .map(|_| {
            let mut v: Vec<u64> = (0..l).map(|_| rng.gen::<u64>() & M52).collect();
            match rng.gen_range(0..16) {
                0 => v.iter_mut().for_each(|x| *x = M52),
                1 => v.iter_mut().for_each(|x| *x = 0),
                2 => v[rng.gen_range(0..l)] |= rng.gen::<u64>() << 52,
                _ => {}
            }
            v
        })
        .collect()
}

/// Random odd moduli (top bit set) as limbs, and their −m⁻¹ mod 2^52.
fn moduli(rng: &mut ChaCha20Rng, l: usize) -> (Vec<Vec<u64>>, [u64; 8]) {
    let mut m = lanes(rng, l);
    for v in m.iter_mut() {
        v.iter_mut().for_each(|x| *x &= M52);
        v[0] |= 1;
        v[l - 1] |= 1 << 51;
    }
    let k0 = std::array::from_fn(|i| super::ifma_k0(m[i][0] | (m[i][1] << 52)));
    (m, k0)
}

fn ops<const L: usize, const L2: usize>(cases: usize, seed: u64) {
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    for _ in 0..cases {
        let (m, k0) = moduli(&mut rng, L);
        let (a, b) = (lanes(&mut rng, L), lanes(&mut rng, L));
        let t = lanes(&mut rng, L2);
        let sel: [u64; 8] = std::array::from_fn(|_| rng.gen_range(0..20));
        macro_rules! g {
            ($k:ident, $x:expr, $n:expr) => {
                $k::gather::<$n>(|i| $x[i].as_slice())
            };
        }
        both!("amm", k => k::scatter(&k::amm::<L, L2>(&g!(k, a, L), &g!(k, b, L), &g!(k, m, L), k::U64x8::from_array(k0))));
        both!("amsqr", k => k::scatter(&k::amsqr::<L, L2>(&g!(k, a, L), &g!(k, m, L), k::U64x8::from_array(k0))));
        both!("amm_mem", k => k::scatter(&k::amm_mem::<L, L2>(&g!(k, a, L), &g!(k, b, L), &g!(k, m, L), k::U64x8::from_array(k0))));
        both!("amsqr_mem", k => k::scatter(&k::amsqr_mem::<L, L2>(&g!(k, a, L), &g!(k, m, L), k::U64x8::from_array(k0))));
        both!("reduce_once", k => k::scatter(&k::reduce_once::<L>(&g!(k, a, L), &g!(k, m, L))));
        both!("redc", k => {
            let mut tt = g!(k, t, L2);
            k::scatter(&k::redc::<L, L2>(&mut tt, &g!(k, m, L), k::U64x8::from_array(k0)))
        });
        both!("mul_wide", k => k::scatter(&k::mul_wide::<L, L2>(&g!(k, a, L), &g!(k, b, L))));
        both!("lookup", k => {
            let table: Vec<_> = (0..16).map(|j| {
                let rows: Vec<Vec<u64>> = (0..8).map(|i| a[i].iter().map(|x| x ^ (j as u64 * 0x9e37)).collect()).collect();
                g!(k, rows, L)
            }).collect();
            k::scatter(&k::lookup::<L>(&table, k::U64x8::from_array(sel)))
        });
    }
}

#[test]
fn montgomery_ops_agree() {
    if !ifma_here("Montgomery multiply, square, REDC, lookup") {
        return;
    }
    ops::<20, 40>(400, 1);
    ops::<30, 60>(200, 2);
    ops::<40, 80>(150, 3);
    ops::<80, 160>(40, 4);
}

/// Fixed-window exponentiation with a different exponent in every lane.
#[test]
fn modexp_agrees() {
    if !ifma_here("modexp") {
        return;
    }
    let mut rng = ChaCha20Rng::seed_from_u64(5);
    fn run<const L: usize, const L2: usize>(rng: &mut ChaCha20Rng, ebits: usize, w: usize) {
        // Two exponentiations side by side, different in every lane and half.
        let halves: Vec<_> = (0..2)
            .map(|_| {
                let (m, k0) = moduli(rng, L);
                let x = lanes(rng, L);
                let r2 = lanes(rng, L);
                let e: Vec<Vec<u64>> = (0..8)
                    .map(|_| (0..ebits.div_ceil(64)).map(|_| rng.gen()).collect())
                    .collect();
                (m, k0, x, r2, e)
            })
            .collect();
        let exps: Vec<[&[u64]; 8]> =
            halves.iter().map(|h| std::array::from_fn(|i| h.4[i].as_slice())).collect();
        both!("modexp", k => {
            let packed: Vec<_> = halves
                .iter()
                .map(|(m, k0, x, r2, _)| {
                    (
                        k::gather::<L>(|i| x[i].as_slice()),
                        k::gather::<L>(|i| m[i].as_slice()),
                        k::U64x8::from_array(*k0),
                        k::gather::<L>(|i| r2[i].as_slice()),
                    )
                })
                .collect();
            let ops: [k::ModExp<'_, L>; 2] = std::array::from_fn(|h| {
                let (x, m, k0, r2) = &packed[h];
                k::ModExp { x_mont: x, exps: &exps[h], m, k0: *k0, r2 }
            });
            let [a, b] = k::modexp_pair::<L, L2>(ops, ebits, w);
            (k::scatter(&a), k::scatter(&b))
        });
    }
    for _ in 0..3 {
        run::<20, 40>(&mut rng, 1024, 4);
        run::<30, 60>(&mut rng, 1536, 5);
    }
    run::<40, 80>(&mut rng, 2048, 5);
}

/// The whole RSA-CRT batch with the fault check, on real keys (a different key and message in
/// every lane), including injected faults in some lanes.
#[test]
fn crt_batch_agrees() {
    let Some(cap) = crate::mb::require_ifma("RSA model vs IFMA: crt_batch") else { return };
    let pems = [
        include_str!("../../../tests/data/rsa2048-1.pem"),
        include_str!("../../../tests/data/rsa2048-2.pem"),
        include_str!("../../../tests/data/rsa2048-3.pem"),
        include_str!("../../../tests/data/rsa2048-4.pem"),
    ];
    let keys: Vec<super::RsaPrivateKey> =
        pems.iter().map(|p| super::RsaPrivateKey::from_pem(p.as_bytes()).unwrap()).collect();
    let mut rng = ChaCha20Rng::seed_from_u64(6);
    for case in 0..6 {
        let pre: Vec<&super::Precomp> =
            (0..8).map(|i| keys[(i + case) % 4].pre.as_ref().unwrap()).collect();
        let lane_keys: [LaneKey<'_>; 8] = std::array::from_fn(|i| pre[i].lane_key());
        let em: Vec<Vec<u64>> = (0..8)
            .map(|i| {
                let mut v: Vec<u64> = (0..40).map(|_| rng.gen::<u64>() & M52).collect();
                // below n: one bit shorter than the modulus
                v[39] &= pre[i].n[39] >> 1;
                v
            })
            .collect();
        let em_refs: [&[u64]; 8] = std::array::from_fn(|i| em[i].as_slice());
        let corrupt: u8 = if case % 2 == 0 { 0 } else { rng.gen() };
        let m: BatchOut<40> =
            super::model::crt_batch::<20, 40, 80>(&lane_keys, &em_refs, 1024, 4, corrupt);
        let i: BatchOut<40> =
            super::ifma::crt_batch::<20, 40, 80>(cap, &lane_keys, &em_refs, 1024, 4, corrupt);
        assert_eq!(m.ok, i.ok, "case {case}: fault-check lanes differ");
        assert_eq!(
            m.ok, !corrupt,
            "case {case}: the fault check catches exactly the corrupted lanes"
        );
        for lane in 0..8 {
            assert_eq!(m.sig[lane], i.sig[lane], "case {case} lane {lane}");
        }
    }
}
