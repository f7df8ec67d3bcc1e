//! SHA-256 compression for the nonce DRBG: SHA-NI when the CPU has it, portable code otherwise.
//!
//! RFC 6979 needs about 18 compressions per signature on short, fixed-shape inputs; BoringSSL's
//! streaming `SHA256_CTX` spends nearly as long in buffering and finalisation as in the
//! compressions themselves. Here HMAC keeps raw chaining values and pads in place.
//! Nothing here branches on or indexes by the data (SHA-256 is data-independent by design).

/// SHA-256 chaining value.
pub(crate) type State = [u32; 8];

pub(crate) const IV: State = [
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
];

const K: [u32; 64] = [
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
];

/// Compresses `blocks` (a multiple of 64 bytes) into `h`.
pub(crate) fn compress(h: &mut State, blocks: &[u8]) {
    debug_assert_eq!(blocks.len() % 64, 0);
    #[cfg(target_arch = "x86_64")]
    if let Some(cap) = crate::mb::cpu::ShaNi::detect() {
        return compress_shani(cap, h, blocks);
    }
    compress_portable(h, blocks);
}

/// The SHA-NI compression, behind the capability that proves its features were detected.
#[cfg(target_arch = "x86_64")]
fn compress_shani(_cap: crate::mb::cpu::ShaNi, h: &mut State, blocks: &[u8]) {
    // SAFETY: a `ShaNi` value exists only after run-time detection of sha, sse2, ssse3 and
    // sse4.1, exactly the features `compress_shani_kernel` enables.
    unsafe { compress_shani_kernel(h, blocks) }
}

fn compress_portable(h: &mut State, blocks: &[u8]) {
    for block in blocks.chunks_exact(64) {
        let mut w = [0u32; 64];
        for (i, c) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes(c.try_into().unwrap());
        }
        for t in 16..64 {
            let s0 = w[t - 15].rotate_right(7) ^ w[t - 15].rotate_right(18) ^ (w[t - 15] >> 3);
            let s1 = w[t - 2].rotate_right(17) ^ w[t - 2].rotate_right(19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16].wrapping_add(s0).wrapping_add(w[t - 7]).wrapping_add(s1);
        }
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut hh] = *h;
        for t in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh.wrapping_add(s1).wrapping_add(ch).wrapping_add(K[t]).wrapping_add(w[t]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & b) ^ (a & c) ^ (b & c);
            let t2 = s0.wrapping_add(maj);
            hh = g;
            g = f;
            f = e;
            e = d.wrapping_add(t1);
            d = c;
            c = b;
            b = a;
            a = t1.wrapping_add(t2);
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e, f, g, hh]) {
            *x = x.wrapping_add(y);
        }
    }
}

/// SHA-NI compression. Register layout of the instructions: `abef` holds (a, b, e, f) and
/// `cdgh` holds (c, d, g, h), each listed from the highest 32-bit lane down.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
fn compress_shani_kernel(h: &mut State, blocks: &[u8]) {
    use core::arch::x86_64::*;
    // SAFETY (loads/stores below): `h` is 32 bytes, every block is 64 bytes; unaligned ops.
    unsafe {
        let bswap = _mm_set_epi64x(0x0c0d0e0f08090a0b, 0x0405060700010203);
        let dcba = _mm_loadu_si128(h.as_ptr() as *const __m128i); // lanes 0..3 = a, b, c, d
        let hgfe = _mm_loadu_si128(h.as_ptr().add(4) as *const __m128i); // e, f, g, h
        let badc = _mm_shuffle_epi32::<0xb1>(dcba); // lanes: b, a, d, c
        let efgh = _mm_shuffle_epi32::<0x1b>(hgfe); // lanes: h, g, f, e
        let mut abef = _mm_alignr_epi8::<8>(badc, efgh); // lanes: f, e, b, a
        let mut cdgh = _mm_blend_epi16::<0xf0>(efgh, badc); // lanes: h, g, d, c
        for block in blocks.chunks_exact(64) {
            let (abef0, cdgh0) = (abef, cdgh);
            let p = block.as_ptr() as *const __m128i;
            let mut g = [
                _mm_shuffle_epi8(_mm_loadu_si128(p), bswap),
                _mm_shuffle_epi8(_mm_loadu_si128(p.add(1)), bswap),
                _mm_shuffle_epi8(_mm_loadu_si128(p.add(2)), bswap),
                _mm_shuffle_epi8(_mm_loadu_si128(p.add(3)), bswap),
            ];
            for i in 0..16 {
                if i >= 4 {
                    // W[4i..4i+4] from the previous four groups (i is a public counter).
                    let t = _mm_sha256msg1_epu32(g[i % 4], g[(i + 1) % 4]);
                    let t = _mm_add_epi32(t, _mm_alignr_epi8::<4>(g[(i + 3) % 4], g[(i + 2) % 4]));
                    g[i % 4] = _mm_sha256msg2_epu32(t, g[(i + 3) % 4]);
                }
                let k = _mm_loadu_si128(K.as_ptr().add(4 * i) as *const __m128i);
                let wk = _mm_add_epi32(g[i % 4], k);
                // rnds2 returns the new (a,b,e,f); the old one becomes (c,d,g,h). Two calls
                // bring the roles back to the variable names.
                cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);
                let wk_hi = _mm_shuffle_epi32::<0x0e>(wk);
                abef = _mm_sha256rnds2_epu32(abef, cdgh, wk_hi);
            }
            abef = _mm_add_epi32(abef, abef0);
            cdgh = _mm_add_epi32(cdgh, cdgh0);
        }
        let feba = _mm_shuffle_epi32::<0x1b>(abef); // lanes: a, b, e, f
        let dchg = _mm_shuffle_epi32::<0xb1>(cdgh); // lanes: g, h, c, d
        let dcba = _mm_blend_epi16::<0xf0>(feba, dchg); // a, b, c, d
        let hgfe = _mm_alignr_epi8::<8>(dchg, feba); // e, f, g, h
        _mm_storeu_si128(h.as_mut_ptr() as *mut __m128i, dcba);
        _mm_storeu_si128(h.as_mut_ptr().add(4) as *mut __m128i, hgfe);
    }
}

/// Eight independent SHA-256 compressions at once, one per 32-bit lane of a 256-bit register
/// (AVX-512VL rotates and three-input logic). Used for the lockstep nonce DRBG of a batch.
#[cfg(target_arch = "x86_64")]
fn compress_x8(_cap: crate::mb::cpu::Avx512Vl, hs: &mut [State; 8], blocks: &[&[u8]; 8]) {
    // SAFETY: an `Avx512Vl` value exists only after run-time detection of avx2, avx512f and
    // avx512vl, exactly the features `compress_x8_kernel` enables.
    unsafe { compress_x8_kernel(hs, blocks) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f,avx512vl")]
fn compress_x8_kernel(hs: &mut [State; 8], blocks: &[&[u8]; 8]) {
    use core::arch::x86_64::*;
    // Transpose through plain arrays (closures would not inherit the target features).
    let mut wt = [[0u32; 8]; 16];
    for (l, blk) in blocks.iter().enumerate() {
        for t in 0..16 {
            wt[t][l] = u32::from_be_bytes(blk[4 * t..4 * t + 4].try_into().unwrap());
        }
    }
    let mut stt = [[0u32; 8]; 8];
    for l in 0..8 {
        for i in 0..8 {
            stt[i][l] = hs[l][i];
        }
    }
    let mut w = [_mm256_setzero_si256(); 16];
    let mut st = [_mm256_setzero_si256(); 8];
    // SAFETY: each row is 32 readable bytes; unaligned loads.
    unsafe {
        for t in 0..16 {
            w[t] = _mm256_loadu_si256(wt[t].as_ptr() as *const __m256i);
        }
        for i in 0..8 {
            st[i] = _mm256_loadu_si256(stt[i].as_ptr() as *const __m256i);
        }
    }
    let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut h] = st;
    // One round; `$j` is a literal so the 16-word message window stays in registers.
    macro_rules! round {
        ($r:ident, $j:literal) => {{
            if $r > 0 {
                let w15 = w[($j + 1) % 16];
                let w2 = w[($j + 14) % 16];
                let s0 = _mm256_ternarylogic_epi32::<0x96>(
                    _mm256_ror_epi32::<7>(w15),
                    _mm256_ror_epi32::<18>(w15),
                    _mm256_srli_epi32::<3>(w15),
                );
                let s1 = _mm256_ternarylogic_epi32::<0x96>(
                    _mm256_ror_epi32::<17>(w2),
                    _mm256_ror_epi32::<19>(w2),
                    _mm256_srli_epi32::<10>(w2),
                );
                w[$j] = _mm256_add_epi32(
                    _mm256_add_epi32(w[$j], s0),
                    _mm256_add_epi32(w[($j + 9) % 16], s1),
                );
            }
            let s1 = _mm256_ternarylogic_epi32::<0x96>(
                _mm256_ror_epi32::<6>(e),
                _mm256_ror_epi32::<11>(e),
                _mm256_ror_epi32::<25>(e),
            );
            let ch = _mm256_ternarylogic_epi32::<0xca>(e, f, g);
            let kw = _mm256_add_epi32(_mm256_set1_epi32(K[16 * $r + $j] as i32), w[$j]);
            let t1 = _mm256_add_epi32(_mm256_add_epi32(h, s1), _mm256_add_epi32(ch, kw));
            let s0 = _mm256_ternarylogic_epi32::<0x96>(
                _mm256_ror_epi32::<2>(a),
                _mm256_ror_epi32::<13>(a),
                _mm256_ror_epi32::<22>(a),
            );
            let maj = _mm256_ternarylogic_epi32::<0xe8>(a, b, c);
            let t2 = _mm256_add_epi32(s0, maj);
            h = g;
            g = f;
            f = e;
            e = _mm256_add_epi32(d, t1);
            d = c;
            c = b;
            b = a;
            a = _mm256_add_epi32(t1, t2);
        }};
    }
    for r in 0..4 {
        round!(r, 0);
        round!(r, 1);
        round!(r, 2);
        round!(r, 3);
        round!(r, 4);
        round!(r, 5);
        round!(r, 6);
        round!(r, 7);
        round!(r, 8);
        round!(r, 9);
        round!(r, 10);
        round!(r, 11);
        round!(r, 12);
        round!(r, 13);
        round!(r, 14);
        round!(r, 15);
    }
    for (i, v) in [a, b, c, d, e, f, g, h].into_iter().enumerate() {
        let mut out = [0u32; 8];
        // SAFETY: `out` is 32 writable bytes; unaligned store.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, v) };
        for l in 0..8 {
            hs[l][i] = hs[l][i].wrapping_add(out[l]);
        }
    }
}

/// Compresses one block in each of eight lanes: at once with AVX-512VL when available,
/// otherwise one by one.
pub(crate) fn compress_lanes(hs: &mut [State; 8], blocks: &[&[u8]; 8]) {
    #[cfg(target_arch = "x86_64")]
    if let Some(cap) = crate::mb::cpu::Avx512Vl::detect() {
        return compress_x8(cap, hs, blocks);
    }
    for (h, b) in hs.iter_mut().zip(blocks) {
        compress(h, b);
    }
}

/// Digest bytes of a chaining value.
pub(crate) fn digest(h: &State) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (o, w) in out.chunks_exact_mut(4).zip(h) {
        o.copy_from_slice(&w.to_be_bytes());
    }
    out
}

/// HMAC-SHA-256 with a 32-byte key, pad states computed once.
#[derive(Clone)]
pub(crate) struct Hmac {
    inner: State,
    outer: State,
}

impl Hmac {
    pub(crate) fn new(key: &[u8; 32]) -> Self {
        let mut ipad = [0x36u8; 64];
        let mut opad = [0x5cu8; 64];
        for i in 0..32 {
            ipad[i] ^= key[i];
            opad[i] ^= key[i];
        }
        let (mut inner, mut outer) = (IV, IV);
        compress(&mut inner, &ipad);
        compress(&mut outer, &opad);
        Hmac { inner, outer }
    }

    /// [`Hmac::new`] for eight keys at once.
    pub(crate) fn new_lanes(keys: &[[u8; 32]; 8]) -> [Hmac; 8] {
        let pads = |c: u8| -> [[u8; 64]; 8] {
            std::array::from_fn(|l| {
                let mut p = [c; 64];
                for i in 0..32 {
                    p[i] ^= keys[l][i];
                }
                p
            })
        };
        let (ipads, opads) = (pads(0x36), pads(0x5c));
        let mut inner = [IV; 8];
        let mut outer = [IV; 8];
        compress_lanes(&mut inner, &std::array::from_fn(|l| &ipads[l][..]));
        compress_lanes(&mut outer, &std::array::from_fn(|l| &opads[l][..]));
        std::array::from_fn(|l| Hmac { inner: inner[l], outer: outer[l] })
    }

    /// HMAC of the concatenation of `parts` (at most 183 bytes in total: three blocks).
    pub(crate) fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        let mut buf = [0u8; 192];
        let mut len = 0;
        for p in parts {
            buf[len..len + p.len()].copy_from_slice(p);
            len += p.len();
        }
        let blocks = pad(&mut buf, len, 64);
        let mut h = self.inner;
        compress(&mut h, &buf[..blocks]);
        let mut ob = [0u8; 64];
        ob[..32].copy_from_slice(&digest(&h));
        pad(&mut ob, 32, 64);
        let mut o = self.outer;
        compress(&mut o, &ob);
        digest(&o)
    }
}

/// HMACs for eight lanes at once: lane `l` authenticates `msgs[l][..len]` (len ≤ 183) under
/// `keys[l]`. Each compression step runs for all lanes together ([`compress_lanes`]).
pub(crate) fn mac_lanes(keys: &[Hmac; 8], msgs: &mut [[u8; 192]; 8], len: usize) -> [[u8; 32]; 8] {
    let mut total = 0;
    for m in msgs.iter_mut() {
        total = pad(m, len, 64);
    }
    let mut hs: [State; 8] = std::array::from_fn(|l| keys[l].inner);
    for off in (0..total).step_by(64) {
        let blocks: [&[u8]; 8] = std::array::from_fn(|l| &msgs[l][off..off + 64]);
        compress_lanes(&mut hs, &blocks);
    }
    let mut obs = [[0u8; 64]; 8];
    for (ob, h) in obs.iter_mut().zip(&hs) {
        ob[..32].copy_from_slice(&digest(h));
        pad(ob, 32, 64);
    }
    let mut os: [State; 8] = std::array::from_fn(|l| keys[l].outer);
    compress_lanes(&mut os, &std::array::from_fn(|l| &obs[l][..]));
    std::array::from_fn(|l| digest(&os[l]))
}

/// Appends SHA-256 padding to `buf[..len]` for a message preceded by `prefix` bytes already
/// compressed; returns the padded length (a multiple of 64).
fn pad(buf: &mut [u8], len: usize, prefix: usize) -> usize {
    let total = (len + 9).div_ceil(64) * 64;
    buf[len] = 0x80;
    buf[len + 1..total - 8].fill(0);
    buf[total - 8..total].copy_from_slice(&(((prefix + len) as u64) * 8).to_be_bytes());
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn hash_with(f: impl Fn(&mut State, &[u8]), m: &[u8]) -> [u8; 32] {
        let mut h = IV;
        let full = m.len() / 64 * 64;
        f(&mut h, &m[..full]);
        let mut tail = [0u8; 128];
        tail[..m.len() - full].copy_from_slice(&m[full..]);
        let n = pad(&mut tail, m.len() - full, full);
        f(&mut h, &tail[..n]);
        digest(&h)
    }

    #[test]
    fn compressions_match_boring() {
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(30);
        for len in (0..300).chain([1000, 4096]) {
            let m: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            let want = boring::sha::sha256(&m);
            assert_eq!(hash_with(compress_portable, &m), want, "portable, len {len}");
            assert_eq!(hash_with(compress, &m), want, "dispatched, len {len}");
            let lanes = |h: &mut State, b: &[u8]| {
                for blk in b.chunks_exact(64) {
                    // Eight lanes with different chaining values: lane 3 carries the message.
                    let mut hs = [IV; 8];
                    for (i, x) in hs.iter_mut().enumerate() {
                        x[0] ^= i as u32;
                    }
                    hs[3] = *h;
                    let mut blocks: [&[u8]; 8] = [&[7u8; 64][..]; 8];
                    blocks[3] = blk;
                    compress_lanes(&mut hs, &blocks);
                    *h = hs[3];
                }
            };
            assert_eq!(hash_with(lanes, &m), want, "8 lanes, len {len}");
        }
    }
}
