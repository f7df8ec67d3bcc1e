//! The Grafana dashboard (`deploy/grafana/mbtunnel-dashboard.json`) against a real Prometheus:
//! Debian's `prometheus` (installed by `make test`), started here as a process, scrapes two
//! mbtunnel nodes on loopback that take their state and certificates from a control plane of our
//! own (as from istiod), while traffic flows: new client identities one after another (new HBONE
//! connections, so handshakes and signatures), a client a DENY policy refuses, DNS queries (mesh
//! names answered, an outside name forwarded), and a control-plane outage (an xDS termination).
//! Then every query of every panel is sent to Prometheus' HTTP API and must return at least one
//! series with a finite value. Grafana's `$__rate_interval` becomes `1m` here.
mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::cp::{self, node_config, ControlPlane};
use common::{ip, start_echo};
use mbtunnel::xds::{ADDRESS_TYPE, AUTHORIZATION_TYPE};

const NET: u8 = 88;
/// Client workloads on node A, each with its own service account: 127.0.88.10 ..
const CLIENTS: u8 = 6;
const INTRUDER: u8 = 20;

fn dashboard() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/grafana/mbtunnel-dashboard.json")
}

/// Every query of the dashboard, with the title of its panel.
fn queries(d: &serde_json::Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack: Vec<&serde_json::Value> =
        d["panels"].as_array().expect("panels").iter().collect();
    while let Some(p) = stack.pop() {
        if let Some(inner) = p["panels"].as_array() {
            stack.extend(inner);
        }
        for t in p["targets"].as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or("?").to_string();
            out.push((title, t["expr"].as_str().expect("a target without expr").to_string()));
        }
    }
    out.reverse();
    out
}

struct Prometheus(Child, PathBuf);

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_dir_all(&self.1);
    }
}

fn encode(v: &str) -> String {
    v.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// GET over HTTP/1.0 (so the answer is never chunked); the JSON body.
fn api(addr: &str, path: &str) -> Option<serde_json::Value> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let (_, body) = out.split_once("\r\n\r\n")?;
    serde_json::from_str(body).ok()
}

/// The result vector of an instant query, or why there is none.
fn query(addr: &str, q: &str) -> Result<Vec<serde_json::Value>, String> {
    let v = api(addr, &format!("/api/v1/query?query={}", encode(q)))
        .ok_or_else(|| "no answer from Prometheus".to_string())?;
    if v["status"] != "success" {
        return Err(format!("{v}"));
    }
    Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
}

/// At least one series whose value is a number (not NaN: a quantile or ratio over nothing).
fn has_data(result: &[serde_json::Value]) -> bool {
    result.iter().any(|s| {
        s["value"][1].as_str().and_then(|v| v.parse::<f64>().ok()).is_some_and(|v| v.is_finite())
    })
}

fn start_prometheus(dir: &Path, listen: &str, targets: &[SocketAddr]) -> Prometheus {
    let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
    let cfg = dir.join("prometheus.yml");
    std::fs::write(
        &cfg,
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
             scrape_configs:\n  - job_name: mbtunnel\n    static_configs:\n      - targets: [{}]\n",
            targets.join(", ")
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", cfg.display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
        .arg(format!("--web.listen-address={listen}"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start prometheus ({e}): this test needs Debian's prometheus package \
                 (`make test` installs it through scripts/deps.sh)"
            )
        });
    Prometheus(child, dir.to_path_buf())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_returns_data_from_a_real_prometheus() {
    use hickory_proto::rr::RecordType::A;
    use mbtunnel::dns::tools::{parse_records, query as dns_query, Ask, StaticServer};

    let d: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dashboard()).unwrap()).unwrap();
    let qs = queries(&d);
    assert!(qs.len() >= 20, "{} queries", qs.len());

    let cp = ControlPlane::start().await;
    let never = common::temp_dir("dashboard-never-ca");
    let mut items = vec![
        cp::workload(
            "e1",
            "echo",
            "echo",
            ip(NET, 3),
            "node-b",
            &[("demo/echo.demo.svc.cluster.local", 8080)],
        ),
        cp::service("echo", ip(NET, 50), 8080),
        cp::workload("x1", "intruder", "intruder", ip(NET, INTRUDER), "node-a", &[]),
    ];
    for i in 0..CLIENTS {
        let name = format!("client{i}");
        items.push(cp::workload(&format!("c{i}"), &name, &name, ip(NET, 10 + i), "node-a", &[]));
    }
    cp.upsert(ADDRESS_TYPE, items);
    cp.upsert(
        AUTHORIZATION_TYPE,
        vec![cp::policy(
            "deny-intruder",
            "demo",
            true,
            &["cluster.local/ns/demo/sa/intruder"],
            false,
        )],
    );
    let _peers = start_echo(SocketAddr::new(ip(NET, 3), 8080)).await;
    let records = parse_records(&[format!("ext.example.test={}", ip(NET, 70))]).unwrap();
    let upstream = StaticServer::start(SocketAddr::new(ip(NET, 60), 0), records, 1).await.unwrap();

    let b = mbtunnel::app::start(node_config(NET, "node-b", &cp, cp::TOKEN, &never), None)
        .await
        .expect("start B");
    let mut cfg = node_config(NET, "node-a", &cp, cp::TOKEN, &never);
    cfg.dns_upstreams = vec![upstream.addr];
    cfg.dns_capture = Some(true);
    cfg.dns_proxy_addr = SocketAddr::new(ip(NET, 2), 15053);
    let a = mbtunnel::app::start(cfg, None).await.expect("start A");
    let t = Duration::from_secs(20);
    assert!(a.wait_ready(t).await && b.wait_ready(t).await, "not ready: {:?}", cp.seen());

    let dir = common::temp_dir("dashboard-prometheus");
    std::fs::create_dir_all(&dir).unwrap();
    let listen = format!("{}:9090", ip(NET, 9));
    let _prom = start_prometheus(&dir, &listen, &[a.bound.metrics, b.bound.metrics]);
    // Both nodes scraped before the traffic starts, so counters are seen growing.
    let start = Instant::now();
    loop {
        let up = query(&listen, "sum(up)").ok();
        if up.as_deref().is_some_and(|r| r.iter().any(|s| s["value"][1] == "2")) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "Prometheus never scraped both nodes: {up:?}\n{}",
            std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // Traffic, over about ten scrapes.
    let dns = SocketAddr::new(ip(NET, 2), 15053);
    for i in 0..CLIENTS {
        assert!(cp::echo_ok(NET, 10 + i).await, "client{i} through the mesh");
        assert!(!cp::echo_ok(NET, INTRUDER).await, "the intruder was let through");
        // From one client, so that its DNS series grow from scrape to scrape (a series first
        // seen at 1 that stays there has a rate of 0).
        let ask = Ask::udp().from(ip(NET, 10));
        let m = dns_query(dns, "echo.demo.svc.cluster.local.", A, ask).await.unwrap();
        assert_eq!(m.answers()[0].data().to_string(), ip(NET, 50).to_string());
        let m = dns_query(dns, "ext.example.test.", A, ask).await.unwrap();
        assert_eq!(m.answers()[0].data().to_string(), ip(NET, 70).to_string());
        if i == CLIENTS / 2 {
            // A control-plane outage: the nodes' xDS streams end (a termination) and come back.
            cp.set_down(true);
            tokio::time::sleep(Duration::from_millis(1500)).await;
            cp.set_down(false);
        }
        tokio::time::sleep(Duration::from_millis(1200)).await;
    }

    // The check itself tells a query without data from one with data.
    assert!(
        !query(&listen, "sum(rate(mbtunnel_no_such_series_total[1m]))").is_ok_and(|r| has_data(&r))
    );
    assert!(query(&listen, "sum(up)").is_ok_and(|r| has_data(&r)));

    // Every query, as Grafana would send it; a few scrapes of slack for the last samples.
    let mut missing = Vec::new();
    for (title, expr) in &qs {
        let q = expr.replace("$__rate_interval", "1m");
        let deadline = Instant::now() + Duration::from_secs(15);
        let last = loop {
            let r = query(&listen, &q);
            if r.as_deref().is_ok_and(has_data) || Instant::now() > deadline {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        if !last.as_deref().is_ok_and(has_data) {
            missing.push(format!("{title}: {q}\n  -> {last:?}"));
        }
    }
    let metrics = a.metrics_text();
    assert!(
        missing.is_empty(),
        "{} of {} dashboard queries returned no data:\n{}\n\nnode A's metrics:\n{metrics}",
        missing.len(),
        qs.len(),
        missing.join("\n")
    );
    a.shutdown().await;
    b.shutdown().await;
}
