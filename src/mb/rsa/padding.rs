//! Signature encodings: EMSA-PKCS1-v1_5 and EMSA-PSS (RFC 8017 §9), producing the message
//! representative (as many bytes as the modulus) that the private operation raises to `d`.
//!
//! Padding works on public data only (the message and, for PSS, a fresh random salt); it runs
//! before the batch and is shared by both backends.

use boring::hash::{hash, MessageDigest};
use boring::ssl::SslSignatureAlgorithm;

use crate::mb::MbError;

/// Signature padding and digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Padding {
    /// RSASSA-PKCS1-v1_5 with SHA-256.
    Pkcs1Sha256,
    /// RSASSA-PKCS1-v1_5 with SHA-384.
    Pkcs1Sha384,
    /// RSASSA-PKCS1-v1_5 with SHA-512.
    Pkcs1Sha512,
    /// RSASSA-PSS with SHA-256, MGF1-SHA-256, salt length 32.
    PssSha256,
    /// RSASSA-PSS with SHA-384, MGF1-SHA-384, salt length 48.
    PssSha384,
    /// RSASSA-PSS with SHA-512, MGF1-SHA-512, salt length 64.
    PssSha512,
}

const PREFIX_SHA256: [u8; 19] = [
    0x30, 0x31, 0x30, 0x0d, 0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x01, 0x05,
    0x00, 0x04, 0x20,
];
const PREFIX_SHA384: [u8; 19] = [
    0x30, 0x41, 0x30, 0x0d, 0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x02, 0x05,
    0x00, 0x04, 0x30,
];
const PREFIX_SHA512: [u8; 19] = [
    0x30, 0x51, 0x30, 0x0d, 0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x03, 0x05,
    0x00, 0x04, 0x40,
];

impl Padding {
    /// All paddings, for tests and benches.
    pub const ALL: [Padding; 6] = [
        Padding::Pkcs1Sha256,
        Padding::Pkcs1Sha384,
        Padding::Pkcs1Sha512,
        Padding::PssSha256,
        Padding::PssSha384,
        Padding::PssSha512,
    ];

    /// The TLS signature scheme this padding implements, mapped from BoringSSL's
    /// `SslSignatureAlgorithm` (what an `AsyncPrivateKeyMethod::sign` receives). `None` for
    /// non-RSA schemes, RSA-PSS-PSS (`rsa_pss_pss_*`, keys we do not hold) and SHA-1 / MD5-SHA1.
    pub fn from_ssl_algorithm(alg: SslSignatureAlgorithm) -> Option<Padding> {
        Some(match alg {
            SslSignatureAlgorithm::RSA_PKCS1_SHA256 => Padding::Pkcs1Sha256,
            SslSignatureAlgorithm::RSA_PKCS1_SHA384 => Padding::Pkcs1Sha384,
            SslSignatureAlgorithm::RSA_PKCS1_SHA512 => Padding::Pkcs1Sha512,
            SslSignatureAlgorithm::RSA_PSS_RSAE_SHA256 => Padding::PssSha256,
            SslSignatureAlgorithm::RSA_PSS_RSAE_SHA384 => Padding::PssSha384,
            SslSignatureAlgorithm::RSA_PSS_RSAE_SHA512 => Padding::PssSha512,
            _ => return None,
        })
    }

    /// The inverse of [`Padding::from_ssl_algorithm`].
    pub fn ssl_algorithm(self) -> SslSignatureAlgorithm {
        match self {
            Padding::Pkcs1Sha256 => SslSignatureAlgorithm::RSA_PKCS1_SHA256,
            Padding::Pkcs1Sha384 => SslSignatureAlgorithm::RSA_PKCS1_SHA384,
            Padding::Pkcs1Sha512 => SslSignatureAlgorithm::RSA_PKCS1_SHA512,
            Padding::PssSha256 => SslSignatureAlgorithm::RSA_PSS_RSAE_SHA256,
            Padding::PssSha384 => SslSignatureAlgorithm::RSA_PSS_RSAE_SHA384,
            Padding::PssSha512 => SslSignatureAlgorithm::RSA_PSS_RSAE_SHA512,
        }
    }

    /// The message digest (also MGF1's digest for PSS).
    pub fn digest(self) -> MessageDigest {
        match self {
            Padding::Pkcs1Sha256 | Padding::PssSha256 => MessageDigest::sha256(),
            Padding::Pkcs1Sha384 | Padding::PssSha384 => MessageDigest::sha384(),
            Padding::Pkcs1Sha512 | Padding::PssSha512 => MessageDigest::sha512(),
        }
    }

    /// True for the PSS variants.
    pub fn is_pss(self) -> bool {
        matches!(self, Padding::PssSha256 | Padding::PssSha384 | Padding::PssSha512)
    }

    /// The encoded message representative (`key.size()` big-endian bytes, below the modulus)
    /// that the private operation raises to d: what a raw RSA primitive such as crypto_mb's is
    /// given, so its output can be compared with ours.
    pub fn encode(self, msg: &[u8], mod_bits: usize) -> Result<Vec<u8>, MbError> {
        encode(self, msg, mod_bits)
    }

    /// A short name, e.g. `pkcs1-sha256`, `pss-sha384`.
    pub fn name(self) -> &'static str {
        match self {
            Padding::Pkcs1Sha256 => "pkcs1-sha256",
            Padding::Pkcs1Sha384 => "pkcs1-sha384",
            Padding::Pkcs1Sha512 => "pkcs1-sha512",
            Padding::PssSha256 => "pss-sha256",
            Padding::PssSha384 => "pss-sha384",
            Padding::PssSha512 => "pss-sha512",
        }
    }

    fn pkcs1_prefix(self) -> &'static [u8] {
        match self {
            Padding::Pkcs1Sha256 | Padding::PssSha256 => &PREFIX_SHA256,
            Padding::Pkcs1Sha384 | Padding::PssSha384 => &PREFIX_SHA384,
            Padding::Pkcs1Sha512 | Padding::PssSha512 => &PREFIX_SHA512,
        }
    }
}

/// Encodes `msg` for a modulus of `mod_bits` bits; returns `ceil(mod_bits / 8)` bytes whose value
/// is below the modulus by construction (leading `00 01` for PKCS#1, top bit(s) cleared for PSS).
pub(crate) fn encode(padding: Padding, msg: &[u8], mod_bits: usize) -> Result<Vec<u8>, MbError> {
    let md = padding.digest();
    let m_hash = hash(md, msg)?;
    if padding.is_pss() {
        let mut salt = vec![0u8; md.size()];
        boring::rand::rand_bytes(&mut salt)?;
        pss_encode(md, &m_hash, &salt, mod_bits)
    } else {
        pkcs1_encode(padding.pkcs1_prefix(), &m_hash, mod_bits.div_ceil(8))
    }
}

/// EMSA-PKCS1-v1_5: `00 01 FF…FF 00 || DigestInfo prefix || H`.
fn pkcs1_encode(prefix: &[u8], h: &[u8], k: usize) -> Result<Vec<u8>, MbError> {
    let t_len = prefix.len() + h.len();
    if k < t_len + 11 {
        return Err(MbError::InvalidKey(format!("modulus of {k} bytes too small for PKCS#1 v1.5")));
    }
    let mut em = vec![0xffu8; k];
    em[0] = 0;
    em[1] = 1;
    em[k - t_len - 1] = 0;
    em[k - t_len..k - h.len()].copy_from_slice(prefix);
    em[k - h.len()..].copy_from_slice(h);
    Ok(em)
}

/// MGF1 mask of `len` bytes XORed into `out`.
fn mgf1_xor(md: MessageDigest, seed: &[u8], out: &mut [u8]) -> Result<(), MbError> {
    let mut counter = 0u32;
    let mut done = 0;
    while done < out.len() {
        let mut input = seed.to_vec();
        input.extend_from_slice(&counter.to_be_bytes());
        let block = hash(md, &input)?;
        for (o, b) in out[done..].iter_mut().zip(block.iter()) {
            *o ^= b;
        }
        done += block.len();
        counter += 1;
    }
    Ok(())
}

/// EMSA-PSS-ENCODE with emBits = mod_bits − 1, returned left-padded to `ceil(mod_bits / 8)`.
pub(crate) fn pss_encode(
    md: MessageDigest,
    m_hash: &[u8],
    salt: &[u8],
    mod_bits: usize,
) -> Result<Vec<u8>, MbError> {
    let h_len = md.size();
    let em_bits = mod_bits - 1;
    let em_len = em_bits.div_ceil(8);
    if em_len < h_len + salt.len() + 2 {
        return Err(MbError::InvalidKey(format!("modulus of {mod_bits} bits too small for PSS")));
    }
    let mut m_prime = vec![0u8; 8];
    m_prime.extend_from_slice(m_hash);
    m_prime.extend_from_slice(salt);
    let h = hash(md, &m_prime)?;
    let db_len = em_len - h_len - 1;
    let mut db = vec![0u8; db_len];
    db[db_len - salt.len() - 1] = 1;
    db[db_len - salt.len()..].copy_from_slice(salt);
    mgf1_xor(md, &h, &mut db)?;
    db[0] &= 0xffu8 >> (8 * em_len - em_bits);
    let k = mod_bits.div_ceil(8);
    let mut out = vec![0u8; k - em_len];
    out.extend_from_slice(&db);
    out.extend_from_slice(&h);
    out.push(0xbc);
    Ok(out)
}
