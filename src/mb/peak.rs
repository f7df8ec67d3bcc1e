//! The IFMA ceiling of the core this runs on, measured: sixteen independent chains of
//! `vpmadd52luq` (512-bit), enough to cover a 4-cycle latency at two instructions per cycle
//! (4 × 2 = 8 chains needed) with room to spare, and nothing else in the loop but its counter.
//! `mbtunnel speed` divides each kernel's IFMA count per batch by this rate to say what share of
//! the peak the kernel reaches.

use std::time::{Duration, Instant};

use crate::mb::simd::U64x8;
use crate::mb::Ifma;

/// Independent accumulator chains in the probe loop.
pub const CHAINS: usize = 16;

/// `iters` rounds of one `vpmadd52luq` per chain; returns a value depending on every chain so
/// the loop cannot be dropped.
#[target_feature(enable = "avx512f,avx512ifma,avx512vl")]
fn chains(iters: u64, seed: u64) -> u64 {
    let b = U64x8::splat(std::hint::black_box(seed | 1));
    let c = U64x8::splat(std::hint::black_box(seed.rotate_left(17) | 3));
    let mut acc = [U64x8::zero(); CHAINS];
    for (i, a) in acc.iter_mut().enumerate() {
        *a = U64x8::splat(i as u64);
    }
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = a.madd52lo(b, c);
        }
    }
    let mut x = U64x8::zero();
    for a in acc {
        x = x.xor(a);
    }
    x.to_array().iter().fold(0, |s, &v| s ^ v)
}

/// IFMA instructions per second on this core (each one 8 lanes): the best of several short runs
/// spread over about `duration`, after a warm-up (the wide units may need one).
pub fn ifma_peak_per_s(_cap: Ifma, duration: Duration) -> f64 {
    const ITERS: u64 = 200_000;
    // SAFETY (reachability): `_cap` proves the CPU has every feature `chains` is compiled with.
    let run = |seed: u64| unsafe { chains(ITERS, seed) };
    std::hint::black_box(run(1));
    let start = Instant::now();
    let mut best = 0f64;
    let mut seed = 2;
    while seed < 4 || start.elapsed() < duration {
        let t = Instant::now();
        std::hint::black_box(run(seed));
        let rate = (ITERS * CHAINS as u64) as f64 / t.elapsed().as_secs_f64();
        best = best.max(rate);
        seed += 1;
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ifma_count_of_the_probe_and_its_rate() {
        let Some(cap) = crate::mb::require_ifma("IFMA peak probe") else { return };
        #[cfg(feature = "ifma-count")]
        {
            crate::mb::simd::ifma_count::take();
            // SAFETY: `cap` proves the features.
            unsafe { chains(10, 5) };
            assert_eq!(crate::mb::simd::ifma_count::take(), 10 * CHAINS as u64);
        }
        assert!(ifma_peak_per_s(cap, Duration::from_millis(5)) > 0.0);
    }
}
