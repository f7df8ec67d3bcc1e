#![allow(dead_code, unused_imports, unused_macros)]
pub mod mb {
    pub mod simd_model {
        pub const MASK52: u64 = (1 << 52) - 1;
        #[repr(C, align(64))]
        pub struct Aligned8(pub [u64; 8]);
    }
    pub mod simd {
        include!("simd_body.rs");
    }
    pub mod rsa {
        pub(crate) struct LaneKey<'a> {
            pub p: &'a [u64], pub q: &'a [u64], pub p_k0: u64, pub q_k0: u64,
            pub p_r2: &'a [u64], pub q_r2: &'a [u64], pub qinv_r: &'a [u64],
            pub dp: &'a [u64], pub dq: &'a [u64], pub n: &'a [u64], pub n_k0: u64, pub n_r2: &'a [u64],
        }
        pub(crate) struct BatchOut<const L2: usize> { pub sig: [[u64; L2]; 8], pub ok: u8 }
        pub mod ifma {
            pub(crate) use crate::mb::simd::{U64x8, MASK52};
            use crate::mb::rsa::{BatchOut, LaneKey};
            macro_rules! kfn {
                ($(#[$m:meta])* $vis:vis fn $($rest:tt)*) => {
                    $(#[$m])*
                    #[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
                    $vis fn $($rest)*
                };
            }
            include!("kernel_body.rs");
        }
    }
}
use mb::rsa::ifma::*;
use std::sync::atomic::Ordering::Relaxed;

struct Rng(u64);
impl Rng { fn next(&mut self) -> u64 { self.0 ^= self.0 << 13; self.0 ^= self.0 >> 7; self.0 ^= self.0 << 17; self.0 } }

// scalar helpers on radix-2^52 limbs (L limbs), value < 2^(52L)
fn dbl_mod(x: &mut [u64], m: &[u64]) {
    let l = x.len();
    let mut c = 0u64;
    for j in 0..l { let t = (x[j] << 1) | c; c = x[j] >> 51; x[j] = t & MASK52; }
    // if c or x >= m: subtract
    let mut ge = c != 0;
    if !ge { ge = true; for j in (0..l).rev() { if x[j] != m[j] { ge = x[j] > m[j]; break; } } }
    if ge { let mut b = 0i64; for j in 0..l { let t = x[j] as i64 - m[j] as i64 + b; b = t >> 52; x[j] = (t as u64) & MASK52; } }
}
fn k0(m0: u64) -> u64 { let mut inv: u64 = 1; for _ in 0..7 { inv = inv.wrapping_mul(2u64.wrapping_sub(m0.wrapping_mul(inv))); } inv.wrapping_neg() & MASK52 }

fn main() {
    const L: usize = 20; const L2: usize = 40;
    let args: Vec<String> = std::env::args().collect();
    let iters: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(200);
    let vs: Vec<usize> = args.get(2).map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect()).unwrap_or(vec![0]);
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let mut ms = vec![[0u64; L]; 8]; let mut r2s = vec![[0u64; L]; 8]; let mut xs = vec![[0u64; L]; 8];
    let mut es = vec![[0u64; 16]; 8];
    for i in 0..8 {
        for j in 0..L { ms[i][j] = rng.next() & MASK52; }
        ms[i][L - 1] &= (1u64 << 36) - 1; ms[i][L - 1] |= 1u64 << 35; ms[i][0] |= 1; // 1024-bit odd
        let mut r = [0u64; L]; r[0] = 1;
        for _ in 0..2 * 52 * L { dbl_mod(&mut r, &ms[i]); }
        r2s[i] = r;
        let mut x = [0u64; L]; x[0] = 1; for _ in 0..52 * L { dbl_mod(&mut x, &ms[i]); } // R mod m (valid Montgomery value)
        for _ in 0..(rng.next() % 100) { dbl_mod(&mut x, &ms[i]); }
        xs[i] = x;
        for w in 0..16 { es[i][w] = rng.next(); }
    }
    unsafe {
        let m: N52x8<L> = gather(|i| &ms[i][..]);
        let r2: N52x8<L> = gather(|i| &r2s[i][..]);
        let x: N52x8<L> = gather(|i| &xs[i][..]);
        let kk = U64x8::from_array(core::array::from_fn(|i| k0(ms[i][0] | (ms[i][1] << 52))));
        let exps: [&[u64]; 8] = core::array::from_fn(|i| &es[i][..]);
        if std::env::var("PRIM").is_ok() {
            let n = 2000;
            let mut tab = vec![x; 16];
            for k in 1..16 { tab[k] = amm::<L, L2>(&tab[k - 1], &x, &m, kk); }
            for _ in 0..5 {
                let mut va = x;
                let s = std::time::Instant::now();
                for _ in 0..n { va = amsqr::<L, L2>(&va, &m, kk); }
                let ts = s.elapsed().as_secs_f64() / n as f64 * 1e6;
                let s = std::time::Instant::now();
                for _ in 0..n { va = amm::<L, L2>(&va, &x, &m, kk); }
                let tm = s.elapsed().as_secs_f64() / n as f64 * 1e6;
                let s = std::time::Instant::now();
                let mut idx = U64x8::from_array([1, 2, 3, 4, 5, 6, 7, 8]);
                for _ in 0..n { va = lookup(&tab, idx); idx = idx.add(va[0]).and(U64x8::splat(15)); }
                let tl = s.elapsed().as_secs_f64() / n as f64 * 1e6;
                let s = std::time::Instant::now();
                for _ in 0..n/4 { for _ in 0..4 { va = amsqr::<L, L2>(&va, &m, kk); } let e = lookup(&tab, idx); va = amm::<L, L2>(&va, &e, &m, kk); }
                let tw = s.elapsed().as_secs_f64() / (n / 4) as f64 * 1e6;
                println!("amsqr {ts:.3} us  amm {tm:.3} us  lookup {tl:.3} us  window(4 sqr+lookup+amm) {tw:.3} us");
            }
            return;
        }
        let mut want: Option<[[u64; L]; 8]> = None;
        let mut t: Vec<Vec<f64>> = vec![Vec::new(); vs.len()];
        for _ in 0..iters {
            for (k, &v) in vs.iter().enumerate() {
                XAMM.store(v / 10 % 10, Relaxed); XSQR.store(v % 10, Relaxed);
                let s = std::time::Instant::now();
                let w = (v / 100).max(4); let a = modexp::<L, L2>(&x, &exps, 1024, w, &m, kk, &r2);
                let b = modexp::<L, L2>(&a, &exps, 1024, w, &m, kk, &r2);
                t[k].push(s.elapsed().as_secs_f64() * 1e6);
                let r = scatter(&b);
                if want.is_none() { want = Some(r); }
                if v < 100 { assert!(want == Some(r), "variant {v} differs"); }
            }
        }
        for (k, v) in vs.iter().enumerate() {
            let x = &mut t[k]; x.sort_by(|a, b| a.partial_cmp(b).unwrap());
            println!("variant {v}: two 1024-bit modexp min {:.1} us p10 {:.1} median {:.1}", x[0], x[x.len()/10], x[x.len()/2]);
        }
    }
}
