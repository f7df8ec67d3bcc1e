//! The shared batching signer: batches form under concurrent handshakes, a lone handshake is not
//! delayed, a full queue fails fast, a panicking thread is replaced, a faulty lane fails alone,
//! and certificate rotation under load loses no handshake.
//!
//! The batch path runs on every CPU: the signers here use [`test_backend`] — the IFMA backend
//! where the CPU has it, and otherwise the model test backend (the portable model of the IFMA
//! kernels) instead of BoringSSL single-op.

use std::sync::Arc;
use std::time::Duration;

use boring::hash::MessageDigest;
use boring::pkey::{PKey, Private};
use boring::ssl::SslSignatureAlgorithm;
use mbtunnel::config::KeyAlgorithm;
use mbtunnel::identity::ca::{generate_key, DevCa};
use mbtunnel::identity::store::CertStore;
use mbtunnel::identity::Identity;
use mbtunnel::mb::Backend;
use mbtunnel::metrics::Metrics;
use mbtunnel::signer::{Budget, SignError, Signer, SignerConfig};
use mbtunnel::tls::TlsProvider;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The backend the signers of these tests use: `MBTUNNEL_SIGNER_BACKEND` when it forces one
/// (a forced `scalar` is respected: the batch-path tests then say that they skip); otherwise
/// IFMA where the CPU has it, else the model test backend, so the batch path runs everywhere.
/// Choosing the model prints that the IFMA part is skipped, and fails under `REQUIRE_IFMA=1`.
fn test_backend() -> Backend {
    let env = std::env::var(mbtunnel::mb::BACKEND_ENV).unwrap_or_default();
    let forced = !matches!(env.trim().to_ascii_lowercase().as_str(), "" | "auto");
    match mbtunnel::mb::backend() {
        Backend::Scalar if !forced => {
            let _ =
                mbtunnel::mb::require_ifma("the signer's batch path on IFMA (runs on the model)");
            Backend::Model
        }
        b => b,
    }
}

fn signer(cfg: SignerConfig) -> (Signer, Arc<std::sync::Mutex<Registry>>) {
    let backend = test_backend();
    let s = Signer::start(SignerConfig { backend, ..cfg });
    let mut reg = Registry::default();
    let choice =
        mbtunnel::mb::choose_backend(Some(backend.as_str()), mbtunnel::mb::cpu_features()).unwrap();
    s.metrics().register(&mut reg, &choice);
    (s, Arc::new(std::sync::Mutex::new(reg)))
}

fn metrics_text(reg: &std::sync::Mutex<Registry>) -> String {
    let mut s = String::new();
    prometheus_client::encoding::text::encode(&mut s, &reg.lock().unwrap()).unwrap();
    s
}

fn value(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

fn verify(key: &PKey<Private>, alg: SslSignatureAlgorithm, msg: &[u8], sig: &[u8]) -> bool {
    let (md, pss) = match alg {
        SslSignatureAlgorithm::RSA_PSS_RSAE_SHA256 => (MessageDigest::sha256(), true),
        SslSignatureAlgorithm::RSA_PKCS1_SHA256 => (MessageDigest::sha256(), false),
        _ => (MessageDigest::sha256(), false),
    };
    let mut v = boring::sign::Verifier::new(md, key).unwrap();
    if pss {
        v.set_rsa_padding(boring::rsa::Padding::PKCS1_PSS).unwrap();
        v.set_rsa_pss_saltlen(boring::sign::RsaPssSaltlen::DIGEST_LENGTH).unwrap();
    }
    v.verify_oneshot(sig, msg).unwrap_or(false)
}

struct Side {
    tls: Vec<Arc<TlsProvider>>,
}

/// TLS providers for ECDSA P-256 and RSA-2048 identities, all on one signer and one CA.
fn providers(tag: &str, signer: &Signer) -> (Side, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("mbt-signer-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut tls = Vec::new();
    for alg in [KeyAlgorithm::EcdsaP256, KeyAlgorithm::Rsa2048] {
        let ca = DevCa::load_or_create(&dir, "cluster.local").unwrap();
        let store = Arc::new(CertStore::new(ca, alg, Duration::from_secs(3600)));
        let mut reg = Registry::default();
        let m = Arc::new(Metrics::new(&mut reg));
        tls.push(Arc::new(TlsProvider::new(store, signer.clone(), "cluster.local".into(), m)));
    }
    (Side { tls }, dir)
}

fn id(kind: &str, i: usize) -> Identity {
    format!("spiffe://cluster.local/ns/load/sa/{kind}-{i}").parse().unwrap()
}

/// Starts a TLS server per identity; each accepted connection gets one byte, then closes.
async fn servers(side: &Side, per_alg: usize) -> Vec<(std::net::SocketAddr, Identity, usize)> {
    let mut out = Vec::new();
    for (a, tls) in side.tls.iter().enumerate() {
        for i in 0..per_alg {
            let sid = id(&format!("srv{a}"), i);
            tls.store().fetch(&sid).await.unwrap();
            let l = tokio::net::TcpListener::bind("127.0.31.1:0").await.unwrap();
            out.push((l.local_addr().unwrap(), sid.clone(), a));
            let tls = tls.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((s, _)) = l.accept().await else { return };
                    let tls = tls.clone();
                    let sid = sid.clone();
                    tokio::spawn(async move {
                        if let Ok((mut s, _peer)) = tls.accept(s, &sid).await {
                            let _ = s.write_all(b"k").await;
                            let _ = s.shutdown().await;
                        }
                    });
                }
            });
        }
    }
    out
}

async fn handshake(
    tls: &TlsProvider,
    me: &Identity,
    dst: std::net::SocketAddr,
    peer: &Identity,
) -> Result<(), String> {
    let tcp = tokio::net::TcpStream::connect(dst).await.map_err(|e| e.to_string())?;
    let mut s = tls.connect(tcp, me, peer).await.map_err(|e| e.to_string())?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b).await.map_err(|e| e.to_string())?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_concurrent_mixed_handshakes_batch_and_verify() {
    let (signer, reg) = signer(SignerConfig { threads: 2, ..Default::default() });
    let (side, dir) = providers("load", &signer);
    let srv = Arc::new(servers(&side, 4).await);
    // Client identities: 4 per algorithm, issued before the load starts.
    for (a, tls) in side.tls.iter().enumerate() {
        for i in 0..4 {
            tls.store().fetch(&id(&format!("cli{a}"), i)).await.unwrap();
        }
    }
    let mut tasks = Vec::new();
    for n in 0..320usize {
        let (addr, sid, _) = srv[n % srv.len()].clone();
        let a = (n / srv.len()) % 2; // client key type varies independently of the server's
        let tls = side.tls[a].clone();
        let me = id(&format!("cli{a}"), n % 4);
        tasks.push(tokio::spawn(async move { handshake(&tls, &me, addr, &sid).await }));
    }
    let mut failures = Vec::new();
    for t in tasks {
        if let Err(e) = t.await.unwrap() {
            failures.push(e);
        }
    }
    assert!(
        failures.is_empty(),
        "{} handshakes failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(3)]
    );
    let t = metrics_text(&reg);
    // Every handshake signs twice (server and client CertificateVerify).
    assert_eq!(value(&t, "mbtunnel_signer_ops_total"), 640.0, "{t}");
    let (sum, count) = (
        value(&t, "mbtunnel_signer_batch_size_sum"),
        value(&t, "mbtunnel_signer_batch_size_count"),
    );
    let mean = sum / count;
    println!("mean batch size {mean:.2} over {count} batches");
    let b = test_backend();
    if b.is_multi_buffer() {
        assert!(mean > 1.0, "batches must form under concurrency: mean {mean}\n{t}");
        let ops = |alg: &str| {
            value(&t, &format!("mbtunnel_signer_ops_total{{algorithm=\"{alg}\",backend=\"{b}\"}}"))
        };
        assert!(ops("rsa-2048") > 0.0, "{t}");
        assert!(ops("ecdsa-p256") > 0.0, "{t}");
        assert!(t.contains(&format!("backend=\"{b}\"")), "the backend info names {b}\n{t}");
    } else {
        println!(
            "batching assertions skipped: {} forces the scalar backend",
            mbtunnel::mb::BACKEND_ENV
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lone_handshake_runs_alone_without_a_timer() {
    let (signer, reg) = signer(SignerConfig { threads: 1, ..Default::default() });
    let (side, dir) = providers("lone", &signer);
    let srv = servers(&side, 1).await;
    let (addr, sid, a) = srv[1].clone();
    let me = id("cli", 0);
    side.tls[a].store().fetch(&me).await.unwrap();
    handshake(&side.tls[a], &me, addr, &sid).await.unwrap();
    let t = metrics_text(&reg);
    // Two signatures, each in a batch of its own: nothing waited for company.
    assert_eq!(value(&t, "mbtunnel_signer_batch_size_count"), 2.0, "{t}");
    assert_eq!(value(&t, "mbtunnel_signer_batch_size_sum"), 2.0, "{t}");
    let wait = value(&t, "mbtunnel_signer_queue_wait_seconds_sum") / 2.0;
    println!("lone handshake: mean queue wait {:.1} us", wait * 1e6);
    let _ = std::fs::remove_dir_all(dir);
}

fn rsa_key() -> PKey<Private> {
    generate_key(KeyAlgorithm::Rsa2048).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_fails_fast_and_recovers() {
    let (signer, reg) = signer(SignerConfig { threads: 1, queue_limit: 4, ..Default::default() });
    let pkey = generate_key(KeyAlgorithm::EcdsaP256).unwrap();
    let key = signer.register(pkey.clone());
    signer.hold(true);
    let mut queued = Vec::new();
    for i in 0..4 {
        let (s, k) = (signer.clone(), key.clone());
        queued.push(tokio::spawn(async move {
            s.sign(k, vec![i; 32], SslSignatureAlgorithm::ECDSA_SECP256R1_SHA256).await
        }));
    }
    while signer.queue_depth() < 4 {
        tokio::task::yield_now().await;
    }
    let e = signer
        .sign(key.clone(), b"one too many".to_vec(), SslSignatureAlgorithm::ECDSA_SECP256R1_SHA256)
        .await;
    assert_eq!(e, Err(SignError::QueueFull(4)));
    assert!(e.unwrap_err().to_string().contains("queue full"));
    assert_eq!(
        value(&metrics_text(&reg), "mbtunnel_signer_rejected_total{reason=\"queue_full\"}"),
        1.0
    );
    signer.hold(false);
    for (i, q) in queued.into_iter().enumerate() {
        let sig = q.await.unwrap().expect("queued request completes once load drops");
        assert!(verify(&pkey, SslSignatureAlgorithm::ECDSA_SECP256R1_SHA256, &[i as u8; 32], &sig));
    }
    let sig = signer
        .sign(key, b"after".to_vec(), SslSignatureAlgorithm::ECDSA_SECP256R1_SHA256)
        .await
        .unwrap();
    assert!(verify(&pkey, SslSignatureAlgorithm::ECDSA_SECP256R1_SHA256, b"after", &sig));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panicking_thread_fails_its_batch_and_is_restarted() {
    let (signer, reg) = signer(SignerConfig { threads: 1, ..Default::default() });
    let pkey = rsa_key();
    let key = signer.register(pkey.clone());
    signer.hold(true);
    let mut queued = Vec::new();
    for i in 0..3u8 {
        let (s, k) = (signer.clone(), key.clone());
        queued.push(tokio::spawn(async move {
            s.sign(k, vec![i], SslSignatureAlgorithm::RSA_PSS_RSAE_SHA256).await
        }));
    }
    while signer.queue_depth() < 3 {
        tokio::task::yield_now().await;
    }
    signer.inject_panic_next_batch();
    signer.hold(false);
    // The first batch panics: all three requests when the key batches (IFMA), only the first
    // when it signs one at a time (a CPU without IFMA classes the key `other`). Every request of
    // that batch fails, and only those: the rest are signed by the replacement thread.
    let in_batch = if key.class == mbtunnel::signer::KeyClass::Other { 1 } else { 3 };
    for (i, q) in queued.into_iter().enumerate() {
        let r = tokio::time::timeout(Duration::from_secs(30), q).await.unwrap().unwrap();
        if i < in_batch {
            assert_eq!(r, Err(SignError::WorkerPanicked), "request {i} was in the panicked batch");
        } else {
            let sig = r.unwrap_or_else(|e| panic!("request {i} was not in the batch: {e}"));
            assert!(verify(&pkey, SslSignatureAlgorithm::RSA_PSS_RSAE_SHA256, &[i as u8], &sig));
        }
    }
    // The replacement thread is counted right after the unwind that failed the batch.
    for _ in 0..400 {
        if value(&metrics_text(&reg), "mbtunnel_signer_thread_restarts_total") >= 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(value(&metrics_text(&reg), "mbtunnel_signer_thread_restarts_total"), 1.0);
    let alg = SslSignatureAlgorithm::RSA_PSS_RSAE_SHA256;
    let sig = signer.sign(key, b"new".to_vec(), alg).await.expect("the restarted thread serves");
    assert!(verify(&pkey, alg, b"new", &sig));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_faulty_lane_fails_only_its_handshake() {
    if !test_backend().is_multi_buffer() {
        println!(
            "skipped: the process backend is forced to scalar ({})",
            mbtunnel::mb::BACKEND_ENV
        );
        return;
    }
    let (signer, reg) = signer(SignerConfig { threads: 1, ..Default::default() });
    let pkeys: Vec<_> = (0..4).map(|_| rsa_key()).collect();
    let keys: Vec<_> = pkeys.iter().map(|k| signer.register(k.clone())).collect();
    signer.hold(true);
    let alg = SslSignatureAlgorithm::RSA_PKCS1_SHA256;
    let mut queued = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        let (s, k) = (signer.clone(), k.clone());
        queued.push(tokio::spawn(async move { s.sign(k, vec![i as u8; 40], alg).await }));
        // One at a time, so that request i is lane i of the batch.
        while signer.queue_depth() < i + 1 {
            tokio::task::yield_now().await;
        }
    }
    signer.inject_fault_next_batch(0b0100);
    signer.hold(false);
    for (i, q) in queued.into_iter().enumerate() {
        let r = q.await.unwrap();
        if i == 2 {
            assert_eq!(r, Err(SignError::FaultCheck));
        } else {
            assert!(verify(&pkeys[i], alg, &[i as u8; 40], &r.unwrap()), "lane {i}");
        }
    }
    assert_eq!(value(&metrics_text(&reg), "mbtunnel_signer_fault_check_failures_total"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_under_load_registers_new_keys_and_retires_old() {
    let (signer, _reg) = signer(SignerConfig { threads: 2, ..Default::default() });
    let (side, dir) = providers("rot", &signer);
    let srv = Arc::new(servers(&side, 1).await);
    let me = id("cli", 0);
    for tls in &side.tls {
        tls.store().fetch(&me).await.unwrap();
    }
    let load = {
        let (side_tls, srv, me) = (side.tls.clone(), srv.clone(), me.clone());
        tokio::spawn(async move {
            let mut fails = 0;
            for round in 0..12 {
                let mut ts = Vec::new();
                for n in 0..16 {
                    let (addr, sid, a) = srv[n % srv.len()].clone();
                    let tls = side_tls[a].clone();
                    let me = me.clone();
                    ts.push(tokio::spawn(async move { handshake(&tls, &me, addr, &sid).await }));
                }
                for t in ts {
                    fails += t.await.unwrap().is_err() as usize;
                }
                let _ = round;
            }
            fails
        })
    };
    for _ in 0..4 {
        for (a, tls) in side.tls.iter().enumerate() {
            let store = tls.store().clone();
            let sid = srv.iter().find(|s| s.2 == a).unwrap().1.clone();
            store.renew(&sid).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(load.await.unwrap(), 0, "no handshake may fail during rotation");
    // One more handshake per server through the current contexts, then only current keys live.
    for (addr, sid, a) in srv.iter() {
        handshake(&side.tls[*a], &me, *addr, sid).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let live: usize = signer.keys().live().iter().map(|(_, n)| n).sum();
    // 2 server identities + 1 client identity in 2 providers = 4 current keys; each context pair
    // (acceptor + connector) registers its key twice.
    assert_eq!(live, 8, "old keys must retire once their contexts are gone");
    let _ = std::fs::remove_dir_all(dir);
}

/// Adaptive fill: sends `n` RSA-2048 requests `gap` apart, the first `held` of them while the
/// signer takes nothing, and returns (batches, lanes, fill holds) from the metrics.
async fn spaced_requests(
    fill_wait: Option<Duration>,
    held: usize,
    n: usize,
    gap: Duration,
) -> (f64, f64, f64) {
    let (signer, reg) = signer(SignerConfig { threads: 1, fill_wait, ..Default::default() });
    let pkey = rsa_key();
    let key = signer.register(pkey.clone());
    let alg = SslSignatureAlgorithm::RSA_PSS_RSAE_SHA256;
    signer.hold(held > 0);
    let mut pending = Vec::new();
    for i in 0..n {
        if i == held && held > 0 {
            signer.hold(false);
        }
        let (s, k) = (signer.clone(), key.clone());
        pending.push(tokio::spawn(async move { s.sign(k, vec![i as u8; 32], alg).await }));
        tokio::time::sleep(gap).await;
    }
    signer.hold(false);
    for (i, p) in pending.into_iter().enumerate() {
        let sig = p.await.unwrap().expect("signed");
        assert!(verify(&pkey, alg, &[i as u8; 32], &sig));
    }
    let t = metrics_text(&reg);
    (
        value(&t, "mbtunnel_signer_batch_size_count"),
        value(&t, "mbtunnel_signer_batch_size_sum"),
        value(&t, "mbtunnel_signer_fill_holds_total"),
    )
}

/// The gap between the spaced requests of the adaptive-fill test: 10 ms, or four times one
/// 8-lane RSA-2048 pass on the test backend when that is slower (the model's pass takes
/// milliseconds), so that a request never arrives while the previous one is still being signed
/// unless the rule held it. Sizes the stream; asserts nothing about time.
fn stream_gap(pkey: &PKey<Private>) -> Duration {
    let key = mbtunnel::mb::RsaPrivateKey::from_boring(&pkey.rsa().unwrap()).unwrap();
    let keys = [&key; 8];
    let msgs: [&[u8]; 8] = [b"gap"; 8];
    let algs = [SslSignatureAlgorithm::RSA_PSS_RSAE_SHA256; 8];
    let mut best = Duration::MAX;
    for _ in 0..3 {
        let t = std::time::Instant::now();
        let out = mbtunnel::mb::RsaBatch::sign_tls_with(test_backend(), &keys, &msgs, &algs);
        assert!(out.iter().all(Result::is_ok));
        best = best.min(t.elapsed());
    }
    (4 * best).max(Duration::from_millis(10))
}

/// Adaptive fill applies to the multi-buffer backends (IFMA, or the model where IFMA is
/// absent); only a forced scalar backend skips it, and says so.
fn ifma_or_skip() -> bool {
    let mb = test_backend().is_multi_buffer();
    if !mb {
        println!("skipped: adaptive fill needs a multi-buffer backend; scalar is forced");
    }
    mb
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adaptive_fill_holds_a_batch_open_while_requests_keep_arriving() {
    if !ifma_or_skip() {
        return;
    }
    // Two requests queue while the signer is held, then six more follow 10 ms apart (or four
    // batch times, on a backend as slow as the model): the arrival gap promises more lanes well
    // within the bound, so the batch of two is held
    // open and the stream fills it, instead of one batch of two and six singles.
    let gap = stream_gap(&rsa_key());
    let (batches, lanes, holds) = spaced_requests(Some(Duration::from_secs(5)), 2, 8, gap).await;
    println!("adaptive fill ({gap:?} apart): {batches} batches, {lanes} lanes, {holds} holds");
    assert_eq!(lanes, 8.0);
    assert!(holds >= 1.0, "the rule held the batch open");
    assert!(batches <= 3.0, "batches filled from the stream: {batches} batches for 8 requests");
    // The same stream with the rule off: every arrival is taken as it comes.
    let (batches, _, holds) = spaced_requests(Some(Duration::ZERO), 2, 8, gap).await;
    assert_eq!(holds, 0.0);
    assert!(batches >= 5.0, "without the rule the stream is signed as it arrives: {batches}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adaptive_fill_never_holds_a_lone_request() {
    if !ifma_or_skip() {
        return;
    }
    // A burst (so recent arrivals look busy), then requests one after another: however recent
    // the burst and however long the bound (5 s), a request alone in its queue starts at once.
    let (signer, reg) = signer(SignerConfig {
        threads: 1,
        fill_wait: Some(Duration::from_secs(5)),
        ..Default::default()
    });
    let pkey = rsa_key();
    let key = signer.register(pkey.clone());
    let alg = SslSignatureAlgorithm::RSA_PKCS1_SHA256;
    let burst: Vec<_> = (0..8u8)
        .map(|i| {
            let (s, k) = (signer.clone(), key.clone());
            tokio::spawn(async move { s.sign(k, vec![i; 32], alg).await })
        })
        .collect();
    for b in burst {
        b.await.unwrap().expect("signed");
    }
    let t = metrics_text(&reg);
    let (holds0, batches0) = (
        value(&t, "mbtunnel_signer_fill_holds_total"),
        value(&t, "mbtunnel_signer_batch_size_count"),
    );
    let wait0 = value(&t, "mbtunnel_signer_queue_wait_seconds_sum");
    let t0 = std::time::Instant::now();
    for i in 0..12u8 {
        let sig = signer.sign(key.clone(), vec![i; 32], alg).await.expect("signed");
        assert!(verify(&pkey, alg, &[i; 32], &sig));
    }
    let t = metrics_text(&reg);
    assert_eq!(value(&t, "mbtunnel_signer_fill_holds_total"), holds0, "a lone request was held");
    assert_eq!(value(&t, "mbtunnel_signer_batch_size_count") - batches0, 12.0);
    let wait = (value(&t, "mbtunnel_signer_queue_wait_seconds_sum") - wait0) / 12.0;
    println!("lone requests under a 5 s fill bound: mean queue wait {:.1} us", wait * 1e6);
    assert!(wait < 0.5, "a lone request waited {wait} s");
    assert!(t0.elapsed() < Duration::from_secs(4), "not delayed by the fill bound");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_requests_are_dropped_before_signing() {
    let (signer, reg) = signer(SignerConfig { threads: 1, ..Default::default() });
    let pkey = generate_key(KeyAlgorithm::EcdsaP256).unwrap();
    let key = signer.register(pkey.clone());
    let alg = SslSignatureAlgorithm::ECDSA_SECP256R1_SHA256;
    signer.hold(true);
    let mut tasks = Vec::new();
    for i in 0..4u8 {
        let (s, k) = (signer.clone(), key.clone());
        tasks.push(tokio::spawn(async move { s.sign(k, vec![i; 32], alg).await }));
    }
    while signer.queue_depth() < 4 {
        tokio::task::yield_now().await;
    }
    // The handshakes behind the first three requests go away (client gone, timeout).
    for t in tasks.drain(..3) {
        t.abort();
        assert!(t.await.unwrap_err().is_cancelled());
    }
    signer.hold(false);
    let last = tasks.pop().unwrap().await.unwrap().expect("the live request is signed");
    assert!(verify(&pkey, alg, &[3u8; 32], &last));
    let t = metrics_text(&reg);
    assert_eq!(value(&t, "mbtunnel_signer_abandoned_total"), 3.0, "{t}");
    assert_eq!(value(&t, "mbtunnel_signer_ops_total"), 1.0, "only the live request was signed");
    assert_eq!(signer.queue_depth(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbound_flood_neither_fails_nor_starves_outbound_signatures() {
    let limit = 16;
    let (signer, reg) =
        signer(SignerConfig { threads: 1, queue_limit: limit, ..Default::default() });
    let pkey = generate_key(KeyAlgorithm::EcdsaP256).unwrap();
    let key = signer.register(pkey.clone());
    let alg = SslSignatureAlgorithm::ECDSA_SECP256R1_SHA256;
    signer.hold(true);
    let spawn = |budget: Budget, i: u8| {
        let (s, k) = (signer.clone(), key.clone());
        tokio::spawn(async move { s.sign_for(budget, k, vec![i; 32], alg).await })
    };
    // The flood fills the inbound budget...
    let inbound: Vec<_> = (0..limit as u8).map(|i| spawn(Budget::Inbound, i)).collect();
    while signer.queue_depth() < limit {
        tokio::task::yield_now().await;
    }
    let refused = signer.sign_for(Budget::Inbound, key.clone(), b"more".to_vec(), alg).await;
    assert_eq!(refused, Err(SignError::QueueFull(limit)));
    // ...and outbound signatures still queue, on their own budget.
    let outbound: Vec<_> = (0..2u8).map(|i| spawn(Budget::Outbound, 100 + i)).collect();
    while signer.queue_depth() < limit + 2 {
        tokio::task::yield_now().await;
    }
    signer.note_taken_order(true);
    signer.hold(false);
    for (i, o) in outbound.into_iter().enumerate() {
        let sig = o.await.unwrap().expect("outbound signed despite the inbound flood");
        assert!(verify(&pkey, alg, &[100 + i as u8; 32], &sig));
    }
    for (i, t) in inbound.into_iter().enumerate() {
        assert!(verify(&pkey, alg, &[i as u8; 32], &t.await.unwrap().unwrap()));
    }
    // Batches interleave the budgets: the outbound requests, queued after the whole flood, were
    // not served after it (first-in first-out would take them last, at positions 16 and 17;
    // interleaved they are in the first batch of eight). The order is the one the signer thread
    // took the requests in, not the order the woken tasks happened to run in.
    let order = signer.taken_order();
    assert_eq!(order.len(), limit + 2, "{order:?}");
    let last_out = order.iter().rposition(|b| *b == Budget::Outbound).unwrap();
    assert!(last_out < 8, "outbound waited behind the flood: {order:?}");
    let t = metrics_text(&reg);
    assert_eq!(value(&t, "mbtunnel_signer_budget_rejected_total{budget=\"inbound\"}"), 1.0);
    assert_eq!(value(&t, "mbtunnel_signer_budget_rejected_total{budget=\"outbound\"}"), 0.0);
    let dump = signer.dump();
    assert_eq!(dump["budgets"]["inbound"]["limit"], limit);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_signer_signs_a_cheap_key_on_the_calling_thread() {
    let (signer, reg) = signer(SignerConfig { threads: 1, ..Default::default() });
    // Start-up calibration: measured, in the dump and in the metrics.
    let cal = signer.calibration();
    assert!(cal.handoff_us > 0.0 && cal.inline_max_us > 0.0, "{cal:?}");
    let p256 = *cal.single_op_us.get("ecdsa-p256").expect("P-256 calibrated at start-up");
    assert!(p256 > 0.0);
    assert_eq!(signer.dump()["calibration"]["handoff_us"].as_f64(), Some(cal.handoff_us));
    let t = metrics_text(&reg);
    assert!(value(&t, "mbtunnel_signer_calibrated_handoff_seconds") > 0.0, "{t}");
    assert!(value(&t, "mbtunnel_signer_calibrated_single_op_seconds{kind=\"ecdsa-p256\"}") > 0.0);
    let cheap = p256 <= cal.inline_max_us;
    println!("calibration: {cal:?}; P-256 inline: {cheap}");

    let pkey = generate_key(KeyAlgorithm::EcdsaP256).unwrap();
    let key = signer.register(pkey.clone());
    let alg = SslSignatureAlgorithm::ECDSA_SECP256R1_SHA256;
    while signer.threads_asleep() < 1 {
        tokio::task::yield_now().await; // the thread has just started
    }
    for i in 0..3u8 {
        let sig = signer.sign(key.clone(), vec![i; 32], alg).await.unwrap();
        assert!(verify(&pkey, alg, &[i; 32], &sig));
    }
    let t = metrics_text(&reg);
    let inline = value(&t, "mbtunnel_signer_inline_ops_total");
    assert_eq!(inline, if cheap { 3.0 } else { 0.0 }, "{t}");
    assert_eq!(value(&t, "mbtunnel_signer_ops_total"), 3.0);

    // An RSA key's first registration calibrates its kind too.
    let rsa = rsa_key();
    let _k = signer.register(rsa);
    assert!(signer.calibration().single_op_us.contains_key("rsa-2048"));
}

/// The model test backend, forced on any CPU: a held queue of eight RSA-2048 and eight P-256
/// requests becomes one 8-lane model pass per class (not BoringSSL single-op), every signature
/// verifies, and the metrics name the backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_model_backend_batches_on_any_cpu() {
    let s =
        Signer::start(SignerConfig { threads: 1, backend: Backend::Model, ..Default::default() });
    let mut reg = Registry::default();
    let choice = mbtunnel::mb::choose_backend(Some("model"), mbtunnel::mb::cpu_features()).unwrap();
    assert!(choice.reason.contains("TEST BACKEND"), "{}", choice.reason);
    s.metrics().register(&mut reg, &choice);
    let reg = std::sync::Mutex::new(reg);
    let rsa = rsa_key();
    let ec = generate_key(KeyAlgorithm::EcdsaP256).unwrap();
    let (rk, ek) = (s.register(rsa.clone()), s.register(ec.clone()));
    s.hold(true);
    let mut queued = Vec::new();
    for i in 0..8u8 {
        for (k, alg) in [
            (rk.clone(), SslSignatureAlgorithm::RSA_PSS_RSAE_SHA256),
            (ek.clone(), SslSignatureAlgorithm::ECDSA_SECP256R1_SHA256),
        ] {
            let s2 = s.clone();
            queued.push((alg, i, tokio::spawn(async move { s2.sign(k, vec![i; 48], alg).await })));
            // One at a time: a queued request keeps the signer from looking idle (an idle
            // signer may sign a cheap P-256 request on the calling thread instead).
            while s.queue_depth() < queued.len() {
                tokio::task::yield_now().await;
            }
        }
    }
    s.hold(false);
    for (alg, i, q) in queued {
        let sig = q.await.unwrap().expect("signed");
        let key = if alg == SslSignatureAlgorithm::ECDSA_SECP256R1_SHA256 { &ec } else { &rsa };
        assert!(verify(key, alg, &[i; 48], &sig), "{alg:?} {i}");
    }
    let t = metrics_text(&reg);
    for alg in ["rsa-2048", "ecdsa-p256"] {
        let ops = format!("mbtunnel_signer_ops_total{{algorithm=\"{alg}\",backend=\"model\"}}");
        assert_eq!(value(&t, &ops), 8.0, "{alg} signed in one model batch\n{t}");
    }
    assert!(t.contains("backend=\"model\""), "{t}");
}
