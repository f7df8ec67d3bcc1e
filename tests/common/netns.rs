//! Node simulation in network namespaces: a "fabric" namespace with a bridge joins the node
//! namespaces (10.0.0.<node>/24, fd00::<node>/64); each pod namespace hangs off its node by a veth
//! pair (10.0.<node>.<pod>/32, fd00:<node>::<pod>/128, default route via its node), and nodes
//! route each other's pod ranges. Nothing is created in the test process's own namespace.
//!
//! Every namespace is deleted when the [`Sim`] (or [`Pod`]) guard drops, panics included; names
//! carry the process id, so parallel runs never collide and a later run removes what a killed
//! run left behind.

use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use mbtunnel::net::netns::{self, Netns};

static NEXT: AtomicU32 = AtomicU32::new(1);
const PREFIX: &str = "mbtt";

/// Why namespace tests cannot run here, if they cannot.
pub fn skip_reason() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let uid =
        status.lines().find(|l| l.starts_with("Uid:")).and_then(|l| l.split_whitespace().nth(1));
    if uid != Some("0") {
        return Some(
            "not root: network namespace tests need CAP_SYS_ADMIN and CAP_NET_ADMIN".into(),
        );
    }
    for tool in ["ip", "iptables-restore", "ip6tables-restore"] {
        if Command::new(tool).arg("-V").output().is_err()
            && Command::new(tool).arg("--version").output().is_err()
        {
            return Some(format!("{tool} not installed (scripts/deps.sh installs it)"));
        }
    }
    let probe =
        format!("{PREFIX}{}probe{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
    match Command::new("ip").args(["netns", "add", &probe]).output() {
        Ok(o) if o.status.success() => {
            let _ = Command::new("ip").args(["netns", "del", &probe]).output();
            None
        }
        Ok(o) => Some(format!(
            "cannot create a network namespace: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(format!("cannot run ip: {e}")),
    }
}

/// Skips the calling test (returns from it) with a printed reason when namespaces are unavailable;
/// under `REQUIRE_NETNS=1` (CI runs as root and sets it) a skip is a failure instead.
#[macro_export]
macro_rules! require_netns {
    () => {
        if let Some(why) = common::netns::skip_reason() {
            common::netns::skip_or_fail(&why);
            return;
        }
    };
}

/// Prints why a namespace test is skipped, or panics under `REQUIRE_NETNS=1`.
pub fn skip_or_fail(why: &str) {
    let name = std::thread::current().name().unwrap_or("test").to_string();
    if std::env::var("REQUIRE_NETNS").as_deref() == Ok("1") {
        panic!("{name} cannot run, and REQUIRE_NETNS=1 makes that a failure: {why}");
    }
    eprintln!("SKIPPED {name}: {why}");
}

/// Why IPv6 cannot be used in the namespaces, if it cannot.
pub fn ipv6_skip_reason() -> Option<String> {
    if !std::path::Path::new("/proc/sys/net/ipv6").exists() {
        return Some("kernel without IPv6".into());
    }
    match std::fs::read_to_string("/proc/sys/net/ipv6/conf/default/disable_ipv6") {
        Ok(v) if v.trim() == "0" => None,
        Ok(_) => Some(
            "IPv6 disabled by default for new interfaces (net.ipv6.conf.default.disable_ipv6)"
                .into(),
        ),
        Err(e) => Some(format!("cannot read IPv6 settings: {e}")),
    }
}

pub fn sh(args: &[&str]) {
    let o = Command::new(args[0]).args(&args[1..]).output().expect("spawn");
    assert!(
        o.status.success(),
        "{}: {}",
        args.join(" "),
        String::from_utf8_lossy(&o.stderr).trim()
    );
}

/// `ip -n <ns> ...`
pub fn ip(ns: &str, args: &str) {
    let mut v = vec!["ip", "-n", ns];
    v.extend(args.split_whitespace());
    sh(&v);
}

/// Sets a network sysctl (`net.ipv4.ip_forward=1`) in namespace `ns`: written from a thread inside
/// it, since /proc/sys/net shows the namespace of the task that opens it (no `sysctl` binary needed).
fn sysctl(ns: &str, kv: &str) {
    let (key, value) = kv.split_once('=').expect("key=value");
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    let value = value.to_string();
    let n = Netns::enter(netns::open(&ns_path(ns)).unwrap(), ns).unwrap();
    n.run_blocking(move || std::fs::write(&path, value))
        .unwrap()
        .unwrap_or_else(|e| panic!("sysctl {kv} in {ns}: {e}"));
}

/// Deletes namespaces left by test processes that no longer exist.
fn remove_stale() {
    let Ok(o) = Command::new("ip").args(["netns", "list"]).output() else { return };
    for line in String::from_utf8_lossy(&o.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(PREFIX) else { continue };
        let pid: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
        if !pid.is_empty() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new("ip").args(["netns", "del", name]).output();
        }
    }
}

struct NsGuard(String);

impl Drop for NsGuard {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

fn add_ns(name: &str) -> NsGuard {
    sh(&["ip", "netns", "add", name]);
    let g = NsGuard(name.to_string());
    ip(name, "link set lo up");
    g
}

pub fn ns_path(name: &str) -> PathBuf {
    PathBuf::from("/var/run/netns").join(name)
}

/// A lone namespace with only loopback up, for a test that needs netfilter state of its own.
/// Dropping it deletes the namespace.
pub struct Lone {
    pub name: String,
    _guard: NsGuard,
}

impl Lone {
    pub fn new(tag: &str) -> Lone {
        remove_stale();
        let name =
            format!("{PREFIX}{}{tag}{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let g = add_ns(&name);
        Lone { name, _guard: g }
    }

    /// Runs `f` on a new thread that has entered the namespace; threads it starts (a tokio
    /// runtime's workers) are created inside it too.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let fd = netns::open(&ns_path(&self.name)).expect("open netns");
        std::thread::spawn(move || {
            netns::enter_current_thread(fd.as_fd()).expect("setns");
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    }
}

/// A simulated cluster. Drop removes every namespace it made.
pub struct Sim {
    pub tag: String,
    // Dropped last to first: pods, nodes, fabric.
    guards: Vec<NsGuard>,
    nodes: Vec<u8>,
    /// IPv6 addresses and routes are set up (see [`ipv6_skip_reason`]).
    pub v6: bool,
}

/// A pod namespace.
pub struct Pod {
    pub name: String,
    pub node: u8,
    pub index: u8,
    pub v4: std::net::IpAddr,
    pub v6: std::net::IpAddr,
    pub ns: Arc<Netns>,
    _guard: NsGuard,
}

impl Pod {
    pub fn path(&self) -> PathBuf {
        ns_path(&self.name)
    }
    /// A fresh fd of the pod's namespace (what the CNI sends).
    pub fn fd(&self) -> OwnedFd {
        netns::open(&self.path()).expect("open pod netns")
    }
    /// Runs `f` on a thread inside the pod.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        self.ns.run_blocking(f).expect("pod thread")
    }
}

impl Sim {
    pub fn new() -> Sim {
        remove_stale();
        let tag =
            format!("{PREFIX}{}x{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let fab = format!("{tag}-fab");
        let g = add_ns(&fab);
        ip(&fab, "link add br0 type bridge");
        ip(&fab, "link set br0 up");
        Sim { tag, guards: vec![g], nodes: Vec::new(), v6: ipv6_skip_reason().is_none() }
    }

    /// Two nodes (1 and 2) routed to each other.
    pub fn two_nodes() -> Sim {
        let mut sim = Sim::new();
        sim.add_node(1);
        sim.add_node(2);
        sim
    }

    pub fn node_ns(&self, n: u8) -> String {
        format!("{}-n{n}", self.tag)
    }

    /// Adds node `n` (1..) and routes between it and the nodes already there.
    pub fn add_node(&mut self, n: u8) {
        let fab = format!("{}-fab", self.tag);
        let ns = self.node_ns(n);
        self.guards.push(add_ns(&ns));
        ip(&fab, &format!("link add n{n} type veth peer name eth0 netns {ns}"));
        ip(&fab, &format!("link set n{n} master br0 up"));
        ip(&ns, &format!("addr add 10.0.0.{n}/24 dev eth0"));
        ip(&ns, "link set eth0 up");
        sysctl(&ns, "net.ipv4.ip_forward=1");
        if self.v6 {
            ip(&ns, &format!("addr add fd00::{n}/64 dev eth0 nodad"));
            sysctl(&ns, "net.ipv6.conf.all.forwarding=1");
        }
        for &m in &self.nodes {
            let other = self.node_ns(m);
            ip(&ns, &format!("route add 10.0.{m}.0/24 via 10.0.0.{m}"));
            ip(&other, &format!("route add 10.0.{n}.0/24 via 10.0.0.{n}"));
            if self.v6 {
                ip(&ns, &format!("-6 route add fd00:{m}::/64 via fd00::{m}"));
                ip(&other, &format!("-6 route add fd00:{n}::/64 via fd00::{n}"));
            }
        }
        self.nodes.push(n);
    }

    /// Adds pod `p` (2..) on node `n`. Drop the returned guard to delete the pod.
    pub fn add_pod(&self, n: u8, p: u8) -> Pod {
        let node = self.node_ns(n);
        let name = format!("{}-n{n}p{p}", self.tag);
        let guard = add_ns(&name);
        ip(&node, &format!("link add vp{p} type veth peer name eth0 netns {name}"));
        ip(&node, &format!("addr add 10.0.{n}.1/32 dev vp{p}"));
        ip(&node, &format!("link set vp{p} up"));
        ip(&node, &format!("route add 10.0.{n}.{p}/32 dev vp{p}"));
        ip(&name, &format!("addr add 10.0.{n}.{p}/32 dev eth0"));
        ip(&name, "link set eth0 up");
        ip(&name, &format!("route add 10.0.{n}.1 dev eth0 scope link"));
        ip(&name, &format!("route add default via 10.0.{n}.1 dev eth0"));
        if self.v6 {
            ip(&node, &format!("addr add fd00:{n}::1/128 dev vp{p} nodad"));
            ip(&node, &format!("-6 route add fd00:{n}::{p}/128 dev vp{p}"));
            ip(&name, &format!("addr add fd00:{n}::{p}/128 dev eth0 nodad"));
            ip(&name, &format!("-6 route add fd00:{n}::1 dev eth0"));
            ip(&name, &format!("-6 route add default via fd00:{n}::1 dev eth0"));
        }
        let ns = Arc::new(Netns::enter(netns::open(&ns_path(&name)).unwrap(), &name).unwrap());
        Pod {
            v4: format!("10.0.{n}.{p}").parse().unwrap(),
            v6: format!("fd00:{n}::{p}").parse().unwrap(),
            name,
            node: n,
            index: p,
            ns,
            _guard: guard,
        }
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        while let Some(g) = self.guards.pop() {
            drop(g);
        }
    }
}

/// A tokio runtime whose every thread lives in the namespace `name` (where a node proxy runs).
pub fn runtime_in(name: &str) -> tokio::runtime::Runtime {
    let fd = Arc::new(netns::open(&ns_path(name)).expect("open node netns"));
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .on_thread_start(move || {
            netns::enter_current_thread(fd.as_fd()).expect("enter node netns");
        })
        .build()
        .expect("runtime")
}
