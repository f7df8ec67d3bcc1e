//! Helpers for in-process mesh tests: two node proxies and an echo workload on a private block of
//! loopback addresses (127.0.<net>.x), so tests running in parallel never collide.
#![allow(dead_code)]

pub mod cluster;
pub mod cp;
pub mod netns;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mbtunnel::app::Running;
use mbtunnel::config::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

pub struct Mesh {
    pub net: u8,
    pub a: Running,
    pub b: Running,
    pub echo_peers: Arc<Mutex<Vec<SocketAddr>>>,
    pub ca_dir: PathBuf,
}

pub fn ip(net: u8, host: u8) -> IpAddr {
    IpAddr::from([127, 0, net, host])
}

/// The mesh YAML for node `node`; `echo_sa_seen_by_a` lets a test make node A expect a different
/// identity for the echo workload than node B holds.
pub fn config(net: u8, node: &str, ca_dir: &std::path::Path, echo_sa: &str, key: &str) -> Config {
    let (me, out) = if node == "node-a" {
        (2, format!("127.0.{net}.50:8080"))
    } else {
        (3, format!("127.0.{net}.3:15001"))
    };
    let yaml = format!(
        r#"
node_name: {node}
ca_dir: {ca}
key_algorithm: {key}
drain_timeout_secs: 5
outbound_addr: "{out}"
inbound_addr: "127.0.{net}.{me}:15008"
inbound_plaintext_addr: "127.0.{net}.{me}:15006"
metrics_addr: "127.0.{net}.{me}:15020"
readiness_addr: "127.0.{net}.{me}:15021"
admin_addr: "127.0.{net}.{me}:15000"
workloads:
  - {{uid: client-1, name: client, workload_name: client, namespace: demo, service_account: client, ips: ["127.0.{net}.2"], node: node-a}}
  - {{uid: echo-1, name: echo, workload_name: echo, namespace: demo, service_account: {echo_sa}, ips: ["127.0.{net}.3"], node: node-b}}
  - {{uid: other-1, name: other, workload_name: other, namespace: demo, service_account: other, ips: ["127.0.{net}.4"], node: node-b}}
services:
  - {{name: echo, namespace: demo, vips: ["127.0.{net}.50"], ports: [{{port: 8080}}], workloads: [echo-1]}}
"#,
        ca = ca_dir.display()
    );
    Config::from_yaml(&yaml, std::path::Path::new("test.yaml")).expect("test config")
}

pub fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mbt-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

pub async fn start_echo(addr: SocketAddr) -> Arc<Mutex<Vec<SocketAddr>>> {
    let l = TcpListener::bind(addr).await.expect("bind echo");
    let peers = Arc::new(Mutex::new(Vec::new()));
    let p = peers.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, peer)) = l.accept().await else { return };
            p.lock().unwrap().push(peer);
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
    peers
}

pub async fn start_mesh(net: u8, a_expects_echo_sa: &str, key: &str) -> Mesh {
    let ca_dir = temp_dir(&format!("ca{net}"));
    let echo_peers = start_echo(SocketAddr::new(ip(net, 3), 8080)).await;
    let b = mbtunnel::app::start(config(net, "node-b", &ca_dir, "echo", key), None)
        .await
        .expect("start B");
    let a = mbtunnel::app::start(config(net, "node-a", &ca_dir, a_expects_echo_sa, key), None)
        .await
        .expect("start A");
    assert!(
        a.wait_ready(Duration::from_secs(30)).await && b.wait_ready(Duration::from_secs(30)).await
    );
    Mesh { net, a, b, echo_peers, ca_dir }
}

/// A client connection from the client workload's address to the echo service VIP.
pub async fn client(net: u8) -> TcpStream {
    try_client(net).await.expect("connect to VIP")
}

/// [`client`], for tests in which the proxy refuses the connection: a refusal can be quick
/// enough to reset it before `connect` returns.
pub async fn try_client(net: u8) -> std::io::Result<TcpStream> {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::new(ip(net, 2), 0)).unwrap();
    s.connect(SocketAddr::new(ip(net, 50), 8080)).await
}

pub fn pattern(n: usize, seed: u32) -> Vec<u8> {
    (0..n).map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 11) as u8).collect()
}

/// Sends `data`, half-closes, reads everything back.
pub async fn round_trip(s: TcpStream, data: Vec<u8>) -> Vec<u8> {
    let (mut r, mut w) = s.into_split();
    let writer = tokio::spawn(async move {
        w.write_all(&data).await.unwrap();
        w.shutdown().await.unwrap();
    });
    let mut back = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), r.read_to_end(&mut back))
        .await
        .expect("echo timed out")
        .unwrap();
    writer.await.unwrap();
    back
}

/// The value of the first metric line starting with `prefix` (labels included in the prefix).
pub fn metric(text: &str, name: &str, must_contain: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(name) && must_contain.iter().all(|c| l.contains(c)))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .reduce(|a, b| a + b)
}

pub async fn wait_for<F: Fn() -> bool>(f: F) -> bool {
    for _ in 0..200 {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    false
}
