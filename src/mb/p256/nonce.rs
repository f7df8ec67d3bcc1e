//! Hedged RFC 6979 nonces: HMAC-DRBG (HMAC-SHA-256) seeded with the private key and the message
//! hash, plus 32 fresh random bytes as the additional input `k'` of RFC 6979 section 3.6.
//!
//! Deterministic mode (no fresh bytes) reproduces RFC 6979 exactly; it exists for known-answer
//! tests. The DRBG keeps its state so that a retry (r = 0 or s = 0) draws the next candidate as
//! section 3.2 step h.3 prescribes.

use std::sync::OnceLock;

use super::sha::{mac_lanes, Hmac};

/// Group order n, big-endian.
pub(crate) const N_BE: [u8; 32] = [
    0xff, 0xff, 0xff, 0xff, 0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    0xbc, 0xe6, 0xfa, 0xad, 0xa7, 0x17, 0x9e, 0x84, 0xf3, 0xb9, 0xca, 0xc2, 0xfc, 0x63, 0x25, 0x51,
];

/// Big-endian 32 bytes as four little-endian-ordered 64-bit words.
fn words(a: &[u8; 32]) -> [u64; 4] {
    std::array::from_fn(|i| u64::from_be_bytes(a[24 - 8 * i..32 - 8 * i].try_into().unwrap()))
}

/// `a - b` on 4-word values, wrapping, with the final borrow (0 or 1); branch-free.
fn sub_words(a: &[u64; 4], b: &[u64; 4]) -> ([u64; 4], u64) {
    let mut out = [0u64; 4];
    let mut borrow = 0u64;
    for i in 0..4 {
        let (d, b1) = a[i].overflowing_sub(b[i]);
        let (d, b2) = d.overflowing_sub(borrow);
        out[i] = d;
        borrow = (b1 | b2) as u64;
    }
    (out, borrow)
}

/// `a < b` for 32-byte big-endian values, without branches on the data.
pub(crate) fn lt_be(a: &[u8; 32], b: &[u8; 32]) -> bool {
    sub_words(&words(a), &words(b)).1 == 1
}

/// bits2octets(h) for P-256/SHA-256: h as an integer, reduced once mod n (h < 2^256 < 2n).
pub(crate) fn bits2octets(h: &[u8; 32]) -> [u8; 32] {
    let hw = words(h);
    let (reduced, borrow) = sub_words(&hw, &words(&N_BE));
    let keep = 0u64.wrapping_sub(borrow); // all ones when h < n
    let mut out = [0u8; 32];
    for i in 0..4 {
        let v = (hw[i] & keep) | (reduced[i] & !keep);
        out[24 - 8 * i..32 - 8 * i].copy_from_slice(&v.to_be_bytes());
    }
    out
}

/// The initial key K = 0x00..00 is a constant: its pad states are computed once.
fn k0() -> &'static Hmac {
    static K0: OnceLock<Hmac> = OnceLock::new();
    K0.get_or_init(|| Hmac::new(&[0u8; 32]))
}

/// A candidate is used when 0 < t < n (RFC 6979 section 3.2 step h.3).
pub(crate) fn valid(t: &[u8; 32]) -> bool {
    let w = words(t);
    (w[0] | w[1] | w[2] | w[3]) != 0 && lt_be(t, &N_BE)
}

/// RFC 6979 HMAC-DRBG state for one signature.
pub(crate) struct Rfc6979 {
    k: Hmac,
    v: [u8; 32],
    first: bool,
}

impl Rfc6979 {
    /// Section 3.2 steps b–f, with `extra` as the additional data k' of section 3.6.
    /// `x`: private key (32 bytes, big-endian); `h`: SHA-256 of the message.
    pub(crate) fn new(x: &[u8; 32], h: &[u8; 32], extra: Option<&[u8; 32]>) -> Self {
        let h1 = bits2octets(h);
        let extra: &[u8] = match extra {
            Some(e) => e,
            None => &[],
        };
        let mut v = [0x01u8; 32];
        let kb = k0().mac(&[&v, &[0x00], x, &h1, extra]);
        let mut k = Hmac::new(&kb);
        v = k.mac(&[&v]);
        let kb = k.mac(&[&v, &[0x01], x, &h1, extra]);
        k = Hmac::new(&kb);
        v = k.mac(&[&v]);
        Rfc6979 { k, v, first: true }
    }

    /// [`Rfc6979::new`] followed by the first [`Rfc6979::next_k`] for eight lanes at once, in
    /// lockstep (each HMAC step runs for every lane before the next step, eight SHA-256
    /// compressions per instruction stream). All lanes hedge or none do.
    pub(crate) fn new_lanes(
        x: &[[u8; 32]; 8],
        h: &[[u8; 32]; 8],
        extra: Option<&[[u8; 32]; 8]>,
    ) -> ([Self; 8], [[u8; 32]; 8]) {
        let h1: [[u8; 32]; 8] = std::array::from_fn(|l| bits2octets(&h[l]));
        let seed_len = if extra.is_some() { 129 } else { 97 };
        // One message buffer per lane, rewritten in place for every step (mac_lanes pads it).
        let mut buf = [[0u8; 192]; 8];
        let seed = |buf: &mut [[u8; 192]; 8], v: &[[u8; 32]; 8], sep: u8| {
            for (l, m) in buf.iter_mut().enumerate() {
                m[..32].copy_from_slice(&v[l]);
                m[32] = sep;
                m[33..65].copy_from_slice(&x[l]);
                m[65..97].copy_from_slice(&h1[l]);
                if let Some(e) = extra {
                    m[97..129].copy_from_slice(&e[l]);
                }
            }
        };
        let vmsg = |buf: &mut [[u8; 192]; 8], v: &[[u8; 32]; 8]| {
            for (m, v) in buf.iter_mut().zip(v) {
                m[..32].copy_from_slice(v);
            }
        };
        let k0 = k0();
        let mut v = [[0x01u8; 32]; 8];
        seed(&mut buf, &v, 0x00);
        let mut k =
            Hmac::new_lanes(&mac_lanes(&std::array::from_fn(|_| k0.clone()), &mut buf, seed_len));
        vmsg(&mut buf, &v);
        v = mac_lanes(&k, &mut buf, 32);
        seed(&mut buf, &v, 0x01);
        k = Hmac::new_lanes(&mac_lanes(&k, &mut buf, seed_len));
        vmsg(&mut buf, &v);
        v = mac_lanes(&k, &mut buf, 32);
        // Step h, first candidate for every lane.
        vmsg(&mut buf, &v);
        v = mac_lanes(&k, &mut buf, 32);
        let mut gens: [Self; 8] =
            std::array::from_fn(|l| Rfc6979 { k: k[l].clone(), v: v[l], first: false });
        let ks = std::array::from_fn(|l| if valid(&v[l]) { v[l] } else { gens[l].next_k() });
        (gens, ks)
    }

    /// Section 3.2 step h: the next candidate k in [1, n). The loop rejects a candidate with
    /// probability ~2^-32; that branch reveals only that a discarded value was out of range.
    pub(crate) fn next_k(&mut self) -> [u8; 32] {
        loop {
            if !self.first {
                let kb = self.k.mac(&[&self.v, &[0x00]]);
                self.k = Hmac::new(&kb);
                self.v = self.k.mac(&[&self.v]);
            }
            self.first = false;
            self.v = self.k.mac(&[&self.v]);
            if valid(&self.v) {
                return self.v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_known_answer() {
        // Expected value from an independent HMAC-SHA-256 implementation (Python's hmac module).
        let key = [7u8; 32];
        let msg = b"the quick brown fox jumps over the lazy dog, several times over";
        let want = "548ac2799f16cc969f89da6528c36c5b40b9f2f2c840f9bf85024bc5006db8a9";
        let got = Hmac::new(&key).mac(&[&msg[..10], &msg[10..]]);
        let hex: String = got.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, want);
    }

    #[test]
    fn lockstep_matches_single_lane() {
        let x: [[u8; 32]; 8] = std::array::from_fn(|i| [i as u8 + 1; 32]);
        let h: [[u8; 32]; 8] = std::array::from_fn(|i| [0xf0 ^ i as u8; 32]);
        let e: [[u8; 32]; 8] = std::array::from_fn(|i| [0x33 + i as u8; 32]);
        for extra in [None, Some(&e)] {
            let (mut gens, ks) = Rfc6979::new_lanes(&x, &h, extra);
            for i in 0..8 {
                let mut single = Rfc6979::new(&x[i], &h[i], extra.map(|e| &e[i]));
                assert_eq!(ks[i], single.next_k(), "lane {i}");
                assert_eq!(gens[i].next_k(), single.next_k(), "retry candidate, lane {i}");
            }
        }
    }

    #[test]
    fn compare_and_reduce() {
        let mut big = N_BE;
        big[31] = 0x60;
        assert!(!lt_be(&big, &N_BE));
        assert!(!lt_be(&N_BE, &N_BE));
        assert!(lt_be(&[0u8; 32], &N_BE));
        let r = bits2octets(&big);
        let mut want = [0u8; 32];
        want[31] = 0x0f;
        assert_eq!(r, want);
        assert_eq!(bits2octets(&[1u8; 32]), [1u8; 32]);
    }
}
