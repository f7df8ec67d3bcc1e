//! Minimum and median latency of one 8-lane IFMA batch per RSA size (robust on a shared core):
//! `taskset -c 1 cargo run --release --example rsa_latency -- [iterations] [bits,...]`.
use mbtunnel::mb::rsa::{Padding, RsaBatch, RsaPrivateKey};
use mbtunnel::mb::Backend;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let iters: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(100);
    let sizes: Vec<u32> = args
        .get(1)
        .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![2048, 3072, 4096]);
    for bits in sizes {
        let key = RsaPrivateKey::from_boring(&boring::rsa::Rsa::generate(bits).unwrap()).unwrap();
        let keys = vec![&key; 8];
        let msgs: Vec<&[u8]> = vec![b"latency"; 8];
        let mut t: Vec<f64> = (0..iters)
            .map(|_| {
                let s = std::time::Instant::now();
                let r = RsaBatch::sign_with(Backend::Ifma, &keys, &msgs, Padding::Pkcs1Sha256);
                assert!(r.iter().all(|x| x.is_ok()));
                s.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        t.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let mut b: Vec<f64> = (0..iters.min(50))
            .map(|_| {
                let s = std::time::Instant::now();
                let r = RsaBatch::sign_with(
                    Backend::Scalar,
                    &keys[..1],
                    &msgs[..1],
                    Padding::Pkcs1Sha256,
                );
                assert!(r[0].is_ok());
                s.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        b.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!(
            "RSA-{bits}: ifma batch-8 min {:.0} us median {:.0} us; boringssl single min {:.0} us; ratio (min) {:.2}x",
            t[0],
            t[t.len() / 2],
            b[0],
            8.0 * b[0] / t[0]
        );
    }
}
