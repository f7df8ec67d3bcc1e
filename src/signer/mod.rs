//! The shared batching signer. Every TLS handshake's signature goes through it: the `boring`
//! `AsyncPrivateKeyMethod` ([`KeyMethod`]) parks the handshake and queues the request; dedicated
//! signer threads (never tokio workers) take requests per key class (RSA-2048/3072/4096,
//! ECDSA P-256) up to eight at a time and run them on the multi-buffer core.
//!
//! Inline rule (the signer never loses to inline signing): a request whose key's single op costs
//! at most the calibrated idle threshold is signed on the calling thread, with no hand-off, when
//! the signer is idle (nothing queued, a thread asleep) — it would have been a batch of one, the
//! same single op; and, below a lower threshold, also when the signer is busy if its class cannot
//! batch at all (scalar backend, keys the multi-buffer core does not take), since queueing such a
//! request buys nothing. Batches still run on the signer threads. See [`calibrate`].
//!
//! Flush policy: an idle signer thread takes what is queued *now* — batches grow only under load,
//! and a lone handshake waits for no timer. `max_wait` (default 0) lets operators trade latency
//! for fuller batches. Batches of at most `scalar_below` requests go to the BoringSSL single-op
//! path, which is faster than a multi-buffer pass for so few; the per-class crossover is
//! calibrated at start-up (`⌊pass / single op⌋`, see [`calibrate`]).
//!
//! Adaptive fill (classes whose 8-lane pass costs the same for 1 or 8 lanes: RSA): under load, a
//! thread may hold a forming batch open for more lanes — only while requests of that class keep
//! arriving fast enough to expect two or more within the class's fill bound (about six batch
//! times), and never for a request that is alone in its queue and arrived while the thread was
//! not computing (a lone handshake, or requests one after another). The hold
//! ends at eight lanes, when arrivals pause (no request for three average gaps), when the bound
//! expires, or when another class needs the thread. See [`FillPolicy`].
//!
//! Budgets: inbound signatures (server side: TLS 1.3 servers sign before the client is
//! authenticated) and outbound ones (client side, this node's pods) queue against separate
//! budgets of `queue_limit` requests each ([`Budget`]), and threads take batches from the two in
//! turn (a batch of one class interleaves both budgets' requests), so a flood on the inbound port
//! can neither make outbound signatures fail nor keep them waiting behind it.
//!
//! Backpressure: the budgets are bounded; a full budget answers at once with
//! [`SignError::QueueFull`] (the handshake fails and the client retries) instead of letting
//! latency grow without bound; the warning is logged at most once a second, with the count of
//! rejections it stands for. A request whose handshake has gone (its waiter dropped) is removed
//! before its batch is computed, never signed (`mbtunnel_signer_abandoned_total`). A panicking
//! signer thread fails only its batch and is restarted.
#![forbid(unsafe_code)]

pub mod calibrate;
pub mod keys;
pub mod metrics;

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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
pub use calibrate::Calibration;
use keys::MbKey;
pub use keys::{KeyClass, KeyEntry, KeyTable};
pub use metrics::SignerMetrics;
use metrics::{AlgLabels, BudgetLabels, KindLabels, OpLabels, OutcomeLabels, ReasonLabels};

/// Which queue budget a signature draws from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Budget {
    /// Server side: handshakes of peers that are not authenticated yet (TLS 1.3 servers sign
    /// their `CertificateVerify` before the client's certificate arrives).
    Inbound,
    /// Client side: connections this node's pods open.
    Outbound,
}

impl Budget {
    pub const ALL: [Budget; 2] = [Budget::Inbound, Budget::Outbound];

    pub fn as_str(self) -> &'static str {
        match self {
            Budget::Inbound => "inbound",
            Budget::Outbound => "outbound",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

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
    /// Signer threads (0 = [`default_threads`] of `cpus`).
    pub threads: usize,
    /// CPUs the process may use, for the default thread count (0 = detect the quota).
    pub cpus: usize,
    /// How long an idle thread may wait for a fuller batch (0 = take what is queued now).
    pub max_wait: Duration,
    /// Bound on queued requests of each budget ([`Budget`]: inbound and outbound are bounded
    /// separately, each to this many, across all classes).
    pub queue_limit: usize,
    /// Batches of at most this many requests use the single-op path; `None` = the per-class
    /// crossover calibrated at start-up ([`calibrate`]; [`default_scalar_below`] until then).
    pub scalar_below: Option<usize>,
    /// Backend for eligible keys.
    #[serde(serialize_with = "ser_backend")]
    pub backend: Backend,
    /// Adaptive fill bound: the longest a forming batch is held open for more arrivals under
    /// load. `None` = the per-class bound calibrated at start-up ([`calibrate`];
    /// [`default_fill_wait`] until then); `Some(ZERO)` = off.
    pub fill_wait: Option<Duration>,
}

fn ser_backend<S: serde::Serializer>(b: &Backend, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(b.as_str())
}

/// Fallback until the class is calibrated ([`calibrate::crossover`]). The largest batch that is
/// faster on BoringSSL single-op than as one multi-buffer pass, per class — measured (AMD Zen 4, one pinned core; `benches/README.md`): an 8-lane pass costs
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

/// Fallback until the class is calibrated ([`calibrate::fill_bound`]). The adaptive-fill bound
/// per class: about six 8-lane batch times for RSA (a batch costs
/// 1.37 / 4.25 / 10.2 ms for RSA-2048 / 3072 / 4096 on that Zen 4; about half that on a Zen 5). Measured for RSA-2048 with
/// `mbtunnel bench handshakes` (`benches/README.md`): 4 ms fills batches to ~4 lanes at
/// concurrency 64, 8 ms to ~5, 12 ms no further; RSA-3072/4096 are scaled by their batch time.
/// Zero (off) for ECDSA P-256, whose pass (29 µs) costs little more than one single op (18 µs).
pub fn default_fill_wait(class: KeyClass) -> Duration {
    match class {
        KeyClass::Rsa2048 => Duration::from_millis(8),
        KeyClass::Rsa3072 => Duration::from_millis(25),
        KeyClass::Rsa4096 => Duration::from_millis(60),
        KeyClass::EcdsaP256 | KeyClass::Other => Duration::ZERO,
    }
}

/// Default signer threads for a CPU quota: half of it, at least one. The signer threads share the
/// CPUs with the tokio workers that do the rest of each handshake (most of its CPU once signing is
/// batched), and every extra thread splits the queue into smaller batches. Measured on 2 vCPUs
/// (`benches/README.md`): one thread per side beat two for RSA-2048 (fuller batches, less CPU per
/// handshake) and for ECDSA P-256 (fewer threads competing for the two CPUs).
pub fn default_threads(cpus: usize) -> usize {
    (cpus / 2).max(1)
}

impl Default for SignerConfig {
    fn default() -> Self {
        SignerConfig {
            threads: 0,
            cpus: 0,
            max_wait: Duration::ZERO,
            queue_limit: 4096,
            scalar_below: None,
            backend: crate::mb::backend(),
            fill_wait: None,
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

    /// The adaptive-fill bound in force for `class` (zero = off).
    pub fn fill_wait_for(&self, class: KeyClass) -> Duration {
        match (class, self.fill_wait) {
            (KeyClass::Other, _) => Duration::ZERO,
            _ if self.backend == Backend::Scalar => Duration::ZERO,
            (_, Some(d)) => d,
            (c, None) => default_fill_wait(c),
        }
    }

    pub fn thread_count(&self) -> usize {
        if self.threads > 0 {
            return self.threads;
        }
        let cpus = if self.cpus > 0 {
            self.cpus
        } else {
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
        };
        default_threads(cpus)
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

/// Recent arrivals of one class, for the adaptive fill rule.
#[derive(Clone, Copy, Default)]
struct Flow {
    last: Option<Instant>,
    /// Moving average (weight 1/8) of the gap between arrivals, in seconds; `None` until two
    /// arrivals were seen. A long idle gap raises it by an eighth of the gap at once.
    gap: Option<f64>,
}

impl Flow {
    fn arrive(&mut self, now: Instant) {
        if let Some(last) = self.last {
            let d = now.saturating_duration_since(last).as_secs_f64();
            self.gap = Some(match self.gap {
                Some(g) => g + (d - g) / 8.0,
                None => d,
            });
        }
        self.last = Some(now);
    }
}

/// A hold ends when no request arrived for this many average gaps (arrivals paused).
const PAUSE_GAPS: u32 = 3;

/// Whether a thread holds a batch of `class` open for more lanes, and until when.
///
/// The rule (evaluated with the queue lock held, `k` = requests of the class queued now, `B` =
/// [`SignerConfig::fill_wait_for`], `g` = the moving average of the gap between arrivals of the
/// class, which an idle spell raises at once by an eighth of its length): start holding only if
/// no operator `max_wait` is set, `B > 0`, `k < 8`, and either `k >= 2` or the request arrived
/// while this thread was computing its previous batch (the signer is busy); and at least
/// two more arrivals are expected before the oldest request has waited `B`
/// (`(B - waited) / g >= 2`). Keep holding while fewer than eight are queued, the oldest has
/// waited less than `B`, the last arrival was less than `3g` ago, and no request of another class
/// lacks an idle thread. So a request that arrives alone while no batch is being computed — a
/// lone handshake, or requests one after another — starts at once, whatever `B` is.
pub struct FillPolicy;

impl FillPolicy {
    /// The instant to stop waiting, or `None` to take the batch now.
    fn hold_until(
        k: usize,
        bound: Duration,
        oldest: Instant,
        flow: &Flow,
        now: Instant,
        filling: bool,
        busy: bool,
    ) -> Option<Instant> {
        if bound.is_zero() || k == 0 || k >= crate::mb::LANES {
            return None;
        }
        // A request alone in its queue that arrived while the thread was idle starts at once.
        if k < 2 && !busy && !filling {
            return None;
        }
        let g = Duration::from_secs_f64(flow.gap?.max(1e-6));
        let deadline = oldest + bound;
        let last = flow.last?;
        let pause = last + g * PAUSE_GAPS;
        if now >= deadline || now >= pause {
            return None;
        }
        if !filling && (deadline - now).as_secs_f64() / g.as_secs_f64() < 2.0 {
            return None;
        }
        Some(deadline.min(pause))
    }
}

struct Queues {
    /// Per class, one FIFO per budget (indexed by [`Budget::index`]).
    by_class: [[VecDeque<Request>; 2]; 5],
    /// Requests queued per budget (abandoned ones included until a thread drops them).
    budget_depth: [usize; 2],
    /// The budget whose turn it is to choose the next batch's class.
    turn: usize,
    flow: [Flow; 5],
    /// A thread is holding this class's batch open (adaptive fill); others leave it alone.
    filling: [bool; 5],
    depth: usize,
    /// Threads waiting on `ready` (a request wakes one only if some thread sleeps).
    sleepers: usize,
    shutdown: bool,
    /// Test hook: while `Some`, the budget of every live request taken, in the order taken.
    taken_log: Option<Vec<Budget>>,
}

impl Queues {
    fn class_len(&self, c: KeyClass) -> usize {
        self.by_class[c.index()].iter().map(VecDeque::len).sum()
    }

    fn class_empty(&self, c: KeyClass) -> bool {
        self.by_class[c.index()].iter().all(VecDeque::is_empty)
    }

    /// The oldest request of class `c` (in `budget` only, if given).
    fn oldest(&self, c: KeyClass, budget: Option<usize>) -> Option<Instant> {
        self.by_class[c.index()]
            .iter()
            .enumerate()
            .filter(|(b, _)| budget.is_none_or(|x| x == *b))
            .filter_map(|(_, d)| d.front().map(|r| r.enqueued))
            .min()
    }

    /// Takes up to `n` live requests of class `c`, alternating between the budgets starting
    /// with `first`. Requests whose waiter has gone are dropped here, unsigned; their number is
    /// returned with the batch.
    fn take(&mut self, c: KeyClass, n: usize, first: usize) -> (Vec<Request>, usize) {
        let mut out = Vec::with_capacity(n);
        let (mut b, mut misses, mut abandoned) = (first, 0, 0);
        while out.len() < n && misses < 2 {
            match self.by_class[c.index()][b].pop_front() {
                Some(r) => {
                    self.budget_depth[b] -= 1;
                    self.depth -= 1;
                    if r.reply.is_closed() {
                        abandoned += 1;
                        continue;
                    }
                    if let Some(log) = &mut self.taken_log {
                        log.push(Budget::ALL[b]);
                    }
                    out.push(r);
                    misses = 0;
                    b ^= 1;
                }
                None => {
                    misses += 1;
                    b ^= 1;
                }
            }
        }
        (out, abandoned)
    }
}

struct Shared {
    cfg: SignerConfig,
    queues: Mutex<Queues>,
    /// Idle threads wait here.
    ready: Condvar,
    /// A thread holding a batch open waits here: woken when its class has eight requests, or
    /// when a request of another class finds no idle thread.
    full: Condvar,
    metrics: SignerMetrics,
    keys: KeyTable,
    batches: AtomicUsize,
    /// Test hook: the next batch panics.
    inject_panic: AtomicBool,
    /// Test hook: lanes of the next multi-buffer batch to corrupt before the RSA fault check.
    inject_fault: std::sync::atomic::AtomicU8,
    /// Test hook: while set, threads take no batch (so queues fill deterministically).
    held: AtomicBool,
    /// What the calibration measured (for the dump); the fields below are its fast copies.
    calib: Mutex<Calibration>,
    /// Calibrated crossover per class (0 = not yet calibrated).
    cal_scalar_below: [AtomicUsize; 5],
    /// Calibrated fill bound per class in µs (`u64::MAX` = not yet calibrated).
    cal_fill_us: [AtomicU64; 5],
    /// Inline thresholds in ns: idle signer, and busy signer for classes that cannot batch.
    inline_max_ns: AtomicU64,
    inline_busy_max_ns: AtomicU64,
    /// Single-op cost per key kind, measured once.
    kind_costs: Mutex<std::collections::HashMap<String, Option<Duration>>>,
    /// Rate limit of the queue-full warning.
    reject_log: crate::ratelog::RateLog<()>,
    /// Signer threads started.
    threads: usize,
    /// Signatures being computed inline right now (callers' threads).
    inline_inflight: AtomicUsize,
}

impl Shared {
    /// The crossover in force for `class`: configured, else calibrated, else the fallback.
    fn scalar_below(&self, class: KeyClass) -> usize {
        if class == KeyClass::Other || self.cfg.scalar_below.is_some() {
            return self.cfg.scalar_below_for(class);
        }
        match self.cal_scalar_below[class.index()].load(Ordering::Relaxed) {
            0 => self.cfg.scalar_below_for(class),
            k => k,
        }
    }

    /// The fill bound in force for `class`: configured, else calibrated, else the fallback.
    fn fill_wait(&self, class: KeyClass) -> Duration {
        if self.cfg.fill_wait.is_some() || self.cfg.fill_wait_for(class).is_zero() {
            return self.cfg.fill_wait_for(class);
        }
        match self.cal_fill_us[class.index()].load(Ordering::Relaxed) {
            u64::MAX => self.cfg.fill_wait_for(class),
            us => Duration::from_micros(us),
        }
    }

    /// Whether a class forms multi-buffer batches at all on this signer.
    fn batches(&self, class: KeyClass) -> bool {
        class != KeyClass::Other && self.cfg.backend.is_multi_buffer()
    }

    /// Measures (once per kind) the single-op cost of `key`'s kind and, on the IFMA backend, the
    /// pass of its class (once per class), deriving the class's crossover and fill bound.
    fn calibrate_key(&self, key: &KeyEntry) {
        let t0 = Instant::now();
        let mut measured = false;
        let cost = {
            let mut costs = self.kind_costs.lock().unwrap();
            *costs.entry(key.kind.clone()).or_insert_with(|| {
                measured = true;
                calibrate::measure_single_op(&key.pkey)
            })
        };
        if let Some(c) = cost {
            let _ = key.single_op.set(c);
        }
        let c = key.class;
        // The model test backend's pass (scalar code) says nothing about production: its classes
        // keep the fallback rules (measured on IFMA), so the batch path runs as it would there.
        let class_pending = self.batches(c)
            && !self.cfg.backend.is_test_only()
            && self.cal_scalar_below[c.index()].load(Ordering::Relaxed) == 0
            && cost.is_some();
        let batch =
            if class_pending { calibrate::measure_batch(self.cfg.backend, key) } else { None };
        if !measured && batch.is_none() {
            return;
        }
        let mut cal = self.calib.lock().unwrap();
        if let Some(c) = cost.filter(|_| measured) {
            cal.single_op_us.insert(key.kind.clone(), c.as_secs_f64() * 1e6);
            self.metrics
                .calibrated_single_op
                .get_or_create(&KindLabels { kind: key.kind.clone() })
                .set(c.as_secs_f64());
        }
        if let (Some(b), Some(single)) = (batch, cost) {
            let inline_max = Duration::from_nanos(self.inline_max_ns.load(Ordering::Relaxed));
            let k = calibrate::crossover(b, single);
            let fill = calibrate::fill_bound(b, single, inline_max);
            self.cal_scalar_below[c.index()].store(k, Ordering::Relaxed);
            self.cal_fill_us[c.index()].store(fill.as_micros() as u64, Ordering::Relaxed);
            let name = c.as_str().to_string();
            cal.batch_us.insert(name.clone(), b.as_secs_f64() * 1e6);
            let labels = KindLabels { kind: name };
            self.metrics.calibrated_batch.get_or_create(&labels).set(b.as_secs_f64());
        }
        cal.took_ms += t0.elapsed().as_secs_f64() * 1e3;
        self.publish_rules(&mut cal);
        tracing::info!(
            kind = %key.kind,
            class = c.as_str(),
            single_op_us = cost.map(|d| d.as_secs_f64() * 1e6),
            batch_us = batch.map(|d| d.as_secs_f64() * 1e6),
            scalar_below = self.scalar_below(c),
            fill_wait_us = self.fill_wait(c).as_micros() as u64,
            inline = cost.is_some_and(|d| d.as_nanos() as u64 <= self.inline_max_ns.load(Ordering::Relaxed)),
            "signer calibrated a key kind"
        );
    }

    /// Copies the rules in force per class into the calibration record and the metrics.
    fn publish_rules(&self, cal: &mut Calibration) {
        for c in KeyClass::ALL.iter().filter(|c| self.batches(**c)) {
            let (k, fill) = (self.scalar_below(*c), self.fill_wait(*c));
            let name = c.as_str().to_string();
            cal.scalar_below.insert(name.clone(), k);
            cal.fill_wait_us.insert(name.clone(), fill.as_micros() as u64);
            let labels = KindLabels { kind: name };
            self.metrics.scalar_below.get_or_create(&labels).set(k.min(i64::MAX as usize) as i64);
            self.metrics.fill_wait.get_or_create(&labels).set(fill.as_secs_f64());
        }
    }
}

/// Which thread a new request wakes (see [`Signer::sign`]).
enum Wake {
    /// One idle thread.
    Idle,
    /// The thread(s) holding a batch open.
    Filler,
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
        self.0.full.notify_all();
    }
}

impl Signer {
    /// Calibrates (a few milliseconds: see [`calibrate`]) and starts the signer threads.
    pub fn start(cfg: SignerConfig) -> Signer {
        let n = cfg.thread_count();
        let cfg_backend = cfg.backend;
        if cfg.backend.is_test_only() {
            tracing::warn!(
                backend = %cfg.backend,
                "signer runs on the '{}' TEST backend: the portable model of the IFMA kernels \
                 (scalar code, many times slower than BoringSSL); never use it in production",
                cfg.backend
            );
        }
        let shared = Arc::new(Shared {
            cfg,
            queues: Mutex::new(Queues {
                by_class: Default::default(),
                budget_depth: [0; 2],
                turn: 0,
                flow: Default::default(),
                filling: [false; 5],
                depth: 0,
                sleepers: 0,
                shutdown: false,
                taken_log: None,
            }),
            ready: Condvar::new(),
            full: Condvar::new(),
            metrics: SignerMetrics::default(),
            keys: KeyTable::for_backend(cfg_backend),
            batches: AtomicUsize::new(0),
            inject_panic: AtomicBool::new(false),
            inject_fault: std::sync::atomic::AtomicU8::new(0),
            held: AtomicBool::new(false),
            calib: Mutex::new(Calibration::default()),
            cal_scalar_below: Default::default(),
            cal_fill_us: std::array::from_fn(|_| AtomicU64::new(u64::MAX)),
            inline_max_ns: AtomicU64::new(0),
            inline_busy_max_ns: AtomicU64::new(0),
            kind_costs: Mutex::new(Default::default()),
            reject_log: Default::default(),
            threads: n,
            inline_inflight: AtomicUsize::new(0),
        });
        calibrate_start(&shared);
        for i in 0..n {
            spawn_worker(shared.clone(), i);
        }
        Signer { _stop: Arc::new(StopOnDrop(shared.clone())), shared }
    }

    /// What the calibration measured and the rules it derived.
    pub fn calibration(&self) -> Calibration {
        self.shared.calib.lock().unwrap().clone()
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
            .map(|c| (c.as_str().to_string(), q.class_len(*c).into()))
            .collect();
        drop(q);
        let keys: serde_json::Map<String, serde_json::Value> = self
            .shared
            .keys
            .live()
            .into_iter()
            .map(|(c, n)| (c.as_str().to_string(), n.into()))
            .collect();
        let fill: serde_json::Map<String, serde_json::Value> = KeyClass::ALL
            .iter()
            .filter(|c| **c != KeyClass::Other)
            .map(|c| {
                let us = self.shared.fill_wait(*c).as_micros() as u64;
                (c.as_str().to_string(), us.into())
            })
            .collect();
        let scalar_below: serde_json::Map<String, serde_json::Value> = KeyClass::ALL
            .iter()
            .filter(|c| self.shared.batches(**c))
            .map(|c| (c.as_str().to_string(), self.shared.scalar_below(*c).into()))
            .collect();
        let q = self.shared.queues.lock().unwrap();
        let budgets: serde_json::Map<String, serde_json::Value> = Budget::ALL
            .iter()
            .map(|b| {
                let v = serde_json::json!({
                    "queued": q.budget_depth[b.index()],
                    "limit": self.shared.cfg.queue_limit,
                });
                (b.as_str().to_string(), v)
            })
            .collect();
        drop(q);
        serde_json::json!({
            "config": self.shared.cfg,
            "threads": self.shared.cfg.thread_count(),
            "fill_wait_us": fill,
            "scalar_below": scalar_below,
            "calibration": self.calibration(),
            "budgets": budgets,
            "queue_depth": depths,
            "live_keys": keys,
            "batches": self.batches(),
            "fault_check_failures": crate::mb::rsa::fault_check_failures(),
        })
    }

    /// Registers a certificate key; the entry lives as long as the contexts that hold it. The
    /// first key of a kind calibrates that kind (a few single ops; on the IFMA backend a few
    /// passes of its class), logged.
    pub fn register(&self, key: PKey<Private>) -> Arc<KeyEntry> {
        let e = self.shared.keys.register(key);
        self.shared.calibrate_key(&e);
        e
    }

    /// Signs for a client-side (outbound) handshake: [`Signer::sign_for`] with
    /// [`Budget::Outbound`].
    pub async fn sign(
        &self,
        key: Arc<KeyEntry>,
        msg: Vec<u8>,
        alg: SslSignatureAlgorithm,
    ) -> Result<Vec<u8>, SignError> {
        self.sign_for(Budget::Outbound, key, msg, alg).await
    }

    /// Whether a request of `key` is signed on the calling thread now: its single op is cheap
    /// (calibrated) and queueing gains nothing — the signer is idle (nothing queued, every signer
    /// thread asleep, no other signature being computed inline: otherwise concurrent requests
    /// could never meet in a batch), or the class never batches. On `true` the caller holds one
    /// of `inline_inflight`, to release after signing.
    fn sign_inline_now(&self, key: &KeyEntry) -> bool {
        let sh = &self.shared;
        let Some(cost) = key.single_op().map(|c| c.as_nanos() as u64) else { return false };
        if cost > sh.inline_max_ns.load(Ordering::Relaxed) || sh.held.load(Ordering::SeqCst) {
            return false;
        }
        if !sh.batches(key.class) && cost <= sh.inline_busy_max_ns.load(Ordering::Relaxed) {
            sh.inline_inflight.fetch_add(1, Ordering::SeqCst);
            return true;
        }
        let q = sh.queues.lock().unwrap();
        !q.shutdown
            && q.depth == 0
            && q.sleepers >= sh.threads
            && sh.inline_inflight.compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst).is_ok()
    }

    /// Signs on the calling thread (BoringSSL single op), accounted like a batch of one.
    fn sign_inline(
        &self,
        key: &KeyEntry,
        msg: &[u8],
        alg: SslSignatureAlgorithm,
    ) -> Result<Vec<u8>, SignError> {
        let m = &self.shared.metrics;
        let algorithm = key.class.as_str();
        let start = Instant::now();
        let res = sign_one(&key.pkey, msg, alg);
        let labels = OpLabels { algorithm, backend: Backend::Scalar.as_str() };
        m.batch_seconds.get_or_create(&labels).observe(start.elapsed().as_secs_f64());
        m.ops.get_or_create(&labels).inc();
        m.inline_ops.get_or_create(&AlgLabels { algorithm }).inc();
        m.batch_size.get_or_create(&AlgLabels { algorithm }).observe(1.0);
        m.queue_wait.get_or_create(&AlgLabels { algorithm }).observe(0.0);
        self.shared.batches.fetch_add(1, Ordering::Relaxed);
        res
    }

    /// Signs with `key` for a handshake on the `budget` side: on the calling thread when the
    /// inline rule says so, otherwise queued against that budget until a signer thread answers.
    pub async fn sign_for(
        &self,
        budget: Budget,
        key: Arc<KeyEntry>,
        msg: Vec<u8>,
        alg: SslSignatureAlgorithm,
    ) -> Result<Vec<u8>, SignError> {
        if self.sign_inline_now(&key) {
            let r = self.sign_inline(&key, &msg, alg);
            self.shared.inline_inflight.fetch_sub(1, Ordering::SeqCst);
            return r;
        }
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
        let wake = {
            let mut q = self.shared.queues.lock().unwrap();
            if q.shutdown {
                return Err(SignError::ShutDown);
            }
            let b = budget.index();
            if q.budget_depth[b] >= self.shared.cfg.queue_limit {
                let depth = q.budget_depth[b];
                drop(q);
                let m = &self.shared.metrics;
                m.rejected.get_or_create(&ReasonLabels { reason: "queue_full" }).inc();
                m.budget_rejected.get_or_create(&BudgetLabels { budget: budget.as_str() }).inc();
                if let Some(suppressed) = self.shared.reject_log.allow((), Instant::now()) {
                    tracing::warn!(
                        depth,
                        budget = budget.as_str(),
                        suppressed,
                        "signer queue full: refusing the handshake's signature (logged at most \
                         once a second; `suppressed` counts the rejections not logged since)"
                    );
                }
                return Err(SignError::QueueFull(depth));
            }
            let now = req.enqueued;
            q.by_class[class.index()][b].push_back(req);
            q.flow[class.index()].arrive(now);
            q.depth += 1;
            q.budget_depth[b] += 1;
            self.shared.metrics.queue_depth.set(q.depth as i64);
            self.shared
                .metrics
                .budget_depth
                .get_or_create(&BudgetLabels { budget: budget.as_str() })
                .set(q.budget_depth[b] as i64);
            // Wake a thread only if one sleeps (a busy thread finds the request when it next
            // looks). A thread filling this class is woken only once there are eight (it wakes
            // by itself when arrivals pause); a filler of another class is woken when no idle
            // thread is left to take this request.
            // The wake-up itself happens after the lock is released, so that the woken thread
            // does not wake only to block on the lock.
            let c = class.index();
            if q.filling[c] {
                (q.class_len(class) >= crate::mb::LANES).then_some(Wake::Filler)
            } else if q.sleepers > 0 {
                Some(Wake::Idle)
            } else if q.filling.iter().any(|f| *f) {
                Some(Wake::Filler)
            } else {
                None
            }
        };
        match wake {
            Some(Wake::Idle) => self.shared.ready.notify_one(),
            Some(Wake::Filler) => self.shared.full.notify_all(),
            None => {}
        }
        rx.await.map_err(|_| SignError::WorkerPanicked)?
    }

    /// The `AsyncPrivateKeyMethod` for a context whose certificate's key is `key`, drawing on the
    /// outbound budget: [`Signer::key_method_for`] with [`Budget::Outbound`].
    pub fn key_method(&self, key: PKey<Private>) -> KeyMethod {
        self.key_method_for(key, Budget::Outbound)
    }

    /// The `AsyncPrivateKeyMethod` for a context whose certificate's key is `key` and whose
    /// handshakes draw on `budget`: [`Budget::Inbound`] for server (acceptor) contexts,
    /// [`Budget::Outbound`] for client (connector) contexts.
    pub fn key_method_for(&self, key: PKey<Private>, budget: Budget) -> KeyMethod {
        KeyMethod { key: self.register(key), signer: self.clone(), budget }
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
        self.shared.full.notify_all();
    }

    /// Test hook: from now on, note the budget of every request a thread takes (`true`), or stop
    /// noting (`false`). What was noted is read with [`Signer::taken_order`].
    #[doc(hidden)]
    pub fn note_taken_order(&self, on: bool) {
        self.shared.queues.lock().unwrap().taken_log = on.then(Vec::new);
    }

    /// Test hook: the budgets of the requests taken since [`Signer::note_taken_order`], in the
    /// order the signer threads took them (not the order their handshakes happened to resume).
    #[doc(hidden)]
    pub fn taken_order(&self) -> Vec<Budget> {
        self.shared.queues.lock().unwrap().taken_log.clone().unwrap_or_default()
    }

    /// Signer threads waiting for work now (all of them: the signer is idle).
    #[doc(hidden)]
    pub fn threads_asleep(&self) -> usize {
        self.shared.queues.lock().unwrap().sleepers
    }

    /// Requests waiting now.
    pub fn queue_depth(&self) -> usize {
        self.shared.queues.lock().unwrap().depth
    }
}

/// Start-up calibration (a few milliseconds): the hand-off round trip, hence the inline
/// threshold, and the P-256 kind (the default key type) with a fresh key — on the IFMA backend
/// including the class's pass, crossover and fill bound. Other kinds calibrate on first use.
fn calibrate_start(shared: &Shared) {
    let t0 = Instant::now();
    let h = calibrate::measure_handoff(33);
    let max = calibrate::inline_max(h);
    let busy = calibrate::inline_busy_max(h);
    shared.inline_max_ns.store(max.as_nanos() as u64, Ordering::Relaxed);
    shared.inline_busy_max_ns.store(busy.as_nanos() as u64, Ordering::Relaxed);
    shared.metrics.calibrated_handoff.set(h.as_secs_f64());
    shared.metrics.calibrated_inline_max.set(max.as_secs_f64());
    {
        let mut cal = shared.calib.lock().unwrap();
        cal.handoff_us = h.as_secs_f64() * 1e6;
        cal.inline_max_us = max.as_secs_f64() * 1e6;
        cal.inline_busy_max_us = busy.as_secs_f64() * 1e6;
        cal.took_ms = t0.elapsed().as_secs_f64() * 1e3;
    }
    tracing::info!(
        handoff_us = h.as_secs_f64() * 1e6,
        inline_max_us = max.as_secs_f64() * 1e6,
        inline_busy_max_us = busy.as_secs_f64() * 1e6,
        "signer calibrated the hand-off"
    );
    match crate::identity::ca::generate_key(crate::config::KeyAlgorithm::EcdsaP256) {
        Ok(k) => {
            // Registered in the table only for the duration of the measurement.
            let e = shared.keys.register(k);
            shared.calibrate_key(&e);
        }
        Err(e) => tracing::warn!(error = %e, "signer calibration: no P-256 key to measure"),
    }
    let mut cal = shared.calib.lock().unwrap();
    shared.publish_rules(&mut cal);
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

/// Takes the next batch: from the class whose oldest request has waited longest, up to 8 —
/// possibly after holding it open for more lanes (`max_wait`, or the adaptive [`FillPolicy`]).
///
/// `computed_until`: when this thread's previous batch finished computing. A request that was
/// already queued then arrived while the signer was busy.
fn next_batch(
    shared: &Shared,
    computed_until: Option<Instant>,
) -> Option<(KeyClass, Vec<Request>)> {
    let mut q = shared.queues.lock().unwrap();
    // The class this thread is filling, if any.
    let mut mine: Option<KeyClass> = None;
    let mut hold_ended_by_others = false;
    loop {
        if q.shutdown {
            if let Some(c) = mine {
                q.filling[c.index()] = false;
            }
            return None;
        }
        let held = shared.held.load(Ordering::SeqCst);
        // The budget whose turn it is picks the class (its oldest request's); the other budget
        // picks when the first has nothing eligible.
        let pick = |q: &Queues, budget: Option<usize>| {
            KeyClass::ALL
                .iter()
                .filter(|c| mine == Some(**c) || !q.filling[c.index()])
                .filter_map(|c| q.oldest(*c, budget).map(|t| (t, *c)))
                .min_by_key(|(t, _)| *t)
        };
        let oldest = pick(&q, Some(q.turn)).or_else(|| pick(&q, None));
        let Some((_, class)) = oldest.filter(|_| !held) else {
            q.sleepers += 1;
            q = shared.ready.wait(q).unwrap();
            q.sleepers -= 1;
            continue;
        };
        // Filling one class while another has an older request: serve that one first.
        if let Some(c) = mine.filter(|c| *c != class) {
            q.filling[c.index()] = false;
            mine = None;
        }
        let since = q.oldest(class, None).expect("the class has a request");
        let len = q.class_len(class);
        let max_wait = shared.cfg.max_wait;
        if len < crate::mb::LANES && class != KeyClass::Other && !max_wait.is_zero() {
            let waited = since.elapsed();
            if waited < max_wait {
                q.sleepers += 1;
                q = shared.ready.wait_timeout(q, max_wait - waited).unwrap().0;
                q.sleepers -= 1;
                continue;
            }
        }
        if class != KeyClass::Other && max_wait.is_zero() {
            let now = Instant::now();
            let hold = FillPolicy::hold_until(
                len,
                shared.fill_wait(class),
                since,
                &q.flow[class.index()],
                now,
                mine == Some(class),
                computed_until.is_some_and(|t| since < t),
            );
            // Another class has requests and no idle thread would take them: stop filling.
            let others_starved = q.sleepers == 0
                && KeyClass::ALL
                    .iter()
                    .any(|c| *c != class && !q.filling[c.index()] && !q.class_empty(*c));
            hold_ended_by_others = hold.is_some() && others_starved;
            if let Some(until) = hold.filter(|_| !others_starved) {
                mine = Some(class);
                q.filling[class.index()] = true;
                q = shared.full.wait_timeout(q, until - now).unwrap().0;
                continue;
            }
        }
        if mine.take().is_some() {
            q.filling[class.index()] = false;
            let now = Instant::now();
            let outcome = if len >= crate::mb::LANES {
                "full"
            } else if now >= since + shared.fill_wait(class) {
                "bound"
            } else if hold_ended_by_others {
                "other"
            } else {
                "pause"
            };
            shared.metrics.fill_holds.get_or_create(&OutcomeLabels { outcome }).inc();
        }
        let take = if class == KeyClass::Other { 1 } else { len.min(crate::mb::LANES) };
        let first = q.turn;
        let (batch, abandoned) = q.take(class, take, first);
        q.turn ^= 1;
        shared.metrics.queue_depth.set(q.depth as i64);
        for b in Budget::ALL {
            let labels = BudgetLabels { budget: b.as_str() };
            shared
                .metrics
                .budget_depth
                .get_or_create(&labels)
                .set(q.budget_depth[b.index()] as i64);
        }
        if abandoned > 0 {
            let labels = AlgLabels { algorithm: class.as_str() };
            shared.metrics.abandoned.get_or_create(&labels).inc_by(abandoned as u64);
        }
        if batch.is_empty() {
            continue; // every request taken had been abandoned
        }
        if q.depth > 0 && q.sleepers > 0 {
            shared.ready.notify_one();
        }
        return Some((class, batch));
    }
}

fn worker_loop(shared: &Shared) {
    let mut computed_until = None;
    while let Some((class, batch)) = next_batch(shared, computed_until) {
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
        let single = !shared.batches(class) || batch.len() <= shared.scalar_below(class);
        let backend = if single { Backend::Scalar } else { shared.cfg.backend };
        let start = Instant::now();
        let fault = shared.inject_fault.swap(0, Ordering::SeqCst);
        if fault != 0 {
            crate::mb::rsa::inject_fault_next_batch(fault);
        }
        let results = if single {
            batch.iter().map(|r| sign_one(&r.key.pkey, &r.msg, r.alg)).collect()
        } else {
            sign_batch(backend, &batch)
        };
        computed_until = Some(Instant::now());
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

/// One multi-buffer pass over requests of one class, on `backend` (IFMA, or the model test
/// backend when that was forced).
fn sign_batch(backend: Backend, batch: &[Request]) -> Vec<Result<Vec<u8>, SignError>> {
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
            crate::mb::rsa::RsaBatch::sign_tls_with(backend, &keys, &msgs, &algs)
        }
        MbKey::Ec(_) => {
            let keys: Vec<_> = batch
                .iter()
                .map(|r| match &r.key.mb {
                    MbKey::Ec(k) => k,
                    _ => unreachable!("queues hold one key class"),
                })
                .collect();
            let mut out = crate::mb::p256::sign_batch_with(backend, &keys, &msgs);
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
    budget: Budget,
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
        let budget = self.budget;
        Ok(Box::pin(async move {
            let sig = signer.sign_for(budget, key, msg, alg).await.map_err(|e| {
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

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A flow whose arrivals came `gap` apart, the last at `last`.
    fn flow(gap: Duration, last: Instant) -> Flow {
        Flow { last: Some(last), gap: Some(gap.as_secs_f64()) }
    }

    #[test]
    fn fill_holds_a_busy_batch_until_eight_a_pause_or_the_bound() {
        let t = Instant::now();
        let f = flow(MS, t);
        // Two queued, arrivals 1 ms apart, bound 8 ms: hold until the pause (last + 3 gaps).
        assert_eq!(FillPolicy::hold_until(2, 8 * MS, t, &f, t, false, false), Some(t + 3 * MS));
        // The bound comes first when the oldest has already waited.
        let old = t - 7 * MS;
        assert_eq!(FillPolicy::hold_until(3, 8 * MS, old, &f, t, true, false), Some(t + MS));
        // Eight lanes, an expired bound, a pause, or the rule off: take now.
        assert_eq!(FillPolicy::hold_until(8, 8 * MS, t, &f, t, true, true), None);
        assert_eq!(FillPolicy::hold_until(3, 8 * MS, t - 9 * MS, &f, t, true, true), None);
        assert_eq!(FillPolicy::hold_until(3, 8 * MS, t, &f, t + 4 * MS, true, true), None);
        assert_eq!(FillPolicy::hold_until(3, Duration::ZERO, t, &f, t, false, true), None);
    }

    #[test]
    fn fill_never_holds_a_lone_request_on_an_idle_signer_thread() {
        let t = Instant::now();
        let f = flow(MS, t);
        // Alone in its queue and the thread was idle: start at once, however busy the flow.
        assert_eq!(FillPolicy::hold_until(1, Duration::from_secs(5), t, &f, t, false, false), None);
        // Alone, but it arrived while the thread computed a batch: the signer is busy.
        assert!(FillPolicy::hold_until(1, 8 * MS, t, &f, t, false, true).is_some());
        // No arrival history yet: nothing to predict from.
        let fresh = Flow { last: Some(t), gap: None };
        assert_eq!(FillPolicy::hold_until(4, 8 * MS, t, &fresh, t, false, true), None);
    }

    #[test]
    fn fill_does_not_hold_when_arrivals_are_slow_or_after_an_idle_spell() {
        let t = Instant::now();
        // Arrivals 5 ms apart: fewer than two more expected within an 8 ms bound.
        assert_eq!(FillPolicy::hold_until(2, 8 * MS, t, &flow(5 * MS, t), t, false, true), None);
        // A busy flow (1 ms gaps), then 100 ms of silence: the average jumps by 12.5 ms.
        let mut f = Flow::default();
        for i in 0..32 {
            f.arrive(t + i * MS);
        }
        let after = t + 131 * MS;
        f.arrive(after);
        assert!(f.gap.unwrap() > 0.012, "{:?}", f.gap);
        assert_eq!(FillPolicy::hold_until(2, 8 * MS, after, &f, after, false, true), None);
    }

    #[test]
    fn fill_defaults_are_on_for_rsa_and_off_for_ecdsa_and_scalar() {
        let ifma = SignerConfig { backend: Backend::Ifma, ..Default::default() };
        assert_eq!(ifma.fill_wait_for(KeyClass::Rsa2048), 8 * MS);
        assert_eq!(ifma.fill_wait_for(KeyClass::EcdsaP256), Duration::ZERO);
        assert_eq!(ifma.fill_wait_for(KeyClass::Other), Duration::ZERO);
        let off = SignerConfig { fill_wait: Some(Duration::ZERO), ..ifma.clone() };
        assert_eq!(off.fill_wait_for(KeyClass::Rsa2048), Duration::ZERO);
        let scalar = SignerConfig { backend: Backend::Scalar, ..ifma };
        assert_eq!(scalar.fill_wait_for(KeyClass::Rsa2048), Duration::ZERO);
    }
}
