//! Multi-buffer RSA signing: size × backend (ifma, boringssl) × batch size (1, 2, 4, 8).
//!
//! `cargo bench --bench mb` (pin it: `taskset -c 1 cargo bench --bench mb`). Throughput is
//! reported in signatures (criterion `Elements`), so the IFMA and BoringSSL lines of one size
//! compare directly; measurement times are short on purpose.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mbtunnel::mb::rsa::{Padding, RsaBatch, RsaPrivateKey};
use mbtunnel::mb::{cpu_features, Backend};

fn keys(bits: usize) -> Vec<RsaPrivateKey> {
    let pems: &[&str] = match bits {
        2048 => &[
            include_str!("../tests/data/rsa2048-1.pem"),
            include_str!("../tests/data/rsa2048-2.pem"),
            include_str!("../tests/data/rsa2048-3.pem"),
            include_str!("../tests/data/rsa2048-4.pem"),
        ],
        3072 => &[
            include_str!("../tests/data/rsa3072-1.pem"),
            include_str!("../tests/data/rsa3072-2.pem"),
            include_str!("../tests/data/rsa3072-3.pem"),
        ],
        _ => &[
            include_str!("../tests/data/rsa4096-1.pem"),
            include_str!("../tests/data/rsa4096-2.pem"),
            include_str!("../tests/data/rsa4096-3.pem"),
        ],
    };
    pems.iter().map(|p| RsaPrivateKey::from_pem(p.as_bytes()).unwrap()).collect()
}

fn rsa(c: &mut Criterion) {
    let ifma = cpu_features().ifma_capable();
    if !ifma {
        eprintln!("CPU lacks AVX-512 IFMA: benchmarking BoringSSL only");
    }
    for bits in [2048usize, 3072, 4096] {
        let ks = keys(bits);
        let mut g = c.benchmark_group(format!("rsa{bits}_pkcs1_sha256"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(if bits == 4096 { 3 } else { 2 }));
        for batch in [1usize, 2, 4, 8] {
            let lane_keys: Vec<&RsaPrivateKey> = (0..batch).map(|i| &ks[i % ks.len()]).collect();
            let msgs: Vec<&[u8]> = vec![b"criterion".as_slice(); batch];
            g.throughput(Throughput::Elements(batch as u64));
            let mut backends = vec![(Backend::Scalar, "boringssl")];
            if ifma {
                backends.insert(0, (Backend::Ifma, "ifma"));
            }
            for (backend, name) in backends {
                g.bench_with_input(BenchmarkId::new(name, batch), &batch, |b, _| {
                    b.iter(|| RsaBatch::sign_with(backend, &lane_keys, &msgs, Padding::Pkcs1Sha256))
                });
            }
        }
        g.finish();
    }
}

criterion_group!(benches, rsa);
criterion_main!(benches);
