//! Certificate store: one certificate and key per identity the node serves, requested from a
//! [`CertSource`] on first use (one request per identity however many handshakes wait for it;
//! after a failure, the next only when its backoff ends, however many callers ask), renewed at
//! half of its lifetime counted from when it was issued (with jitter and a floor), retried with
//! backoff while the CA is unreachable — the current certificate keeps serving until it
//! expires — and forgotten when its workloads leave. Published through `tokio::sync::watch`: a
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
/// Retry after a failed first request (no certificate held yet): doubling from the first to
/// the last.
pub const FIRST_RETRY_FIRST: Duration = Duration::from_millis(200);
pub const FIRST_RETRY_MAX: Duration = Duration::from_secs(30);

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
    /// No certificate held yet; the store's request for one is in flight.
    Pending,
    Ready(Arc<CertBundle>),
    /// No certificate held: the last request failed. The store tries again at `retry_at` (no
    /// caller can make it try sooner); until then callers get [`CaError::Backoff`].
    Failed {
        error: String,
        retry_at: SystemTime,
    },
}

struct Entry {
    tx: watch::Sender<Slot>,
    /// Ready: when to renew. Failed: when to try again.
    renew_at: SystemTime,
    /// Consecutive failures (of renewals while Ready, of requests otherwise).
    failures: u32,
    /// Tells a request's result apart from one for an entry forgotten and made again.
    generation: u64,
}

/// The backoff of an identity forgotten while it had no certificate, so that asking again
/// (a pod ADD retried, a workload that flaps) resumes it instead of starting a request at once.
struct Remembered {
    failures: u32,
    retry_at: SystemTime,
    error: String,
}

/// The wait before the next first request after `failures` consecutive failures.
pub fn first_retry_after(failures: u32) -> Duration {
    FIRST_RETRY_FIRST
        .saturating_mul(1 << failures.clamp(1, 17).saturating_sub(1))
        .min(FIRST_RETRY_MAX)
}

/// Certificate store over a [`CertSource`]: the one place that asks the source for
/// certificates. First requests run on a task of their own (so a caller that stops waiting does
/// not cancel one), one per identity at a time, and after a failure not before the backoff
/// ([`FIRST_RETRY_FIRST`] doubling to [`FIRST_RETRY_MAX`]) has passed.
pub struct CertStore {
    source: Arc<dyn CertSource>,
    entries: Mutex<HashMap<Identity, Entry>>,
    remembered: Mutex<HashMap<Identity, Remembered>>,
    generation: std::sync::atomic::AtomicU64,
    changed: tokio::sync::Notify,
    /// Bumped whenever a slot changes (the manager's readiness wakes on it).
    version: watch::Sender<u64>,
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
            remembered: Mutex::new(HashMap::new()),
            generation: Default::default(),
            changed: tokio::sync::Notify::new(),
            version: watch::channel(0).0,
        }
    }

    pub fn source(&self) -> &Arc<dyn CertSource> {
        &self.source
    }

    /// Changes of any identity's slot, as a counter.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    fn changed(&self) {
        self.version.send_modify(|v| *v += 1);
        self.changed.notify_one();
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

    /// Asks for a certificate for `id` and returns its channel without waiting. Starts a
    /// request only when none is held, none is in flight and no backoff is running: asking
    /// again, however often, never makes more requests than the backoff allows.
    pub fn request(self: &Arc<Self>, id: &Identity) -> watch::Receiver<Slot> {
        let mut entries = self.entries.lock().unwrap();
        if !entries.contains_key(id) {
            let generation = self.generation.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let (tx, _) = watch::channel(Slot::Pending);
            let mut e = Entry { tx, renew_at: SystemTime::UNIX_EPOCH, failures: 0, generation };
            match self.remembered.lock().unwrap().remove(id) {
                // Forgotten during a backoff: the backoff goes on.
                Some(r) => {
                    e.failures = r.failures;
                    e.renew_at = r.retry_at;
                    e.tx.send_replace(Slot::Failed { error: r.error, retry_at: r.retry_at });
                }
                None => self.spawn_attempt(id, generation),
            }
            let rx = e.tx.subscribe();
            entries.insert(id.clone(), e);
            drop(entries);
            self.changed();
            return rx;
        }
        let e = entries.get_mut(id).expect("checked above");
        let due = matches!(&*e.tx.borrow(), Slot::Failed { retry_at, .. } if *retry_at <= SystemTime::now());
        if due {
            e.tx.send_replace(Slot::Pending);
            let generation = e.generation;
            self.spawn_attempt(id, generation);
        }
        let rx = e.tx.subscribe();
        drop(entries);
        if due {
            self.changed();
        }
        rx
    }

    /// One request for an entry that holds no certificate, on a task of its own.
    fn spawn_attempt(self: &Arc<Self>, id: &Identity, generation: u64) {
        let (store, id) = (self.clone(), id.clone());
        tokio::spawn(async move {
            let r = store.issue(&id).await;
            let mut entries = store.entries.lock().unwrap();
            let Some(e) = entries.get_mut(&id).filter(|e| e.generation == generation) else {
                return;
            };
            match r {
                Ok(b) => {
                    e.renew_at = b.refresh_at_jittered();
                    e.failures = 0;
                    e.tx.send_replace(Slot::Ready(b));
                }
                // A renewal made meanwhile may have put a certificate in: it stays.
                Err(_) if !matches!(&*e.tx.borrow(), Slot::Pending) => return,
                Err(err) => {
                    e.failures += 1;
                    let wait = first_retry_after(e.failures);
                    let retry_at = SystemTime::now() + wait;
                    e.renew_at = retry_at;
                    tracing::warn!(identity = %id, error = %err, failures = e.failures,
                        retry_in_ms = wait.as_millis() as u64,
                        "cannot get a certificate; asking again after the backoff");
                    e.tx.send_replace(Slot::Failed { error: err.to_string(), retry_at });
                }
            }
            drop(entries);
            store.changed();
        });
    }

    /// The current certificate for `id`, requested on first use ([`request`](Self::request))
    /// and waited for while its request is in flight. Concurrent first uses of one identity
    /// share a single request; during a backoff the answer is [`CaError::Backoff`] at once.
    pub async fn fetch(self: &Arc<Self>, id: &Identity) -> Result<Arc<CertBundle>, CaError> {
        let rx = self.request(id);
        Self::settled(id, rx).await
    }

    /// [`fetch`](Self::fetch), waiting at most `bound` for a request in flight
    /// ([`CaError::NotYet`] after that; the request goes on).
    pub async fn fetch_within(
        self: &Arc<Self>,
        id: &Identity,
        bound: Duration,
    ) -> Result<Arc<CertBundle>, CaError> {
        let rx = self.request(id);
        match tokio::time::timeout(bound, Self::settled(id, rx)).await {
            Ok(r) => r,
            Err(_) => Err(CaError::NotYet { identity: id.to_string(), waited: bound }),
        }
    }

    async fn settled(
        id: &Identity,
        mut rx: watch::Receiver<Slot>,
    ) -> Result<Arc<CertBundle>, CaError> {
        let slot = rx.wait_for(|s| !matches!(s, Slot::Pending)).await.map(|s| s.clone());
        match slot {
            Ok(Slot::Ready(b)) => Ok(b),
            Ok(Slot::Failed { error, retry_at }) => Err(CaError::Backoff {
                identity: id.to_string(),
                retry_in: retry_at.duration_since(SystemTime::now()).unwrap_or_default(),
                last: error,
            }),
            // Forgotten while pending.
            _ => Err(CaError::Remote {
                identity: id.to_string(),
                message: "identity was removed while its certificate was requested".into(),
            }),
        }
    }

    /// Subscribes to certificate changes of `id` (requesting one if needed).
    pub async fn subscribe(
        self: &Arc<Self>,
        id: &Identity,
    ) -> Result<watch::Receiver<Slot>, CaError> {
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
                    let generation =
                        self.generation.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    entries.insert(
                        id.clone(),
                        Entry { tx, renew_at: b.refresh_at_jittered(), failures: 0, generation },
                    );
                }
            },
            Err(err) => {
                if let Some(e) =
                    entries.get_mut(id).filter(|e| matches!(&*e.tx.borrow(), Slot::Ready(_)))
                {
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
        self.changed();
        r
    }

    /// Drops the certificate of an identity no workload of this node uses any more. A backoff
    /// running for it is remembered, so asking for it again soon does not skip the backoff.
    pub fn forget(&self, id: &Identity) -> bool {
        let gone = self.entries.lock().unwrap().remove(id);
        let Some(e) = gone else { return false };
        let now = SystemTime::now();
        let mut remembered = self.remembered.lock().unwrap();
        // Backoffs that ran out long ago are forgotten too.
        remembered.retain(|_, r| r.retry_at + FIRST_RETRY_MAX > now);
        if let Slot::Failed { error, retry_at } = &*e.tx.borrow() {
            remembered.insert(
                id.clone(),
                Remembered { failures: e.failures, retry_at: *retry_at, error: error.clone() },
            );
        }
        drop(remembered);
        tracing::info!(identity = %id, "certificate forgotten: no local workload uses it");
        self.changed();
        true
    }

    /// Identities held (ready, pending or backing off).
    pub fn identities(&self) -> Vec<Identity> {
        let mut v: Vec<_> = self.entries.lock().unwrap().keys().cloned().collect();
        v.sort();
        v
    }

    /// Every identity held with its slot (ready, pending, failed), sorted by identity: the
    /// certificates section of the config dump.
    pub fn slots(&self) -> Vec<(Identity, Slot)> {
        let entries = self.entries.lock().unwrap();
        let mut v: Vec<_> =
            entries.iter().map(|(id, e)| (id.clone(), e.tx.borrow().clone())).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
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
    /// failure), and asks again for the ones whose first requests failed once their backoff
    /// ends. Runs until dropped.
    pub async fn run_renewal(self: Arc<Self>) {
        loop {
            let notified = self.changed.notified();
            let next = {
                let entries = self.entries.lock().unwrap();
                entries
                    .iter()
                    .filter_map(|(id, e)| match &*e.tx.borrow() {
                        Slot::Ready(_) => Some((e.renew_at, id.clone(), true)),
                        Slot::Failed { .. } => Some((e.renew_at, id.clone(), false)),
                        Slot::Pending => None,
                    })
                    .min_by_key(|(t, _, _)| *t)
            };
            match next {
                None => notified.await,
                Some((at, id, held)) => {
                    let wait = at.duration_since(SystemTime::now()).unwrap_or_default();
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {
                            if held {
                                let _ = self.renew(&id).await;
                            } else {
                                self.request(&id);
                            }
                        }
                        _ = notified => {}
                    }
                }
            }
        }
    }
}

/// The store's certificates as metrics, read at each scrape:
/// `mbtunnel_certificates{state="available|pending|failed"}` (identities held in each state) and
/// `mbtunnel_certificate_expiry_seconds` (time until the soonest certificate held expires; absent
/// when none is). Ends with the store (a weak reference).
pub struct CertCollector(pub std::sync::Weak<CertStore>);

impl std::fmt::Debug for CertCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CertCollector")
    }
}

impl prometheus_client::collector::Collector for CertCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::gauge::ConstGauge;
        let Some(store) = self.0.upgrade() else { return Ok(()) };
        let (mut available, mut pending, mut failed) = (0i64, 0i64, 0i64);
        let mut soonest: Option<SystemTime> = None;
        for (_, slot) in store.slots() {
            match slot {
                Slot::Ready(b) => {
                    available += 1;
                    soonest = Some(soonest.map_or(b.not_after, |s| s.min(b.not_after)));
                }
                Slot::Pending => pending += 1,
                Slot::Failed { .. } => failed += 1,
            }
        }
        let mut e = encoder.encode_descriptor(
            "mbtunnel_certificates",
            "Workload certificates held, by state: available, pending (first request in flight), \
             failed (backing off)",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (state, n) in [("available", available), ("pending", pending), ("failed", failed)] {
            let g = ConstGauge::new(n);
            g.encode(e.encode_family(&[("state", state)])?)?;
        }
        if let Some(t) = soonest {
            let left = t.duration_since(SystemTime::now()).map(|d| d.as_secs() as i64).unwrap_or(0);
            let g = ConstGauge::new(left);
            g.encode(encoder.encode_descriptor(
                "mbtunnel_certificate_expiry_seconds",
                "Seconds until the soonest workload certificate held expires",
                None,
                g.metric_type(),
            )?)?;
        }
        Ok(())
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

    /// Moves the end of `id`'s backoff.
    fn set_retry_at(store: &CertStore, id: &Identity, at: SystemTime) {
        let mut entries = store.entries.lock().unwrap();
        let e = entries.get_mut(id).unwrap();
        let Slot::Failed { error, .. } = e.tx.borrow().clone() else { panic!("not failed") };
        e.renew_at = at;
        e.tx.send_replace(Slot::Failed { error, retry_at: at });
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
        // A new identity during the outage fails, and the failure is remembered (not left
        // pending, not dropped): asking again during the backoff gets the backoff at once and
        // makes no request, even once the CA is back.
        let other: Identity = "spiffe://cluster.local/ns/a/sa/c".parse().unwrap();
        let calls = src.calls.load(Ordering::SeqCst);
        assert!(store.fetch(&other).await.is_err());
        assert_eq!(src.calls.load(Ordering::SeqCst), calls + 1);
        assert_eq!(store.identities(), vec![id.clone(), other.clone()]);
        src.down.store(false, Ordering::SeqCst);
        // (A long backoff, so that a slow machine cannot see this one end mid-test.)
        let later = SystemTime::now() + Duration::from_secs(3600);
        set_retry_at(&store, &other, later);
        for _ in 0..100 {
            let e = store.fetch(&other).await.unwrap_err();
            assert!(matches!(e, CaError::Backoff { .. }), "{e}");
        }
        assert_eq!(src.calls.load(Ordering::SeqCst), calls + 1, "no request during the backoff");
        // Forgetting it keeps the backoff: asking again soon still waits it out.
        assert!(store.forget(&other));
        let Slot::Failed { retry_at, .. } = store.request(&other).borrow().clone() else {
            panic!("a forgotten failure is remembered");
        };
        assert_eq!(src.calls.load(Ordering::SeqCst), calls + 1);
        assert_eq!(retry_at, later);
        // Once the backoff ends, the next ask makes one request, and it succeeds.
        set_retry_at(&store, &other, SystemTime::now());
        assert!(store.fetch(&other).await.is_ok());
        assert_eq!(src.calls.load(Ordering::SeqCst), calls + 2);
        assert!(store.forget(&other));
        assert!(store.current(&other).is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn first_request_backoff_doubles_to_its_cap() {
        assert_eq!(first_retry_after(1), FIRST_RETRY_FIRST);
        assert_eq!(first_retry_after(2), FIRST_RETRY_FIRST * 2);
        assert_eq!(first_retry_after(3), FIRST_RETRY_FIRST * 4);
        assert_eq!(first_retry_after(10), FIRST_RETRY_MAX);
        assert_eq!(first_retry_after(u32::MAX), FIRST_RETRY_MAX);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_store_asks_again_after_the_backoff_by_itself() {
        let dir = std::env::temp_dir().join(format!("mbt-store-retry-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ca = DevCa::load_or_create(&dir, "cluster.local").unwrap();
        let src = Arc::new(Flaky {
            inner: DevCaSource::new(ca, KeyAlgorithm::EcdsaP256, Duration::from_secs(3600)),
            calls: AtomicUsize::new(0),
            down: true.into(),
        });
        let store = Arc::new(CertStore::with_source(src.clone()));
        let id: Identity = "spiffe://cluster.local/ns/a/sa/b".parse().unwrap();
        assert!(store.fetch(&id).await.is_err());
        src.down.store(false, Ordering::SeqCst);
        // Nobody asks again: the store's own task does when the backoff ends.
        let mut rx = store.entries.lock().unwrap()[&id].tx.subscribe();
        let task = tokio::spawn(store.clone().run_renewal());
        // A guard against a hang, not a timing assertion.
        let ready = tokio::time::timeout(
            Duration::from_secs(20),
            rx.wait_for(|s| matches!(s, Slot::Ready(_))),
        )
        .await;
        assert!(matches!(ready, Ok(Ok(_))), "the store's task asked again");
        assert_eq!(src.calls.load(Ordering::SeqCst), 2);
        task.abort();
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
