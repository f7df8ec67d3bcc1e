//! Ours against Intel's crypto_mb, same keys and inputs, 8 lanes per call: RSA-2048/3072/4096
//! private operation and ECDSA P-256 sign with the digest and nonce given (the work crypto_mb's
//! calls do; see `mbtunnel::speed::compare` for what each call includes). Throughput in
//! signatures (criterion `Elements`).
//!
//! `taskset -c 1 cargo bench --bench crypto_mb`. crypto_mb is loaded at run time
//! (`MBTUNNEL_CRYPTO_MB_LIB`, the pip prefixes, the loader's path); without it, or without
//! AVX-512 IFMA, the bench says so and measures nothing. Before timing, crypto_mb's outputs are
//! checked identical to ours; a mismatch panics.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mbtunnel::cryptomb::{CryptoMb, EcdsaInputs, EcdsaOutputs, RsaCrtKey};
use mbtunnel::mb::p256::{self, EcdsaKey, Nonces};
use mbtunnel::mb::rsa::{Padding, RsaBatch, RsaPrivateKey};
use mbtunnel::mb::{Backend, Ifma};

fn rsa_keys(bits: usize) -> Vec<RsaPrivateKey> {
    let pems: &[&str] = match bits {
        2048 => &[
            include_str!("../tests/data/rsa2048-1.pem"),
            include_str!("../tests/data/rsa2048-2.pem"),
        ],
        3072 => &[
            include_str!("../tests/data/rsa3072-1.pem"),
            include_str!("../tests/data/rsa3072-2.pem"),
        ],
        _ => &[
            include_str!("../tests/data/rsa4096-1.pem"),
            include_str!("../tests/data/rsa4096-2.pem"),
        ],
    };
    pems.iter().map(|p| RsaPrivateKey::from_pem(p.as_bytes()).unwrap()).collect()
}

fn bench(c: &mut Criterion) {
    let Some(cap) = Ifma::detect() else {
        eprintln!("skipped: the CPU lacks AVX-512 IFMA (crypto_mb and our kernels need it)");
        return;
    };
    let lib = match CryptoMb::load(None) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("skipped: {e}");
            return;
        }
    };
    eprintln!("crypto_mb: {} ({})", lib.version(), lib.path().display());
    let msg: &[u8] = b"criterion crypto_mb comparison";

    for bits in [2048usize, 3072, 4096] {
        let keys = rsa_keys(bits);
        let lane_keys: Vec<&RsaPrivateKey> = (0..8).map(|i| &keys[i % keys.len()]).collect();
        let cmb_keys: Vec<RsaCrtKey> =
            keys.iter().map(|k| RsaCrtKey::from_key(k).unwrap()).collect();
        let cmb_lane: [&RsaCrtKey; 8] = std::array::from_fn(|i| &cmb_keys[i % cmb_keys.len()]);
        let rep = Padding::Pkcs1Sha256.encode(msg, bits).unwrap();
        let reps: Vec<&[u8]> = vec![rep.as_slice(); 8];
        let input: [&[u8]; 8] = [rep.as_slice(); 8];
        let mut batch = lib.rsa_batch(cmb_lane).unwrap();
        let mut out: [Vec<u8>; 8] = Default::default();
        batch.private_crt(&input, &mut out).unwrap();
        let ours = RsaBatch::private_op_with(Backend::Ifma, &lane_keys, &reps);
        for i in 0..8 {
            assert_eq!(ours[i].as_ref().unwrap(), &out[i], "RSA-{bits} lane {i}: outputs differ");
        }
        let mut g = c.benchmark_group(format!("crypto_mb_rsa{bits}"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(if bits == 4096 { 4 } else { 2 }))
            .throughput(Throughput::Elements(8));
        g.bench_function(BenchmarkId::new("ours_private_op", 8), |b| {
            b.iter(|| RsaBatch::private_op_with(Backend::Ifma, &lane_keys, &reps))
        });
        g.bench_function(BenchmarkId::new("crypto_mb_private_crt", 8), |b| {
            b.iter(|| batch.private_crt(&input, &mut out).unwrap())
        });
        g.finish();
    }

    let group = boring::ec::EcGroup::from_curve_name(boring::nid::Nid::X9_62_PRIME256V1).unwrap();
    let keys: Vec<EcdsaKey> = (0..8)
        .map(|_| EcdsaKey::from_boring(&boring::ec::EcKey::generate(&group).unwrap()).unwrap())
        .collect();
    let key_refs: Vec<&EcdsaKey> = keys.iter().collect();
    let d: [[u8; 32]; 8] = std::array::from_fn(|i| {
        keys[i].ec_key().private_key().to_vec_padded(32).unwrap().try_into().unwrap()
    });
    let digests: [[u8; 32]; 8] =
        std::array::from_fn(|i| boring::sha::sha256(&[msg, &[i as u8]].concat()));
    let nonces: [[u8; 32]; 8] =
        std::array::from_fn(|i| p256::rfc6979_nonce(&d[i], &digests[i], None));
    let cands: Vec<[[u8; 32]; 1]> = nonces.iter().map(|k| [*k]).collect();
    let refs: Vec<&[[u8; 32]]> = cands.iter().map(|c| c.as_slice()).collect();
    let inp = EcdsaInputs::new(&digests, &nonces, &d);
    let mut out = EcdsaOutputs::default();
    lib.ecdsa_p256_sign(&inp, &mut out).unwrap();
    let ours = p256::sign_digests_raw(cap, &key_refs, &digests, &Nonces::Injected(&refs));
    for (i, lane) in ours.iter().enumerate() {
        assert_eq!(lane.as_ref().unwrap(), &(out.r[i], out.s[i]), "P-256 lane {i}: outputs differ");
    }
    let mut g = c.benchmark_group("crypto_mb_ecdsa_p256");
    g.sample_size(30)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
        .throughput(Throughput::Elements(8));
    g.bench_function(BenchmarkId::new("ours_sign_digest_nonce", 8), |b| {
        b.iter(|| p256::sign_digests_raw(cap, &key_refs, &digests, &Nonces::Injected(&refs)))
    });
    g.bench_function(BenchmarkId::new("crypto_mb_sign", 8), |b| {
        b.iter(|| lib.ecdsa_p256_sign(&inp, &mut out).unwrap())
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
