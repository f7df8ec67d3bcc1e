//! Where workload certificates come from: the [`CertSource`] trait, with the built-in
//! development CA behind it (local mode) and istiod's CA (`identity::istio`).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::future::BoxFuture;

use super::ca::{CaError, DevCa};
use super::store::CertBundle;
use super::Identity;
use super::KeyAlgorithm;

/// Issues a certificate (with a fresh private key) for one identity.
pub trait CertSource: Send + Sync + 'static {
    fn issue<'a>(&'a self, id: &'a Identity) -> BoxFuture<'a, Result<CertBundle, CaError>>;
    /// One line for logs and the config dump.
    fn describe(&self) -> String;
    /// Whether this process holds a CA private key (true only for the development CA).
    fn holds_ca_key(&self) -> bool;
}

/// The development CA as a certificate source: key generation and signing off the async
/// workers.
pub struct DevCaSource {
    ca: Arc<DevCa>,
    algorithm: KeyAlgorithm,
    lifetime: Duration,
}

impl DevCaSource {
    pub fn new(ca: DevCa, algorithm: KeyAlgorithm, lifetime: Duration) -> DevCaSource {
        DevCaSource { ca: Arc::new(ca), algorithm, lifetime }
    }
}

impl CertSource for DevCaSource {
    fn issue<'a>(&'a self, id: &'a Identity) -> BoxFuture<'a, Result<CertBundle, CaError>> {
        let (ca, alg, life, id) = (self.ca.clone(), self.algorithm, self.lifetime, id.clone());
        Box::pin(async move {
            tokio::task::spawn_blocking(move || {
                let issued_at = SystemTime::now();
                let c = ca.issue(&id, alg, life)?;
                Ok(CertBundle {
                    identity: c.identity,
                    cert_der: c.cert_der,
                    chain_der: Vec::new(),
                    key: c.key,
                    roots_der: vec![ca.root_der().to_vec()],
                    issued_at,
                    not_before: c.not_before,
                    not_after: c.not_after,
                    serial: c.serial,
                    algorithm: alg,
                })
            })
            .await
            .map_err(|e| CaError::KeyGen(format!("issuing task failed: {e}")))?
        })
    }

    fn describe(&self) -> String {
        format!("development CA ({})", self.ca.dir().display())
    }

    fn holds_ca_key(&self) -> bool {
        true
    }
}
