//! The built-in development CA: a root key and certificate kept in a directory (created on first
//! use, or an existing root loaded from PEM + PKCS#8 so that a mesh can share Istio's root), issuing
//! one short-lived leaf certificate per workload identity with rcgen. Keys are BoringSSL keys; rcgen
//! only assembles and signs the certificate through [`BoringKey`].

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use boring::ec::{EcGroup, EcKey};
use boring::hash::MessageDigest;
use boring::nid::Nid;
use boring::pkey::{Id, PKey, Private};
use boring::rsa::Rsa;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyUsagePurpose, PublicKeyData, SanType, SerialNumber, SignatureAlgorithm, SigningKey,
};

use super::Identity;
use super::KeyAlgorithm;

pub const ROOT_CERT_FILE: &str = "ca-cert.pem";
pub const ROOT_KEY_FILE: &str = "ca-key.pem";

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("CA directory {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("CA key {path}: {message}")]
    Key { path: PathBuf, message: String },
    #[error("CA certificate {path}: {message}")]
    Cert { path: PathBuf, message: String },
    #[error("issuing certificate for {identity}: {message}")]
    Issue { identity: String, message: String },
    #[error("key generation: {0}")]
    KeyGen(String),
    #[error("CA request for {identity} failed: {message}")]
    Remote { identity: String, message: String },
    #[error("CA answer for {identity} refused: {message}")]
    BadResponse { identity: String, message: String },
    /// No certificate held: the last request failed and the store waits out its backoff before
    /// the next (callers never start one themselves).
    #[error("no certificate for {identity}: the last request failed ({last}); next attempt in {}ms", retry_in.as_millis())]
    Backoff { identity: String, retry_in: std::time::Duration, last: String },
    /// No certificate held yet: its request was still in flight when the caller stopped waiting.
    #[error("no certificate for {identity} yet: its request is still in flight after {}ms", waited.as_millis())]
    NotYet { identity: String, waited: std::time::Duration },
}

/// A BoringSSL private key usable by rcgen for signing and as a subject public key.
pub struct BoringKey {
    pkey: PKey<Private>,
    public_raw: Vec<u8>,
    alg: &'static SignatureAlgorithm,
}

impl BoringKey {
    pub fn new(pkey: PKey<Private>) -> Result<BoringKey, String> {
        match pkey.id() {
            Id::RSA => {
                let rsa = pkey.rsa().map_err(|e| e.to_string())?;
                let public_raw = rsa.public_key_to_der_pkcs1().map_err(|e| e.to_string())?;
                Ok(BoringKey { pkey, public_raw, alg: &rcgen::PKCS_RSA_SHA256 })
            }
            Id::EC => {
                let ec = pkey.ec_key().map_err(|e| e.to_string())?;
                if ec.group().curve_name() != Some(Nid::X9_62_PRIME256V1) {
                    return Err("only the P-256 curve is supported for EC keys".into());
                }
                let mut ctx = boring::bn::BigNumContext::new().map_err(|e| e.to_string())?;
                let public_raw = ec
                    .public_key()
                    .to_bytes(ec.group(), boring::ec::PointConversionForm::UNCOMPRESSED, &mut ctx)
                    .map_err(|e| e.to_string())?;
                Ok(BoringKey { pkey, public_raw, alg: &rcgen::PKCS_ECDSA_P256_SHA256 })
            }
            other => Err(format!("unsupported key type {other:?}: expected RSA or EC P-256")),
        }
    }

    pub fn pkey(&self) -> &PKey<Private> {
        &self.pkey
    }
}

impl PublicKeyData for BoringKey {
    fn der_bytes(&self) -> &[u8] {
        &self.public_raw
    }
    fn algorithm(&self) -> &'static SignatureAlgorithm {
        self.alg
    }
}

impl SigningKey for BoringKey {
    fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, rcgen::Error> {
        let mut s = boring::sign::Signer::new(MessageDigest::sha256(), &self.pkey)
            .map_err(|_| rcgen::Error::RemoteKeyError)?;
        s.sign_oneshot_to_vec(msg).map_err(|_| rcgen::Error::RemoteKeyError)
    }
}

/// Generates a private key of the given algorithm.
pub fn generate_key(alg: KeyAlgorithm) -> Result<PKey<Private>, CaError> {
    let e = |e: boring::error::ErrorStack| CaError::KeyGen(e.to_string());
    match alg {
        KeyAlgorithm::EcdsaP256 => {
            let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).map_err(e)?;
            PKey::from_ec_key(EcKey::generate(&group).map_err(e)?).map_err(e)
        }
        KeyAlgorithm::Rsa2048 => PKey::from_rsa(Rsa::generate(2048).map_err(e)?).map_err(e),
        KeyAlgorithm::Rsa3072 => PKey::from_rsa(Rsa::generate(3072).map_err(e)?).map_err(e),
        KeyAlgorithm::Rsa4096 => PKey::from_rsa(Rsa::generate(4096).map_err(e)?).map_err(e),
    }
}

/// A certificate issued for one identity, with its private key.
pub struct IssuedCert {
    pub identity: Identity,
    pub cert_der: Vec<u8>,
    pub cert_pem: String,
    pub key: PKey<Private>,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    pub serial: String,
}

/// The development CA.
pub struct DevCa {
    root_pem: String,
    root_der: Vec<u8>,
    issuer: Issuer<'static, BoringKey>,
    dir: PathBuf,
}

impl std::fmt::Debug for DevCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevCa").field("dir", &self.dir).finish_non_exhaustive()
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CaError + '_ {
    move |source| CaError::Io { path: path.to_path_buf(), source }
}

fn random_serial() -> SerialNumber {
    let mut b = [0u8; 16];
    boring::rand::rand_bytes(&mut b).expect("BoringSSL RNG");
    b[0] &= 0x7f; // positive
    b[0] |= 0x01; // no leading zero byte
    SerialNumber::from_slice(&b)
}

impl DevCa {
    /// Loads the root from `dir`, or creates a new ECDSA P-256 root there if none exists. Safe
    /// against several proxies starting at once on the same directory (a lock file serialises
    /// creation).
    pub fn load_or_create(dir: &Path, trust_domain: &str) -> Result<DevCa, CaError> {
        let (cert_path, key_path) = (dir.join(ROOT_CERT_FILE), dir.join(ROOT_KEY_FILE));
        if cert_path.exists() && key_path.exists() {
            // An existing root (possibly a read-only mount, e.g. a Kubernetes Secret): no lock.
            return Self::load(&cert_path, &key_path);
        }
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let lock_path = dir.join(".lock");
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_err(&lock_path))?;
        lock.lock().map_err(io_err(&lock_path))?;
        if !cert_path.exists() && !key_path.exists() {
            Self::create_root(dir, trust_domain)?;
        }
        let r = Self::load(&cert_path, &key_path);
        let _ = lock.unlock();
        r
    }

    fn create_root(dir: &Path, trust_domain: &str) -> Result<(), CaError> {
        let pkey = generate_key(KeyAlgorithm::EcdsaP256)?;
        let key = BoringKey::new(pkey).map_err(CaError::KeyGen)?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, trust_domain);
        dn.push(DnType::CommonName, "mbtunnel development root");
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::minutes(5);
        params.not_after = now + time::Duration::days(3650);
        params.serial_number = Some(random_serial());
        let cert = params.self_signed(&key).map_err(|e| CaError::Cert {
            path: dir.join(ROOT_CERT_FILE),
            message: e.to_string(),
        })?;
        let key_pem = key
            .pkey()
            .private_key_to_pem_pkcs8()
            .map_err(|e| CaError::Key { path: dir.join(ROOT_KEY_FILE), message: e.to_string() })?;
        write_private(&dir.join(ROOT_KEY_FILE), &key_pem)?;
        let cert_path = dir.join(ROOT_CERT_FILE);
        fs::write(&cert_path, cert.pem()).map_err(io_err(&cert_path))?;
        tracing::info!(dir = %dir.display(), "created development CA root");
        Ok(())
    }

    /// Loads an existing root certificate (PEM) and key (PEM, PKCS#8 or traditional).
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<DevCa, CaError> {
        let key_pem = fs::read(key_path).map_err(io_err(key_path))?;
        let pkey = PKey::private_key_from_pem(&key_pem).map_err(|e| CaError::Key {
            path: key_path.into(),
            message: format!("not a PEM private key: {e}"),
        })?;
        let key = BoringKey::new(pkey)
            .map_err(|message| CaError::Key { path: key_path.into(), message })?;
        let root_pem = fs::read_to_string(cert_path).map_err(io_err(cert_path))?;
        let x = boring::x509::X509::from_pem(root_pem.as_bytes()).map_err(|e| CaError::Cert {
            path: cert_path.into(),
            message: format!("not a PEM certificate: {e}"),
        })?;
        let cert_pub = x.public_key().and_then(|p| p.public_key_to_der()).ok();
        let key_pub = key.pkey().public_key_to_der().ok();
        if cert_pub.is_none() || cert_pub != key_pub {
            return Err(CaError::Cert {
                path: cert_path.into(),
                message: format!("does not match the key in {}", key_path.display()),
            });
        }
        let root_der = x
            .to_der()
            .map_err(|e| CaError::Cert { path: cert_path.into(), message: e.to_string() })?;
        let issuer = Issuer::from_ca_cert_pem(&root_pem, key)
            .map_err(|e| CaError::Cert { path: cert_path.into(), message: e.to_string() })?;
        Ok(DevCa {
            root_pem,
            root_der,
            issuer,
            dir: cert_path.parent().unwrap_or(Path::new(".")).to_path_buf(),
        })
    }

    pub fn root_pem(&self) -> &str {
        &self.root_pem
    }

    pub fn root_der(&self) -> &[u8] {
        &self.root_der
    }

    /// The directory the root was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Issues a leaf certificate for `identity` with a fresh key of algorithm `alg`.
    pub fn issue(
        &self,
        identity: &Identity,
        alg: KeyAlgorithm,
        lifetime: Duration,
    ) -> Result<IssuedCert, CaError> {
        let err = |message: String| CaError::Issue { identity: identity.to_string(), message };
        let pkey = generate_key(alg)?;
        let subject = BoringKey::new(pkey).map_err(err)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        let uri = rcgen::string::Ia5String::try_from(identity.to_string())
            .map_err(|e| err(e.to_string()))?;
        params.subject_alt_names = vec![SanType::URI(uri)];
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages =
            vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        params.extended_key_usages =
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let now = SystemTime::now();
        // Allow for small clock skew between nodes.
        let not_before = now - Duration::from_secs(60);
        let not_after = now + lifetime;
        params.not_before = time::OffsetDateTime::from(not_before);
        params.not_after = time::OffsetDateTime::from(not_after);
        let serial = random_serial();
        let serial_hex = serial.as_ref().iter().map(|b| format!("{b:02x}")).collect::<String>();
        params.serial_number = Some(serial);
        let cert = params.signed_by(&subject, &self.issuer).map_err(|e| err(e.to_string()))?;
        Ok(IssuedCert {
            identity: identity.clone(),
            cert_der: cert.der().to_vec(),
            cert_pem: cert.pem(),
            key: subject.pkey,
            not_before,
            not_after,
            serial: serial_hex,
        })
    }
}

fn write_private(path: &Path, data: &[u8]) -> Result<(), CaError> {
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts.open(path).map_err(io_err(path))?;
    f.write_all(data).map_err(io_err(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("mbt-ca-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn creates_then_reloads_root_and_issues() {
        let dir = tmpdir("a");
        let ca = DevCa::load_or_create(&dir, "cluster.local").unwrap();
        let ca2 = DevCa::load_or_create(&dir, "cluster.local").unwrap();
        assert_eq!(ca.root_der(), ca2.root_der(), "second start reuses the root");
        let id: Identity = "spiffe://cluster.local/ns/ns1/sa/sa1".parse().unwrap();
        for alg in [KeyAlgorithm::EcdsaP256, KeyAlgorithm::Rsa2048] {
            let c = ca2.issue(&id, alg, Duration::from_secs(3600)).unwrap();
            let x = boring::x509::X509::from_der(&c.cert_der).unwrap();
            let root = boring::x509::X509::from_der(ca.root_der()).unwrap();
            assert!(x.verify(&root.public_key().unwrap()).unwrap(), "signed by the root");
            let uris = crate::tls::spiffe_ids_of(&c.cert_der).unwrap();
            assert_eq!(uris, vec![id.clone()]);
            assert_eq!(
                x.public_key().unwrap().public_key_to_der().unwrap(),
                c.key.public_key_to_der().unwrap()
            );
        }
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn mismatched_key_is_reported() {
        let a = tmpdir("b1");
        let b = tmpdir("b2");
        DevCa::load_or_create(&a, "cluster.local").unwrap();
        DevCa::load_or_create(&b, "cluster.local").unwrap();
        let e = DevCa::load(&a.join(ROOT_CERT_FILE), &b.join(ROOT_KEY_FILE)).unwrap_err();
        assert!(e.to_string().contains("does not match"), "{e}");
        let e = DevCa::load(&a.join("nope.pem"), &a.join(ROOT_KEY_FILE)).unwrap_err();
        assert!(e.to_string().contains("nope.pem"), "{e}");
        let _ = fs::remove_dir_all(&a);
        let _ = fs::remove_dir_all(&b);
    }

    #[test]
    fn loads_rsa_root_as_istio_uses() {
        // An existing RSA-2048 root (as istiod's) in PKCS#8 is accepted and issues P-256 leaves.
        let dir = tmpdir("c");
        fs::create_dir_all(&dir).unwrap();
        let pkey = generate_key(KeyAlgorithm::Rsa2048).unwrap();
        let key = BoringKey::new(pkey).unwrap();
        let mut p = CertificateParams::default();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign];
        p.serial_number = Some(random_serial());
        let cert = p.self_signed(&key).unwrap();
        fs::write(dir.join(ROOT_CERT_FILE), cert.pem()).unwrap();
        fs::write(dir.join(ROOT_KEY_FILE), key.pkey().private_key_to_pem_pkcs8().unwrap()).unwrap();
        let ca = DevCa::load_or_create(&dir, "cluster.local").unwrap();
        let id: Identity = "spiffe://cluster.local/ns/a/sa/b".parse().unwrap();
        let c = ca.issue(&id, KeyAlgorithm::EcdsaP256, Duration::from_secs(600)).unwrap();
        let x = boring::x509::X509::from_der(&c.cert_der).unwrap();
        assert!(x.verify(key.pkey()).unwrap());
        let _ = fs::remove_dir_all(&dir);
    }
}
