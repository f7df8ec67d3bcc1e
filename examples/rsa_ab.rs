//! A/B of kernel variants inside the batch: `taskset -c 1 cargo run --release --example rsa_ab -- ITERS v0,v1,...`
use mbtunnel::mb::rsa::{Padding, RsaBatch, RsaPrivateKey};
use mbtunnel::mb::Backend;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let iters: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(100);
    let vs: Vec<usize> = args.get(1).map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect()).unwrap_or_else(|| vec![0]);
    let key = RsaPrivateKey::from_boring(&boring::rsa::Rsa::generate(2048).unwrap()).unwrap();
    let keys = vec![&key; 8];
    let msgs: Vec<&[u8]> = vec![b"latency"; 8];
    let mut want = None;
    let mut t: Vec<Vec<f64>> = vec![Vec::new(); vs.len()];
    for _ in 0..iters {
        for (k, &v) in vs.iter().enumerate() {
            mbtunnel::mb::rsa::set_xsqr(v);
            let s = std::time::Instant::now();
            let r = RsaBatch::sign_with(Backend::Ifma, &keys, &msgs, Padding::Pkcs1Sha256);
            t[k].push(s.elapsed().as_secs_f64() * 1e6);
            let r: Vec<Vec<u8>> = r.into_iter().map(|x| x.unwrap()).collect();
            if want.is_none() { want = Some(r.clone()); }
            assert_eq!(want.as_ref(), Some(&r), "variant {v} differs");
        }
    }
    for (k, v) in vs.iter().enumerate() {
        let x = &mut t[k];
        x.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!("variant {v}: min {:.0} us  p10 {:.0}  median {:.0}", x[0], x[x.len() / 10], x[x.len() / 2]);
    }
}
