//! ECDSA P-256 sign: IFMA multi-buffer vs BoringSSL single-op, batch sizes 1, 2, 4, 8.
//! Throughput is reported in signatures (elements) per second.
//!
//! Run pinned: `taskset -c 1 cargo bench --bench mb_p256`.

use std::time::Duration;

use boring::ec::{EcGroup, EcKey};
use boring::nid::Nid;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mbtunnel::mb::p256::{self, EcdsaKey};
use mbtunnel::mb::Backend;

fn bench(c: &mut Criterion) {
    let group_ec = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).unwrap();
    let keys: Vec<EcdsaKey> = (0..8)
        .map(|_| EcdsaKey::from_boring(&EcKey::generate(&group_ec).unwrap()).unwrap())
        .collect();
    let key_refs: Vec<&EcdsaKey> = keys.iter().collect();
    // About the size of a TLS 1.3 CertificateVerify input (64 spaces, context, hash).
    let msgs: Vec<Vec<u8>> = (0..8).map(|i| vec![0x20 + i as u8; 130]).collect();
    let msg_refs: Vec<&[u8]> = msgs.iter().map(|m| m.as_slice()).collect();

    let mut g = c.benchmark_group("ecdsa_p256_sign");
    g.warm_up_time(Duration::from_millis(500));
    g.measurement_time(Duration::from_secs(2));
    g.sample_size(30);
    let mut backends = vec![Backend::Scalar];
    if mbtunnel::mb::cpu_features().ifma_capable() {
        backends.push(Backend::Ifma);
    }
    for batch in [1usize, 2, 4, 8] {
        g.throughput(Throughput::Elements(batch as u64));
        for &backend in &backends {
            let name = match backend {
                Backend::Scalar => "boringssl",
                b => b.as_str(),
            };
            g.bench_with_input(BenchmarkId::new(name, batch), &batch, |b, &n| {
                b.iter(|| p256::sign_batch_with(backend, &key_refs[..n], &msg_refs[..n]))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
