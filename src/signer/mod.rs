//! The shared batching signer. Every TLS handshake's signature goes through it: the `boring`
//! `AsyncPrivateKeyMethod` ([`KeyMethod`]) parks the handshake and queues the request; dedicated
//! signer threads (never tokio workers) take requests per key class (RSA-2048/3072/4096,
//! ECDSA P-256) up to eight at a time and run them on the multi-buffer core.
//!
//! Flush policy: an idle signer thread takes what is queued *now* — batches grow only under load,
//! and a lone handshake waits for no timer. `max_wait` (default 0) lets operators trade latency
//! for fuller batches. Batches of at most `scalar_below` requests (measured per class: 2 for RSA,
//! 1 for ECDSA) go to the BoringSSL single-op path, which is faster than a multi-buffer pass for so
//! few.
//!
//! Backpressure: the queues are bounded; a full signer answers at once with
//! [`SignError::QueueFull`] (the handshake fails and the client retries) instead of letting
//! latency grow without bound. A panicking signer thread fails only its batch and is restarted.
#![forbid(unsafe_code)]

pub mod keys;
pub mod metrics;

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use boring::hash::MessageDigest;
use boring::pkey::{PKey, Private};
use boring::rsa::Padding;
use boring::sign::RsaPssSaltlen;
use boring::ssl::{
    AsyncPrivateKeyMethod, AsyncPrivateKeyMethodError, BoxPrivateKeyMethodFuture, SslRef,
    SslSignatureAlgorithm,
};
use serde::Serialize;
use tokio::sync::oneshot;

use crate::mb::{Backend, MbError};
use keys::MbKey;
pub use keys::{KeyClass, KeyEntry, KeyTable};
pub use metrics::SignerMetrics;
use metrics::{AlgLabels, OpLabels, ReasonLabels};

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SignError {
    #[error("unsupported signature algorithm {0} for this key")]
    UnsupportedAlgorithm(String),
    #[error("signer queue full ({0} requests waiting): handshake refused, the client may retry")]
    QueueFull(usize),
    #[error("signer is shut down")]
    ShutDown,
    #[error("signer thread failed while computing this request's batch")]
    WorkerPanicked,
    #[error("RSA fault check failed: the signature did not verify and was withheld")]
    FaultCheck,
    #[error("signing failed: {0}")]
    Failed(String),
}

impl From<MbError> for SignError {
    fn from(e: MbError) -> Self {
        match e {
            MbError::FaultCheck => SignError::FaultCheck,
            MbError::Unsupported(s) => SignError::UnsupportedAlgorithm(s),
            other => SignError::Failed(other.to_string()),
        }
    }
}

/// Signer settings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SignerConfig {
    /// Signer threads (0 = one per CPU of the quota).
    pub threads: usize,
    /// How long an idle thread may wait for a fuller batch (0 = take what is queued now).
    pub max_wait: Duration,
    /// Bound on queued requests across all classes.
    pub queue_limit: usize,
    /// Batches of at most this many requests use the single-op path; `None` = the measured
    /// per-class defaults ([`default_scalar_below`]).
    pub scalar_below: Option<usize>,
    /// Backend for eligible keys.
    #[serde(serialize_with = "ser_backend")]
    pub backend: Backend,
}

fn ser_backend<S: serde::Serializer>(b: &Backend, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(b.as_str())
}

/// The largest batch that is faster on BoringSSL single-op than as one multi-buffer pass, per
/// class — measured here (AMD Zen 4, one pinned core; `benches/README.md`): an 8-lane pass costs
/// the same for 1 to 8 lanes. RSA-2048: pass ≈ 1.22 ms, single op ≈ 0.56 ms, so two singles
/// (1.12 ms) still win and three (1.67 ms) lose; RSA-3072/4096 likewise cross between 2 and 3.
/// ECDSA P-256: pass ≈ 28 µs, single ≈ 17.5 µs, so only a lone request is faster alone.
pub fn default_scalar_below(class: KeyClass) -> usize {
    match class {
        KeyClass::Rsa2048 | KeyClass::Rsa3072 | KeyClass::Rsa4096 => 2,
        KeyClass::EcdsaP256 => 1,
        KeyClass::Other => usize::MAX,
    }
}

impl Default for SignerConfig {
    fn default() -> Self {
        SignerConfig {
            threads: 0,
            max_wait: Duration::ZERO,
            queue_limit: 4096,
            scalar_below: None,
            backend: crate::mb::backend(),
        }
    }
}

impl SignerConfig {
    /// The small-batch threshold in force for `class`.
    pub fn scalar_below_for(&self, class: KeyClass) -> usize {
        match (class, self.scalar_below) {
            (KeyClass::Other, _) => usize::MAX,
            (_, Some(k)) => k,
            (c, None) => default_scalar_below(c),
        }
    }

    pub fn thread_count(&self) -> usize {
        if self.threads > 0 {
            self.threads
        } else {
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
        }
    }
}

struct Request {
    key: Arc<KeyEntry>,
    msg: Vec<u8>,
    alg: SslSignatureAlgorithm,
    reply: oneshot::Sender<Result<Vec<u8>, SignError>>,
    span: tracing::Span,
    enqueued: Instant,
}

struct Queues {
    by_class: [VecDeque<Request>; 5],
    depth: usize,
    shutdown: bool,
}

struct Shared {
    cfg: SignerConfig,
    queues: Mutex<Queues>,
    ready: Condvar,
    metrics: SignerMetrics,
    keys: KeyTable,
    batches: AtomicUsize,
    /// Test hook: the next batch panics.
    inject_panic: AtomicBool,
    /// Test hook: lanes of the next multi-buffer batch to corrupt before the RSA fault check.
    inject_fault: std::sync::atomic::AtomicU8,
    /// Test hook: while set, threads take no batch (so queues fill deterministically).
    held: AtomicBool,
}

/// Handle to the signer. Cheap to clone; the threads stop when the last handle is dropped.
#[derive(Clone)]
pub struct Signer {
    shared: Arc<Shared>,
    _stop: Arc<StopOnDrop>,
}

struct StopOnDrop(Arc<Shared>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        let mut q = self.0.queues.lock().unwrap();
        q.shutdown = true;
        self.0.ready.notify_all();
    }
}

impl Signer {
    /// Starts the signer threads.
    pub fn start(cfg: SignerConfig) -> Signer {
        let n = cfg.thread_count();
        let shared = Arc::new(Shared {
            cfg,
            queues: Mutex::new(Queues { by_class: Default::default(), depth: 0, shutdown: false }),
            ready: Condvar::new(),
            metrics: SignerMetrics::default(),
            keys: KeyTable::default(),
            batches: AtomicUsize::new(0),
            inject_panic: AtomicBool::new(false),
            inject_fault: std::sync::atomic::AtomicU8::new(0),
            held: AtomicBool::new(false),
        });
        for i in 0..n {
            spawn_worker(shared.clone(), i);
        }
        Signer { _stop: Arc::new(StopOnDrop(shared.clone())), shared }
    }

    pub fn config(&self) -> &SignerConfig {
        &self.shared.cfg
    }

    pub fn metrics(&self) -> &SignerMetrics {
        &self.shared.metrics
    }

    pub fn keys(&self) -> &KeyTable {
        &self.shared.keys
    }

    /// Batches run so far.
    pub fn batches(&self) -> usize {
        self.shared.batches.load(Ordering::Relaxed)
    }

    /// Live state for the config dump.
    pub fn dump(&self) -> serde_json::Value {
        let q = self.shared.queues.lock().unwrap();
        let depths: serde_json::Map<String, serde_json::Value> = KeyClass::ALL
            .iter()
            .map(|c| (c.as_str().to_string(), q.by_class[c.index()].len().into()))
            .collect();
        drop(q);
        let keys: serde_json::Map<String, serde_json::Value> = self
            .shared
            .keys
            .live()
            .into_iter()
            .map(|(c, n)| (c.as_str().to_string(), n.into()))
            .collect();
        serde_json::json!({
            "config": self.shared.cfg,
            "threads": self.shared.cfg.thread_count(),
            "queue_depth": depths,
            "live_keys": keys,
            "batches": self.batches(),
            "fault_check_failures": crate::mb::rsa::fault_check_failures(),
        })
    }

    /// Registers a certificate key; the entry lives as long as the contexts that hold it.
    pub fn register(&self, key: PKey<Private>) -> Arc<KeyEntry> {
        self.shared.keys.register(key)
    }

    /// Queues a signing request and waits for its result.
    pub async fn sign(
        &self,
        key: Arc<KeyEntry>,
        msg: Vec<u8>,
        alg: SslSignatureAlgorithm,
    ) -> Result<Vec<u8>, SignError> {
        let (reply, rx) = oneshot::channel();
        let class = key.class;
        let req = Request {
            key,
            msg,
            alg,
            reply,
            span: tracing::Span::current(),
            enqueued: Instant::now(),
        };
        {
            let mut q = self.shared.queues.lock().unwrap();
            if q.shutdown {
                return Err(SignError::ShutDown);
            }
            if q.depth >= self.shared.cfg.queue_limit {
                let depth = q.depth;
                drop(q);
                self.shared
                    .metrics
                    .rejected
                    .get_or_create(&ReasonLabels { reason: "queue_full" })
                    .inc();
                tracing::warn!(depth, "signer queue full: refusing the handshake's signature");
                return Err(SignError::QueueFull(depth));
            }
            q.by_class[class.index()].push_back(req);
            q.depth += 1;
            self.shared.metrics.queue_depth.set(q.depth as i64);
        }
        self.shared.ready.notify_one();
        rx.await.map_err(|_| SignError::WorkerPanicked)?
    }

    /// The `AsyncPrivateKeyMethod` for a context whose certificate's key is `key`.
    pub fn key_method(&self, key: PKey<Private>) -> KeyMethod {
        KeyMethod { key: self.register(key), signer: self.clone() }
    }

    /// Test hook: the next batch computed panics inside the signer thread.
    #[doc(hidden)]
    pub fn inject_panic_next_batch(&self) {
        self.shared.inject_panic.store(true, Ordering::SeqCst);
    }

    /// Test hook: the next multi-buffer RSA batch corrupts the lanes in `lane_mask` before its
    /// fault check (which must then withhold those signatures).
    #[doc(hidden)]
    pub fn inject_fault_next_batch(&self, lane_mask: u8) {
        self.shared.inject_fault.store(lane_mask, Ordering::SeqCst);
    }

    /// Test hook: stop (`true`) or resume (`false`) taking batches.
    #[doc(hidden)]
    pub fn hold(&self, held: bool) {
        self.shared.held.store(held, Ordering::SeqCst);
        let _q = self.shared.queues.lock().unwrap();
        self.shared.ready.notify_all();
    }

    /// Requests waiting now.
    pub fn queue_depth(&self) -> usize {
        self.shared.queues.lock().unwrap().depth
    }
}

fn spawn_worker(shared: Arc<Shared>, i: usize) {
    std::thread::Builder::new()
        .name(format!("mbt-signer-{i}"))
        .spawn(move || {
            let s = shared.clone();
            // A panic unwinds out of `worker_loop`, dropping the batch's reply senders: every
            // request of that batch gets `WorkerPanicked`. Then a fresh thread takes over.
            let r = std::panic::catch_unwind(AssertUnwindSafe(|| worker_loop(&s)));
            if r.is_err() {
                shared.metrics.thread_restarts.inc();
                tracing::error!(
                    thread = i,
                    "signer thread panicked; its batch failed; restarting it"
                );
                if !shared.queues.lock().map(|q| q.shutdown).unwrap_or(true) {
                    spawn_worker(shared, i);
                }
            }
        })
        .expect("spawn signer thread");
}

/// Takes the next batch: from the class whose oldest request has waited longest, up to 8.
fn next_batch(shared: &Shared) -> Option<(KeyClass, Vec<Request>)> {
    let mut q = shared.queues.lock().unwrap();
    loop {
        if q.shutdown {
            return None;
        }
        let oldest = KeyClass::ALL
            .iter()
            .filter_map(|c| q.by_class[c.index()].front().map(|r| (r.enqueued, *c)))
            .min_by_key(|(t, _)| *t);
        let Some((since, class)) = oldest.filter(|_| !shared.held.load(Ordering::SeqCst)) else {
            q = shared.ready.wait(q).unwrap();
            continue;
        };
        let len = q.by_class[class.index()].len();
        let max_wait = shared.cfg.max_wait;
        if len < crate::mb::LANES && class != KeyClass::Other && !max_wait.is_zero() {
            let waited = since.elapsed();
            if waited < max_wait {
                q = shared.ready.wait_timeout(q, max_wait - waited).unwrap().0;
                continue;
            }
        }
        let take = if class == KeyClass::Other { 1 } else { len.min(crate::mb::LANES) };
        let batch: Vec<Request> = q.by_class[class.index()].drain(..take).collect();
        q.depth -= batch.len();
        shared.metrics.queue_depth.set(q.depth as i64);
        if q.depth > 0 {
            shared.ready.notify_one();
        }
        return Some((class, batch));
    }
}

fn worker_loop(shared: &Shared) {
    while let Some((class, batch)) = next_batch(shared) {
        let alg = AlgLabels { algorithm: class.as_str() };
        for r in &batch {
            shared
                .metrics
                .queue_wait
                .get_or_create(&alg)
                .observe(r.enqueued.elapsed().as_secs_f64());
        }
        shared.metrics.batch_size.get_or_create(&alg).observe(batch.len() as f64);
        shared.batches.fetch_add(1, Ordering::Relaxed);
        if shared.inject_panic.swap(false, Ordering::SeqCst) {
            panic!("injected signer panic (test hook)");
        }
        let single = class == KeyClass::Other
            || shared.cfg.backend == Backend::Scalar
            || batch.len() <= shared.cfg.scalar_below_for(class);
        let backend = if single { Backend::Scalar } else { Backend::Ifma };
        let start = Instant::now();
        let fault = shared.inject_fault.swap(0, Ordering::SeqCst);
        if fault != 0 {
            crate::mb::rsa::inject_fault_next_batch(fault);
        }
        let results = if single {
            batch.iter().map(|r| sign_one(&r.key.pkey, &r.msg, r.alg)).collect()
        } else {
            sign_batch(&batch)
        };
        let labels = OpLabels { algorithm: class.as_str(), backend: backend.as_str() };
        shared.metrics.batch_seconds.get_or_create(&labels).observe(start.elapsed().as_secs_f64());
        shared.metrics.ops.get_or_create(&labels).inc_by(batch.len() as u64);
        for (r, res) in batch.into_iter().zip(results) {
            let _g = r.span.enter();
            if res == Err(SignError::FaultCheck) {
                shared.metrics.fault_check_failures.inc();
                tracing::error!(key = r.key.id, "RSA fault check failed: signature withheld");
            }
            let _ = r.reply.send(res);
        }
    }
}

/// One multi-buffer pass over requests of one class.
fn sign_batch(batch: &[Request]) -> Vec<Result<Vec<u8>, SignError>> {
    let msgs: Vec<&[u8]> = batch.iter().map(|r| r.msg.as_slice()).collect();
    let out: Vec<Result<Vec<u8>, MbError>> = match &batch[0].key.mb {
        MbKey::Rsa(_) => {
            let keys: Vec<_> = batch
                .iter()
                .map(|r| match &r.key.mb {
                    MbKey::Rsa(k) => &**k,
                    _ => unreachable!("queues hold one key class"),
                })
                .collect();
            let algs: Vec<_> = batch.iter().map(|r| r.alg).collect();
            crate::mb::rsa::RsaBatch::sign_tls_with(Backend::Ifma, &keys, &msgs, &algs)
        }
        MbKey::Ec(_) => {
            let keys: Vec<_> = batch
                .iter()
                .map(|r| match &r.key.mb {
                    MbKey::Ec(k) => k,
                    _ => unreachable!("queues hold one key class"),
                })
                .collect();
            let mut out = crate::mb::p256::sign_batch_with(Backend::Ifma, &keys, &msgs);
            for (o, r) in out.iter_mut().zip(batch) {
                if r.alg != SslSignatureAlgorithm::ECDSA_SECP256R1_SHA256 {
                    *o = Err(MbError::Unsupported(format!("{:?}", r.alg)));
                }
            }
            out
        }
        MbKey::None => return batch.iter().map(|r| sign_one(&r.key.pkey, &r.msg, r.alg)).collect(),
    };
    out.into_iter().map(|r| r.map_err(SignError::from)).collect()
}

/// Signs one message with BoringSSL (the single-op path).
pub fn sign_one(
    key: &PKey<Private>,
    msg: &[u8],
    alg: SslSignatureAlgorithm,
) -> Result<Vec<u8>, SignError> {
    let fail = |e: boring::error::ErrorStack| SignError::Failed(e.to_string());
    let (digest, pss) = match alg {
        SslSignatureAlgorithm::RSA_PKCS1_SHA256 => (MessageDigest::sha256(), false),
        SslSignatureAlgorithm::RSA_PKCS1_SHA384 => (MessageDigest::sha384(), false),
        SslSignatureAlgorithm::RSA_PKCS1_SHA512 => (MessageDigest::sha512(), false),
        SslSignatureAlgorithm::RSA_PSS_RSAE_SHA256 => (MessageDigest::sha256(), true),
        SslSignatureAlgorithm::RSA_PSS_RSAE_SHA384 => (MessageDigest::sha384(), true),
        SslSignatureAlgorithm::RSA_PSS_RSAE_SHA512 => (MessageDigest::sha512(), true),
        SslSignatureAlgorithm::ECDSA_SECP256R1_SHA256 => (MessageDigest::sha256(), false),
        other => return Err(SignError::UnsupportedAlgorithm(format!("{other:?}"))),
    };
    let mut s = boring::sign::Signer::new(digest, key).map_err(fail)?;
    if pss {
        s.set_rsa_padding(Padding::PKCS1_PSS).map_err(fail)?;
        s.set_rsa_pss_saltlen(RsaPssSaltlen::DIGEST_LENGTH).map_err(fail)?;
        s.set_rsa_mgf1_md(digest).map_err(fail)?;
    }
    s.sign_oneshot_to_vec(msg).map_err(fail)
}

/// `boring` async private-key method: the handshake parks until the signer answers.
pub struct KeyMethod {
    key: Arc<KeyEntry>,
    signer: Signer,
}

impl AsyncPrivateKeyMethod for KeyMethod {
    fn sign(
        &self,
        _ssl: &mut SslRef,
        input: &[u8],
        alg: SslSignatureAlgorithm,
        _output: &mut [u8],
    ) -> Result<BoxPrivateKeyMethodFuture, AsyncPrivateKeyMethodError> {
        let signer = self.signer.clone();
        let key = self.key.clone();
        let msg = input.to_vec();
        Ok(Box::pin(async move {
            let sig = signer.sign(key, msg, alg).await.map_err(|e| {
                tracing::warn!(error = %e, "handshake signature failed");
                AsyncPrivateKeyMethodError
            })?;
            Ok(Box::new(move |_: &mut SslRef, out: &mut [u8]| {
                if sig.len() > out.len() {
                    return Err(AsyncPrivateKeyMethodError);
                }
                out[..sig.len()].copy_from_slice(&sig);
                Ok(sig.len())
            }) as boring::ssl::BoxPrivateKeyMethodFinish)
        }))
    }

    fn decrypt(
        &self,
        _ssl: &mut SslRef,
        _input: &[u8],
        _output: &mut [u8],
    ) -> Result<BoxPrivateKeyMethodFuture, AsyncPrivateKeyMethodError> {
        // TLS 1.3 never decrypts with the certificate key.
        Err(AsyncPrivateKeyMethodError)
    }
}
