//! Certificate store: one certificate and key per identity the node serves, issued on demand,
//! renewed at half of its lifetime (as ztunnel does) and published through `tokio::sync::watch`.
//! A renewal only affects new handshakes: live connections keep the TLS session they have.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use boring::pkey::{PKey, Private};
use tokio::sync::watch;

use super::ca::{CaError, DevCa};
use super::Identity;
use crate::config::KeyAlgorithm;

/// A certificate with its key, as published to TLS.
pub struct CertBundle {
    pub identity: Identity,
    pub cert_der: Vec<u8>,
    pub key: PKey<Private>,
    pub root_der: Vec<u8>,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    pub serial: String,
    pub algorithm: KeyAlgorithm,
}

impl CertBundle {
    /// When this certificate should be replaced: half of its lifetime.
    pub fn refresh_at(&self) -> SystemTime {
        let life = self.not_after.duration_since(self.not_before).unwrap_or_default();
        self.not_before + life / 2
    }
}

impl std::fmt::Debug for CertBundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("CertBundle")
            .field("identity", &self.identity.to_string())
            .field("serial", &self.serial)
            .finish_non_exhaustive()
    }
}

/// Certificate store over the development CA.
pub struct CertStore {
    ca: DevCa,
    algorithm: KeyAlgorithm,
    lifetime: Duration,
    certs: Mutex<HashMap<Identity, watch::Sender<Arc<CertBundle>>>>,
    changed: tokio::sync::Notify,
}

impl CertStore {
    pub fn new(ca: DevCa, algorithm: KeyAlgorithm, lifetime: Duration) -> CertStore {
        CertStore {
            ca,
            algorithm,
            lifetime,
            certs: Mutex::new(HashMap::new()),
            changed: tokio::sync::Notify::new(),
        }
    }

    pub fn root_der(&self) -> &[u8] {
        self.ca.root_der()
    }

    pub fn root_pem(&self) -> &str {
        self.ca.root_pem()
    }

    fn issue(&self, id: &Identity) -> Result<Arc<CertBundle>, CaError> {
        let c = self.ca.issue(id, self.algorithm, self.lifetime)?;
        tracing::info!(identity = %id, serial = %c.serial, algorithm = ?self.algorithm,
            expires = %humantime(c.not_after), "issued workload certificate");
        Ok(Arc::new(CertBundle {
            identity: c.identity,
            cert_der: c.cert_der,
            key: c.key,
            root_der: self.ca.root_der().to_vec(),
            not_before: c.not_before,
            not_after: c.not_after,
            serial: c.serial,
            algorithm: self.algorithm,
        }))
    }

    /// The current certificate for `id`, issuing one on first use. Blocking (key generation):
    /// call from a blocking context or accept the cost once per identity.
    pub fn fetch(&self, id: &Identity) -> Result<Arc<CertBundle>, CaError> {
        if let Some(tx) = self.certs.lock().unwrap().get(id) {
            return Ok(tx.borrow().clone());
        }
        let bundle = self.issue(id)?;
        let mut certs = self.certs.lock().unwrap();
        let current =
            certs.entry(id.clone()).or_insert_with(|| watch::channel(bundle).0).borrow().clone();
        drop(certs);
        self.changed.notify_one();
        Ok(current)
    }

    /// Subscribes to certificate changes of `id` (issuing one if needed).
    pub fn subscribe(&self, id: &Identity) -> Result<watch::Receiver<Arc<CertBundle>>, CaError> {
        self.fetch(id)?;
        Ok(self.certs.lock().unwrap()[id].subscribe())
    }

    /// Replaces the certificate of `id` now.
    pub fn renew(&self, id: &Identity) -> Result<Arc<CertBundle>, CaError> {
        let bundle = self.issue(id)?;
        let mut certs = self.certs.lock().unwrap();
        match certs.get(id) {
            Some(tx) => {
                tx.send_replace(bundle.clone());
            }
            None => {
                certs.insert(id.clone(), watch::channel(bundle.clone()).0);
            }
        }
        self.changed.notify_one();
        Ok(bundle)
    }

    /// All current certificates.
    pub fn snapshot(&self) -> Vec<Arc<CertBundle>> {
        let mut v: Vec<_> =
            self.certs.lock().unwrap().values().map(|tx| tx.borrow().clone()).collect();
        v.sort_by(|a, b| a.identity.cmp(&b.identity));
        v
    }

    /// Renews every certificate when it reaches half of its lifetime. Runs until dropped.
    pub async fn run_renewal(self: Arc<Self>) {
        loop {
            let next = self
                .snapshot()
                .iter()
                .map(|b| (b.refresh_at(), b.identity.clone()))
                .min_by_key(|(t, _)| *t);
            let notified = self.changed.notified();
            match next {
                None => notified.await,
                Some((at, id)) => {
                    let wait = at.duration_since(SystemTime::now()).unwrap_or_default();
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {
                            let this = self.clone();
                            let r = tokio::task::spawn_blocking(move || this.renew(&id)).await;
                            match r {
                                Ok(Ok(_)) => {}
                                Ok(Err(e)) => {
                                    tracing::error!(error = %e, "certificate renewal failed; retrying in 10s");
                                    tokio::time::sleep(Duration::from_secs(10)).await;
                                }
                                Err(e) => tracing::error!(error = %e, "renewal task failed"),
                            }
                        }
                        _ = notified => {}
                    }
                }
            }
        }
    }
}

/// RFC 3339 rendering of a time, for logs and the config dump.
pub fn humantime(t: SystemTime) -> String {
    time::OffsetDateTime::from(t)
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| "?".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn renews_at_half_life_and_publishes() {
        let dir = std::env::temp_dir().join(format!("mbt-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ca = DevCa::load_or_create(&dir, "cluster.local").unwrap();
        // 62 s lifetime, issued 60 s in the past (clock skew allowance): refresh at +31 s - 60 s,
        // i.e. already due, so the renewal task replaces it at once.
        let store = Arc::new(CertStore::new(ca, KeyAlgorithm::EcdsaP256, Duration::from_secs(62)));
        let id: Identity = "spiffe://cluster.local/ns/a/sa/b".parse().unwrap();
        let mut rx = store.subscribe(&id).unwrap();
        let first = rx.borrow().serial.clone();
        let task = tokio::spawn(store.clone().run_renewal());
        tokio::time::timeout(Duration::from_secs(20), rx.changed()).await.unwrap().unwrap();
        assert_ne!(rx.borrow().serial, first);
        task.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
