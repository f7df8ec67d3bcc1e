//! The multi-buffer RSA input/output conversion (big-endian bytes → radix-2^52 limbs → 8 lanes
//! and back), end to end through the public batch API, against the scalar path.
//!
//! Each input describes up to 16 lanes (so batches of 8 are split, and key sizes mix): a key
//! from tests/data (2048/3072/4096-bit, plus a 1024-bit and an e=3 key that must route to
//! BoringSSL) and a representative shaped from fuzz bytes: right- or left-aligned, repeated,
//! just below the modulus, or of the wrong length. The IFMA backend's result for every lane
//! must equal BoringSSL's (`Backend::Scalar`): the same bytes, or an error on both sides. On a CPU
//! without IFMA the kernels' portable model (`Backend::Model`) stands in for them.
//! Limb conversion bugs (a byte straddling two limbs, the top limb, leading zeros) show up as a
//! lane mismatch here, and a lane-crossing bug as a mismatch in a lane that did not change.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use mbtunnel::mb::rsa::{RsaBatch, RsaPrivateKey};
use mbtunnel::mb::Backend;

const PEMS: [&[u8]; 12] = [
    include_bytes!("../../tests/data/rsa2048-1.pem"),
    include_bytes!("../../tests/data/rsa2048-2.pem"),
    include_bytes!("../../tests/data/rsa2048-3.pem"),
    include_bytes!("../../tests/data/rsa2048-4.pem"),
    include_bytes!("../../tests/data/rsa3072-1.pem"),
    include_bytes!("../../tests/data/rsa3072-2.pem"),
    include_bytes!("../../tests/data/rsa3072-3.pem"),
    include_bytes!("../../tests/data/rsa4096-1.pem"),
    include_bytes!("../../tests/data/rsa4096-2.pem"),
    include_bytes!("../../tests/data/rsa4096-3.pem"),
    include_bytes!("../../tests/data/rsa1024.pem"),
    include_bytes!("../../tests/data/rsa2048-e3.pem"),
];

/// Keys with their big-endian moduli.
fn keys() -> &'static [(RsaPrivateKey, Vec<u8>)] {
    static KEYS: OnceLock<Vec<(RsaPrivateKey, Vec<u8>)>> = OnceLock::new();
    KEYS.get_or_init(|| {
        PEMS.iter()
            .map(|pem| {
                let k = RsaPrivateKey::from_pem(pem).expect("test key");
                let n = k.boring().n().to_vec_padded(k.size()).expect("modulus");
                (k, n)
            })
            .collect()
    })
}

/// `n - 1 - d` for a small `d`, big-endian, same length as `n`.
fn below(n: &[u8], d: u8) -> Vec<u8> {
    let mut out = n.to_vec();
    let mut borrow = d as u16 + 1;
    for b in out.iter_mut().rev() {
        let v = *b as u16;
        let (nv, nb) = if v >= borrow { (v - borrow, 0) } else { (v + 256 - borrow, 1) };
        *b = nv as u8;
        borrow = nb;
        if borrow == 0 {
            break;
        }
    }
    out
}

fuzz_target!(|data: &[u8]| {
    // The IFMA kernels where the CPU has them; elsewhere their portable model (the same kernel
    // source), so the conversions are fuzzed on every CPU.
    let mb = if mbtunnel::mb::cpu_features().ifma_capable() {
        Backend::Ifma
    } else {
        static SAID: OnceLock<()> = OnceLock::new();
        SAID.get_or_init(|| eprintln!("mb_convert: CPU lacks AVX-512 IFMA; fuzzing the model"));
        Backend::Model
    };
    let keys = keys();
    let mut lanes: Vec<(&RsaPrivateKey, Vec<u8>)> = Vec::new();
    let mut rest = data;
    while lanes.len() < 16 && rest.len() >= 2 {
        let (sel, mode) = (rest[0], rest[1]);
        rest = &rest[2..];
        let (key, n) = &keys[sel as usize % keys.len()];
        let size = key.size();
        let want = if mode >> 3 == 31 { size } else { 1 + (mode as usize >> 3) * 16 };
        let take = size.min(rest.len()).min(want);
        let (head, tail) = rest.split_at(take);
        rest = tail;
        let mut rep = vec![0u8; size];
        match mode & 7 {
            0 => rep[size - head.len()..].copy_from_slice(head),
            1 => rep[..head.len()].copy_from_slice(head),
            2 if !head.is_empty() => {
                for (i, b) in rep.iter_mut().enumerate() {
                    *b = head[i % head.len()];
                }
            }
            3 => rep = below(n, head.first().copied().unwrap_or(0)),
            4 => rep = head.to_vec(), // usually the wrong length: an error on both sides
            5 => rep.iter_mut().for_each(|b| *b = 0xff),
            _ => rep[size - head.len()..].copy_from_slice(head),
        }
        // Mostly keep the representative below n so the private operation runs.
        if mode & 4 == 0 && rep.len() == size && rep.as_slice() >= n.as_slice() {
            rep[0] %= n[0];
        }
        lanes.push((key, rep));
    }
    if lanes.is_empty() {
        return;
    }
    let ks: Vec<&RsaPrivateKey> = lanes.iter().map(|(k, _)| *k).collect();
    let rs: Vec<&[u8]> = lanes.iter().map(|(_, r)| r.as_slice()).collect();
    let ifma = RsaBatch::private_op_with(mb, &ks, &rs);
    let scalar = RsaBatch::private_op_with(Backend::Scalar, &ks, &rs);
    assert_eq!(ifma.len(), lanes.len());
    assert_eq!(scalar.len(), lanes.len());
    for (i, (a, b)) in ifma.iter().zip(&scalar).enumerate() {
        match (a, b) {
            (Ok(x), Ok(y)) => {
                assert_eq!(x.len(), ks[i].size(), "lane {i}: output length");
                assert!(x == y, "lane {i} ({} bits): {mb} and scalar results differ", ks[i].bits());
            }
            (Err(_), Err(_)) => {}
            _ => panic!("lane {i} ({} bits): {mb} {a:?} vs scalar {b:?}", ks[i].bits()),
        }
    }
});
