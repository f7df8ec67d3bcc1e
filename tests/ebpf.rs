//! eBPF redirect end to end, in network namespaces: two simulated nodes whose proxies run with
//! `ebpf_enabled` inside the node namespaces; pods are attached and enrolled with the real
//! command (`mbtunnel redirect ebpf attach --pod-netns ...`, run in the node's namespace, talking
//! to the proxy's admin API). No iptables or nftables rule exists anywhere. Needs root; prints
//! why and skips otherwise.
//!
//! The redirect-mode comparison (eBPF vs in-pod iptables vs no proxy) is the ignored test
//! `bench_redirect_modes`:
//! `cargo test --release --test ebpf bench_redirect_modes -- --ignored --nocapture`.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::cluster::{connect_from, echo_in, round_trip, sa, wait, Cni, Node};
use common::netns::{ns_path, Pod, Sim};
use common::{metric, temp_dir};
use mbtunnel::config::Config;
use mbtunnel::redirect::Backend;

const CLIENT: &str = "spiffe://cluster.local/ns/demo/sa/client";
const ECHO: &str = "spiffe://cluster.local/ns/demo/sa/echo";

/// The tests look at the kernel's global program and map lists: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The mesh: (name, node, pod index).
const PODS: &[(&str, u8, u8)] = &[("client", 1, 2), ("echo", 2, 2), ("neighbour", 1, 4)];

/// Node `node`'s config. `mode`: "ebpf" (listeners on the node, classifiers), "inpod" (the
/// fake CNI enrols pods and installs iptables rules in them).
fn node_cfg(node: u8, ca: &Path, mode: &str, cni: Option<&Path>) -> Config {
    let mut y = format!(
        "node_name: node-{node}\nca_dir: {}\ndrain_timeout_secs: 1\n\
         metrics_addr: 127.0.0.1:0\nreadiness_addr: 127.0.0.1:0\nadmin_addr: 127.0.0.1:0\n",
        ca.display()
    );
    if mode == "ebpf" || mode == "ebpf-fail-open" {
        y += "ebpf_enabled: true\nebpf_uplinks: [eth0]\noutbound_addr: \"[::]:15001\"\n\
              inbound_addr: \"[::]:15008\"\ninbound_plaintext_addr: \"[::]:15006\"\n";
        y += &format!("ebpf_token_file: {}\n", token_file(ca, node).display());
        y += &format!(
            "ebpf_pin_dir: {}\nebpf_fail_closed: {}\n",
            pin_dir(ca, node).display(),
            mode == "ebpf"
        );
    } else {
        y += &format!(
            "inpod_enabled: true\ninpod_socket: {}\noutbound_addr: 127.0.0.1:0\n\
             inbound_addr: 127.0.0.1:0\ninbound_plaintext_addr: 127.0.0.1:0\n",
            cni.expect("CNI socket").display()
        );
    }
    y += "workloads:\n";
    for (name, n, p) in PODS {
        y += &format!(
            "  - {{uid: {name}-uid, name: {name}, workload_name: {name}, namespace: demo, service_account: {name}, \
             ips: [\"10.0.{n}.{p}\", \"fd00:{n}::{p}\"], node: node-{n}, protocol: HBONE}}\n"
        );
    }
    Config::from_yaml(&y, Path::new("ebpf-test.yaml")).expect("mesh yaml")
}

/// Node `node`'s admin token file (beside the shared CA directory).
fn token_file(ca: &Path, node: u8) -> PathBuf {
    ca.with_file_name(format!("node-{node}.token"))
}

/// Node `node`'s bpffs directory for pinned maps and links, unique to the test run.
fn pin_dir(ca: &Path, node: u8) -> PathBuf {
    let tag = ca.parent().and_then(|d| d.file_name()).unwrap().to_string_lossy().into_owned();
    PathBuf::from(BPFFS).join(format!("{tag}-node-{node}"))
}

const BPFFS: &str = "/sys/fs/bpf";

/// Mounts the BPF filesystem at /sys/fs/bpf when nothing is mounted there (systemd usually
/// does it; a container or a bare CI machine may not have).
fn ensure_bpffs() {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    if !mounts.lines().any(|l| l.split_whitespace().nth(4) == Some(BPFFS) && l.contains(" - bpf "))
    {
        let o = Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]).output().expect("mount");
        assert!(o.status.success(), "mount bpffs: {}", String::from_utf8_lossy(&o.stderr));
    }
}

/// Runs the mbtunnel binary inside namespace `ns` (as a CNI plugin would on the node).
fn mbtunnel_in(ns: &str, args: &[&str]) -> Result<String, String> {
    let o = Command::new("ip")
        .args(["netns", "exec", ns, env!("CARGO_BIN_EXE_mbtunnel")])
        .args(args)
        .output()
        .expect("spawn ip netns exec");
    if o.status.success() {
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&o.stderr).into_owned())
    }
}

struct Cluster {
    // Drop order: proxies, then namespaces.
    n1: Option<Node>,
    n2: Option<Node>,
    client: Pod,
    echo: Pod,
    dir: PathBuf,
    sim: Sim,
}

impl Cluster {
    fn n1(&self) -> &Node {
        self.n1.as_ref().unwrap()
    }
    fn n2(&self) -> &Node {
        self.n2.as_ref().unwrap()
    }
    fn admin(n: &Node) -> String {
        n.r().bound.admin.to_string()
    }
    /// `mbtunnel redirect ebpf <args> --admin <node's admin>` in node `node`'s namespace.
    fn ctl(&self, node: u8, args: &[&str]) -> Result<String, String> {
        let token = token_file(&self.dir.join("ca"), node);
        self.ctl_with_token(node, args, &token)
    }
    fn ctl_with_token(&self, node: u8, args: &[&str], token: &Path) -> Result<String, String> {
        let admin = Self::admin(if node == 1 { self.n1() } else { self.n2() });
        let mut v = vec!["redirect", "ebpf"];
        v.extend_from_slice(args);
        v.extend_from_slice(&["--admin", &admin, "--token-file", token.to_str().unwrap()]);
        mbtunnel_in(&self.sim.node_ns(node), &v)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.n1.take();
        self.n2.take();
        // Unlinking the pins frees what a fail-closed proxy left (links detach, maps go).
        for n in [1, 2] {
            let _ = std::fs::remove_dir_all(pin_dir(&self.dir.join("ca"), n));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Two nodes whose proxies run in eBPF mode: `mode` "ebpf" (fail closed, the default) or
/// "ebpf-fail-open".
fn ebpf_cluster(tag: &str) -> Cluster {
    ebpf_cluster_in(tag, "ebpf")
}

fn ebpf_cluster_in(tag: &str, mode: &str) -> Cluster {
    ensure_bpffs();
    let sim = Sim::two_nodes();
    let client = sim.add_pod(1, 2);
    let echo = sim.add_pod(2, 2);
    let dir = temp_dir(&format!("ebpf-{tag}"));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = dir.join("ca");
    let n1 = Node::start(&sim, 1, node_cfg(1, &ca, mode, None));
    let n2 = Node::start(&sim, 2, node_cfg(2, &ca, mode, None));
    assert!(n1.rt.block_on(n1.r().wait_ready(Duration::from_secs(20))), "node 1 ready");
    assert!(n2.rt.block_on(n2.r().wait_ready(Duration::from_secs(20))), "node 2 ready");
    Cluster { n1: Some(n1), n2: Some(n2), client, echo, dir, sim }
}

/// Attaches and enrols both pods with the real command.
fn attach_pods(c: &Cluster) {
    for (node, pod) in [(1, &c.client), (2, &c.echo)] {
        let out = c
            .ctl(node, &["attach", "--pod-netns", ns_path(&pod.name).to_str().unwrap()])
            .unwrap_or_else(|e| panic!("attach {}: {e}", pod.name));
        assert!(out.contains(&format!("enrolled {}", pod.v4)), "{out}");
    }
}

/// Every namespace of the simulation, the host's excluded.
fn all_namespaces(c: &Cluster) -> Vec<String> {
    let mut v = vec![format!("{}-fab", c.sim.tag), c.sim.node_ns(1), c.sim.node_ns(2)];
    v.push(c.client.name.clone());
    v.push(c.echo.name.clone());
    v
}

/// No iptables (legacy or nft), ip6tables or nftables rule in `ns`.
fn assert_no_packet_filter_rules(ns: &str) {
    for tool in ["iptables-save", "ip6tables-save"] {
        let o = Command::new("ip").args(["netns", "exec", ns, tool]).output().expect(tool);
        let text = String::from_utf8_lossy(&o.stdout);
        let rules: Vec<_> = text.lines().filter(|l| l.starts_with("-A")).collect();
        assert!(rules.is_empty(), "{tool} in {ns} shows rules: {rules:?}");
    }
    if let Ok(o) = Command::new("ip").args(["netns", "exec", ns, "nft", "list", "ruleset"]).output()
    {
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(!text.contains("chain"), "nftables ruleset in {ns}: {text}");
    }
}

fn opened(n: &Node, reporter: &str) -> f64 {
    metric(
        &n.metrics(),
        "istio_tcp_connections_opened_total",
        &[&format!("reporter=\"{reporter}\"")],
    )
    .unwrap_or(0.0)
}

#[test]
fn client_pod_to_server_pod_captured_by_ebpf_over_hbone_mtls() {
    require_netns!();
    let _s = serial();
    let c = ebpf_cluster("e2e");
    attach_pods(&c);
    let peers = echo_in(&c.echo);
    let mut families = vec![(c.client.v4, c.echo.v4)];
    if c.sim.v6 {
        families.push((c.client.v6, c.echo.v6));
    } else {
        eprintln!("IPv6 part skipped: {}", common::netns::ipv6_skip_reason().unwrap_or_default());
    }
    for (i, (src, dst)) in families.iter().enumerate() {
        let s = connect_from(&c.client, sa(*dst, 8080)).expect("connect through the proxies");
        round_trip(s, 256 * 1024);
        // The server saw the client's own address: no NAT, no proxy address.
        wait("echo saw the client", || peers.lock().unwrap().iter().any(|p| p.ip() == *src));
        wait("both proxies counted the connection", || {
            opened(c.n1(), "source") >= (i + 1) as f64
                && opened(c.n2(), "destination") >= (i + 1) as f64
        });
    }
    if c.sim.v6 {
        // TCP hidden behind an IPv6 hop-by-hop header cannot be read by the classifier: from
        // an enrolled pod it is dropped, not let past the proxy.
        let r = connect_with_hop_by_hop(&c.client, sa(c.echo.v6, 8080));
        assert!(r.is_err(), "a SYN behind extension headers got through");
        let m1 = c.n1().metrics();
        assert!(
            metric(&m1, "mbtunnel_redirect_ebpf_packets_total", &["kind=\"malformed\""])
                >= Some(1.0),
            "{m1}"
        );
    }
    let m1 = c.n1().metrics();
    let m2 = c.n2().metrics();
    for (m, reporter) in [(&m1, "source"), (&m2, "destination")] {
        let sent = metric(
            m,
            "istio_tcp_sent_bytes_total",
            &[
                &format!("reporter=\"{reporter}\""),
                "connection_security_policy=\"mutual_tls\"",
                &format!("source_principal=\"{CLIENT}\""),
                &format!("destination_principal=\"{ECHO}\""),
            ],
        );
        assert!(sent.unwrap_or(0.0) >= 256.0 * 1024.0, "{reporter} mTLS bytes: {m}");
        assert_eq!(metric(m, "mbtunnel_redirect_info", &["mode=\"ebpf\""]), Some(1.0), "{m}");
        // Two addresses per pod (IPv4, IPv6).
        assert_eq!(metric(m, "mbtunnel_redirect_enrolled_pods", &[]), Some(2.0), "{m}");
        assert_eq!(metric(m, "mbtunnel_redirect_attached_interfaces", &[]), Some(2.0), "{m}");
    }
    let n = families.len() as f64;
    assert!(
        metric(&m1, "mbtunnel_redirect_ebpf_packets_total", &["kind=\"outbound\""]) >= Some(n),
        "{m1}"
    );
    assert!(
        metric(&m2, "mbtunnel_redirect_ebpf_packets_total", &["kind=\"inbound_hbone\""]) >= Some(n),
        "{m2}"
    );
    // A mesh pod on the client's own node: HBONE stays inside node 1's proxy (no wire), both
    // reporters count it there, and the server still sees the client's address.
    let neighbour = c.sim.add_pod(1, 4);
    let out = c
        .ctl(1, &["attach", "--pod-netns", ns_path(&neighbour.name).to_str().unwrap()])
        .expect("attach neighbour");
    assert!(out.contains("enrolled"), "{out}");
    let npeers = echo_in(&neighbour);
    let s = connect_from(&c.client, sa(neighbour.v4, 8080)).expect("same-node connection");
    round_trip(s, 64 * 1024);
    wait("neighbour saw the client", || {
        npeers.lock().unwrap().iter().any(|p| p.ip() == c.client.v4)
    });
    let m1 = c.n1().metrics();
    let local = metric(
        &m1,
        "istio_tcp_connections_opened_total",
        &[
            "reporter=\"destination\"",
            "destination_workload=\"neighbour\"",
            "connection_security_policy=\"mutual_tls\"",
            &format!("source_principal=\"{CLIENT}\""),
        ],
    );
    assert_eq!(local, Some(1.0), "{m1}");
    c.ctl(1, &["detach", "--pod-netns", ns_path(&neighbour.name).to_str().unwrap()])
        .expect("detach");

    // A pod outside the mesh (not enrolled) on node 1 reaching the enrolled echo pod: not
    // captured on its way out, captured on node 2's uplink into the plaintext inbound listener.
    let before = opened(c.n1(), "source");
    let legacy = c.sim.add_pod(1, 3);
    let s = connect_from(&legacy, sa(c.echo.v4, 8080)).expect("plaintext client");
    round_trip(s, 4096);
    wait("echo saw the legacy pod", || peers.lock().unwrap().iter().any(|p| p.ip() == legacy.v4));
    let m2 = c.n2().metrics();
    assert!(
        metric(&m2, "mbtunnel_redirect_ebpf_packets_total", &["kind=\"inbound_plaintext\""])
            >= Some(1.0),
        "{m2}"
    );
    assert_eq!(opened(c.n1(), "source"), before, "node 1 did not capture the legacy pod");
    let status = c.ctl(2, &["status"]).expect("status");
    let v: serde_json::Value = serde_json::from_str(&status).expect("status is JSON");
    assert_eq!(v["mode"], "ebpf");
    assert!(v["pods"].as_array().unwrap().iter().any(|p| p == &c.echo.v4.to_string()), "{v}");
    for ns in all_namespaces(&c) {
        assert_no_packet_filter_rules(&ns);
    }
}

/// Connects from a thread in namespace `ns` (a node: what node processes and hostNetwork pods
/// share), from `bind` when given.
fn connect_in_ns(
    ns: &str,
    bind: Option<std::net::IpAddr>,
    dst: SocketAddr,
) -> std::io::Result<TcpStream> {
    let fd = mbtunnel::net::netns::open(&ns_path(ns))?;
    let s = std::thread::spawn(move || {
        mbtunnel::net::netns::enter_current_thread(fd.as_fd())?;
        let sock =
            socket2::Socket::new(socket2::Domain::for_address(dst), socket2::Type::STREAM, None)?;
        if let Some(ip) = bind {
            sock.bind(&SocketAddr::new(ip, 0).into())?;
        }
        sock.connect_timeout(&dst.into(), Duration::from_secs(3))?;
        Ok::<TcpStream, std::io::Error>(sock.into())
    })
    .join()
    .unwrap()?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    Ok(s)
}

/// Whether an echo round trip over `s` works (false: refused, reset or nothing back).
fn echoes(s: std::io::Result<TcpStream>) -> bool {
    let Ok(mut s) = s else { return false };
    if s.write_all(b"are you there").is_err() || s.shutdown(std::net::Shutdown::Write).is_err() {
        return false;
    }
    let mut back = Vec::new();
    s.read_to_end(&mut back).is_ok() && back == b"are you there"
}

/// Replaces node `n`'s policies with the YAML list `yaml`.
fn set_policies(n: &Node, yaml: &str) {
    use mbtunnel::state::{Delta, Family, Resource};
    let state = &n.r().ctx.state;
    let ps: Vec<mbtunnel::state::policy::Authorization> = serde_yaml::from_str(yaml).unwrap();
    let removes = state.names(Family::Policy).into_iter().map(|n| (Family::Policy, n)).collect();
    state.apply(Delta { upserts: ps.into_iter().map(Resource::Policy).collect(), removes });
}

#[test]
fn every_same_node_path_into_an_enrolled_pod_goes_through_the_proxy() {
    require_netns!();
    let _s = serial();
    let c = ebpf_cluster("same-node");
    attach_pods(&c);
    let peers = echo_in(&c.echo);
    let to = sa(c.echo.v4, 8080);
    let node2 = c.sim.node_ns(2);
    // A pod outside the mesh on the echo pod's own node, and the node itself (its processes,
    // hostNetwork pods). Neither crosses an uplink.
    let legacy = c.sim.add_pod(2, 3);
    // Attaching the echo pod's interface let it deliver what its egress classifier turns back.
    for (knob, want) in [("accept_local", "1"), ("rp_filter", "0")] {
        let o = Command::new("ip")
            .args(["netns", "exec", &node2, "cat", &format!("/proc/sys/net/ipv4/conf/vp2/{knob}")])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), want, "vp2 {knob}");
    }
    let same_node = |m: &str| {
        metric(m, "mbtunnel_redirect_ebpf_packets_total", &["kind=\"same_node\""]).unwrap_or(0.0)
    };
    let plaintext_opened = |n: &Node| {
        metric(
            &n.metrics(),
            "istio_tcp_connections_opened_total",
            &["reporter=\"destination\"", "connection_security_policy=\"unknown\""],
        )
        .unwrap_or(0.0)
    };

    // PERMISSIVE (no policy): both reach the pod, through node 2's plaintext inbound listener
    // (counted there), and the pod sees their own addresses.
    let redirect_lines = |n: &Node| {
        let m = n.metrics();
        m.lines()
            .filter(|l| l.contains("redirect_ebpf_packets_total") || l.contains("refused_total"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    // The node's other pods carry the pod classifier too (attached, not enrolled).
    c.ctl(2, &["attach", "--iface", "vp3", "--role", "pod"]).expect("attach legacy's veth");
    let ok = echoes(connect_from(&legacy, to));
    assert!(ok, "same-node pod outside the mesh: {}", redirect_lines(c.n2()));
    assert!(echoes(connect_in_ns(&node2, None, to)), "node process: {}", redirect_lines(c.n2()));
    wait("echo saw the legacy pod", || peers.lock().unwrap().iter().any(|p| p.ip() == legacy.v4));
    let m2 = c.n2().metrics();
    assert!(same_node(&m2) >= 1.0, "the node process was turned back to the proxy: {m2}");
    wait("node 2's proxy served both in plaintext", || plaintext_opened(c.n2()) >= 2.0);

    // A pod whose veth lacks the classifier: its connection is dropped, never let past.
    let bare = c.sim.add_pod(2, 5);
    assert!(!echoes(connect_from(&bare, to)), "a pod on an unattached veth reached the pod");
    assert!(!peers.lock().unwrap().iter().any(|p| p.ip() == bare.v4), "echo saw it");
    let m2 = c.n2().metrics();
    assert!(
        metric(&m2, "mbtunnel_redirect_ebpf_packets_total", &["kind=\"unattached\""]) >= Some(1.0),
        "{m2}"
    );

    // The kubelet's probes (SNATed to istio-cni's link-local address) are not captured.
    common::netns::ip(&node2, "addr add 169.254.7.127/32 dev lo");
    let before = same_node(&c.n2().metrics());
    let probe: std::net::IpAddr = "169.254.7.127".parse().unwrap();
    assert!(echoes(connect_in_ns(&node2, Some(probe), to)), "probe source");
    wait("echo saw the probe", || peers.lock().unwrap().iter().any(|p| p.ip() == probe));
    assert_eq!(same_node(&c.n2().metrics()), before, "a probe was turned back");

    // STRICT: every plaintext path is refused at the proxy; mTLS from node 1 and the probes pass.
    set_policies(
        c.n2(),
        "[{name: strict, namespace: demo, scope: NAMESPACE, action: DENY, \
          rules: [{clauses: [{matches: [{not_principals: [presence]}]}]}]}]",
    );
    assert!(!echoes(connect_from(&legacy, to)), "same-node plaintext pod passed STRICT");
    assert!(!echoes(connect_in_ns(&node2, None, to)), "node process passed STRICT");
    assert!(echoes(connect_from(&c.client, to)), "mTLS from node 1 refused under STRICT");
    assert!(echoes(connect_in_ns(&node2, Some(probe), to)), "probe refused under STRICT");
    let m2 = c.n2().metrics();
    assert!(
        metric(&m2, "istio_tcp_connections_failed_total", &["response_flags=\"DENY\""])
            >= Some(2.0),
        "{m2}"
    );
    for ns in all_namespaces(&c) {
        assert_no_packet_filter_rules(&ns);
    }
}

/// Connects from `pod` with an IPv6 hop-by-hop options header (one PadN) on every segment.
fn connect_with_hop_by_hop(pod: &Pod, dst: SocketAddr) -> std::io::Result<TcpStream> {
    pod.run(move || {
        use std::os::fd::AsRawFd;
        let s = socket2::Socket::new(socket2::Domain::IPV6, socket2::Type::STREAM, None)?;
        let opt: [u8; 8] = [0, 0, 1, 4, 0, 0, 0, 0];
        // SAFETY: a valid socket and an 8-byte buffer of the length given.
        let r = unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::IPPROTO_IPV6,
                libc::IPV6_HOPOPTS,
                opt.as_ptr().cast(),
                opt.len() as libc::socklen_t,
            )
        };
        if r != 0 {
            panic!("IPV6_HOPOPTS: {}", std::io::Error::last_os_error());
        }
        s.connect_timeout(&dst.into(), Duration::from_secs(2))?;
        Ok(s.into())
    })
}

/// Sends `msg` on `s` and reads the echo.
fn ping(s: &mut TcpStream, msg: &[u8]) {
    s.write_all(msg).expect("write");
    let mut back = vec![0; msg.len()];
    s.read_exact(&mut back).expect("echo");
    assert_eq!(back, msg);
}

fn programs_and_maps_named_mbt() -> Vec<String> {
    let mut v = Vec::new();
    for p in aya::programs::loaded_programs().flatten() {
        if let Some(n) = p.name_as_str().filter(|n| n.starts_with("mbt_")) {
            v.push(format!("program {n}"));
        }
    }
    for m in aya::maps::loaded_maps().flatten() {
        if let Some(n) = m.name_as_str().filter(|n| n.starts_with("mbt_")) {
            v.push(format!("map {n}"));
        }
    }
    v
}

#[test]
fn enrol_and_remove_while_traffic_flows_then_detach_leaves_nothing() {
    require_netns!();
    let _s = serial();
    // Fail open: everything goes away with the proxies (checked at the end).
    let mut c = ebpf_cluster_in("enrol", "ebpf-fail-open");
    assert!(!programs_and_maps_named_mbt().is_empty(), "the proxies loaded their programs");
    attach_pods(&c);
    let _peers = echo_in(&c.echo);
    let dst = sa(c.echo.v4, 8080);
    let mut a = connect_from(&c.client, dst).expect("connection A");
    ping(&mut a, b"first through the proxy");
    wait("A counted", || opened(c.n1(), "source") >= 1.0);

    // Changes need the proxy's token (root-only file): a wrong one is refused.
    let fake = c.dir.join("fake.token");
    std::fs::write(&fake, "0123").unwrap();
    let e = c.ctl_with_token(1, &["unenrol", "--ip", &c.client.v4.to_string()], &fake).unwrap_err();
    assert!(e.contains("wrong token"), "{e}");
    let mode = std::fs::metadata(token_file(&c.dir.join("ca"), 1)).unwrap();
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777, 0o600);

    // Removed from the map: the next connection goes straight to the server, A goes on.
    let out = c.ctl(1, &["unenrol", "--ip", &c.client.v4.to_string()]).expect("unenrol");
    assert!(out.contains("removed"), "{out}");
    let mut b = connect_from(&c.client, dst).expect("connection B (direct)");
    ping(&mut b, b"direct");
    ping(&mut a, b"A still flows after the pod left the map");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(opened(c.n1(), "source"), 1.0, "B was not captured");
    let m = c.n1().metrics();
    assert_eq!(metric(&m, "mbtunnel_redirect_enrolled_pods", &[]), Some(1.0), "{m}");

    // Back in the map: captured again at once.
    c.ctl(1, &["enrol", "--ip", &c.client.v4.to_string()]).expect("enrol");
    let mut d = connect_from(&c.client, dst).expect("connection D");
    ping(&mut d, b"captured again");
    wait("D counted", || opened(c.n1(), "source") >= 2.0);
    ping(&mut b, b"B still direct");
    drop((a, b, d));

    // Detach by pod: interfaces and addresses gone from the proxy's state.
    for (node, pod) in [(1, &c.client), (2, &c.echo)] {
        c.ctl(node, &["detach", "--pod-netns", ns_path(&pod.name).to_str().unwrap()])
            .expect("detach");
    }
    let v: serde_json::Value = serde_json::from_str(&c.ctl(1, &["status"]).unwrap()).unwrap();
    assert_eq!(v["interfaces"].as_array().unwrap().len(), 1, "only the uplink remains: {v}");
    assert!(v["pods"].as_array().unwrap().is_empty(), "{v}");
    let e = c.ctl(1, &["detach", "--iface", "vp2"]).unwrap_err();
    assert!(e.contains("not attached"), "{e}");
    // Not captured any more: a connection goes direct.
    let mut f = connect_from(&c.client, dst).expect("connection after detach");
    ping(&mut f, b"after detach");
    assert_eq!(opened(c.n1(), "source"), 2.0);

    // Proxies gone: no program, no map, no policy route left behind.
    let (n1, n2) = (c.sim.node_ns(1), c.sim.node_ns(2));
    c.n1.take();
    c.n2.take();
    let freed = (0..400).any(|_| {
        std::thread::sleep(Duration::from_millis(25));
        programs_and_maps_named_mbt().is_empty()
    });
    assert!(freed, "left behind: {:?}", programs_and_maps_named_mbt());
    for ns in [n1, n2] {
        let o = Command::new("ip").args(["-n", &ns, "rule", "show"]).output().unwrap();
        let rules = String::from_utf8_lossy(&o.stdout);
        assert!(!rules.contains("lookup 134"), "policy rule left in {ns}: {rules}");
    }
}

/// Fail closed (the default): while node 1's proxy is gone, the enrolled client pod's new
/// connections are dropped — not sent directly, unencrypted — and counted; a restarted proxy
/// takes the pinned classifiers and maps over without the pod being attached again, and
/// attaching it again replaces the inherited classifier.
#[test]
fn fail_closed_while_no_proxy_listens_and_a_restarted_proxy_takes_over() {
    require_netns!();
    let _s = serial();
    let mut c = ebpf_cluster("failclosed");
    attach_pods(&c);
    let peers = echo_in(&c.echo);
    let dst = sa(c.echo.v4, 8080);
    round_trip(connect_from(&c.client, dst).expect("through the proxy"), 4096);
    wait("counted", || opened(c.n1(), "source") >= 1.0);
    let seen_before = peers.lock().unwrap().len();

    // Node 1's proxy exits: its classifiers and maps stay pinned.
    c.n1.take();
    let pins = pin_dir(&c.dir.join("ca"), 1);
    let mut left: Vec<String> = std::fs::read_dir(&pins)
        .expect("pin directory kept")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert!(left.contains(&"link-pod-vp2".to_string()), "{left:?}");
    assert!(left.contains(&"link-uplink-eth0".to_string()), "{left:?}");
    assert!(left.contains(&"mbt_pods".to_string()), "{left:?}");
    let e = connect_from(&c.client, dst).expect_err("no proxy: the connection is dropped");
    assert!(
        matches!(e.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock),
        "{e}"
    );
    assert_eq!(peers.lock().unwrap().len(), seen_before, "nothing reached the server directly");

    // A new proxy with the same pin directory: no attach, no enrol, and traffic flows again.
    let n1 = Node::start(&c.sim, 1, node_cfg(1, &c.dir.join("ca"), "ebpf", None));
    assert!(n1.rt.block_on(n1.r().wait_ready(Duration::from_secs(20))), "node 1 ready again");
    c.n1 = Some(n1);
    let m = c.n1().metrics();
    assert!(
        metric(&m, "mbtunnel_redirect_ebpf_packets_total", &["kind=\"no_listener\""]) >= Some(1.0),
        "the drops while no proxy listened are counted: {m}"
    );
    round_trip(connect_from(&c.client, dst).expect("through the new proxy"), 4096);
    wait("the new proxy counted it", || opened(c.n1(), "source") >= 1.0);
    let v: serde_json::Value = serde_json::from_str(&c.ctl(1, &["status"]).unwrap()).unwrap();
    assert_eq!(v["fail_closed"], true, "{v}");
    let ifaces = v["interfaces"].as_array().unwrap();
    let vp2 = ifaces.iter().find(|i| i["iface"] == "vp2").expect("vp2 inherited");
    assert_eq!(vp2["inherited"], true, "{v}");
    // The uplink was attached again at start: this proxy's classifier replaced the old one.
    let eth0 = ifaces.iter().find(|i| i["iface"] == "eth0").expect("eth0");
    assert_eq!(eth0["inherited"], false, "{v}");
    assert!(v["pods"].as_array().unwrap().iter().any(|p| p == &c.client.v4.to_string()), "{v}");

    // Attaching the pod again replaces the inherited classifier; traffic still flows.
    c.ctl(1, &["attach", "--pod-netns", ns_path(&c.client.name).to_str().unwrap()])
        .expect("attach again");
    let v: serde_json::Value = serde_json::from_str(&c.ctl(1, &["status"]).unwrap()).unwrap();
    let vp2 = v["interfaces"].as_array().unwrap().iter().find(|i| i["iface"] == "vp2").cloned();
    assert_eq!(vp2.expect("vp2")["inherited"], false, "{v}");
    round_trip(connect_from(&c.client, dst).expect("after the replacement"), 4096);
    wait("counted again", || opened(c.n1(), "source") >= 2.0);

    // A fail-open start removes what the fail-closed proxies pinned.
    c.n1.take();
    let n1 = Node::start(&c.sim, 1, node_cfg(1, &c.dir.join("ca"), "ebpf-fail-open", None));
    assert!(n1.rt.block_on(n1.r().wait_ready(Duration::from_secs(20))));
    assert!(!pins.join("link-pod-vp2").exists(), "fail-open start unpinned the old links");
    drop(n1);
    let e = connect_from(&c.client, dst);
    assert!(e.is_ok(), "fail open: with no proxy the pod talks directly again: {e:?}");
}

#[test]
fn missing_capability_is_a_clear_error_not_a_crash() {
    require_netns!();
    let _s = serial();
    ensure_bpffs();
    let dir = temp_dir("ebpf-nocap");
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("mbtunnel.yaml");
    let pins = pin_dir(&dir.join("ca"), 1);
    std::fs::write(
        &cfg,
        format!(
            "node_name: node-1\nca_dir: {}\nebpf_enabled: true\noutbound_addr: 127.0.0.1:0\n\
             inbound_addr: 127.0.0.1:0\ninbound_plaintext_addr: 127.0.0.1:0\n\
             metrics_addr: 127.0.0.1:0\nreadiness_addr: 127.0.0.1:0\nadmin_addr: 127.0.0.1:0\n\
             ebpf_pin_dir: {}\n",
            dir.join("ca").display(),
            pins.display()
        ),
    )
    .unwrap();
    // Root without CAP_BPF, CAP_SYS_ADMIN and CAP_PERFMON (CAP_NET_ADMIN kept: the listeners
    // can still be transparent, so the eBPF load is what fails).
    let o = Command::new("setpriv")
        .args(["--bounding-set", "-bpf,-sys_admin,-perfmon", "--"])
        .arg(env!("CARGO_BIN_EXE_mbtunnel"))
        .args(["run", "--config"])
        .arg(&cfg)
        .env("MBTUNNEL_LOG_FORMAT", "text")
        .output()
        .expect("setpriv (util-linux)");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "must not start: {err}");
    assert_eq!(o.status.code(), Some(1), "an error exit, not a signal: {err}");
    assert!(!err.contains("panicked"), "{err}");
    for want in ["eBPF redirect unavailable", "CAP_BPF", "INPOD_ENABLED=true", "iptables"] {
        assert!(err.contains(want), "missing '{want}' in: {err}");
    }
    let _ = std::fs::remove_dir_all(&pins);
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// Redirect-mode comparison (ignored: a benchmark, run by hand).

/// Connections per second: `workers` threads in the client pod, each connecting, sending 64
/// bytes, reading them back and closing, for `secs`.
fn conn_rate(client: &Pod, dst: SocketAddr, workers: usize, secs: f64) -> f64 {
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let threads: Vec<_> = (0..workers)
        .map(|_| {
            let fd = client.fd();
            std::thread::spawn(move || {
                mbtunnel::net::netns::enter_current_thread(fd.as_fd()).expect("enter pod");
                let mut n = 0u64;
                while Instant::now() < end {
                    let Ok(mut s) = TcpStream::connect_timeout(&dst, Duration::from_secs(5)) else {
                        continue;
                    };
                    let _ = s.set_nodelay(true);
                    ping(&mut s, &[7u8; 64]);
                    n += 1;
                }
                n
            })
        })
        .collect();
    let total: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    total as f64 / secs
}

/// Request latency on one connection: `n` sequential 64-byte round trips; (p50, p99) in µs.
fn latency(client: &Pod, dst: SocketAddr, n: usize) -> (f64, f64) {
    let mut s = connect_from(client, dst).expect("connect");
    s.set_nodelay(true).unwrap();
    let mut v = Vec::with_capacity(n);
    for i in 0..n + 100 {
        let t = Instant::now();
        ping(&mut s, &[1u8; 64]);
        if i >= 100 {
            v.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (v[n / 2], v[n * 99 / 100])
}

struct Row {
    mode: &'static str,
    cps: f64,
    p50: f64,
    p99: f64,
}

fn measure(mode: &'static str, client: &Pod, dst: SocketAddr, secs: f64) -> Row {
    // Warm-up (certificates, HBONE pool).
    let _ = conn_rate(client, dst, 2, 0.3);
    let cps = conn_rate(client, dst, 4, secs);
    let (p50, p99) = latency(client, dst, 5000);
    Row { mode, cps, p50, p99 }
}

#[test]
#[ignore = "benchmark: cargo test --release --test ebpf bench_redirect_modes -- --ignored --nocapture"]
fn bench_redirect_modes() {
    require_netns!();
    let _s = serial();
    let secs: f64 = std::env::var("BENCH_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let rounds: usize =
        std::env::var("BENCH_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    let mut all: Vec<Row> = Vec::new();
    for round in 0..rounds {
        // No proxy: the pods talk directly.
        {
            let sim = Sim::two_nodes();
            let client = sim.add_pod(1, 2);
            let echo = sim.add_pod(2, 2);
            let _p = echo_in(&echo);
            all.push(measure("no proxy", &client, sa(echo.v4, 8080), secs));
        }
        // eBPF redirect, node proxies.
        {
            let c = ebpf_cluster(&format!("bench{round}"));
            attach_pods(&c);
            let _p = echo_in(&c.echo);
            all.push(measure("eBPF redirect", &c.client, sa(c.echo.v4, 8080), secs));
        }
        // In-pod mode with iptables rules in the pods (istio-cni's default).
        {
            let sim = Sim::two_nodes();
            let client = sim.add_pod(1, 2);
            let echo = sim.add_pod(2, 2);
            let dir = temp_dir(&format!("ebpf-bench-inpod{round}"));
            std::fs::create_dir_all(&dir).unwrap();
            let (s1, s2) = (dir.join("cni-1.sock"), dir.join("cni-2.sock"));
            let mut cni1 = Cni::new(s1.clone());
            let mut cni2 = Cni::new(s2.clone());
            let ca = dir.join("ca");
            let n1 = Node::start(&sim, 1, node_cfg(1, &ca, "inpod", Some(&s1)));
            let n2 = Node::start(&sim, 2, node_cfg(2, &ca, "inpod", Some(&s2)));
            cni1.accept();
            cni2.accept();
            assert_eq!(
                cni1.enroll(&client, "client-uid", "client", "client", Backend::Iptables),
                ""
            );
            assert_eq!(cni2.enroll(&echo, "echo-uid", "echo", "echo", Backend::Iptables), "");
            let _p = echo_in(&echo);
            all.push(measure("in-pod iptables", &client, sa(echo.v4, 8080), secs));
            drop((n1, n2, cni1, cni2));
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let base = median(all.iter().filter(|r| r.mode == "no proxy").map(|r| r.cps).collect());
    println!("\nredirect modes, medians of {rounds} rounds ({secs} s each; client pod on node 1 → echo pod on node 2)");
    println!("| mode | connections/s | vs no proxy | request p50 µs | request p99 µs |");
    println!("|---|---|---|---|---|");
    for mode in ["no proxy", "eBPF redirect", "in-pod iptables"] {
        let rows: Vec<_> = all.iter().filter(|r| r.mode == mode).collect();
        let cps = median(rows.iter().map(|r| r.cps).collect());
        println!(
            "| {mode} | {cps:.0} | {:.2}× | {:.0} | {:.0} |",
            cps / base,
            median(rows.iter().map(|r| r.p50).collect()),
            median(rows.iter().map(|r| r.p99).collect())
        );
    }
    for r in &all {
        println!("raw: {} {:.0} conn/s p50 {:.0} p99 {:.0}", r.mode, r.cps, r.p50, r.p99);
    }
}
