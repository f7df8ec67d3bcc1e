//! The portable model of the multi-buffer kernels (`Backend::Model`: the IFMA kernels' own
//! source compiled over `[u64; 8]` lanes) against BoringSSL, on any CPU.
//!
//! The first byte picks the algorithm (RSA about one input in four: a model RSA batch costs far
//! more than a P-256 one). Up to eight lanes follow, each with a key picked by the fuzz input
//! and a message of fuzz bytes:
//! - RSA: a key from tests/data (2048-bit mostly; 3072/4096 now and then; key generation is too
//!   slow to do per input) and PKCS#1 v1.5 or PSS with SHA-256/384/512. PKCS#1 signatures must
//!   be byte-identical to BoringSSL's, PSS ones must verify with BoringSSL.
//! - P-256: a private scalar taken from fuzz bytes (reduced into [1, n)); every signature
//!   (hedged nonces) must verify with BoringSSL; ECDSA is randomised, so it is verified, not
//!   compared. With RFC 6979 deterministic nonces the model's signature must equal the IFMA
//!   kernels' where the CPU has them.
//! Where the CPU has AVX-512 IFMA, the model's RSA result must also equal the IFMA backend's.
#![no_main]

use std::sync::OnceLock;

use boring::bn::{BigNum, BigNumContext};
use boring::ec::{EcGroup, EcKey, EcPoint};
use boring::hash::MessageDigest;
use boring::nid::Nid;
use boring::pkey::PKey;
use boring::sign::{RsaPssSaltlen, Verifier};
use libfuzzer_sys::fuzz_target;
use mbtunnel::mb::p256::{self, EcdsaKey, Nonces};
use mbtunnel::mb::rsa::{Padding, RsaBatch, RsaPrivateKey};
use mbtunnel::mb::Backend;

const PEMS: [&[u8]; 6] = [
    include_bytes!("../../tests/data/rsa2048-1.pem"),
    include_bytes!("../../tests/data/rsa2048-2.pem"),
    include_bytes!("../../tests/data/rsa2048-3.pem"),
    include_bytes!("../../tests/data/rsa2048-4.pem"),
    include_bytes!("../../tests/data/rsa3072-1.pem"),
    include_bytes!("../../tests/data/rsa4096-1.pem"),
];

fn rsa_keys() -> &'static [RsaPrivateKey] {
    static KEYS: OnceLock<Vec<RsaPrivateKey>> = OnceLock::new();
    KEYS.get_or_init(|| {
        PEMS.iter().map(|p| RsaPrivateKey::from_pem(p).expect("test key")).collect()
    })
}

fn ifma() -> bool {
    mbtunnel::mb::cpu_features().ifma_capable()
}

/// Splits the input into up to eight (selector, message) lanes.
fn lanes(mut rest: &[u8]) -> Vec<(u8, &[u8])> {
    let mut out = Vec::new();
    while out.len() < 8 && rest.len() >= 2 {
        let (sel, len) = (rest[0], rest[1] as usize);
        rest = &rest[2..];
        let (msg, tail) = rest.split_at(len.min(rest.len()));
        out.push((sel, msg));
        rest = tail;
    }
    out
}

fn rsa_case(data: &[u8]) {
    let keys = rsa_keys();
    let lanes = lanes(data);
    if lanes.is_empty() {
        return;
    }
    // One key size per input (a model batch per size is the cost): 3072/4096 one time in 16.
    let big = lanes[0].0 & 0xf0 == 0xf0;
    let pick = |sel: u8| -> &RsaPrivateKey {
        if big {
            &keys[4 + (sel as usize & 1)]
        } else {
            &keys[sel as usize % 4]
        }
    };
    let ks: Vec<&RsaPrivateKey> = lanes.iter().map(|(s, _)| pick(*s)).collect();
    let msgs: Vec<&[u8]> = lanes.iter().map(|(_, m)| *m).collect();
    let pads: Vec<Padding> =
        lanes.iter().map(|(s, _)| Padding::ALL[(*s as usize >> 2) % Padding::ALL.len()]).collect();
    let model = RsaBatch::sign_mixed_with(Backend::Model, &ks, &msgs, &pads);
    let scalar = RsaBatch::sign_mixed_with(Backend::Scalar, &ks, &msgs, &pads);
    for i in 0..ks.len() {
        let sig = model[i].as_ref().unwrap_or_else(|e| panic!("lane {i}: model failed: {e}"));
        assert_eq!(sig.len(), ks[i].size(), "lane {i}: signature length");
        if pads[i].is_pss() {
            let pkey = PKey::from_rsa(ks[i].public_key().unwrap()).unwrap();
            let mut v = Verifier::new(pads[i].digest(), &pkey).unwrap();
            v.set_rsa_padding(boring::rsa::Padding::PKCS1_PSS).unwrap();
            v.set_rsa_pss_saltlen(RsaPssSaltlen::DIGEST_LENGTH).unwrap();
            v.set_rsa_mgf1_md(pads[i].digest()).unwrap();
            assert!(v.verify_oneshot(sig, msgs[i]).unwrap(), "lane {i}: model PSS does not verify");
        } else {
            assert!(sig == scalar[i].as_ref().unwrap(), "lane {i}: model and BoringSSL differ");
        }
    }
    if ifma() {
        // PKCS#1 is deterministic: the model and the IFMA kernels must agree byte for byte.
        let pk: Vec<Padding> =
            pads.iter().map(|p| if p.is_pss() { Padding::Pkcs1Sha256 } else { *p }).collect();
        let a = RsaBatch::sign_mixed_with(Backend::Model, &ks, &msgs, &pk);
        let b = RsaBatch::sign_mixed_with(Backend::Ifma, &ks, &msgs, &pk);
        assert!(a == b, "model and IFMA differ");
    }
}

fn group() -> &'static EcGroup {
    static G: OnceLock<EcGroup> = OnceLock::new();
    G.get_or_init(|| EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).unwrap())
}

/// A P-256 key whose private scalar comes from `seed` (reduced into [1, n)).
fn ec_key(seed: &[u8]) -> EcdsaKey {
    let g = group();
    let mut ctx = BigNumContext::new().unwrap();
    let mut n = BigNum::new().unwrap();
    g.order(&mut n, &mut ctx).unwrap();
    let mut b = [0u8; 32];
    for (i, x) in seed.iter().take(32).enumerate() {
        b[31 - i] = *x;
    }
    let raw = BigNum::from_slice(&b).unwrap();
    let mut nm1 = n.to_owned().unwrap();
    nm1.sub_word(1).unwrap();
    let mut d = BigNum::new().unwrap();
    d.nnmod(&raw, &nm1, &mut ctx).unwrap();
    d.add_word(1).unwrap(); // [1, n - 1]
    let mut pubk = EcPoint::new(g).unwrap();
    pubk.mul_generator(g, &d, &mut ctx).unwrap();
    EcdsaKey::from_boring(&EcKey::from_private_components(g, &d, &pubk).unwrap()).unwrap()
}

fn p256_case(data: &[u8]) {
    let lanes = lanes(data);
    if lanes.is_empty() {
        return;
    }
    // The key of lane i comes from its message's first bytes and its selector.
    let keys: Vec<EcdsaKey> = lanes
        .iter()
        .map(|(s, m)| {
            let mut seed = vec![*s];
            seed.extend_from_slice(&m[..m.len().min(31)]);
            ec_key(&seed)
        })
        .collect();
    let refs: Vec<&EcdsaKey> = keys.iter().collect();
    let msgs: Vec<&[u8]> = lanes.iter().map(|(_, m)| *m).collect();
    let sigs = p256::sign_batch_with(Backend::Model, &refs, &msgs);
    for i in 0..refs.len() {
        let der = sigs[i].as_ref().unwrap_or_else(|e| panic!("lane {i}: model failed: {e}"));
        let pkey = PKey::from_ec_key(refs[i].ec_key().to_owned()).unwrap();
        let mut v = Verifier::new(MessageDigest::sha256(), &pkey).unwrap();
        assert!(v.verify_oneshot(der, msgs[i]).unwrap(), "lane {i}: model ECDSA does not verify");
    }
    if ifma() {
        let digests: Vec<[u8; 32]> = msgs.iter().map(|m| boring::sha::sha256(m)).collect();
        let a = p256::sign_digests(Backend::Model, &refs, &digests, &Nonces::Deterministic);
        let b = p256::sign_digests(Backend::Ifma, &refs, &digests, &Nonces::Deterministic);
        assert!(a == b, "model and IFMA differ (deterministic nonces)");
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else { return };
    if first & 3 == 0 {
        rsa_case(rest);
    } else {
        p256_case(rest);
    }
});
