//! In-pod mode end to end, in network namespaces: two simulated nodes, pods enrolled by a fake
//! CNI that speaks ZDS over a real SEQPACKET socket (netns fds as SCM_RIGHTS) and installs the
//! redirect rules; node proxies run in-process on runtimes whose threads live in the node
//! namespaces. Needs root; prints why and skips otherwise.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::cluster::{connect_from, echo_in, round_trip, sa, wait, Cni, Node};
use common::netns::{Pod, Sim};
use common::{metric, temp_dir};
use mbtunnel::config::Config;
use mbtunnel::inpod::zds::{WorkloadInfo, WorkloadRequest};
use mbtunnel::redirect::Backend;
use prost::Message;

const CLIENT: &str = "spiffe://cluster.local/ns/demo/sa/client";
const ECHO: &str = "spiffe://cluster.local/ns/demo/sa/echo";

/// The mesh every node knows (as xDS would tell it): uid, name, sa, pod (node, index).
const PODS: &[(&str, &str, &str, u8, u8)] = &[
    ("client-uid", "client", "client", 1, 2),
    ("client2-uid", "client2", "client2", 1, 3),
    ("stale-uid", "stale", "stale", 1, 4),
    ("legacy-uid", "legacy", "legacy", 1, 5),
    ("echo-uid", "echo", "echo", 2, 2),
    ("plain-uid", "plain", "plain", 2, 3),
    // The workloads of tests/fixtures/ztunnel-metrics (recorded from ztunnel).
    ("zclient-uid", "client-7d4f", "client", 1, 8),
    ("zserver-uid", "server-5c9b", "server", 2, 8),
];

/// Enrols `pod` as the PODS entry `uid` through the fake CNI.
fn enroll(cni: &Cni, pod: &Pod, uid: &str, backend: Backend) -> String {
    let (name, sa) = PODS.iter().find(|p| p.0 == uid).map(|p| (p.1, p.2)).unwrap_or(("?", "?"));
    cni.enroll(pod, uid, name, sa, backend)
}

fn mesh_yaml(node: u8, ca: &Path, cni: &Path) -> Config {
    let mut y = format!(
        "node_name: node-{node}\nca_dir: {}\ninpod_enabled: true\ninpod_socket: {}\n\
         drain_timeout_secs: 1\noutbound_addr: 127.0.0.1:0\ninbound_addr: 127.0.0.1:0\n\
         inbound_plaintext_addr: 127.0.0.1:0\nmetrics_addr: 127.0.0.1:0\nreadiness_addr: 127.0.0.1:0\n\
         admin_addr: 127.0.0.1:0\nworkloads:\n",
        ca.display(),
        cni.display()
    );
    for (uid, name, sa, n, p) in PODS {
        // legacy and plain pods are not in the mesh: TCP, never enrolled.
        let proto = if *name == "legacy" || *name == "plain" { "TCP" } else { "HBONE" };
        y += &format!(
            "  - {{uid: {uid}, name: {name}, namespace: demo, service_account: {sa}, \
             ips: [\"10.0.{n}.{p}\", \"fd00:{n}::{p}\"], node: node-{n}, protocol: {proto}}}\n"
        );
    }
    Config::from_yaml(&y, Path::new("inpod-test.yaml")).expect("mesh yaml")
}

struct Cluster {
    // Field order = drop order: proxies first, then CNIs, then namespaces.
    n1: Node,
    n2: Node,
    cni1: Cni,
    cni2: Cni,
    dir: PathBuf,
    sim: Sim,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn cluster(tag: &str) -> Cluster {
    cluster_with(tag, |_| {})
}

/// [`cluster`] with each node's configuration changed by `tweak` first.
fn cluster_with(tag: &str, tweak: fn(&mut Config)) -> Cluster {
    let sim = Sim::two_nodes();
    let dir = temp_dir(&format!("inpod-{tag}"));
    std::fs::create_dir_all(&dir).unwrap();
    let (s1, s2) = (dir.join("cni-1.sock"), dir.join("cni-2.sock"));
    let mut cni1 = Cni::new(s1.clone());
    let mut cni2 = Cni::new(s2.clone());
    let ca = dir.join("ca");
    let (mut y1, mut y2) = (mesh_yaml(1, &ca, &s1), mesh_yaml(2, &ca, &s2));
    tweak(&mut y1);
    tweak(&mut y2);
    let n1 = Node::start(&sim, 1, y1);
    let n2 = Node::start(&sim, 2, y2);
    cni1.accept();
    cni2.accept();
    assert!(!n1.r().is_ready(), "not ready before the CNI's snapshot");
    Cluster { n1, n2, cni1, cni2, dir, sim }
}

fn snapshot(c: &Cni) {
    assert_eq!(c.send(WorkloadRequest::snapshot_sent(), None), "");
}

#[test]
fn client_pod_to_server_pod_over_hbone_mtls_both_sides_captured() {
    require_netns!();
    let t0 = Instant::now();
    let c = cluster("mtls");
    let client = c.sim.add_pod(1, 2);
    let echo = c.sim.add_pod(2, 2);
    let peers = echo_in(&echo);
    assert_eq!(enroll(&c.cni1, &client, "client-uid", Backend::Iptables), "");
    assert_eq!(enroll(&c.cni2, &echo, "echo-uid", Backend::Nftables), "");
    snapshot(&c.cni1);
    snapshot(&c.cni2);
    assert!(c.n1.r().is_ready() && c.n2.r().is_ready());

    // A plain TCP connect from the client pod to the echo pod's IP: captured on both sides.
    round_trip(connect_from(&client, sa(echo.v4, 8080)).unwrap(), 256 * 1024);
    assert_eq!(peers.lock().unwrap()[0].ip(), client.v4, "the app sees the client pod's IP");
    wait("closed on both sides", || {
        metric(&c.n2.metrics(), "istio_tcp_connections_closed_total", &["mutual_tls"]) == Some(1.0)
            && metric(&c.n1.metrics(), "istio_tcp_connections_closed_total", &["mutual_tls"])
                == Some(1.0)
    });
    for (node, reporter) in [(&c.n1, "source"), (&c.n2, "destination")] {
        let t = node.metrics();
        let l = [
            &*format!("reporter=\"{reporter}\""),
            &*format!("source_principal=\"{CLIENT}\""),
            &*format!("destination_principal=\"{ECHO}\""),
            "connection_security_policy=\"mutual_tls\"",
        ];
        assert_eq!(
            metric(&t, "istio_tcp_connections_opened_total", &l),
            Some(1.0),
            "{reporter}\n{t}"
        );
        assert_eq!(
            metric(&t, "istio_tcp_received_bytes_total", &l),
            Some(256.0 * 1024.0),
            "{reporter}"
        );
    }
    // The HBONE handshake happened between the proxies (client side on node 1).
    assert_eq!(
        metric(&c.n1.metrics(), "mbtunnel_tls_handshakes_total", &["side=\"client\"", "success"]),
        Some(1.0)
    );

    // IPv6 through the same pods (dual stack): the app sees the client's IPv6 address.
    if let Some(why) = common::netns::ipv6_skip_reason() {
        eprintln!("SKIPPED the IPv6 part: {why}");
        return;
    }
    round_trip(connect_from(&client, sa(echo.v6, 8080)).unwrap(), 4096);
    assert!(
        peers.lock().unwrap().iter().any(|p| p.ip() == client.v6),
        "{:?}",
        peers.lock().unwrap()
    );
    wait("IPv6 connection counted", || {
        metric(&c.n2.metrics(), "istio_tcp_connections_closed_total", &["mutual_tls"]) == Some(2.0)
    });
    eprintln!("mtls test: {:?}", t0.elapsed());
}

#[test]
fn pods_come_and_go_while_traffic_flows_and_snapshot_removes_stale() {
    require_netns!();
    let t0 = Instant::now();
    let mut c = cluster("churn");
    let client = c.sim.add_pod(1, 2);
    let stale = c.sim.add_pod(1, 4);
    let echo = c.sim.add_pod(2, 2);
    let _peers = echo_in(&echo);
    for (pod, uid) in [(&client, "client-uid"), (&stale, "stale-uid")] {
        assert_eq!(enroll(&c.cni1, pod, uid, Backend::Iptables), "");
    }
    assert_eq!(enroll(&c.cni2, &echo, "echo-uid", Backend::Iptables), "");
    snapshot(&c.cni1);
    snapshot(&c.cni2);

    // A long connection from the client pod, in flight through everything below.
    let mut long = connect_from(&client, sa(echo.v4, 8080)).unwrap();
    let echo_once = |s: &mut TcpStream, msg: &[u8]| {
        s.write_all(msg).unwrap();
        let mut b = vec![0; msg.len()];
        s.read_exact(&mut b).unwrap();
        assert_eq!(b, msg);
    };
    echo_once(&mut long, b"before");

    // A second client pod appears: its listeners open, its traffic is mTLS as client2.
    let client2 = c.sim.add_pod(1, 3);
    assert_eq!(enroll(&c.cni1, &client2, "client2-uid", Backend::Nftables), "");
    round_trip(connect_from(&client2, sa(echo.v4, 8080)).unwrap(), 1000);
    wait("client2 counted", || {
        metric(
            &c.n2.metrics(),
            "istio_tcp_connections_opened_total",
            &["source_principal=\"spiffe://cluster.local/ns/demo/sa/client2\"", "mutual_tls"],
        ) == Some(1.0)
    });
    echo_once(&mut long, b"during");

    // client2 is deleted: its listeners close; the client's connection does not notice.
    assert_eq!(c.cni1.send(WorkloadRequest::del("client2-uid"), None), "");
    assert!(connect_from(&client2, "127.0.0.1:15001".parse().unwrap()).is_err(), "15001 closed");
    assert!(connect_from(&client2, sa(client2.v4, 15008)).is_err(), "15008 closed");
    assert!(!c.n1.pods().contains(&"client2-uid".to_string()));
    echo_once(&mut long, b"after delete");
    drop(client2);

    // The CNI restarts: it replays the client (same netns) but not `stale`, then the snapshot.
    c.cni1.disconnect();
    c.cni1.accept();
    assert_eq!(enroll(&c.cni1, &client, "client-uid", Backend::Iptables), "");
    snapshot(&c.cni1);
    assert_eq!(c.n1.pods(), vec!["client-uid".to_string()], "stale pod reconciled away");
    assert_eq!(metric(&c.n1.metrics(), "mbtunnel_inpod_pods", &[]), Some(1.0));
    assert_eq!(metric(&c.n1.metrics(), "mbtunnel_zds_connections_total", &[]), Some(2.0));
    assert!(
        connect_from(&stale, "127.0.0.1:15001".parse().unwrap()).is_err(),
        "stale's listener closed"
    );
    echo_once(&mut long, b"after snapshot");
    long.shutdown(std::net::Shutdown::Write).unwrap();
    // New connections from the client still work after all that.
    round_trip(connect_from(&client, sa(echo.v4, 8080)).unwrap(), 1000);
    eprintln!("churn test: {:?}", t0.elapsed());
}

#[test]
fn malformed_zds_messages_are_nacked_and_the_proxy_keeps_serving() {
    require_netns!();
    let c = cluster("nack");
    let client = c.sim.add_pod(1, 2);
    let echo = c.sim.add_pod(2, 2);
    let _peers = echo_in(&echo);
    assert_eq!(enroll(&c.cni2, &echo, "echo-uid", Backend::Iptables), "");
    snapshot(&c.cni2);
    let fd = client.fd();
    for (what, bytes, fds, want) in [
        ("garbage", vec![0xff, 0xff, 0xff], vec![], "malformed"),
        ("truncated field", vec![0x0a, 0x7f, 0x01], vec![&fd], "malformed"),
        ("unknown message type", vec![0x22, 0x00], vec![], "without a payload"),
        (
            "add without fd",
            WorkloadRequest::add("client-uid", None).encode_to_vec(),
            vec![],
            "without a network namespace",
        ),
        (
            "unknown uid",
            WorkloadRequest::add("nobody", None).encode_to_vec(),
            vec![&fd],
            "no workload with this uid",
        ),
        (
            "keep unknown",
            WorkloadRequest::keep("client-uid").encode_to_vec(),
            vec![],
            "does not hold",
        ),
    ] {
        let err = c.cni1.send_raw(&bytes, &fds);
        assert!(err.contains(want), "{what}: ack error '{err}' should contain '{want}'");
    }
    let wrong = WorkloadInfo {
        name: "client".into(),
        namespace: "demo".into(),
        service_account: "admin".into(),
    };
    let err = c.cni1.send(WorkloadRequest::add("client-uid", Some(wrong)), Some(&fd));
    assert!(err.contains("mesh state says"), "{err}");
    let t = c.n1.metrics();
    assert_eq!(metric(&t, "mbtunnel_zds_requests_total", &["result=\"error\""]), Some(7.0), "{t}");
    assert_eq!(
        metric(&t, "mbtunnel_zds_requests_total", &["kind=\"malformed\""]),
        Some(3.0),
        "{t}"
    );
    assert_eq!(metric(&t, "mbtunnel_inpod_pods", &[]), Some(0.0), "{t}");
    // Still serving: a good add after all that works, and traffic flows.
    assert_eq!(enroll(&c.cni1, &client, "client-uid", Backend::Iptables), "");
    snapshot(&c.cni1);
    round_trip(connect_from(&client, sa(echo.v4, 8080)).unwrap(), 1000);

    // The app dialling the proxy's own outbound port directly is a loop: closed, counted.
    let mut s = connect_from(&client, "127.0.0.1:15001".parse().unwrap()).unwrap();
    let mut b = Vec::new();
    let _ = s.read_to_end(&mut b);
    assert!(b.is_empty());
    wait("loop refusal counted", || {
        metric(&c.n1.metrics(), "mbtunnel_connections_refused_total", &["loop"]) == Some(1.0)
    });
    // A tunnel asking for the destination pod's own HBONE port is refused by its proxy.
    let mut s = connect_from(&client, sa(echo.v4, 15008)).unwrap();
    let _ = s.read_to_end(&mut b);
    wait("CONNECT to a proxy port refused", || {
        metric(&c.n2.metrics(), "mbtunnel_connections_refused_total", &["loop"]) == Some(1.0)
    });
}

#[test]
fn pod_outside_the_mesh_talks_plaintext_and_is_not_intercepted() {
    require_netns!();
    let c = cluster("plain");
    let legacy = c.sim.add_pod(1, 5); // never enrolled, no rules
    let plain = c.sim.add_pod(2, 3); // never enrolled, no rules
    let echo = c.sim.add_pod(2, 2);
    let plain_peers = echo_in(&plain);
    let echo_peers = echo_in(&echo);
    assert_eq!(enroll(&c.cni2, &echo, "echo-uid", Backend::Iptables), "");
    snapshot(&c.cni1);
    snapshot(&c.cni2);

    // legacy → plain: nobody's proxy is involved.
    round_trip(connect_from(&legacy, sa(plain.v4, 8080)).unwrap(), 1000);
    assert_eq!(plain_peers.lock().unwrap()[0].ip(), legacy.v4);
    // legacy → echo (enrolled): captured inbound on 15006, plaintext, source kept.
    round_trip(connect_from(&legacy, sa(echo.v4, 8080)).unwrap(), 1000);
    assert_eq!(echo_peers.lock().unwrap()[0].ip(), legacy.v4);
    wait("plaintext inbound counted", || {
        metric(&c.n2.metrics(), "istio_tcp_connections_closed_total", &["reporter=\"destination\""])
            == Some(1.0)
    });
    let t2 = c.n2.metrics();
    assert_eq!(
        metric(
            &t2,
            "istio_tcp_connections_opened_total",
            &[
                "connection_security_policy=\"unknown\"",
                &format!("destination_principal=\"{ECHO}\"")
            ]
        ),
        Some(1.0),
        "{t2}"
    );
    assert_eq!(metric(&t2, "istio_tcp_connections_opened_total", &["mutual_tls"]), None);
    // Node 1's proxy saw none of it.
    assert_eq!(metric(&c.n1.metrics(), "istio_tcp_connections_opened_total", &[]), None);
}

/// No namespaces needed: readiness waits for the CNI, and the proxy keeps retrying its socket
/// (with backoff) until the CNI appears, and again after the CNI goes away.
#[test]
fn not_ready_until_the_cni_answers_and_reconnects_after_it_restarts() {
    let dir = temp_dir("inpod-ready");
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("cni.sock");
    let mut cfg = mesh_yaml(1, &dir.join("ca"), &sock);
    for a in [
        &mut cfg.outbound_addr,
        &mut cfg.inbound_addr,
        &mut cfg.inbound_plaintext_addr,
        &mut cfg.metrics_addr,
        &mut cfg.readiness_addr,
        &mut cfg.admin_addr,
    ] {
        *a = "127.0.0.1:0".parse().unwrap();
    }
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let running = rt.block_on(mbtunnel::app::start(cfg, None)).expect("start");
    std::thread::sleep(Duration::from_millis(300));
    assert!(!running.is_ready(), "no CNI yet: not ready");
    let mut cni = Cni::new(sock.clone());
    cni.accept();
    assert!(!running.is_ready(), "connected, snapshot not applied yet");
    snapshot(&cni);
    assert!(running.is_ready());
    // The CNI restarts; the proxy reconnects and says hello again.
    drop(cni);
    let mut cni = Cni::new(sock);
    cni.accept();
    snapshot(&cni);
    assert!(running.is_ready());
    rt.block_on(running.shutdown());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Output of a command, without `#` comment lines (iptables-save stamps the time in them).
fn out(args: &[&str]) -> String {
    let o = std::process::Command::new(args[0]).args(&args[1..]).output().expect("spawn");
    let text =
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    text.lines().filter(|l| !l.starts_with('#')).collect::<Vec<_>>().join("\n")
}

/// The operator's path: `mbtunnel redirect ... --netns`, applied twice (same as once), removed.
#[test]
fn redirect_subcommand_applies_idempotently_and_removes_cleanly() {
    require_netns!();
    let mut sim = Sim::new();
    sim.add_node(1);
    let pod = sim.add_pod(1, 2);
    let bin = env!("CARGO_BIN_EXE_mbtunnel");
    let path = pod.path();
    let p = path.to_str().unwrap();
    let ns = &pod.name;
    for backend in ["iptables", "nftables"] {
        let show = || match backend {
            "iptables" => out(&["ip", "netns", "exec", ns, "iptables-save"]),
            _ => out(&["ip", "netns", "exec", ns, "nft", "list", "ruleset"]),
        };
        let rules_v6 = || out(&["ip", "netns", "exec", ns, "ip6tables-save"]);
        let ip_rules = || out(&["ip", "-n", ns, "rule", "show"]);
        sh_ok(&[bin, "redirect", backend, "apply", "--netns", p]);
        let once = show();
        assert!(
            once.contains("15001") && once.contains("15006") && once.contains("15008"),
            "{once}"
        );
        assert!(ip_rules().contains("lookup 100"), "{}", ip_rules());
        sh_ok(&[bin, "redirect", backend, "apply", "--netns", p]);
        assert_eq!(show(), once, "{backend}: applying twice equals once");
        assert_eq!(ip_rules().matches("lookup 100").count(), 1);
        if backend == "iptables" && common::netns::ipv6_skip_reason().is_none() {
            assert!(rules_v6().contains("--to-ports 15001"), "{}", rules_v6());
        }
        sh_ok(&[bin, "redirect", backend, "remove", "--netns", p]);
        let after = show();
        assert!(!after.contains("MBT_") && !after.contains("mbtunnel"), "{backend}: {after}");
        assert!(!ip_rules().contains("lookup 100"));
    }
    // A namespace that does not exist is a clear error.
    let o = std::process::Command::new(bin)
        .args(["redirect", "iptables", "apply", "--netns", "/var/run/netns/mbt-no-such-ns"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("cannot enter network namespace /var/run/netns/mbt-no-such-ns"), "{e}");
}

fn sh_ok(args: &[&str]) {
    let o = std::process::Command::new(args[0]).args(&args[1..]).output().expect("spawn");
    assert!(o.status.success(), "{}: {}", args.join(" "), String::from_utf8_lossy(&o.stderr));
}

/// Pushes `policies` (YAML list of istio.security.Authorization) into a node's mesh state,
/// replacing the ones it holds, as a control-plane update would.
fn set_policies(node: &Node, yaml: &str) {
    use mbtunnel::state::{Delta, Family, Resource};
    let state = &node.r().ctx.state;
    let ps: Vec<mbtunnel::state::policy::Authorization> = serde_yaml::from_str(yaml).unwrap();
    let removes = state.names(Family::Policy).into_iter().map(|n| (Family::Policy, n)).collect();
    state.apply(Delta { upserts: ps.into_iter().map(Resource::Policy).collect(), removes });
}

/// Whether an echo round trip from `pod` to `dst` succeeds (false: refused, reset or empty).
fn echo_works(pod: &Pod, dst: std::net::SocketAddr) -> bool {
    let Ok(mut s) = connect_from(pod, dst) else { return false };
    if s.write_all(b"are you there").is_err() || s.shutdown(std::net::Shutdown::Write).is_err() {
        return false;
    }
    let mut back = Vec::new();
    s.read_to_end(&mut back).is_ok() && back == b"are you there"
}

#[test]
fn authorization_policy_in_pod_namespaces() {
    require_netns!();
    let c = cluster("authz");
    let client = c.sim.add_pod(1, 2);
    let legacy = c.sim.add_pod(1, 5); // not in the mesh: plaintext
    let echo = c.sim.add_pod(2, 2);
    let _peers = echo_in(&echo);
    assert_eq!(enroll(&c.cni1, &client, "client-uid", Backend::Iptables), "");
    assert_eq!(enroll(&c.cni2, &echo, "echo-uid", Backend::Iptables), "");
    snapshot(&c.cni1);
    snapshot(&c.cni2);
    let to = sa(echo.v4, 8080);
    assert!(echo_works(&client, to) && echo_works(&legacy, to), "no policy: both pass");

    // STRICT (istiod's DENY of peers without a principal): plaintext refused, HBONE passes.
    set_policies(
        &c.n2,
        "[{name: strict, namespace: demo, scope: NAMESPACE, action: DENY, \
          rules: [{clauses: [{matches: [{not_principals: [presence]}]}]}]}]",
    );
    assert!(!echo_works(&legacy, to), "plaintext passed a STRICT policy");
    assert!(echo_works(&client, to), "mTLS refused by a STRICT policy");
    let t = c.n2.metrics();
    assert_eq!(
        metric(
            &t,
            "istio_tcp_connections_failed_total",
            &["response_flags=\"DENY\"", "connection_security_policy=\"unknown\""]
        ),
        Some(1.0),
        "{t}"
    );

    // An ALLOW naming another principal: the client's CONNECT is answered 401.
    set_policies(
        &c.n2,
        "[{name: only-client2, namespace: demo, scope: NAMESPACE, action: ALLOW, \
          rules: [{clauses: [{matches: [{principals: [{exact: cluster.local/ns/demo/sa/client2}]}]}]}]}]",
    );
    assert!(!echo_works(&client, to), "a principal the ALLOW does not name got through");
    wait("the denial counted on both sides", || {
        metric(
            &c.n2.metrics(),
            "istio_tcp_connections_failed_total",
            &["response_flags=\"DENY\"", "mutual_tls"],
        ) == Some(1.0)
            && metric(
                &c.n1.metrics(),
                "mbtunnel_connections_refused_total",
                &["denied_by_destination"],
            ) == Some(1.0)
    });
}

/// Adds `yaml` (one workload) to a node's mesh state, as an xDS push would.
fn push_workload(node: &Node, yaml: &str) {
    use mbtunnel::state::{Delta, Resource, Workload};
    let w: Workload = serde_yaml::from_str(yaml).unwrap();
    node.r().ctx.state.apply(Delta { upserts: vec![Resource::Workload(w)], removes: vec![] });
}

/// istio-cni sends the ADD before the pod has a published IP, so before istiod can have sent its
/// workload. The ADD is accepted from the CNI's identity, the pod is counted pending, and a
/// connection it opens then waits for the workload instead of being refused; a pending pod can
/// be deleted like any other.
#[test]
fn a_pod_added_before_its_workload_is_accepted_and_its_connections_wait_for_it() {
    require_netns!();
    let c = cluster("pending");
    let late = c.sim.add_pod(1, 6);
    let gone = c.sim.add_pod(1, 7);
    let echo = c.sim.add_pod(2, 2);
    let peers = echo_in(&echo);
    assert_eq!(enroll(&c.cni2, &echo, "echo-uid", Backend::Iptables), "");
    // Neither pod is in any node's mesh state.
    assert_eq!(
        c.cni1.enroll(&late, "late-uid", "late", "late", Backend::Iptables),
        "",
        "ADD refused"
    );
    assert_eq!(c.cni1.enroll(&gone, "gone-uid", "gone", "gone", Backend::Iptables), "");
    snapshot(&c.cni1);
    snapshot(&c.cni2);
    let pending = |n: &Node| metric(&n.metrics(), "mbtunnel_inpod_pods_pending", &[]);
    assert_eq!(pending(&c.n1), Some(2.0), "{}", c.n1.metrics());
    assert_eq!(c.n1.pods(), ["gone-uid", "late-uid"]);
    // The config dump's `workloadState` (ztunnel's): each pod by uid, up, as the CNI named it.
    let ws = c.n1.r().inpod.as_ref().unwrap().workload_state();
    assert_eq!(
        ws["late-uid"],
        serde_json::json!({"state": "Up", "info": {"name": "late", "namespace": "demo",
            "trustDomain": "cluster.local", "serviceAccount": "late"}}),
        "{ws:#}"
    );

    // A connection from the pending pod waits; its workload arrives meanwhile.
    let to = sa(echo.v4, 8080);
    let s = connect_from(&late, to).expect("the connect is accepted by the pod's listener");
    std::thread::sleep(Duration::from_millis(400));
    assert!(peers.lock().unwrap().is_empty(), "went through before the workload was known");
    for n in [&c.n1, &c.n2] {
        push_workload(
            n,
            "{uid: late-uid, name: late, namespace: demo, service_account: late, \
             ips: [10.0.1.6], node: node-1}",
        );
    }
    common::cluster::round_trip(s, 4096);
    assert_eq!(peers.lock().unwrap()[0].ip(), late.v4, "the app sees the pod's IP");
    wait("the workload counted, the pod no longer pending", || pending(&c.n1) == Some(1.0));
    let t = c.n2.metrics();
    assert_eq!(
        metric(
            &t,
            "istio_tcp_connections_opened_total",
            &["source_principal=\"spiffe://cluster.local/ns/demo/sa/late\"", "mutual_tls"]
        ),
        Some(1.0),
        "the pod's identity, from the CNI's ADD, over mTLS\n{t}"
    );

    // A pending pod deleted before its workload ever came.
    assert_eq!(c.cni1.send(WorkloadRequest::del("gone-uid"), None), "");
    wait("the deleted pod gone", || c.n1.pods() == ["late-uid"] && pending(&c.n1) == Some(0.0));
}

/// The node's resolver in the tests below (where kube-dns would be): node 1's own address.
const NODE_DNS: &str = "10.0.0.1:53";

/// One DNS query from inside `pod` to the node's resolver address (captured to the proxy).
fn dig(pod: &Pod, name: &str, rtype: &str, tcp: bool) -> hickory_proto::op::Message {
    let (name, rtype) = (name.to_string(), rtype.parse().unwrap());
    pod.run(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let ask = mbtunnel::dns::tools::Ask::udp().tcp(tcp);
        rt.block_on(mbtunnel::dns::tools::query(NODE_DNS.parse().unwrap(), &name, rtype, ask))
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    })
}

/// Answer addresses of a response.
fn addrs(m: &hickory_proto::op::Message) -> Vec<String> {
    m.answers()
        .iter()
        .filter(|r| r.record_type().is_ip_addr())
        .map(|r| r.data().to_string())
        .collect()
}

/// In-pod DNS capture: the pod's queries to its resolver (port 53, UDP and TCP) reach the proxy
/// in its namespace, which answers mesh names (a service by full and short name, a ServiceEntry
/// host) from the mesh state and forwards the rest to the node's resolver (a server this test
/// starts in node 1's namespace); the answer for a service is usable (the pod connects to it).
#[test]
fn a_pod_resolves_mesh_names_service_entries_and_outside_names_through_the_proxy() {
    use mbtunnel::dns::tools::{parse_records, StaticServer};
    use mbtunnel::state::{local_resources, Delta, Service};
    require_netns!();
    let c = cluster_with("dns", |cfg| cfg.dns_upstreams = vec![NODE_DNS.parse().unwrap()]);
    let records = parse_records(&["outside.example.test=203.0.113.9".into()]).unwrap();
    let up =
        c.n1.rt
            // Spawned: binds on a runtime thread, inside node 1's namespace.
            .block_on(async {
                tokio::spawn(StaticServer::start(NODE_DNS.parse().unwrap(), records, 30)).await
            })
            .unwrap()
            .expect("the node's resolver");
    let client = c.sim.add_pod(1, 2);
    let echo = c.sim.add_pod(2, 2);
    let _peers = echo_in(&echo);
    assert_eq!(enroll(&c.cni1, &client, "client-uid", Backend::Iptables), "");
    assert_eq!(enroll(&c.cni2, &echo, "echo-uid", Backend::Nftables), "");
    snapshot(&c.cni1);
    snapshot(&c.cni2);
    // A Kubernetes service and a ServiceEntry host (auto-allocated address), both backed by
    // the echo pod, as istiod would push them.
    let svcs: Vec<Service> = serde_yaml::from_str(
        "- {name: echo, namespace: demo, vips: [10.96.0.2], ports: [{port: 80, target_port: 8080}],
           workloads: [echo-uid]}
- {name: api, namespace: demo, hostname: api.example.test, vips: [240.240.0.1],
   ports: [{port: 80, target_port: 8080}], workloads: [echo-uid]}",
    )
    .unwrap();
    for node in [&c.n1, &c.n2] {
        let state = &node.r().ctx.state;
        let w = (*state.workload_by_uid("echo-uid").unwrap()).clone();
        state.apply(Delta { upserts: local_resources(&[w], &svcs, &[]), removes: vec![] });
    }

    use hickory_proto::op::ResponseCode;
    for tcp in [false, true] {
        // Mesh names: authoritative answers from the proxy (the node's resolver knows none).
        for name in ["echo.demo.svc.cluster.local.", "echo", "echo.demo"] {
            let m = dig(&client, name, "A", tcp);
            assert_eq!(addrs(&m), ["10.96.0.2"], "{name} tcp={tcp}");
            assert!(m.authoritative(), "{name}");
        }
        let m = dig(&client, "api.example.test.", "A", tcp);
        assert_eq!(addrs(&m), ["240.240.0.1"]);
        assert!(m.authoritative());
        // Outside names: forwarded; the node's resolver is authoritative for them, the proxy's
        // relayed answer is not (so it did not bypass the proxy).
        let m = dig(&client, "outside.example.test.", "A", tcp);
        assert_eq!(addrs(&m), ["203.0.113.9"]);
        assert!(!m.authoritative(), "answered directly, not through the proxy");
        let m = dig(&client, "nowhere.example.test.", "A", tcp);
        assert_eq!(m.response_code(), ResponseCode::NXDomain);
    }
    assert!(up.queries.load(std::sync::atomic::Ordering::Relaxed) >= 2);
    // The answer is usable: the pod connects to the service's address through its proxy.
    round_trip(connect_from(&client, sa("10.96.0.2".parse().unwrap(), 80)).unwrap(), 4096);
    round_trip(connect_from(&client, sa("240.240.0.1".parse().unwrap(), 80)).unwrap(), 4096);

    let t = c.n1.metrics();
    let udp = ["request_query_type=\"a\"", "request_protocol=\"udp\""];
    let tcp = ["request_query_type=\"a\"", "request_protocol=\"tcp\""];
    assert_eq!(metric(&t, "istio_dns_requests_total", &udp), Some(6.0), "{t}");
    assert_eq!(metric(&t, "istio_dns_requests_total", &tcp), Some(6.0), "{t}");
    assert_eq!(metric(&t, "istio_dns_upstream_requests_total", &udp), Some(2.0), "{t}");
    assert_eq!(metric(&t, "istio_dns_upstream_failures_total", &udp), Some(1.0), "{t}");
    assert!(t.contains("istio_dns_upstream_request_duration_seconds_bucket"), "{t}");
}

/// The `istio_tcp_*` series of a Prometheus exposition: (name with its labels, value), sorted.
fn tcp_series(text: &str, families: &[&str]) -> Vec<(String, f64)> {
    let mut v: Vec<(String, f64)> = text
        .lines()
        .filter(|l| families.iter().any(|f| l.starts_with(&format!("{f}{{"))))
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').unwrap();
            (series.to_string(), value.parse().unwrap())
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// The same connections as scripts/record-ztunnel-metrics.sh sent through two ztunnels (one to
/// the server pod, one to its service's VIP, one to a port a DENY policy refuses), through two
/// mbtunnels fed the same mesh: every `istio_tcp_*` series ztunnel exported, on each side, is
/// exported with the same name, the same label names in the same order, the same label values
/// and the same value — and no other.
#[test]
fn tcp_metrics_are_ztunnels_label_for_label() {
    use mbtunnel::state::{local_resources, Delta, Service, Workload};
    require_netns!();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/ztunnel-metrics");
    let c = cluster("zt-metrics");
    let client = c.sim.add_pod(1, 8);
    let server = c.sim.add_pod(2, 8);
    let _peers = echo_in(&server);
    assert_eq!(enroll(&c.cni1, &client, "zclient-uid", Backend::Iptables), "");
    assert_eq!(enroll(&c.cni2, &server, "zserver-uid", Backend::Iptables), "");
    snapshot(&c.cni1);
    snapshot(&c.cni2);
    // The fixture's mesh.yaml in mbtunnel's form (its owner names, canonical names, cluster,
    // locality; the service; the DENY of port 8081).
    let ws: Vec<Workload> = serde_yaml::from_str(
        r#"
- {uid: zclient-uid, name: client-7d4f, namespace: demo, service_account: client, ips: [10.0.1.8],
   node: node-1, workload_name: client, canonical_name: client-app, canonical_revision: v1,
   cluster_id: cluster1, locality: {region: region-a, zone: zone-a1}}
- {uid: zserver-uid, name: server-5c9b, namespace: demo, service_account: server, ips: [10.0.2.8],
   node: node-2, workload_name: server, cluster_id: cluster1}
"#,
    )
    .unwrap();
    let svc: Service = serde_yaml::from_str(
        "{name: server, namespace: demo, vips: [10.96.0.8], ports: [{port: 80, target_port: 8080}],
          workloads: [zserver-uid]}",
    )
    .unwrap();
    for node in [&c.n1, &c.n2] {
        let state = &node.r().ctx.state;
        state.apply(Delta {
            upserts: local_resources(&ws, std::slice::from_ref(&svc), &[]),
            removes: vec![],
        });
        set_policies(
            node,
            "- {name: deny-8081, namespace: demo, scope: NAMESPACE, action: DENY,
                rules: [{clauses: [{matches: [{destination_ports: [8081]}]}]}]}",
        );
    }
    round_trip(connect_from(&client, sa(server.v4, 8080)).unwrap(), 1000);
    round_trip(connect_from(&client, sa("10.96.0.8".parse().unwrap(), 80)).unwrap(), 2000);
    if let Ok(mut s) = connect_from(&client, sa(server.v4, 8081)) {
        let _ = s.write_all(b"denied");
        let mut b = Vec::new();
        let _ = s.read_to_end(&mut b);
        assert!(b.is_empty(), "the denied connection was answered");
    }
    let families = [
        "istio_tcp_connections_opened_total",
        "istio_tcp_connections_closed_total",
        "istio_tcp_connections_failed_total",
        "istio_tcp_received_bytes_total",
        "istio_tcp_sent_bytes_total",
    ];
    for (node, file) in [(&c.n1, "source.prom"), (&c.n2, "destination.prom")] {
        let want = tcp_series(&std::fs::read_to_string(fixtures.join(file)).unwrap(), &families);
        assert!(want.len() >= 6, "{file}: {want:?}");
        let mut got = Vec::new();
        // The closes are counted when both legs have finished.
        for _ in 0..100 {
            got = tcp_series(&node.metrics(), &families);
            if got == want {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let show = |v: &[(String, f64)]| {
            v.iter().map(|(s, n)| format!("{s} {n}")).collect::<Vec<_>>().join("\n")
        };
        assert_eq!(show(&got), show(&want), "{file}: mbtunnel (left) vs ztunnel (right)");
    }
}

/// The namespace the calling thread is in (inode of its nsfs file).
fn thread_netns() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/thread-self/ns/net").unwrap().ino()
}

#[test]
fn a_workers_socket_for_a_pod_is_the_pods_and_the_worker_goes_home() {
    require_netns!();
    let sim = Sim::two_nodes();
    let pod = sim.add_pod(1, 2);
    // A listener on the pod's loopback: reachable only from inside the pod.
    let (port, pod_ns) = pod.run(|| {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.write_all(b"from the pod").unwrap();
        });
        (port, thread_netns())
    });
    let rt = common::netns::runtime_in(&sim.node_ns(1));
    let ns = pod.ns.clone();
    let (node_before, node_after, inside, reply) = rt.block_on(async move {
        tokio::spawn(async move {
            let before = thread_netns();
            let inside = ns.run_here(thread_netns).unwrap();
            let s = ns.tcp_socket(false).unwrap();
            let after = thread_netns();
            let s = tokio::net::TcpSocket::from_std_stream(std::net::TcpStream::from(s));
            let mut c = s.connect(([127, 0, 0, 1], port).into()).await.unwrap();
            let mut reply = Vec::new();
            tokio::io::AsyncReadExt::read_to_end(&mut c, &mut reply).await.unwrap();
            (before, after, inside, reply)
        })
        .await
        .unwrap()
    });
    assert_eq!(inside, pod_ns, "the work ran in the pod's namespace");
    assert_ne!(node_before, pod_ns);
    assert_eq!(node_after, node_before, "the worker is back in its node's namespace");
    assert_eq!(reply, b"from the pod", "the socket connected inside the pod");
    // A panic in the middle still brings the thread home.
    let ns = pod.ns.clone();
    let (home, after_panic) = rt.block_on(async move {
        tokio::spawn(async move {
            let home = thread_netns();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                ns.run_here(|| panic!("inside the pod"))
            }));
            assert!(r.is_err());
            (home, thread_netns())
        })
        .await
        .unwrap()
    });
    assert_eq!(after_panic, home);
}
