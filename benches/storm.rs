//! Storms, floods and rates (issue 15), each with its baseline in the same run:
//!
//! 1. identity storm: TLS contexts for N identities — memory and build time per identity, against
//!    contexts made the way they were before (`SslConnector::builder`, which loads the system
//!    trust store into every context);
//! 2. handshake storm: N TLS handshakes started at once against one server — median completion
//!    time as a share of the storm's duration, with the admission bound and without it, and
//!    where it comes from: when the TCP connects were done and how long each quarter of the
//!    handshakes took to finish;
//! 3. silent flood: F connections that never speak, sent to the HBONE port of a proxy limited to
//!    4,096 file descriptors, while a client makes L requests through two proxies — success rate;
//! 4. source-address dials: connections per second from one source address with
//!    `IP_BIND_ADDRESS_NO_PORT` (ours), with a plain `bind(ip, 0)` (before), and without a source
//!    address (the reference) — needs root (`IP_TRANSPARENT`).
//!
//! 5. handshake admission: fresh identities' connections to a node attacked by 300 and 5,000
//!    half-sent ClientHellos from one source and 2,000 from 2,000 sources — success ratio and
//!    p50/p99 against the same run without attackers; then 2,000 fresh identities from distinct
//!    sources at once — failures, p50/p99 and peak RSS.
//!
//! `cargo bench --bench storm` (all), or name parts: `cargo bench --bench storm -- identity
//! handshake flood dial admission`. STORM_PROBES (200), STORM_FRESH (2000) size part 5. Sizes: STORM_IDENTITIES (2000), STORM_HANDSHAKES (2000), STORM_BOUND
//! (the admission bound, default `max_concurrent_handshakes`), STORM_FLOOD
//! (5000), STORM_DIAL_SECS (60). Loopback blocks 127.0.91.x – 127.0.96.x, 127.1.x.x, 127.2.x.x.
//! The signers use the process backend: `MBTUNNEL_SIGNER_BACKEND=model STORM_HANDSHAKES=400
//! cargo bench --bench storm -- handshake` runs the batching rows on the model test backend on
//! any CPU (a check of the batch path, not a figure).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mbtunnel::config::KeyAlgorithm;
use mbtunnel::identity::ca::DevCa;
use mbtunnel::identity::store::CertStore;
use mbtunnel::identity::Identity;
use mbtunnel::metrics::Metrics;
use mbtunnel::signer::{Signer, SignerConfig};
use mbtunnel::tls::TlsProvider;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn id(i: usize) -> Identity {
    format!("spiffe://cluster.local/ns/storm/sa/sa-{i}").parse().unwrap()
}

fn provider(
    dir: &std::path::Path,
    key: KeyAlgorithm,
    limits: &mbtunnel::net::Limits,
) -> Arc<TlsProvider> {
    provider_and_signer(dir, key, limits).0
}

fn provider_and_signer(
    dir: &std::path::Path,
    key: KeyAlgorithm,
    limits: &mbtunnel::net::Limits,
) -> (Arc<TlsProvider>, Signer) {
    let ca = DevCa::load_or_create(dir, "cluster.local").unwrap();
    let store = Arc::new(CertStore::new(ca, key, Duration::from_secs(3600)));
    let signer = Signer::start(SignerConfig::default());
    let mut reg = prometheus_client::registry::Registry::default();
    let metrics = Arc::new(Metrics::new(&mut reg));
    let p = TlsProvider::new(store, signer.clone(), "cluster.local".into(), metrics);
    (Arc::new(p.with_limits(limits)), signer)
}

/// 1. Per-identity context cost, ours against contexts that load the system trust store.
async fn identity_storm() {
    let n = env_usize("STORM_IDENTITIES", 2000);
    let dir = std::env::temp_dir().join(format!("mbt-storm-ca-{}", std::process::id()));
    let tls = provider(&dir, KeyAlgorithm::EcdsaP256, &Default::default());
    // Certificates first (issuance is not what this measures).
    for i in 0..n {
        tls.store().fetch(&id(i)).await.unwrap();
    }
    let before = rss_bytes();
    let mut times = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        tls.prepare(&id(i)).await.unwrap();
        times.push(t.elapsed().as_secs_f64());
    }
    let total_rss = rss_bytes();
    let ours_rss = total_rss.saturating_sub(before) as f64 / n as f64;
    let ours_ms = median(times) * 1e3;
    // Before: one SslConnector::builder context per identity (it reads the system CA bundle).
    let before = rss_bytes();
    let mut kept = Vec::with_capacity(n);
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let b = boring::ssl::SslConnector::builder(boring::ssl::SslMethod::tls()).unwrap();
        kept.push(b.build());
        times.push(t.elapsed().as_secs_f64());
    }
    let old_rss = rss_bytes().saturating_sub(before) as f64 / n as f64;
    let old_ms = median(times) * 1e3;
    println!("identity storm, {n} identities ({}):", cpu_model());
    println!(
        "  ours (acceptor + connector per identity): {:.1} KB and {:.3} ms per identity",
        ours_rss / 1024.0,
        ours_ms
    );
    println!(
        "  before (SslConnector::builder alone, system trust store): {:.1} KB and {:.3} ms per identity",
        old_rss / 1024.0,
        old_ms
    );
    println!("  ours / before: memory {:.3}x, time {:.3}x", ours_rss / old_rss, ours_ms / old_ms);
    println!(
        "  process RSS with {n} identities' certificates and contexts (ours): {:.1} MB",
        total_rss as f64 / 1e6
    );
    drop(kept);
    let _ = std::fs::remove_dir_all(&dir);
}

/// One handshake storm's completion profile, in seconds from its start.
struct Storm {
    /// Median completion / duration.
    share: f64,
    duration: f64,
    /// When the last client TCP connect finished (the set-up every handshake waits behind).
    connected: f64,
    /// When a quarter, half and three quarters of the handshakes had finished.
    quarters: [f64; 3],
}

impl Storm {
    const STALLED: Storm =
        Storm { share: f64::NAN, duration: f64::NAN, connected: f64::NAN, quarters: [f64::NAN; 3] };

    /// Seconds each quarter of the handshakes took to finish.
    fn quarter_spans(&self) -> String {
        let q = self.quarters;
        let ends = [q[0], q[1], q[2], self.duration];
        let mut prev = 0.0;
        ends.iter()
            .map(|e| {
                let d = e - prev;
                prev = *e;
                format!("{d:.2}")
            })
            .collect::<Vec<_>>()
            .join(" / ")
    }
}

/// 2. N handshakes at once.
async fn one_storm(n: usize, max_concurrent: usize, dir: &std::path::Path) -> Storm {
    let limits = mbtunnel::net::Limits {
        max_concurrent_handshakes: max_concurrent,
        handshake_timeout: Duration::from_secs(600),
        ..Default::default()
    };
    let (server, server_signer) = provider_and_signer(dir, KeyAlgorithm::Rsa2048, &limits);
    let (client, client_signer) = provider_and_signer(dir, KeyAlgorithm::EcdsaP256, &limits);
    let (sid, cid) = (id(100_000), id(100_001));
    server.prepare(&sid).await.unwrap();
    client.prepare(&cid).await.unwrap();
    let l = mbtunnel::net::socket::listen("127.0.91.1:0".parse().unwrap(), false).unwrap();
    let addr = l.local_addr().unwrap();
    let srv = server.clone();
    let sid2 = sid.clone();
    let acceptor = tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let (srv, sid) = (srv.clone(), sid2.clone());
            tokio::spawn(async move {
                // As the inbound listener does: a handshake is admitted only once its ClientHello
                // arrives. Without this, the server's admission slots can all go to connections
                // whose client side is still waiting for one of its own, and the storm stalls.
                if !matches!(mbtunnel::net::socket::first_bytes(&s).await, Ok(true)) {
                    return;
                }
                if let Ok((mut tls, _)) = srv.accept(s, &sid).await {
                    use tokio::io::AsyncReadExt;
                    let mut b = [0u8; 1];
                    let _ = tls.read(&mut b).await;
                }
            });
        }
    });
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for _ in 0..n {
        let (client, cid, sid) = (client.clone(), cid.clone(), sid.clone());
        tasks.push(tokio::spawn(async move {
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let connected = start.elapsed().as_secs_f64();
            let tls = client.connect(tcp, &cid, &sid).await;
            let t = start.elapsed().as_secs_f64();
            (tls.is_ok(), t, connected)
        }));
    }
    let mut done = Vec::with_capacity(n);
    let mut connected: f64 = 0.0;
    let mut failed = 0;
    for t in tasks {
        let (ok, secs, conn) = match tokio::time::timeout(Duration::from_secs(120), t).await {
            Ok(r) => r.unwrap(),
            Err(_) => {
                // Stalled: say where, so the stall can be diagnosed, then give up on this storm.
                println!(
                    "  stalled after {} of {n} handshakes ({failed} failed); server signer: {}; \
                     client signer: {}",
                    done.len(),
                    server_signer.dump(),
                    client_signer.dump()
                );
                acceptor.abort();
                return Storm::STALLED;
            }
        };
        if !ok {
            failed += 1;
        }
        done.push(secs);
        connected = connected.max(conn);
    }
    let duration = start.elapsed().as_secs_f64();
    acceptor.abort();
    assert_eq!(failed, 0, "handshakes failed in the storm");
    done.sort_by(f64::total_cmp);
    let at = |f: f64| done[((n as f64 * f).ceil() as usize).clamp(1, n) - 1];
    Storm {
        share: done[n / 2] / duration,
        duration,
        connected,
        quarters: [at(0.25), at(0.5), at(0.75)],
    }
}

async fn handshake_storm() {
    let n = env_usize("STORM_HANDSHAKES", 2000);
    let dir = std::env::temp_dir().join(format!("mbt-storm-hs-{}", std::process::id()));
    let bounded =
        env_usize("STORM_BOUND", mbtunnel::net::Limits::default().max_concurrent_handshakes);
    // The signers follow MBTUNNEL_SIGNER_BACKEND: `model` runs the batching rows on the
    // portable model of the IFMA kernels (any CPU; its figures say nothing about production).
    let backend = mbtunnel::mb::backend_choice();
    println!(
        "handshake storm, {n} RSA-2048 server handshakes at once ({}; signer backend {}: {}):",
        cpu_model(),
        backend.backend,
        backend.reason
    );
    let mut rows = Vec::new();
    for round in 0..3 {
        // Interleaved: admission on, off, on, off…
        let limit = Duration::from_secs(300);
        let (Ok(on), Ok(off)) = (
            tokio::time::timeout(limit, one_storm(n, bounded, &dir)).await,
            tokio::time::timeout(limit, one_storm(n, 1 << 20, &dir)).await,
        ) else {
            println!("  round {round}: a storm did not finish within {limit:?}: no figure");
            return;
        };
        println!(
            "  round {round}: bounded to {bounded}: p50 at {:.2} of {:.2} s; unbounded: p50 at {:.2} of {:.2} s",
            on.share, on.duration, off.share, off.duration
        );
        for (name, s) in [("bounded", &on), ("unbounded", &off)] {
            println!(
                "    {name}: TCP connects done by {:.2} s; each quarter of the handshakes took {} s",
                s.connected,
                s.quarter_spans()
            );
        }
        rows.push((on, off));
    }
    let on = median(rows.iter().map(|r| r.0.share).collect());
    let off = median(rows.iter().map(|r| r.1.share).collect());
    let (don, doff) = (
        median(rows.iter().map(|r| r.0.duration).collect()),
        median(rows.iter().map(|r| r.1.duration).collect()),
    );
    println!(
        "  medians: p50 / duration = {on:.2} bounded ({don:.2} s), {off:.2} unbounded ({doff:.2} s)"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// 3. Silent connections in a child process against a proxy held to 4,096 descriptors.
async fn silent_flood() {
    let flood = env_usize("STORM_FLOOD", 5000);
    let legit = 200;
    let net = 92u8;
    let ca_dir = std::env::temp_dir().join(format!("mbt-storm-flood-{}", std::process::id()));
    let ip = |h: u8| IpAddr::from([127, 0, net, h]);
    let cfg = |node: &str, me: u8, out: String| {
        let yaml = format!(
            r#"
node_name: {node}
ca_dir: {ca}
outbound_addr: "{out}"
inbound_addr: "127.0.{net}.{me}:15008"
inbound_plaintext_addr: "127.0.{net}.{me}:15006"
metrics_addr: "127.0.{net}.{me}:15020"
readiness_addr: "127.0.{net}.{me}:15021"
admin_addr: "127.0.{net}.{me}:15000"
workloads:
  - {{uid: client-1, name: client, namespace: demo, service_account: client, ips: ["127.0.{net}.2"], node: node-a}}
  - {{uid: echo-1, name: echo, namespace: demo, service_account: echo, ips: ["127.0.{net}.3"], node: node-b}}
services:
  - {{name: echo, namespace: demo, vips: ["127.0.{net}.50"], ports: [{{port: 8080}}], workloads: [echo-1]}}
"#,
            ca = ca_dir.display()
        );
        mbtunnel::config::Config::from_yaml(&yaml, std::path::Path::new("storm.yaml")).unwrap()
    };
    // Echo server.
    let echo = tokio::net::TcpListener::bind(SocketAddr::new(ip(3), 8080)).await.unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = echo.accept().await else { return };
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    let b =
        mbtunnel::app::start(cfg("node-b", 3, format!("127.0.{net}.3:15001")), None).await.unwrap();
    let a =
        mbtunnel::app::start(cfg("node-a", 2, format!("127.0.{net}.50:8080")), None).await.unwrap();
    assert!(
        a.wait_ready(Duration::from_secs(30)).await && b.wait_ready(Duration::from_secs(30)).await
    );
    // The proxies (this process) get 4,096 descriptors; the flood comes from a child process.
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit on a live, properly sized struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        r.rlim_cur = 4096;
        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
    }
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .env("STORM_FLOOD_CHILD", format!("127.0.{net}.3:15008,{flood}"))
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut ok = 0;
    for i in 0..legit {
        let r = tokio::time::timeout(Duration::from_secs(10), async {
            let s = tokio::net::TcpSocket::new_v4()?;
            s.bind(SocketAddr::new(ip(2), 0))?;
            let mut c = s.connect(SocketAddr::new(ip(50), 8080)).await?;
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let msg = format!("request {i}");
            c.write_all(msg.as_bytes()).await?;
            let mut back = vec![0u8; msg.len()];
            c.read_exact(&mut back).await?;
            Ok::<_, std::io::Error>(back == msg.as_bytes())
        })
        .await;
        if matches!(r, Ok(Ok(true))) {
            ok += 1;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let text = b.metrics_text();
    let evicted = text
        .lines()
        .filter(|l| l.contains("reason=\"tls_pending_"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>();
    println!(
        "silent flood: {flood} silent connections to 15008, proxies limited to 4096 fds ({}):",
        cpu_model()
    );
    println!(
        "  legitimate requests through both proxies: {ok}/{legit} ({:.1} %), pending handshakes evicted: {evicted}",
        100.0 * ok as f64 / legit as f64
    );
    a.shutdown().await;
    b.shutdown().await;
    let _ = std::fs::remove_dir_all(&ca_dir);
}

/// The flood itself, in the child: `addr,count` silent connections held until killed.
fn flood_child(spec: &str) {
    let (addr, n) = spec.split_once(',').unwrap();
    let addr: SocketAddr = addr.parse().unwrap();
    let n: usize = n.parse().unwrap();
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: as above.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        r.rlim_cur = r.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
    }
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        // Non-blocking connects: the kernel completes them whether or not the proxy accepts.
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.set_nonblocking(true).unwrap();
        let _ = s.connect(&addr.into());
        held.push(s);
    }
    std::thread::sleep(Duration::from_secs(3600));
}

/// Address of fresh identity `i` (127.1.x.y, one /24 per 250).
fn fresh_ip(i: usize) -> IpAddr {
    IpAddr::from([127, 1, (i / 250) as u8, (i % 250 + 1) as u8])
}

/// The peak resident set of this process (VmHWM), bytes.
fn peak_rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// The first 71 bytes of a ClientHello (a record announcing 512): the server must wait for more.
fn half_client_hello() -> Vec<u8> {
    let mut b = vec![0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03];
    b.resize(71, 0x5a);
    b
}

/// Fresh identities `ids`, each one connection through both proxies (a full handshake at the
/// server), all at once or one after another: (succeeded, latencies in seconds).
async fn fresh_connections(
    ids: std::ops::Range<usize>,
    vip: SocketAddr,
    at_once: bool,
) -> (usize, Vec<f64>) {
    let one = move |i: usize| async move {
        let t = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(30), async {
            let s = tokio::net::TcpSocket::new_v4()?;
            s.bind(SocketAddr::new(fresh_ip(i), 0))?;
            let mut c = s.connect(vip).await?;
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            c.write_all(b"ping").await?;
            let mut back = [0u8; 4];
            c.read_exact(&mut back).await?;
            Ok::<_, std::io::Error>(&back == b"ping")
        })
        .await;
        (matches!(r, Ok(Ok(true))), t.elapsed().as_secs_f64())
    };
    let mut results = Vec::new();
    if at_once {
        let tasks: Vec<_> = ids.map(|i| tokio::spawn(one(i))).collect();
        for t in tasks {
            results.push(t.await.unwrap());
        }
    } else {
        for i in ids {
            results.push(one(i).await);
        }
    }
    let ok = results.iter().filter(|r| r.0).count();
    let mut lat: Vec<f64> = results.iter().map(|r| r.1).collect();
    lat.sort_by(f64::total_cmp);
    (ok, lat)
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// Half ClientHellos from `sources` addresses (127.2.x.y; 127.0.96.1 when one), `n` in all,
/// held until dropped.
async fn half_hellos(n: usize, sources: usize, hbone: SocketAddr) -> Vec<tokio::net::TcpStream> {
    let mut held = Vec::with_capacity(n);
    for i in 0..n {
        let src = if sources == 1 {
            IpAddr::from([127, 0, 96, 1])
        } else {
            let j = i % sources;
            IpAddr::from([127, 2, (j / 250) as u8, (j % 250 + 1) as u8])
        };
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind(SocketAddr::new(src, 0)).unwrap();
        if let Ok(mut c) = s.connect(hbone).await {
            use tokio::io::AsyncWriteExt;
            let _ = c.write_all(&half_client_hello()).await;
            held.push(c);
        }
    }
    held
}

/// Part 5, handshake admission (issue 30): fresh identities connecting to a node that
/// unauthenticated peers attack with half-sent ClientHellos, against the same run without
/// attackers; and a storm of fresh identities from distinct sources, all at once.
async fn admission() {
    let probes = env_usize("STORM_PROBES", 200);
    let storm = env_usize("STORM_FRESH", 2000);
    let net = 95u8;
    let ca_dir = std::env::temp_dir().join(format!("mbt-storm-adm-{}", std::process::id()));
    let clients = 4 * probes + storm;
    let mut workloads = String::new();
    for i in 0..clients {
        workloads.push_str(&format!(
            "  - {{uid: c-{i}, name: c-{i}, namespace: storm, service_account: sa-{i}, ips: [\"{}\"], node: node-a}}\n",
            fresh_ip(i)
        ));
    }
    let cfg = |node: &str, me: u8, out: String| {
        let yaml = format!(
            r#"
node_name: {node}
ca_dir: {ca}
outbound_addr: "{out}"
inbound_addr: "127.0.{net}.{me}:15008"
inbound_plaintext_addr: "127.0.{net}.{me}:15006"
metrics_addr: "127.0.{net}.{me}:15020"
readiness_addr: "127.0.{net}.{me}:15021"
admin_addr: "127.0.{net}.{me}:15000"
workloads:
{workloads}  - {{uid: echo-1, name: echo, namespace: demo, service_account: echo, ips: ["127.0.{net}.3"], node: node-b}}
services:
  - {{name: echo, namespace: demo, vips: ["127.0.{net}.50"], ports: [{{port: 8080}}], workloads: [echo-1]}}
"#,
            ca = ca_dir.display()
        );
        mbtunnel::config::Config::from_yaml(&yaml, std::path::Path::new("storm.yaml")).unwrap()
    };
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit on a live, properly sized struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        r.rlim_cur = r.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
    }
    let echo = tokio::net::TcpListener::bind(SocketAddr::new(IpAddr::from([127, 0, net, 3]), 8080))
        .await
        .unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = echo.accept().await else { return };
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    let b =
        mbtunnel::app::start(cfg("node-b", 3, format!("127.0.{net}.3:15001")), None).await.unwrap();
    let a =
        mbtunnel::app::start(cfg("node-a", 2, format!("127.0.{net}.50:8080")), None).await.unwrap();
    assert!(
        a.wait_ready(Duration::from_secs(30)).await && b.wait_ready(Duration::from_secs(30)).await
    );
    // Certificates first: issuance is not what this measures.
    for i in 0..clients {
        let id: Identity = format!("spiffe://cluster.local/ns/storm/sa/sa-{i}").parse().unwrap();
        a.ctx.tls.prepare(&id).await.unwrap();
    }
    let vip = SocketAddr::new(IpAddr::from([127, 0, net, 50]), 8080);
    let hbone = SocketAddr::new(IpAddr::from([127, 0, net, 3]), 15008);
    println!(
        "handshake admission: {probes} fresh identities one after another to the attacked node, \
         ECDSA P-256, defaults ({}):",
        cpu_model()
    );
    let row = |name: &str, ok: usize, n: usize, lat: &[f64], base: Option<f64>| {
        let ratio = base
            .map(|b| format!(", p99 {:.2}x the control's", pct(lat, 0.99) / b))
            .unwrap_or_default();
        println!(
            "  {name}: {ok}/{n} succeeded ({:.1} %), p50 {:.1} ms, p99 {:.1} ms{ratio}",
            100.0 * ok as f64 / n as f64,
            pct(lat, 0.5) * 1e3,
            pct(lat, 0.99) * 1e3
        );
    };
    let (ok, lat) = fresh_connections(0..probes, vip, false).await;
    row("control, no attackers", ok, probes, &lat, None);
    let base = pct(&lat, 0.99);
    for (k, (n, sources)) in [(300, 1), (5000, 1), (2000, 2000)].into_iter().enumerate() {
        let held = half_hellos(n, sources, hbone).await;
        let pending = b.ctx.pending.len();
        let ids = probes * (k + 1)..probes * (k + 2);
        let (ok, lat) = fresh_connections(ids, vip, false).await;
        row(
            &format!(
                "{n} half ClientHellos from {sources} source(s) ({} connected, {pending} pending)",
                held.len()
            ),
            ok,
            probes,
            &lat,
            Some(base),
        );
        drop(held);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let rss_before = rss_bytes();
    let t = Instant::now();
    let (ok, lat) = fresh_connections(4 * probes..4 * probes + storm, vip, true).await;
    let secs = t.elapsed().as_secs_f64();
    println!(
        "  storm: {storm} fresh identities from {storm} sources at once: {ok}/{storm} succeeded, \
         {} failed; p50 {:.0} ms, p99 {:.0} ms, all done in {secs:.2} s; process RSS {:.0} MB \
         before, peak {:.0} MB (both proxies and the clients)",
        storm - ok,
        pct(&lat, 0.5) * 1e3,
        pct(&lat, 0.99) * 1e3,
        rss_before as f64 / 1e6,
        peak_rss_bytes() as f64 / 1e6
    );
    let text = b.metrics_text();
    let refusals: Vec<&str> =
        text.lines().filter(|l| l.starts_with("mbtunnel_connections_refused_total{")).collect();
    println!(
        "  server refusals over the run: {}",
        if refusals.is_empty() { "none".to_string() } else { refusals.join("; ") }
    );
    a.shutdown().await;
    b.shutdown().await;
    let _ = std::fs::remove_dir_all(&ca_dir);
}

/// 4. Dials per second from one source address.
async fn dial_rate() {
    let secs = env_usize("STORM_DIAL_SECS", 60) as u64;
    let l = mbtunnel::net::socket::listen("127.0.93.1:0".parse().unwrap(), false).unwrap();
    let dst = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            if let Ok((s, _)) = l.accept().await {
                drop(s);
            }
        }
    });
    let src: IpAddr = "127.0.94.2".parse().unwrap();
    let ours = |source| mbtunnel::net::socket::DialOpts {
        mark: 0,
        source,
        netns: None,
        timeout: Duration::from_secs(5),
    };
    let run = |kind: &'static str| async move {
        let end = Instant::now() + Duration::from_secs(secs);
        let (mut n, mut failed) = (0u64, 0u64);
        while Instant::now() < end {
            let r = match kind {
                "plain" => mbtunnel::net::socket::dial(dst, ours(None)).await,
                "ours" => mbtunnel::net::socket::dial(dst, ours(Some(src))).await,
                _ => {
                    // Before: bind(ip, 0) picks a port free for every destination.
                    let s = tokio::net::TcpSocket::new_v4().unwrap();
                    let _ = socket2::SockRef::from(&s).set_ip_transparent_v4(true);
                    match s.bind(SocketAddr::new(src, 0)) {
                        Ok(()) => s.connect(dst).await,
                        Err(e) => Err(e),
                    }
                }
            };
            match r {
                Ok(_) => n += 1,
                Err(_) => failed += 1,
            }
        }
        (n as f64 / secs as f64, failed)
    };
    println!("dials from one source address, {secs} s each ({}):", cpu_model());
    let plain = run("plain").await;
    // TIME_WAIT from one run would slow the next: wait it out (60 s on Linux).
    tokio::time::sleep(Duration::from_secs(61)).await;
    let ours_r = run("ours").await;
    tokio::time::sleep(Duration::from_secs(61)).await;
    let before = run("before").await;
    println!("  no source address (reference): {:.0}/s ({} failed)", plain.0, plain.1);
    println!(
        "  source address, IP_BIND_ADDRESS_NO_PORT (ours): {:.0}/s ({} failed), {:.2}x the reference",
        ours_r.0,
        ours_r.1,
        ours_r.0 / plain.0
    );
    println!(
        "  source address, bind(ip, 0) (before): {:.0}/s ({} failed), {:.2}x the reference",
        before.0,
        before.1,
        before.0 / plain.0
    );
}

fn main() {
    if let Ok(spec) = std::env::var("STORM_FLOOD_CHILD") {
        return flood_child(&spec);
    }
    // `cargo test --all-targets` runs this binary without `--bench`: a smoke run only.
    if !std::env::args().any(|a| a == "--bench") {
        std::env::set_var("STORM_IDENTITIES", "20");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(identity_storm());
        return;
    }
    let parts: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let want = |p: &str| parts.is_empty() || parts.iter().any(|x| x == p);
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        if want("identity") {
            identity_storm().await;
        }
        if want("handshake") {
            handshake_storm().await;
        }
        if want("flood") {
            silent_flood().await;
        }
        if want("dial") {
            dial_rate().await;
        }
        if want("admission") {
            admission().await;
        }
    });
}
