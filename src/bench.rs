//! `mbtunnel bench handshakes`: concurrent mutual-TLS handshakes between two in-process "proxies"
//! (a client side and a server side, each with its own signer, as two nodes would have) over
//! loopback, comparing the signer on the IFMA backend, the signer on the scalar backend, and
//! inline BoringSSL signing with no signer — all measured in the same run.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::config::KeyAlgorithm;
use crate::identity::ca::DevCa;
use crate::identity::store::CertStore;
use crate::identity::Identity;
use crate::mb::Backend;
use crate::metrics::Metrics;
use crate::signer::{Signer, SignerConfig};
use crate::tls::TlsProvider;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// The batching signer on the multi-buffer backend.
    SignerIfma,
    /// The batching signer on BoringSSL single-op.
    SignerScalar,
    /// No signer: BoringSSL signs inline inside the handshake.
    Inline,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::SignerIfma => "signer-ifma",
            Mode::SignerScalar => "signer-scalar",
            Mode::Inline => "inline",
        }
    }
}

#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub duration: Duration,
    pub concurrency: Vec<usize>,
    pub keys: Vec<KeyAlgorithm>,
    pub modes: Vec<Mode>,
    /// Signer threads per side (0 = the signer's default sizing).
    pub signer_threads: usize,
    /// Adaptive fill bound for every class (`None` = the signer's per-class defaults, zero = off).
    pub fill_wait: Option<Duration>,
    /// Rounds per point (modes interleaved); figures are medians over the rounds.
    pub repeat: usize,
    /// TLS 1.3 resumption on both sides, the client offering the session it got from its
    /// previous connection (as two mbtunnel peers do); off: every handshake is full.
    pub resumption: bool,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            duration: Duration::from_secs(2),
            concurrency: vec![1, 8, 64, 256],
            keys: vec![KeyAlgorithm::Rsa2048, KeyAlgorithm::EcdsaP256],
            modes: vec![Mode::SignerIfma, Mode::SignerScalar, Mode::Inline],
            signer_threads: 0,
            fill_wait: None,
            repeat: 1,
            resumption: false,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchRow {
    pub key: KeyAlgorithm,
    pub mode: Mode,
    pub concurrency: usize,
    pub handshakes: usize,
    pub failures: usize,
    /// Handshakes that resumed a session (only with `resumption`).
    pub resumed: usize,
    pub handshakes_per_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Mean requests per signer batch (both sides); `None` inline, or when nothing was signed.
    pub mean_batch: Option<f64>,
    /// Process CPU seconds (user + system) per 1000 handshakes.
    pub cpu_s_per_1000: f64,
    /// handshakes/s relative to inline at the same key and concurrency.
    pub vs_inline: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// The CPU the figures were measured on (model name).
    pub cpu: String,
    pub cpus: usize,
    pub seconds_per_point: f64,
    /// Rounds per point; each figure is the median over them.
    pub repeat: usize,
    pub resumption: bool,
    pub rows: Vec<BenchRow>,
}

/// Process CPU time (user + system) from `/proc/self/stat`, in seconds.
pub fn process_cpu_seconds() -> f64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/stat") else { return 0.0 };
    // Fields after the command name (which may contain spaces) start at ") ".
    let rest = s.rsplit_once(") ").map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the name.
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

struct Side {
    tls: Arc<TlsProvider>,
    signer: Option<Signer>,
}

fn side(
    dir: &std::path::Path,
    key: KeyAlgorithm,
    mode: Mode,
    threads: usize,
    fill_wait: Option<Duration>,
    resumption: bool,
) -> anyhow::Result<Side> {
    let ca = DevCa::load_or_create(dir, "cluster.local")?;
    let store = Arc::new(CertStore::new(ca, key, Duration::from_secs(3600)));
    let backend = if mode == Mode::SignerIfma { Backend::Ifma } else { Backend::Scalar };
    let signer = Signer::start(SignerConfig { threads, backend, fill_wait, ..Default::default() });
    let mut reg = prometheus_client::registry::Registry::default();
    let metrics = Arc::new(Metrics::new(&mut reg));
    let mut tls = TlsProvider::new(store, signer.clone(), "cluster.local".into(), metrics)
        .with_resumption(resumption);
    if mode == Mode::Inline {
        tls = tls.with_inline_signing();
    }
    Ok(Side { tls: Arc::new(tls), signer: (mode != Mode::Inline).then_some(signer) })
}

fn batch_totals(s: &Option<Signer>) -> (f64, f64) {
    let Some(s) = s else { return (0.0, 0.0) };
    let mut reg = prometheus_client::registry::Registry::default();
    s.metrics().register(&mut reg, crate::mb::backend_choice());
    let mut t = String::new();
    let _ = prometheus_client::encoding::text::encode(&mut t, &reg);
    let sum = |p: &str| -> f64 {
        t.lines()
            .filter(|l| l.starts_with(p))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    (sum("mbtunnel_signer_batch_size_sum"), sum("mbtunnel_signer_batch_size_count"))
}

/// Runs the benchmark. Blocking: builds its own runtime with two worker threads.
pub fn run(opts: &BenchOptions) -> anyhow::Result<BenchReport> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(run_async(opts))
}

struct Running {
    mode: Mode,
    client: Side,
    server: Side,
    addr: std::net::SocketAddr,
    acceptor: tokio::task::JoinHandle<()>,
}

async fn start_pair(
    dir: &std::path::Path,
    key: KeyAlgorithm,
    mode: Mode,
    opts: &BenchOptions,
    server_id: &Identity,
    client_id: &Identity,
) -> anyhow::Result<Running> {
    let (threads, fill, resume) = (opts.signer_threads, opts.fill_wait, opts.resumption);
    let server = side(dir, key, mode, threads, fill, resume)?;
    let client = side(dir, key, mode, threads, fill, resume)?;
    server.tls.store().fetch(server_id).await?;
    client.tls.store().fetch(client_id).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stls = server.tls.clone();
    let sid = server_id.clone();
    let acceptor = tokio::spawn(async move {
        loop {
            let Ok((s, _)) = listener.accept().await else { return };
            let _ = s.set_nodelay(true);
            let (tls, sid) = (stls.clone(), sid.clone());
            tokio::spawn(async move {
                if let Ok((mut s, _)) = tls.accept(s, &sid).await {
                    let _ = s.write_all(b"k").await;
                    let _ = s.shutdown().await;
                }
            });
        }
    });
    Ok(Running { mode, client, server, addr, acceptor })
}

/// One measured point: `conc` clients doing back-to-back handshakes for `duration`.
async fn measure(
    r: &Running,
    key: KeyAlgorithm,
    conc: usize,
    duration: Duration,
    resume: bool,
    server_id: &Identity,
    client_id: &Identity,
) -> anyhow::Result<BenchRow> {
    let (b0s, b0c) = (batch_totals(&r.server.signer), batch_totals(&r.client.signer));
    let cpu0 = process_cpu_seconds();
    let start = Instant::now();
    let end = start + duration;
    let addr = r.addr;
    let mut tasks = Vec::new();
    for _ in 0..conc {
        let (tls, cid, sid) = (r.client.tls.clone(), client_id.clone(), server_id.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let (mut fails, mut resumed) = (0usize, 0usize);
            while Instant::now() < end {
                let t = Instant::now();
                let ok = async {
                    let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
                    let _ = tcp.set_nodelay(true);
                    let dest = resume.then_some(addr);
                    let mut s = tls.connect_to(tcp, &cid, &sid, dest).await.ok()?;
                    let mut b = [0u8; 1];
                    // Tickets arrive before this byte, so the next connection can offer one.
                    s.read_exact(&mut b).await.ok()?;
                    Some(s.ssl().session_reused())
                }
                .await;
                match ok {
                    Some(r) => {
                        lat.push(t.elapsed().as_secs_f64() * 1e3);
                        resumed += usize::from(r);
                    }
                    None => fails += 1,
                }
            }
            (lat, fails, resumed)
        }));
    }
    let mut lat = Vec::new();
    let (mut failures, mut resumed) = (0, 0);
    for t in tasks {
        let (l, f, r) = t.await?;
        lat.extend(l);
        failures += f;
        resumed += r;
    }
    let wall = start.elapsed().as_secs_f64();
    let cpu = process_cpu_seconds() - cpu0;
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let pct =
        |p: f64| lat.get(((lat.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(0.0);
    let (b1s, b1c) = (batch_totals(&r.server.signer), batch_totals(&r.client.signer));
    let (sum, count) = ((b1s.0 - b0s.0) + (b1c.0 - b0c.0), (b1s.1 - b0s.1) + (b1c.1 - b0c.1));
    let n = lat.len();
    eprintln!("bench: {key:?} {} c={conc}: {:.0} hs/s", r.mode.as_str(), n as f64 / wall);
    Ok(BenchRow {
        key,
        mode: r.mode,
        concurrency: conc,
        handshakes: n,
        failures,
        resumed,
        handshakes_per_s: n as f64 / wall,
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        mean_batch: (count > 0.0).then(|| sum / count),
        cpu_s_per_1000: if n > 0 { cpu / n as f64 * 1000.0 } else { 0.0 },
        vs_inline: None,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The median of each figure over repeats of one point; `vs_inline` is the median of the
/// per-round ratios against the inline point measured next to it, and the mean batch the median
/// over the rounds that signed at all (with resumption a round may sign nothing: that round has
/// no batch size, not a batch size of 0).
fn median_row(rows: &[BenchRow]) -> BenchRow {
    let m = |f: &dyn Fn(&BenchRow) -> f64| median(rows.iter().map(f).collect());
    let ratios: Vec<f64> = rows.iter().filter_map(|r| r.vs_inline).collect();
    let batches: Vec<f64> = rows.iter().filter_map(|r| r.mean_batch).collect();
    BenchRow {
        handshakes: rows.iter().map(|r| r.handshakes).sum(),
        failures: rows.iter().map(|r| r.failures).sum(),
        resumed: rows.iter().map(|r| r.resumed).sum(),
        handshakes_per_s: m(&|r| r.handshakes_per_s),
        p50_ms: m(&|r| r.p50_ms),
        p99_ms: m(&|r| r.p99_ms),
        mean_batch: (!batches.is_empty()).then(|| median(batches)),
        cpu_s_per_1000: m(&|r| r.cpu_s_per_1000),
        vs_inline: (!ratios.is_empty()).then(|| median(ratios)),
        ..rows[0].clone()
    }
}

async fn run_async(opts: &BenchOptions) -> anyhow::Result<BenchReport> {
    let dir = std::env::temp_dir().join(format!("mbtunnel-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let server_id: Identity = "spiffe://cluster.local/ns/bench/sa/server".parse()?;
    let client_id: Identity = "spiffe://cluster.local/ns/bench/sa/client".parse()?;
    let mut rows = Vec::new();
    for &key in &opts.keys {
        // Every mode's pair of sides is up at once and the modes take turns at each point, so
        // that a ratio compares figures measured seconds apart (this machine is shared).
        let mut pairs = Vec::new();
        for &mode in &opts.modes {
            if mode == Mode::SignerIfma && !crate::mb::cpu_features().ifma_capable() {
                eprintln!("bench: skipping signer-ifma: CPU lacks AVX-512 IFMA");
                continue;
            }
            pairs.push(start_pair(&dir, key, mode, opts, &server_id, &client_id).await?);
        }
        for &conc in &opts.concurrency {
            let mut runs: Vec<Vec<BenchRow>> = vec![Vec::new(); pairs.len()];
            for _ in 0..opts.repeat.max(1) {
                let mut round = Vec::new();
                for p in &pairs {
                    let (d, resume) = (opts.duration, opts.resumption);
                    round.push(measure(p, key, conc, d, resume, &server_id, &client_id).await?);
                }
                let base = round
                    .iter()
                    .find(|r| r.mode == Mode::Inline)
                    .map(|r| r.handshakes_per_s)
                    .filter(|b| *b > 0.0);
                for (i, mut r) in round.into_iter().enumerate() {
                    r.vs_inline = base.map(|b| r.handshakes_per_s / b);
                    runs[i].push(r);
                }
            }
            rows.extend(runs.iter().map(|r| median_row(r)));
        }
        for p in pairs {
            p.acceptor.abort();
        }
    }
    rows.sort_by_key(|r| {
        (
            opts.keys.iter().position(|k| *k == r.key),
            opts.modes.iter().position(|m| *m == r.mode),
            r.concurrency,
        )
    });
    let _ = std::fs::remove_dir_all(&dir);
    Ok(BenchReport {
        cpu: crate::mb::cpu_description(),
        cpus: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        seconds_per_point: opts.duration.as_secs_f64(),
        repeat: opts.repeat.max(1),
        resumption: opts.resumption,
        rows,
    })
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "mTLS handshakes, client and server sides in one process ({} CPUs), {:.1} s per point, \
             median of {} interleaved round(s), resumption {}",
            self.cpus,
            self.seconds_per_point,
            self.repeat,
            if self.resumption { "on (share resumed in the last column)" } else { "off" }
        )?;
        writeln!(f, "CPU: {} (AVX-512 features: {})", self.cpu, crate::mb::cpu_features())?;
        writeln!(
            f,
            "{:<10} {:<14} {:>5} {:>9} {:>8} {:>8} {:>8} {:>10} {:>9} {:>5} {:>8}",
            "key",
            "mode",
            "conc",
            "hs/s",
            "vs inl",
            "p50 ms",
            "p99 ms",
            "mean batch",
            "cpu s/1k",
            "fail",
            "resumed"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{:<10} {:<14} {:>5} {:>9.0} {:>8} {:>8.2} {:>8.2} {:>10} {:>9.2} {:>5} {:>8.2}",
                format!("{:?}", r.key).to_lowercase(),
                r.mode.as_str(),
                r.concurrency,
                r.handshakes_per_s,
                r.vs_inline.map(|v| format!("{v:.2}x")).unwrap_or_else(|| "-".into()),
                r.p50_ms,
                r.p99_ms,
                r.mean_batch.map(|v| format!("{v:.2}")).unwrap_or_else(|| "-".into()),
                r.cpu_s_per_1000,
                r.failures,
                r.resumed as f64 / r.handshakes.max(1) as f64
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(mean_batch: Option<f64>) -> BenchRow {
        BenchRow {
            key: KeyAlgorithm::EcdsaP256,
            mode: Mode::SignerScalar,
            concurrency: 1,
            handshakes: 10,
            failures: 0,
            resumed: 0,
            handshakes_per_s: 100.0,
            p50_ms: 1.0,
            p99_ms: 2.0,
            mean_batch,
            cpu_s_per_1000: 1.0,
            vs_inline: None,
        }
    }

    #[test]
    fn a_round_that_signed_nothing_has_no_batch_size_in_the_median() {
        // With resumption one round signs once (the first, full handshake), the next not at all.
        assert_eq!(median_row(&[row(Some(1.0)), row(None)]).mean_batch, Some(1.0));
        assert_eq!(median_row(&[row(None), row(Some(2.0)), row(Some(4.0))]).mean_batch, Some(3.0));
        assert_eq!(median_row(&[row(None), row(None)]).mean_batch, None);
    }
}
