//! Intel's crypto_mb (`libcrypto_mb.so`), loaded at run time as the anchor of
//! `mbtunnel speed --compare crypto-mb`. Nothing in the product links it or needs it: this module
//! only opens the library when a comparison asks for it, and reports why when it cannot.
//!
//! Install: `pip install ipp-crypto ipp-crypto-include intel-cmplr-lib-rt` (the library, its
//! headers, and the Intel compiler runtime it was built against: `libsvml`, `libimf`, `libirng`,
//! `libintlc`). Search order ([`candidates`]): an explicit path, [`LIB_ENV`], the `lib/` folders
//! of the Python prefixes pip installs into, then the dynamic loader's default search.
//!
//! The two entry points used, as declared in `crypto_mb/rsa.h` and `crypto_mb/ec_nistp256.h`
//! (crypto_mb 2.x; the BIGNUM-free variants, so no OpenSSL objects cross the boundary):
//!
//! * `mbx_rsa_private_crt_mb8(from[8], to[8], p[8], q[8], dp[8], dq[8], iq[8], bits, method,
//!   buffer)`: the raw CRT private operation `from^d mod n`; `from`/`to` are big-endian byte
//!   strings of `bits/8` bytes, the key parts little-endian 64-bit words of `bits/128` words.
//!   No padding, no blinding, no re-check of the result.
//! * `mbx_nistp256_ecdsa_sign_mb8(r[8], s[8], digest[8], k[8], d[8], buffer)`: ECDSA with the
//!   digest (32 big-endian bytes, below n) and the nonce supplied by the caller; k and d are
//!   little-endian 64-bit words, r and s come back as 32 big-endian bytes. No hashing, no nonce
//!   generation, no DER.
//!
//! Safety boundary: every `unsafe` block of this module is a call through one of these
//! function pointers, with arrays of eight pointers built here from buffers of the sizes above,
//! which outlive the call. The pointers come from a `Library` the same struct owns.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt;
use std::path::{Path, PathBuf};

use crate::mb::rsa::RsaPrivateKey;

/// Environment variable naming `libcrypto_mb.so` (a file) or a folder holding it.
pub const LIB_ENV: &str = "MBTUNNEL_CRYPTO_MB_LIB";

/// How to get the library, printed when it cannot be loaded.
pub const INSTALL_HINT: &str = "pip install ipp-crypto ipp-crypto-include intel-cmplr-lib-rt \
     (or set MBTUNNEL_CRYPTO_MB_LIB=/path/to/libcrypto_mb.so)";

const LIB_NAMES: [&str; 2] = ["libcrypto_mb.so", "libcrypto_mb.so.13"];

/// Intel compiler runtime libraries `libcrypto_mb.so` from pip needs and has no RPATH for: opened
/// first from the library's own folder, so the loader finds them by soname.
const RUNTIME_DEPS: [&str; 5] =
    ["libintlc.so.5", "libirc.so", "libirng.so", "libimf.so", "libsvml.so"];

type RsaCrtFn = unsafe extern "C" fn(
    *const *const u8,
    *const *mut u8,
    *const *const u64,
    *const *const u64,
    *const *const u64,
    *const *const u64,
    *const *const u64,
    c_int,
    *const c_void,
    *mut u8,
) -> u32;
type RsaMethodFn = unsafe extern "C" fn(c_int) -> *const c_void;
type BufSizeFn = unsafe extern "C" fn(*const c_void) -> c_int;
type EcdsaSignFn = unsafe extern "C" fn(
    *const *mut u8,
    *const *mut u8,
    *const *const u8,
    *const *const u64,
    *const *const u64,
    *mut u8,
) -> u32;

#[repr(C)]
struct MbxVersion {
    major: c_int,
    minor: c_int,
    patch: c_int,
    target_cpu: [c_char; 4],
    name: *const c_char,
    build_date: *const c_char,
    str_version: *const c_char,
}
type VersionFn = unsafe extern "C" fn() -> *const MbxVersion;

/// Why the library could not be used: every place tried and what went wrong there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadError {
    pub tried: Vec<(String, String)>,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "crypto_mb not loaded (install: {INSTALL_HINT}); tried:")?;
        for (p, e) in &self.tried {
            write!(f, " {p}: {e};")?;
        }
        Ok(())
    }
}

/// A call into crypto_mb that reported a per-lane error (4 status bits per lane, 0 = ok).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    #[error("crypto_mb status {0:#010x} (4 bits per lane; 1 bad parameter, 8 signature error, 10 unsupported CPU)")]
    Status(u32),
    #[error("{0}")]
    Input(String),
}

/// The loaded library and the entry points the comparison uses.
pub struct CryptoMb {
    // Field order: the pointers below are only valid while `_lib` is loaded; it is dropped
    // with the struct, after which no pointer can be used.
    rsa_crt: RsaCrtFn,
    rsa_method: RsaMethodFn,
    rsa_bufsize: BufSizeFn,
    ecdsa_sign: EcdsaSignFn,
    path: PathBuf,
    version: String,
    _lib: libloading::Library,
    _deps: Vec<libloading::Library>,
}

impl fmt::Debug for CryptoMb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CryptoMb")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish()
    }
}

/// Where to look, in order: `explicit`, then [`LIB_ENV`], then the pip prefixes, then the bare
/// names for the dynamic loader. A folder stands for the library file inside it.
pub fn candidates(explicit: Option<&Path>) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let push_dir_or_file = |p: PathBuf, out: &mut Vec<PathBuf>| {
        if p.is_dir() {
            out.extend(LIB_NAMES.iter().map(|n| p.join(n)));
        } else {
            out.push(p);
        }
    };
    if let Some(p) = explicit {
        push_dir_or_file(p.to_path_buf(), &mut out);
    }
    if let Some(p) = std::env::var_os(LIB_ENV).filter(|v| !v.is_empty()) {
        push_dir_or_file(PathBuf::from(p), &mut out);
    }
    for prefix in python_prefixes() {
        let lib = prefix.join("lib");
        out.extend(LIB_NAMES.iter().map(|n| lib.join(n)));
    }
    out.extend(LIB_NAMES.iter().map(PathBuf::from));
    let mut seen = std::collections::HashSet::new();
    out.retain(|p| seen.insert(p.clone()));
    out
}

/// `sys.prefix`, `sys.base_prefix` and `site.USER_BASE` of `python3` (pip puts the library in
/// their `lib/`), plus the usual fixed places; empty when there is no Python.
fn python_prefixes() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let script =
        "import sys, site\nprint(sys.prefix)\nprint(sys.base_prefix)\nprint(site.USER_BASE)";
    for py in ["python3", "python"] {
        if let Ok(o) = std::process::Command::new(py).arg("-c").arg(script).output() {
            if o.status.success() {
                out.extend(
                    String::from_utf8_lossy(&o.stdout)
                        .lines()
                        .filter(|l| !l.trim().is_empty())
                        .map(|l| PathBuf::from(l.trim())),
                );
                break;
            }
        }
    }
    if let Some(home) = std::env::var_os("HOME") {
        out.push(PathBuf::from(home).join(".local"));
    }
    out.push(PathBuf::from("/usr/local"));
    out
}

impl CryptoMb {
    /// Opens the first candidate that loads and has every entry point.
    pub fn load(explicit: Option<&Path>) -> Result<CryptoMb, LoadError> {
        let mut tried = Vec::new();
        for c in candidates(explicit) {
            if c.is_absolute() && !c.exists() {
                continue;
            }
            match Self::open(&c) {
                Ok(l) => return Ok(l),
                Err(e) => tried.push((c.display().to_string(), e)),
            }
        }
        if tried.is_empty() {
            tried.push(("(no candidate path exists)".into(), "not installed".into()));
        }
        Err(LoadError { tried })
    }

    fn open(path: &Path) -> Result<CryptoMb, String> {
        // The runtime libraries from the same folder first (pip's copy has no RPATH). A failure
        // here is not an error: the loader may find them elsewhere.
        let mut deps = Vec::new();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            let mut pending: Vec<PathBuf> =
                RUNTIME_DEPS.iter().map(|n| dir.join(n)).filter(|p| p.exists()).collect();
            // Some depend on others: retry until no progress.
            loop {
                let before = pending.len();
                pending.retain(|p| {
                    // SAFETY: loading an Intel runtime library runs its initialisers, which
                    // only set up its own state.
                    match unsafe { libloading::Library::new(p) } {
                        Ok(l) => {
                            deps.push(l);
                            false
                        }
                        Err(_) => true,
                    }
                });
                if pending.is_empty() || pending.len() == before {
                    break;
                }
            }
        }
        // SAFETY: as above; crypto_mb's initialisers detect the CPU and pick its code path.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
        // SAFETY: each symbol is declared in the crypto_mb headers with exactly these types
        // (see the module comment); the pointers are kept only alongside `lib`.
        unsafe {
            let sym = |name: &[u8]| -> Result<*const c_void, String> {
                lib.get::<*const c_void>(name)
                    .map(|s| *s)
                    .map_err(|e| format!("{}: {e}", String::from_utf8_lossy(name)))
            };
            let rsa_crt: RsaCrtFn = std::mem::transmute(sym(b"mbx_rsa_private_crt_mb8\0")?);
            let rsa_method: RsaMethodFn =
                std::mem::transmute(sym(b"mbx_RSA_private_crt_Method\0")?);
            let rsa_bufsize: BufSizeFn = std::mem::transmute(sym(b"mbx_RSA_Method_BufSize\0")?);
            let ecdsa_sign: EcdsaSignFn =
                std::mem::transmute(sym(b"mbx_nistp256_ecdsa_sign_mb8\0")?);
            let version_fn: VersionFn = std::mem::transmute(sym(b"mbx_getversion\0")?);
            let v = version_fn();
            let version = if v.is_null() {
                "unknown version".to_string()
            } else {
                let v = &*v;
                let s = if v.str_version.is_null() {
                    format!("crypto_mb {}.{}.{}", v.major, v.minor, v.patch)
                } else {
                    CStr::from_ptr(v.str_version).to_string_lossy().into_owned()
                };
                let cpu: String = v
                    .target_cpu
                    .iter()
                    .take_while(|&&c| c != 0)
                    .map(|&c| c as u8 as char)
                    .collect();
                format!("{s}, code path {cpu}")
            };
            Ok(CryptoMb {
                rsa_crt,
                rsa_method,
                rsa_bufsize,
                ecdsa_sign,
                path: path.to_path_buf(),
                version,
                _lib: lib,
                _deps: deps,
            })
        }
    }

    /// The file that was loaded (a bare name when the dynamic loader found it).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `mbx_getversion()`: the version string and the code path it dispatched to (`k1` is the
    /// AVX-512 IFMA path).
    pub fn version(&self) -> &str {
        &self.version
    }

    /// A prepared RSA batch of eight lanes (keys fixed, scratch buffer allocated): the timed call
    /// is only the library call.
    pub fn rsa_batch<'a>(&'a self, keys: [&'a RsaCrtKey; 8]) -> Result<RsaCrtBatch<'a>, CallError> {
        let bits = keys[0].bits;
        if keys.iter().any(|k| k.bits != bits) {
            return Err(CallError::Input("one batch, one key size".into()));
        }
        // SAFETY: `mbx_RSA_private_crt_Method(int)` returns a static method object or null.
        let method = unsafe { (self.rsa_method)(bits as c_int) };
        if method.is_null() {
            return Err(CallError::Input(format!("crypto_mb has no RSA-{bits} CRT method")));
        }
        // SAFETY: `method` is a valid method object.
        let size = unsafe { (self.rsa_bufsize)(method) }.max(0) as usize;
        Ok(RsaCrtBatch {
            lib: self,
            bits,
            method,
            buf: vec![0u8; size.max(64)],
            p: keys.map(|k| k.p.as_ptr()),
            q: keys.map(|k| k.q.as_ptr()),
            dp: keys.map(|k| k.dp.as_ptr()),
            dq: keys.map(|k| k.dq.as_ptr()),
            iq: keys.map(|k| k.iq.as_ptr()),
            _keys: std::marker::PhantomData,
        })
    }

    /// `mbx_nistp256_ecdsa_sign_mb8`: eight signatures of `digests` (big-endian, below n) with
    /// nonces `k` and keys `d` (both 32 big-endian bytes here, converted to words outside
    /// the call by [`EcdsaInputs::new`]).
    pub fn ecdsa_p256_sign(
        &self,
        inp: &EcdsaInputs,
        out: &mut EcdsaOutputs,
    ) -> Result<(), CallError> {
        let r: [*mut u8; 8] = std::array::from_fn(|i| out.r[i].as_mut_ptr());
        let s: [*mut u8; 8] = std::array::from_fn(|i| out.s[i].as_mut_ptr());
        let m: [*const u8; 8] = std::array::from_fn(|i| inp.digest[i].as_ptr());
        let k: [*const u64; 8] = std::array::from_fn(|i| inp.k[i].as_ptr());
        let d: [*const u64; 8] = std::array::from_fn(|i| inp.d[i].as_ptr());
        // SAFETY: eight valid pointers each: r, s 32 writable bytes; digests 32 bytes; k, d four
        // words; all outlive the call. The buffer argument may be null for this function.
        let st = unsafe {
            (self.ecdsa_sign)(
                r.as_ptr(),
                s.as_ptr(),
                m.as_ptr(),
                k.as_ptr(),
                d.as_ptr(),
                std::ptr::null_mut(),
            )
        };
        if st == 0 {
            Ok(())
        } else {
            Err(CallError::Status(st))
        }
    }
}

/// An RSA key in crypto_mb's CRT form: `p, q, dp, dq, qInv` as little-endian 64-bit words,
/// `bits/128` words each.
#[derive(Clone)]
pub struct RsaCrtKey {
    bits: usize,
    p: Vec<u64>,
    q: Vec<u64>,
    dp: Vec<u64>,
    dq: Vec<u64>,
    iq: Vec<u64>,
}

impl RsaCrtKey {
    /// The CRT parts of `key` (which must have them).
    pub fn from_key(key: &RsaPrivateKey) -> Result<RsaCrtKey, CallError> {
        let rsa = key.boring();
        let bits = key.bits();
        let words = bits.div_ceil(128);
        let w = |x: Option<&boring::bn::BigNumRef>| -> Result<Vec<u64>, CallError> {
            let x = x.ok_or_else(|| CallError::Input("key lacks CRT parameters".into()))?;
            let be = x.to_vec_padded(8 * words).map_err(|e| CallError::Input(e.to_string()))?;
            Ok(be_to_words(&be, words))
        };
        Ok(RsaCrtKey {
            bits,
            p: w(rsa.p())?,
            q: w(rsa.q())?,
            dp: w(rsa.dmp1())?,
            dq: w(rsa.dmq1())?,
            iq: w(rsa.iqmp())?,
        })
    }

    pub fn bits(&self) -> usize {
        self.bits
    }
}

/// Big-endian bytes → `words` little-endian 64-bit words.
fn be_to_words(be: &[u8], words: usize) -> Vec<u64> {
    let mut out = vec![0u64; words];
    for (k, &b) in be.iter().rev().enumerate() {
        if k / 8 < words {
            out[k / 8] |= (b as u64) << (8 * (k % 8));
        }
    }
    out
}

/// Eight lanes of RSA-CRT with crypto_mb, ready to call.
pub struct RsaCrtBatch<'a> {
    lib: &'a CryptoMb,
    bits: usize,
    method: *const c_void,
    buf: Vec<u8>,
    p: [*const u64; 8],
    q: [*const u64; 8],
    dp: [*const u64; 8],
    dq: [*const u64; 8],
    iq: [*const u64; 8],
    _keys: std::marker::PhantomData<&'a RsaCrtKey>,
}

impl RsaCrtBatch<'_> {
    /// `out[i] = input[i]^d_i mod n_i`; each input and output is `bits/8` big-endian bytes.
    pub fn private_crt(
        &mut self,
        input: &[&[u8]; 8],
        out: &mut [Vec<u8>; 8],
    ) -> Result<(), CallError> {
        let len = self.bits / 8;
        if input.iter().any(|x| x.len() != len) {
            return Err(CallError::Input(format!("inputs must be {len} bytes")));
        }
        for o in out.iter_mut() {
            o.resize(len, 0);
        }
        let from: [*const u8; 8] = std::array::from_fn(|i| input[i].as_ptr());
        let to: [*mut u8; 8] = std::array::from_fn(|i| out[i].as_mut_ptr());
        // SAFETY: eight valid pointers each — inputs and outputs of `bits/8` bytes, key parts of
        // `bits/128` words (checked at construction: the keys are borrowed for 'a) — and a
        // scratch buffer of the size the method asked for; all outlive the call.
        let st = unsafe {
            (self.lib.rsa_crt)(
                from.as_ptr(),
                to.as_ptr(),
                self.p.as_ptr(),
                self.q.as_ptr(),
                self.dp.as_ptr(),
                self.dq.as_ptr(),
                self.iq.as_ptr(),
                self.bits as c_int,
                self.method,
                self.buf.as_mut_ptr(),
            )
        };
        if st == 0 {
            Ok(())
        } else {
            Err(CallError::Status(st))
        }
    }
}

/// Inputs of one crypto_mb ECDSA P-256 batch, in its formats.
pub struct EcdsaInputs {
    digest: [[u8; 32]; 8],
    k: [[u64; 4]; 8],
    d: [[u64; 4]; 8],
}

impl EcdsaInputs {
    /// From big-endian 32-byte digests, nonces and private scalars.
    pub fn new(digest: &[[u8; 32]; 8], k: &[[u8; 32]; 8], d: &[[u8; 32]; 8]) -> EcdsaInputs {
        let words = |x: &[u8; 32]| -> [u64; 4] { be_to_words(x, 4).try_into().expect("4 words") };
        EcdsaInputs { digest: *digest, k: k.each_ref().map(words), d: d.each_ref().map(words) }
    }
}

/// Outputs of one crypto_mb ECDSA batch: r and s per lane, 32 big-endian bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EcdsaOutputs {
    pub r: [[u8; 32]; 8],
    pub s: [[u8; 32]; 8],
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_little_endian() {
        let mut be = [0u8; 16];
        be[15] = 1;
        be[7] = 2;
        assert_eq!(be_to_words(&be, 2), vec![1, 2]);
    }

    #[test]
    fn candidates_start_with_explicit_then_env() {
        let c = candidates(Some(Path::new("/nonexistent/libx.so")));
        assert_eq!(c[0], PathBuf::from("/nonexistent/libx.so"));
        assert!(c.iter().any(|p| p == Path::new("libcrypto_mb.so")), "{c:?}");
    }

    #[test]
    fn absent_library_is_an_error_with_the_install_hint() {
        // An explicit path that does not exist is skipped; whether the rest loads depends on the
        // machine, but the error (if any) must say how to install.
        if let Err(e) = CryptoMb::load(Some(Path::new("/nonexistent/libcrypto_mb.so"))) {
            assert!(e.to_string().contains("pip install ipp-crypto"), "{e}");
        }
    }
}
