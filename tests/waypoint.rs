//! Waypoints end to end. A test waypoint (an HBONE terminator in this harness: mTLS as the
//! waypoint's identity, HTTP/2 CONNECT) records what each connection asks for; the node proxy's
//! choices are compared with what a real ztunnel sent to the same kind of waypoint
//! (`tests/fixtures/ztunnel-waypoint/outbound.json`, recorded by
//! `scripts/record-ztunnel-waypoint.sh`): the CONNECT target, the identity presented, the
//! headers, the waypoint's own HBONE port.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::{ip, metric, temp_dir, wait_for};
use mbtunnel::config::Config;
use mbtunnel::config::KeyAlgorithm;
use mbtunnel::identity::ca::DevCa;
use mbtunnel::identity::store::CertStore;
use mbtunnel::metrics::Metrics;
use mbtunnel::signer::Signer;
use mbtunnel::tls::TlsProvider;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket};

const NET: u8 = 120;
const WAYPOINT_ID: &str = "spiffe://cluster.local/ns/default/sa/waypoint";
const CLIENT_ID: &str = "spiffe://cluster.local/ns/default/sa/client";

/// One CONNECT the test waypoint saw.
#[derive(Clone, Debug)]
struct Seen {
    authority: String,
    /// Regular headers, in order.
    headers: Vec<(String, String)>,
    peer_identity: String,
}

/// The test waypoint: accepts mTLS as `WAYPOINT_ID` on `addr`, records each CONNECT, answers
/// 200 and echoes the stream.
async fn test_waypoint(ca_dir: &std::path::Path, addr: SocketAddr) -> Arc<Mutex<Vec<Seen>>> {
    hbone_terminator(ca_dir, addr, WAYPOINT_ID, None).await
}

/// An HBONE terminator as `identity` on `addr` that records each CONNECT, answers 200, then
/// echoes the stream, or (`forward`) relays its bytes to a TCP connection to that address, as a
/// network gateway passes the inner tunnel of double HBONE on to a destination's node.
async fn hbone_terminator(
    ca_dir: &std::path::Path,
    addr: SocketAddr,
    identity: &'static str,
    forward: Option<SocketAddr>,
) -> Arc<Mutex<Vec<Seen>>> {
    let ca = DevCa::load_or_create(ca_dir, "cluster.local").unwrap();
    let store = Arc::new(CertStore::new(ca, KeyAlgorithm::EcdsaP256, Duration::from_secs(3600)));
    let metrics = Arc::new(Metrics::new(&mut Registry::default()));
    let tls = Arc::new(TlsProvider::new(
        store,
        Signer::start(mbtunnel::signer::SignerConfig { threads: 1, ..Default::default() }),
        "cluster.local".into(),
        metrics,
    ));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let l = TcpListener::bind(addr).await.expect("bind test waypoint");
    let s2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = l.accept().await else { return };
            let (tls, seen) = (tls.clone(), s2.clone());
            tokio::spawn(async move {
                let me = identity.parse().unwrap();
                let Ok((stream, peer)) = tls.accept(tcp, &me).await else { return };
                let Ok(mut conn) = h2::server::handshake(stream).await else { return };
                while let Some(Ok((req, mut respond))) = conn.accept().await {
                    seen.lock().unwrap().push(Seen {
                        authority: req.uri().authority().map(|a| a.to_string()).unwrap_or_default(),
                        headers: req
                            .headers()
                            .iter()
                            .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("?").to_string()))
                            .collect(),
                        peer_identity: peer.to_string(),
                    });
                    let mut body = req.into_body();
                    let mut send = respond.send_response(http::Response::new(()), false).unwrap();
                    if let Some(to) = forward {
                        tokio::spawn(async move {
                            let mut up = tokio::net::TcpStream::connect(to).await.unwrap();
                            let mut io = mbtunnel::hbone::H2Stream::new(send, body);
                            let _ = tokio::io::copy_bidirectional(&mut io, &mut up).await;
                        });
                        continue;
                    }
                    tokio::spawn(async move {
                        while let Some(Ok(d)) = body.data().await {
                            let _ = body.flow_control().release_capacity(d.len());
                            if send.send_data(d, false).is_err() {
                                return;
                            }
                        }
                        let _ = send.send_data(Bytes::new(), true);
                    });
                }
            });
        }
    });
    seen
}

/// A node proxy for the client workload whose outbound listener stands at `dst` (the
/// destination the app dials: in this loopback harness the listener is the destination).
fn client_node(ca: &std::path::Path, dst: &str, me: u8) -> Config {
    let yaml = format!(
        r#"
node_name: node-a
ca_dir: {ca}
outbound_addr: "{dst}"
inbound_addr: "127.0.{NET}.{me}:15008"
inbound_plaintext_addr: "127.0.{NET}.{me}:15006"
metrics_addr: "127.0.{NET}.{me}:15020"
readiness_addr: "127.0.{NET}.{me}:15021"
admin_addr: "127.0.{NET}.{me}:15000"
workloads:
  - {{uid: cluster1//v1/Pod/default/client, name: client, namespace: default, service_account: client,
      ips: ["127.0.{NET}.2"], node: node-a, cluster_id: cluster1, workload_name: client,
      canonical_name: client, canonical_revision: v1}}
  - {{uid: cluster1//v1/Pod/default/server, name: server, workload_name: server, namespace: default, service_account: server,
      ips: ["127.0.{NET}.4"], node: node-b,
      waypoint: {{address: "127.0.{NET}.60", hbone_port: 15019}}}}
  - {{uid: cluster1//v1/Pod/default/waypoint, name: waypoint, workload_name: waypoint, namespace: default,
      service_account: waypoint, ips: ["127.0.{NET}.9"], node: node-w}}
services:
  - {{name: server, namespace: default, vips: ["127.0.{NET}.50"], ports: [{{port: 8080}}],
      workloads: [cluster1//v1/Pod/default/server],
      waypoint: {{hostname: default/waypoint.default.svc.cluster.local, hbone_port: 15019}}}}
  - {{name: waypoint, namespace: default, vips: ["127.0.{NET}.60"], ports: [{{port: 15019}}],
      workloads: [cluster1//v1/Pod/default/waypoint]}}
"#,
        ca = ca.display()
    );
    Config::from_yaml(&yaml, std::path::Path::new("waypoint-test.yaml")).expect("config")
}

/// Sends a line from the client workload's address to `dst` and returns the local address used
/// and whether it came back.
async fn send_from_client(dst: SocketAddr, line: &[u8]) -> (SocketAddr, bool) {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::new(ip(NET, 2), 0)).unwrap();
    let mut c = s.connect(dst).await.expect("connect");
    let local = c.local_addr().unwrap();
    c.write_all(line).await.unwrap();
    c.shutdown().await.unwrap();
    let mut back = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut back)).await;
    (local, matches!(r, Ok(Ok(_))) && back == line)
}

fn fixture() -> serde_json::Value {
    serde_json::from_str(include_str!("fixtures/ztunnel-waypoint/outbound.json")).unwrap()
}

/// ztunnel's CONNECT in a recorded case.
fn ztunnel_case(name: &str) -> (serde_json::Value, Vec<(String, String)>) {
    let f = fixture();
    let case = f["cases"].as_array().unwrap().iter().find(|c| c["name"] == name).unwrap().clone();
    let headers = case["waypoint_connects"][0]["headers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| (h[0].as_str().unwrap().to_string(), h[1].as_str().unwrap().to_string()))
        .collect();
    (case, headers)
}

fn header<'a>(h: &'a [(String, String)], name: &str) -> &'a str {
    h.iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("no {name}"))
}

fn is_traceparent(v: &str) -> bool {
    let p: Vec<&str> = v.split('-').collect();
    p.len() == 4
        && p[0] == "00"
        && p[1].len() == 32
        && p[2].len() == 16
        && p[3].len() == 2
        && p.iter().all(|x| x.chars().all(|c| c.is_ascii_hexdigit()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_and_pod_addressed_traffic_goes_to_the_waypoint_as_ztunnel_sends_it() {
    let ca = temp_dir("waypoint-ca");
    let vip: SocketAddr = format!("127.0.{NET}.50:8080").parse().unwrap();
    let pod: SocketAddr = format!("127.0.{NET}.4:8080").parse().unwrap();
    // Two proxies for the same client workload, one per destination the app dials.
    let a_vip = mbtunnel::app::start(client_node(&ca, &vip.to_string(), 10), None).await.unwrap();
    let a_pod = mbtunnel::app::start(client_node(&ca, &pod.to_string(), 11), None).await.unwrap();
    assert!(a_vip.wait_ready(Duration::from_secs(30)).await);
    assert!(a_pod.wait_ready(Duration::from_secs(30)).await);
    // Nothing listens on the waypoint's 15008: only its HBONE port (15019) can be used.
    let seen = test_waypoint(&ca, SocketAddr::new(ip(NET, 9), 15019)).await;

    let (vip_src, ok) = send_from_client(vip, b"case=service\n").await;
    assert!(ok, "service-addressed traffic came back through the waypoint");
    let (pod_src, ok) = send_from_client(pod, b"case=pod\n").await;
    assert!(ok, "pod-addressed traffic came back through the waypoint");
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "{seen:?}");

    for (ours, src, zt_case, addressed) in
        [(&seen[0], vip_src, "a_service_vip", vip), (&seen[1], pod_src, "b_workload_ip", pod)]
    {
        let (case, zt) = ztunnel_case(zt_case);
        // The CONNECT target is the destination as the app dialled it — ztunnel's rule.
        assert_eq!(
            header(&zt, ":authority"),
            case["input"]["app_connects_to"].as_str().unwrap(),
            "{zt_case}"
        );
        assert_eq!(ours.authority, addressed.to_string(), "{zt_case}");
        // The client's identity, as ztunnel presents it.
        assert_eq!(case["waypoint_connects"][0]["client_cert"]["uri_sans"][0], CLIENT_ID);
        assert_eq!(ours.peer_identity, CLIENT_ID, "{zt_case}");
        // The same headers in the same order.
        let names = |h: &[(String, String)]| -> Vec<String> {
            h.iter().map(|(k, _)| k.clone()).filter(|k| !k.starts_with(':')).collect()
        };
        assert_eq!(names(&ours.headers), names(&zt), "{zt_case}");
        // Baggage: the same workload attributes give the same value.
        assert_eq!(header(&ours.headers, "baggage"), header(&zt, "baggage"), "{zt_case}");
        // Forwarded: the app's address; `;host=` only when service-addressed.
        let zt_fwd = header(&zt, "forwarded");
        let zt_src = case["app_saw"]["local"].as_str().unwrap();
        let ours_fwd = header(&ours.headers, "forwarded");
        assert_eq!(ours_fwd, zt_fwd.replace(zt_src, &src.to_string()), "{zt_case}");
        assert!(is_traceparent(header(&zt, "traceparent")));
        assert!(is_traceparent(header(&ours.headers, "traceparent")), "{ours:?}");
    }
    assert!(
        header(&seen[0].headers, "forwarded").ends_with(";host=server.default.svc.cluster.local")
    );

    // Reported as ztunnel reports it: the waypoint is the destination workload, the service
    // the intended one.
    let t = a_vip.metrics_text();
    assert!(
        wait_for(|| metric(
            &a_vip.metrics_text(),
            "istio_tcp_connections_closed_total",
            &[
                "destination_workload=\"waypoint\"",
                "destination_service=\"server.default.svc.cluster.local\""
            ]
        ) == Some(1.0))
        .await,
        "{t}"
    );
    assert!(
        wait_for(|| metric(
            &a_pod.metrics_text(),
            "istio_tcp_connections_closed_total",
            &[
                "destination_workload=\"waypoint\"",
                "destination_principal=\"spiffe://cluster.local/ns/default/sa/waypoint\""
            ]
        ) == Some(1.0))
        .await,
        "{}",
        a_pod.metrics_text()
    );
    a_vip.shutdown().await;
    a_pod.shutdown().await;
    let _ = std::fs::remove_dir_all(&ca);
}

// --- In network namespaces: a waypoint enrolled in the mesh, with an application tunnel ---------

use common::cluster::{connect_from, echo_in, sa, wait, Cni, Node};
use common::netns::Sim;
use mbtunnel::inpod::zds::WorkloadRequest;
use mbtunnel::redirect::Backend;
use std::io::{Read, Write};

/// Both nodes' mesh state. Node 1: the client, the server (echo on 8080) and a pod outside the
/// mesh; node 2: the waypoint, enrolled, whose application tunnel (PROXY, 15088) is the test
/// waypoint. The server's service and the server itself both name the waypoint (by hostname and
/// by its service VIP); node 1 lets only the waypoint's identity reach the server.
fn sandwich_config(node: u8, ca: &std::path::Path, cni: &std::path::Path) -> Config {
    let yaml = format!(
        r#"
node_name: node-{node}
ca_dir: {ca}
inpod_enabled: true
inpod_socket: {cni}
drain_timeout_secs: 1
outbound_addr: 127.0.0.1:0
inbound_addr: 127.0.0.1:0
inbound_plaintext_addr: 127.0.0.1:0
metrics_addr: 127.0.0.1:0
readiness_addr: 127.0.0.1:0
admin_addr: 127.0.0.1:0
workloads:
  - {{uid: client-uid, name: client, workload_name: client, namespace: demo, service_account: client, ips: [10.0.1.2], node: node-1}}
  - {{uid: server-uid, name: server, workload_name: server, namespace: demo, service_account: server, ips: [10.0.1.3], node: node-1,
      waypoint: {{address: 10.96.0.9, hbone_port: 15008}}}}
  - {{uid: legacy-uid, name: legacy, workload_name: legacy, namespace: demo, service_account: legacy, ips: [10.0.1.4], node: node-1,
      protocol: TCP}}
  - {{uid: waypoint-uid, name: waypoint, workload_name: waypoint, namespace: demo, service_account: waypoint, ips: [10.0.2.2],
      node: node-2, application_tunnel: {{protocol: PROXY, port: 15088}}}}
services:
  - {{name: server, namespace: demo, vips: [10.96.0.2], ports: [{{port: 80, target_port: 8080}}],
      workloads: [server-uid], waypoint: {{hostname: demo/waypoint.demo.svc.cluster.local, hbone_port: 15008}}}}
  - {{name: waypoint, namespace: demo, vips: [10.96.0.9], ports: [{{port: 15008}}], workloads: [waypoint-uid]}}
policies:
  - {{name: only-via-waypoint, namespace: demo, scope: WORKLOAD_SELECTOR, action: ALLOW,
      rules: [{{clauses: [{{matches: [{{principals: [{{exact: cluster.local/ns/demo/sa/waypoint}}]}}]}}]}}]}}
"#,
        ca = ca.display(),
        cni = cni.display()
    );
    let mut cfg = Config::from_yaml(&yaml, std::path::Path::new("sandwich.yaml")).expect("config");
    // The ALLOW selects the server only (as istiod lists a WORKLOAD_SELECTOR policy on it).
    for w in &mut cfg.workloads {
        if w.uid == "server-uid" {
            w.authorization_policies = vec!["demo/only-via-waypoint".into()];
        }
    }
    cfg
}

/// One PROXY v2 header the test waypoint read.
#[derive(Clone, Debug)]
struct ProxySeen {
    source: SocketAddr,
    destination: SocketAddr,
    identity: String,
}

/// The test waypoint of the namespace test: reads each connection's PROXY v2 header, records
/// it, then forwards as a waypoint would — to an endpoint of the destination (the VIP's is the
/// server pod), from inside the waypoint pod, where node 2 captures it.
fn tunnel_waypoint(
    pod: &common::netns::Pod,
    vip: SocketAddr,
    endpoint: SocketAddr,
) -> Arc<Mutex<Vec<ProxySeen>>> {
    let l = pod.run(|| std::net::TcpListener::bind("127.0.0.1:15088")).expect("bind tunnel port");
    let ns = pod.ns.clone();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = seen.clone();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            let (ns, seen) = (ns.clone(), s2.clone());
            std::thread::spawn(move || {
                let mut head = [0u8; 16];
                if c.read_exact(&mut head).is_err() {
                    return;
                }
                let len = u16::from_be_bytes([head[14], head[15]]) as usize;
                let mut rest = vec![0u8; len];
                if c.read_exact(&mut rest).is_err() {
                    return;
                }
                let all = [&head[..], &rest[..]].concat();
                let h = ppp::v2::Header::try_from(&all[..]).expect("a PROXY v2 header");
                let (source, destination) = match h.addresses {
                    ppp::v2::Addresses::IPv4(a) => (
                        SocketAddr::new(a.source_address.into(), a.source_port),
                        SocketAddr::new(a.destination_address.into(), a.destination_port),
                    ),
                    other => panic!("addresses {other:?}"),
                };
                let identity = h
                    .tlvs()
                    .filter_map(Result::ok)
                    .find(|t| t.kind == 0xD0)
                    .map(|t| String::from_utf8_lossy(&t.value).to_string())
                    .unwrap_or_default();
                seen.lock().unwrap().push(ProxySeen { source, destination, identity });
                let to = if destination == vip { endpoint } else { destination };
                let Ok(Ok(mut up)) = ns.run_blocking(move || {
                    std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5))
                }) else {
                    return;
                };
                let mut c2 = c.try_clone().unwrap();
                let mut up2 = up.try_clone().unwrap();
                let t = std::thread::spawn(move || {
                    let _ = std::io::copy(&mut c2, &mut up2);
                    let _ = up2.shutdown(std::net::Shutdown::Write);
                });
                let _ = std::io::copy(&mut up, &mut c);
                let _ = c.shutdown(std::net::Shutdown::Write);
                let _ = t.join();
            });
        }
    });
    seen
}

fn echo_works(pod: &common::netns::Pod, dst: SocketAddr) -> bool {
    let Ok(mut s) = connect_from(pod, dst) else { return false };
    if s.write_all(b"via the waypoint").is_err() || s.shutdown(std::net::Shutdown::Write).is_err() {
        return false;
    }
    let mut back = Vec::new();
    s.read_to_end(&mut back).is_ok() && back == b"via the waypoint"
}

#[test]
fn a_waypoint_in_the_mesh_gets_its_traffic_through_its_application_tunnel_and_sends_it_on() {
    require_netns!();
    let sim = Sim::two_nodes();
    let dir = temp_dir("waypoint-sandwich");
    std::fs::create_dir_all(&dir).unwrap();
    let (s1, s2) = (dir.join("cni-1.sock"), dir.join("cni-2.sock"));
    let (mut cni1, mut cni2) = (Cni::new(s1.clone()), Cni::new(s2.clone()));
    let ca = dir.join("ca");
    let n1 = Node::start(&sim, 1, sandwich_config(1, &ca, &s1));
    let n2 = Node::start(&sim, 2, sandwich_config(2, &ca, &s2));
    cni1.accept();
    cni2.accept();
    let client = sim.add_pod(1, 2);
    let server = sim.add_pod(1, 3);
    let legacy = sim.add_pod(1, 4);
    let wp = sim.add_pod(2, 2);
    let _echo = echo_in(&server);
    let (vip, pod_addr) = (sa("10.96.0.2".parse().unwrap(), 80), sa(server.v4, 8080));
    let seen = tunnel_waypoint(&wp, vip, pod_addr);
    for (cni, pod, uid, name, sa_) in [
        (&cni1, &client, "client-uid", "client", "client"),
        (&cni1, &server, "server-uid", "server", "server"),
        (&cni2, &wp, "waypoint-uid", "waypoint", "waypoint"),
    ] {
        assert_eq!(cni.enroll(pod, uid, name, sa_, Backend::Iptables), "", "{uid}");
    }
    for cni in [&cni1, &cni2] {
        assert_eq!(cni.send(WorkloadRequest::snapshot_sent(), None), "");
    }

    // Service-addressed, then pod-addressed: both through the waypoint, and on to the server.
    assert!(echo_works(&client, vip), "service-addressed traffic through the waypoint");
    assert!(echo_works(&client, pod_addr), "pod-addressed traffic through the waypoint");
    let got = seen.lock().unwrap().clone();
    assert_eq!(got.len(), 2, "one tunnelled connection each, none looped back: {got:?}");
    for (g, dst) in got.iter().zip([vip, pod_addr]) {
        assert_eq!(g.destination, dst, "PROXY destination = the CONNECT target");
        assert_eq!(g.identity, "spiffe://cluster.local/ns/demo/sa/client");
        assert_eq!(g.source.ip(), client.v4, "PROXY source = the HBONE peer (the client pod)");
    }
    // The waypoint's own connections reached the server with the waypoint's identity (the
    // server's ALLOW names only it), and node 1 reports them so.
    wait("the server side counted the waypoint's connections", || {
        metric(
            &n1.metrics(),
            "istio_tcp_connections_closed_total",
            &[
                "reporter=\"destination\"",
                "source_principal=\"spiffe://cluster.local/ns/demo/sa/waypoint\"",
                "destination_workload=\"server\"",
            ],
        ) == Some(2.0)
    });
    // The client's node reports the waypoint as the destination, the service as intended.
    let t = n1.metrics();
    assert_eq!(
        metric(
            &t,
            "istio_tcp_connections_closed_total",
            &[
                "reporter=\"source\"",
                "destination_workload=\"waypoint\"",
                "destination_service=\"server.demo.svc.cluster.local\"",
            ]
        ),
        Some(1.0),
        "{t}"
    );

    // A bypass: a pod outside the mesh dials the server directly. The server accepts only what
    // came through its waypoint, so node 1 refuses it.
    assert!(!echo_works(&legacy, pod_addr), "a direct connection bypassed the waypoint");
    wait("the bypass counted as denied", || {
        metric(
            &n1.metrics(),
            "istio_tcp_connections_failed_total",
            &["response_flags=\"DENY\"", "destination_workload=\"server\""],
        ) == Some(1.0)
    });
    assert_eq!(seen.lock().unwrap().len(), 2, "the waypoint saw nothing more");
    drop((n1, n2, cni1, cni2));
    let _ = std::fs::remove_dir_all(&dir);
}

// --- Another network: double HBONE through a network gateway ------------------------------------

const GW_NET: u8 = 121;
const GATEWAY_ID: &str = "spiffe://cluster.local/ns/istio-system/sa/eastwest";

/// Node A (the client's, network "") sees the echo workload on network "net2" without an
/// address, reached through the east-west gateway; node B (the echo's, on net2) serves it.
fn network_node(ca: &std::path::Path, node: &str) -> Config {
    let (me, out, echo_ips) = match node {
        "node-a" => (2, format!("127.0.{GW_NET}.50:8080"), "[]".to_string()),
        _ => (3, format!("127.0.{GW_NET}.3:15001"), format!("[\"127.0.{GW_NET}.3\"]")),
    };
    let yaml = format!(
        r#"
node_name: {node}
ca_dir: {ca}
outbound_addr: "{out}"
inbound_addr: "127.0.{GW_NET}.{me}:15008"
inbound_plaintext_addr: "127.0.{GW_NET}.{me}:15006"
metrics_addr: "127.0.{GW_NET}.{me}:15020"
readiness_addr: "127.0.{GW_NET}.{me}:15021"
admin_addr: "127.0.{GW_NET}.{me}:15000"
workloads:
  - {{uid: client-1, name: client, workload_name: client, namespace: demo, service_account: client, ips: ["127.0.{GW_NET}.2"],
      node: node-a}}
  - {{uid: echo-1, name: echo, workload_name: echo, namespace: demo, service_account: echo, ips: {echo_ips}, node: node-b,
      network: net2, network_gateway: {{address: "127.0.{GW_NET}.70", hbone_port: 15009}}}}
  - {{uid: ew-1, name: eastwest, workload_name: eastwest, namespace: istio-system, service_account: eastwest,
      ips: ["127.0.{GW_NET}.70"], node: node-g, network: net2}}
services:
  - {{name: echo, namespace: demo, vips: ["127.0.{GW_NET}.50"], ports: [{{port: 8080}}], workloads: [echo-1]}}
"#,
        ca = ca.display()
    );
    Config::from_yaml(&yaml, std::path::Path::new("network-test.yaml")).expect("config")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_network_is_reached_through_its_gateway_with_double_hbone() {
    let ca = temp_dir("network-ca");
    let echo = common::start_echo(SocketAddr::new(ip(GW_NET, 3), 8080)).await;
    let b = mbtunnel::app::start(network_node(&ca, "node-b"), None).await.unwrap();
    let a = mbtunnel::app::start(network_node(&ca, "node-a"), None).await.unwrap();
    assert!(
        a.wait_ready(Duration::from_secs(30)).await && b.wait_ready(Duration::from_secs(30)).await
    );
    // The gateway terminates the outer tunnel and passes the inner one to the echo's node.
    let gw = hbone_terminator(
        &ca,
        SocketAddr::new(ip(GW_NET, 70), 15009),
        GATEWAY_ID,
        Some(b.bound.inbound),
    )
    .await;
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::new(ip(GW_NET, 2), 0)).unwrap();
    let mut c = s.connect(SocketAddr::new(ip(GW_NET, 50), 8080)).await.unwrap();
    c.write_all(b"across networks").await.unwrap();
    c.shutdown().await.unwrap();
    let mut back = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut back)).await.unwrap().unwrap();
    assert_eq!(back, b"across networks");
    assert_eq!(echo.lock().unwrap().len(), 1, "the echo got the connection");
    let seen = gw.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    // The outer CONNECT names the service by hostname and port; the client's identity.
    assert_eq!(seen[0].authority, "echo.demo.svc.cluster.local:8080");
    assert_eq!(seen[0].peer_identity, "spiffe://cluster.local/ns/demo/sa/client");
    assert!(!seen[0].headers.iter().any(|(k, _)| k == "x-forwarded-network"), "outer only");
    // Node B terminated the inner mTLS (the gateway saw only ciphertext) and counts it.
    assert!(
        wait_for(|| metric(
            &b.metrics_text(),
            "istio_tcp_connections_closed_total",
            &[
                "reporter=\"destination\"",
                "source_principal=\"spiffe://cluster.local/ns/demo/sa/client\"",
                "destination_workload=\"echo\"",
            ]
        ) == Some(1.0))
        .await,
        "{}",
        b.metrics_text()
    );
    a.shutdown().await;
    b.shutdown().await;
    let _ = std::fs::remove_dir_all(&ca);
}
