//! Certificate store: one certificate and key per identity the node serves, fetched from a
//! [`CertSource`] on first use (one request per identity however many handshakes wait for it),
//! renewed at half of its lifetime counted from when it was issued (with jitter and a floor),
//! retried with backoff while the CA is unreachable — the current certificate keeps serving until
//! it expires — and forgotten when its workloads leave. Published through `tokio::sync::watch`: a
//! renewal only affects new handshakes; live connections keep the TLS session they have.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use boring::pkey::{PKey, Private};
use tokio::sync::watch;

use super::ca::{CaError, DevCa};
use super::source::{CertSource, DevCaSource};
use super::Identity;
use super::KeyAlgorithm;

/// The shortest time between two issuances for one identity: a CA that hands out very short
/// lifetimes cannot make the node re-issue in a loop.
pub const MIN_RENEW_INTERVAL: Duration = Duration::from_secs(10);
/// Retry after a failed renewal: doubling from the first to the last.
pub const RETRY_FIRST: Duration = Duration::from_secs(1);
pub const RETRY_MAX: Duration = Duration::from_secs(60);

/// A certificate with its key, as published to TLS.
pub struct CertBundle {
    pub identity: Identity,
    pub cert_der: Vec<u8>,
    /// Intermediates sent after the leaf (empty when the leaf is signed by a root).
    pub chain_der: Vec<Vec<u8>>,
    pub key: PKey<Private>,
    /// The trust bundle: roots that verify peers.
    pub roots_der: Vec<Vec<u8>>,
    /// When this node received it (not_before may be back-dated for clock skew).
    pub issued_at: SystemTime,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    pub serial: String,
    pub algorithm: KeyAlgorithm,
}

impl CertBundle {
    /// Half of the lifetime counted from issuance, never sooner than [`MIN_RENEW_INTERVAL`].
    pub fn refresh_at(&self) -> SystemTime {
        let life = self.not_after.duration_since(self.issued_at).unwrap_or_default();
        self.issued_at + (life / 2).max(MIN_RENEW_INTERVAL)
    }

    /// [`refresh_at`](Self::refresh_at) moved earlier by up to 10 % of the half-life, so that
    /// certificates issued together do not all renew at the same instant.
    pub fn refresh_at_jittered(&self) -> SystemTime {
        let half = self.refresh_at().duration_since(self.issued_at).unwrap_or_default();
        let spread = half / 10;
        let mut b = [0u8; 4];
        let _ = boring::rand::rand_bytes(&mut b);
        let frac = u32::from_le_bytes(b) as f64 / u32::MAX as f64;
        let at = self.refresh_at() - spread.mul_f64(frac);
        at.max(self.issued_at + MIN_RENEW_INTERVAL)
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

/// What one identity's channel carries.
#[derive(Clone, Debug)]
pub enum Slot {
    /// The first request is in flight.
    Pending,
    Ready(Arc<CertBundle>),
    /// The first request failed (waiters get the error; the next fetch tries again).
    Failed(String),
}

struct Entry {
    tx: watch::Sender<Slot>,
    renew_at: SystemTime,
    failures: u32,
}

/// Certificate store over a [`CertSource`].
pub struct CertStore {
    source: Arc<dyn CertSource>,
    entries: Mutex<HashMap<Identity, Entry>>,
    changed: tokio::sync::Notify,
}

impl CertStore {
    /// A store over the development CA.
    pub fn new(ca: DevCa, algorithm: KeyAlgorithm, lifetime: Duration) -> CertStore {
        CertStore::with_source(Arc::new(DevCaSource::new(ca, algorithm, lifetime)))
    }

    pub fn with_source(source: Arc<dyn CertSource>) -> CertStore {
        CertStore {
            source,
            entries: Mutex::new(HashMap::new()),
            changed: tokio::sync::Notify::new(),
        }
    }

    pub fn source(&self) -> &Arc<dyn CertSource> {
        &self.source
    }

    async fn issue(&self, id: &Identity) -> Result<Arc<CertBundle>, CaError> {
        let b = self.source.issue(id).await?;
        tracing::info!(identity = %id, serial = %b.serial, algorithm = ?b.algorithm,
            expires = %humantime(b.not_after), renew_at = %humantime(b.refresh_at()),
            source = %self.source.describe(), "workload certificate issued");
        Ok(Arc::new(b))
    }

    /// The current certificate for `id` if one is held, without waiting.
    pub fn current(&self, id: &Identity) -> Option<Arc<CertBundle>> {
        match &*self.entries.lock().unwrap().get(id)?.tx.borrow() {
            Slot::Ready(b) => Some(b.clone()),
            _ => None,
        }
    }

    /// The current certificate for `id`, requesting one on first use. Concurrent first uses of
    /// one identity share a single request.
    pub async fn fetch(&self, id: &Identity) -> Result<Arc<CertBundle>, CaError> {
        let existing = {
            let mut entries = self.entries.lock().unwrap();
            match entries.get(id) {
                Some(e) => Some(e.tx.subscribe()),
                None => {
                    let (tx, _) = watch::channel(Slot::Pending);
                    entries.insert(
                        id.clone(),
                        Entry { tx, renew_at: SystemTime::UNIX_EPOCH, failures: 0 },
                    );
                    None
                }
            }
        };
        let Some(mut rx) = existing else { return self.first_issue(id).await };
        let slot = rx.wait_for(|s| !matches!(s, Slot::Pending)).await.map(|s| s.clone());
        match slot {
            Ok(Slot::Ready(b)) => Ok(b),
            Ok(Slot::Failed(message)) => Err(CaError::Remote { identity: id.to_string(), message }),
            // Forgotten while pending.
            _ => Err(CaError::Remote {
                identity: id.to_string(),
                message: "identity was removed while its certificate was requested".into(),
            }),
        }
    }

    async fn first_issue(&self, id: &Identity) -> Result<Arc<CertBundle>, CaError> {
        let r = self.issue(id).await;
        let mut entries = self.entries.lock().unwrap();
        match (&r, entries.get_mut(id)) {
            (Ok(b), Some(e)) => {
                e.renew_at = b.refresh_at_jittered();
                e.tx.send_replace(Slot::Ready(b.clone()));
            }
            (Err(err), Some(e)) => {
                e.tx.send_replace(Slot::Failed(err.to_string()));
                entries.remove(id);
            }
            (_, None) => {}
        }
        drop(entries);
        self.changed.notify_one();
        r
    }

    /// Subscribes to certificate changes of `id` (requesting one if needed).
    pub async fn subscribe(&self, id: &Identity) -> Result<watch::Receiver<Slot>, CaError> {
        self.fetch(id).await?;
        let entries = self.entries.lock().unwrap();
        entries.get(id).map(|e| e.tx.subscribe()).ok_or_else(|| CaError::Remote {
            identity: id.to_string(),
            message: "identity was removed".into(),
        })
    }

    /// Replaces the certificate of `id` now. On failure the current one stays.
    pub async fn renew(&self, id: &Identity) -> Result<Arc<CertBundle>, CaError> {
        let r = self.issue(id).await;
        let mut entries = self.entries.lock().unwrap();
        match &r {
            Ok(b) => match entries.get_mut(id) {
                Some(e) => {
                    e.renew_at = b.refresh_at_jittered();
                    e.failures = 0;
                    e.tx.send_replace(Slot::Ready(b.clone()));
                }
                None => {
                    let (tx, _) = watch::channel(Slot::Ready(b.clone()));
                    entries.insert(
                        id.clone(),
                        Entry { tx, renew_at: b.refresh_at_jittered(), failures: 0 },
                    );
                }
            },
            Err(err) => {
                if let Some(e) = entries.get_mut(id) {
                    e.failures += 1;
                    let backoff = RETRY_FIRST
                        .saturating_mul(1 << e.failures.min(16).saturating_sub(1))
                        .min(RETRY_MAX);
                    e.renew_at = SystemTime::now() + backoff;
                    let until = match &*e.tx.borrow() {
                        Slot::Ready(b) => humantime(b.not_after),
                        _ => "-".into(),
                    };
                    tracing::warn!(identity = %id, error = %err, retry_in_ms = backoff.as_millis() as u64,
                        serving_until = %until, "certificate renewal failed; keeping the current certificate");
                }
            }
        }
        drop(entries);
        self.changed.notify_one();
        r
    }

    /// Drops the certificate of an identity no workload of this node uses any more.
    pub fn forget(&self, id: &Identity) -> bool {
        let gone = self.entries.lock().unwrap().remove(id).is_some();
        if gone {
            tracing::info!(identity = %id, "certificate forgotten: no local workload uses it");
            self.changed.notify_one();
        }
        gone
    }

    /// Identities held (ready or pending).
    pub fn identities(&self) -> Vec<Identity> {
        let mut v: Vec<_> = self.entries.lock().unwrap().keys().cloned().collect();
        v.sort();
        v
    }

    /// All current certificates.
    pub fn snapshot(&self) -> Vec<Arc<CertBundle>> {
        let entries = self.entries.lock().unwrap();
        let mut v: Vec<_> = entries
            .values()
            .filter_map(|e| match &*e.tx.borrow() {
                Slot::Ready(b) => Some(b.clone()),
                _ => None,
            })
            .collect();
        v.sort_by(|a, b| a.identity.cmp(&b.identity));
        v
    }

    /// Renews every certificate when it is due (half-life with jitter, or a retry after a
    /// failure). Runs until dropped.
    pub async fn run_renewal(self: Arc<Self>) {
        loop {
            let notified = self.changed.notified();
            let next = {
                let entries = self.entries.lock().unwrap();
                entries
                    .iter()
                    .filter(|(_, e)| matches!(&*e.tx.borrow(), Slot::Ready(_)))
                    .map(|(id, e)| (e.renew_at, id.clone()))
                    .min_by_key(|(t, _)| *t)
            };
            match next {
                None => notified.await,
                Some((at, id)) => {
                    let wait = at.duration_since(SystemTime::now()).unwrap_or_default();
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => { let _ = self.renew(&id).await; }
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
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn dev_store(tag: &str, lifetime: Duration) -> (Arc<CertStore>, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("mbt-store-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ca = DevCa::load_or_create(&dir, "cluster.local").unwrap();
        (Arc::new(CertStore::new(ca, KeyAlgorithm::EcdsaP256, lifetime)), dir)
    }

    #[test]
    fn renewal_counts_from_issuance_with_a_floor() {
        let (store, dir) = dev_store("when", Duration::from_secs(3600));
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let id: Identity = "spiffe://cluster.local/ns/a/sa/b".parse().unwrap();
        let b = rt.block_on(store.fetch(&id)).unwrap();
        // Back-dated not_before does not pull the renewal forward.
        assert!(b.not_before < b.issued_at);
        let half = b.refresh_at().duration_since(b.issued_at).unwrap();
        assert!(half >= Duration::from_secs(1799) && half <= Duration::from_secs(1801), "{half:?}");
        let j = b.refresh_at_jittered().duration_since(b.issued_at).unwrap();
        assert!(j <= half && j >= half.mul_f64(0.9), "{j:?}");
        // A 2-second lifetime still waits the floor.
        let short = CertBundle {
            not_after: b.issued_at + Duration::from_secs(2),
            ..CertBundle::clone_for_test(&b)
        };
        assert_eq!(short.refresh_at(), short.issued_at + MIN_RENEW_INTERVAL);
        let _ = std::fs::remove_dir_all(&dir);
    }

    impl CertBundle {
        fn clone_for_test(b: &CertBundle) -> CertBundle {
            CertBundle {
                identity: b.identity.clone(),
                cert_der: b.cert_der.clone(),
                chain_der: b.chain_der.clone(),
                key: b.key.clone(),
                roots_der: b.roots_der.clone(),
                issued_at: b.issued_at,
                not_before: b.not_before,
                not_after: b.not_after,
                serial: b.serial.clone(),
                algorithm: b.algorithm,
            }
        }
    }

    /// A source that counts requests and can be switched off (a CA outage).
    struct Flaky {
        inner: DevCaSource,
        calls: AtomicUsize,
        down: std::sync::atomic::AtomicBool,
    }

    impl CertSource for Flaky {
        fn issue<'a>(
            &'a self,
            id: &'a Identity,
        ) -> futures::future::BoxFuture<'a, Result<CertBundle, CaError>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.down.load(Ordering::SeqCst) {
                return Box::pin(async move {
                    Err(CaError::Remote { identity: id.to_string(), message: "down".into() })
                });
            }
            self.inner.issue(id)
        }
        fn describe(&self) -> String {
            "flaky".into()
        }
        fn holds_ca_key(&self) -> bool {
            false
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn single_flight_outage_and_forget() {
        let dir = std::env::temp_dir().join(format!("mbt-store-flaky-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ca = DevCa::load_or_create(&dir, "cluster.local").unwrap();
        let src = Arc::new(Flaky {
            inner: DevCaSource::new(ca, KeyAlgorithm::EcdsaP256, Duration::from_secs(3600)),
            calls: AtomicUsize::new(0),
            down: Default::default(),
        });
        let store = Arc::new(CertStore::with_source(src.clone()));
        let id: Identity = "spiffe://cluster.local/ns/a/sa/b".parse().unwrap();
        let mut ts = Vec::new();
        for _ in 0..50 {
            let (s, id) = (store.clone(), id.clone());
            ts.push(tokio::spawn(async move { s.fetch(&id).await.unwrap().serial.clone() }));
        }
        let serials: std::collections::HashSet<_> =
            futures::future::join_all(ts).await.into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(serials.len(), 1, "one certificate for all");
        assert_eq!(src.calls.load(Ordering::SeqCst), 1, "one CA request for 50 first uses");
        // Outage: renewal fails, the current certificate keeps serving.
        src.down.store(true, Ordering::SeqCst);
        assert!(store.renew(&id).await.is_err());
        assert_eq!(store.current(&id).unwrap().serial, *serials.iter().next().unwrap());
        // A new identity during the outage fails, and is not left pending.
        let other: Identity = "spiffe://cluster.local/ns/a/sa/c".parse().unwrap();
        assert!(store.fetch(&other).await.is_err());
        assert_eq!(store.identities(), vec![id.clone()]);
        src.down.store(false, Ordering::SeqCst);
        assert!(store.fetch(&other).await.is_ok());
        assert!(store.forget(&other));
        assert!(store.current(&other).is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn renews_when_due_and_publishes() {
        let (store, dir) = dev_store("renew", Duration::from_secs(3600));
        let id: Identity = "spiffe://cluster.local/ns/a/sa/b".parse().unwrap();
        let mut rx = store.subscribe(&id).await.unwrap();
        let first = store.current(&id).unwrap().serial.clone();
        // Make it due now.
        store.entries.lock().unwrap().get_mut(&id).unwrap().renew_at = SystemTime::now();
        let task = tokio::spawn(store.clone().run_renewal());
        tokio::time::timeout(Duration::from_secs(20), rx.changed()).await.unwrap().unwrap();
        assert_ne!(store.current(&id).unwrap().serial, first);
        task.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
