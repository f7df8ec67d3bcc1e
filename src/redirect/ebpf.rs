//! eBPF redirect (node-level capture without NAT): loads the tc classifiers of
//! `mbtunnel.bpf.c`, puts the proxy's three listening sockets in their socket map, installs the
//! policy route that delivers marked packets locally, and then, on request, attaches the
//! classifiers to interfaces and enrols pod addresses.
//!
//! - `pod` role: the host side of a pod's veth. Ingress (what the pod sends): new outbound
//!   connections of enrolled pods go to the outbound listener. Egress (what reaches the pod): a
//!   new connection into an enrolled pod that did not come through the proxy — a pod outside the
//!   mesh on this node, a hostNetwork pod, a node process — is turned back to the ingress and
//!   handed to the inbound listeners there, so STRICT and every policy apply to it as to one
//!   from another node. The proxy's own sockets (its socket mark) and the kubelet's probes
//!   (istio-cni SNATs them to [`PROBE_SOURCES`]) pass. Every pod veth of the node needs the
//!   role, mesh or not (non-mesh pods attached, not enrolled): a SYN into an enrolled pod
//!   forwarded from a veth without it is dropped (`unattached`), since its later segments
//!   would be dropped by the forwarding path. For the turned-back packets to be
//!   delivered, the interface gets `accept_local=1` and `rp_filter=0` (see [`EbpfRedirect::attach`]).
//! - `uplink` role: the node's interface toward other nodes. New connections to enrolled pods go
//!   to the HBONE listener (HBONE port) or the plaintext inbound listener (any other port).
//!
//! Enrolment is a map update: a pod removed from the map is not captured for its next
//! connection, while connections the proxy already owns keep flowing (later segments are steered
//! by socket lookup, not by enrolment).
//!
//! Lifetime ([`PinMode`]): fail closed (the default), the maps are pinned by name in a bpffs
//! directory and every classifier is attached through a pinned tcx link, so both outlive the
//! process. When the proxy is gone its listening sockets leave the socket map, and the
//! classifiers drop an enrolled pod's new connections (`no_listener`) instead of letting them
//! leave unencrypted. The next proxy loads with the same pin directory: it reuses the pinned maps
//! (enrolled pods, counters), puts its own listeners in the socket map — from then on the old
//! classifiers hand connections to it — and replaces each inherited link when that interface is
//! attached again. Fail open, nothing is pinned: links and maps go away when the process exits or
//! [`EbpfRedirect`] is dropped. The policy route is removed in both modes.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use aya::maps::{Array, HashMap as BpfHashMap, PerCpuArray, SockMap};
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::tc::{self, SchedClassifierLinkId, TcAttachType};
use aya::programs::SchedClassifier;
use aya::util::KernelVersion;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::json;

use super::RedirectError;
use crate::net::netns::{self, Netns};

/// The compiled classifiers (build.rs runs clang on `mbtunnel.bpf.c`), with maps not pinned...
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/mbtunnel.bpf.o"));
/// ...and with maps pinned by name (fail-closed mode).
static OBJECT_PINNED: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/mbtunnel-pinned.bpf.o"));

/// Names of the maps (also their pin file names).
const MAP_NAMES: [&str; 5] = ["mbt_listeners", "mbt_pods", "mbt_config", "mbt_stats", "mbt_bypass"];

/// The classifiers in the object.
const PROGRAMS: [&str; 3] = ["mbt_from_pod", "mbt_to_pod", "mbt_from_uplink"];

/// Sources never captured on their way into a pod: the addresses istio-cni SNATs the kubelet's
/// health probes to (ztunnel's in-pod rules let them pass the same way).
pub const PROBE_SOURCES: [IpAddr; 2] = [
    IpAddr::V4(std::net::Ipv4Addr::new(169, 254, 7, 127)),
    IpAddr::V6(std::net::Ipv6Addr::new(
        0xfd16, 0x9254, 0x7127, 0x1337, 0xffff, 0xffff, 0xffff, 0xffff,
    )),
];

/// What outlives the proxy process (see the module documentation).
#[derive(Clone, Debug)]
pub enum PinMode {
    /// Maps and links pinned under this bpffs directory: enrolled pods are cut off while no
    /// proxy listens.
    FailClosed(PathBuf),
    /// Nothing pinned; state a fail-closed proxy left in this directory is removed at load.
    FailOpen(PathBuf),
}

impl PinMode {
    fn dir(&self) -> &Path {
        match self {
            PinMode::FailClosed(d) | PinMode::FailOpen(d) => d,
        }
    }
}

/// Where the admin token lives by default (root-only file; see [`write_token`]).
pub const DEFAULT_TOKEN_FILE: &str = "/var/run/mbtunnel/ebpf-admin.token";
/// The header carrying it.
pub const TOKEN_HEADER: &str = "x-mbtunnel-token";

/// Writes a fresh random token to `path` (mode 0600, parent created) and returns it. Changing
/// the redirect through the admin API needs it: any process of the node's network namespace can
/// reach 127.0.0.1:15000, but only root can read the file.
pub fn write_token(path: &std::path::Path) -> std::io::Result<String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut b = [0u8; 32];
    boring::rand::rand_bytes(&mut b).map_err(std::io::Error::other)?;
    let token: String = b.iter().map(|x| format!("{x:02x}")).collect();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    f.write_all(token.as_bytes())?;
    Ok(token)
}

/// The mark the classifiers set on packets to deliver locally, and its policy route.
pub const MARK: u32 = 0x4000;
pub const ROUTE_TABLE: u32 = 134;
pub const RULE_PRIORITY: u32 = 32763;

// Indexes shared with mbtunnel.bpf.c.
const LISTENER_OUTBOUND: u32 = 0;
const LISTENER_HBONE: u32 = 1;
const LISTENER_PLAINTEXT: u32 = 2;
const CONFIG_MARK: u32 = 0;
const CONFIG_HBONE_PORT: u32 = 1;
const CONFIG_OWN_MARK: u32 = 2;
const STAT_NAMES: [&str; 9] = [
    "outbound",
    "inbound_hbone",
    "inbound_plaintext",
    "no_listener",
    "assign_failed",
    "steered",
    "malformed",
    "same_node",
    "unattached",
];

const HINT: &str = "eBPF redirect needs Linux >= 5.10 with BPF (tcx on >= 6.6, else the clsact \
    qdisc) and the capabilities CAP_BPF and CAP_NET_ADMIN (or CAP_SYS_ADMIN). Without them, \
    choose another redirect mode: in-pod mode with iptables rules in each pod's namespace \
    (INPOD_ENABLED=true; rules by istio-cni or `mbtunnel redirect iptables apply --netns ...`), \
    see the README, \"Choosing a redirect mode\"";

/// Where a classifier is attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Host side of a pod's veth: captures the pod's outbound connections.
    Pod,
    /// The node's interface toward other nodes: captures inbound connections to enrolled pods.
    Uplink,
}

/// One classifier a role attaches to its interface, and the prefix of its link's pin file.
struct Hook {
    program: &'static str,
    direction: TcAttachType,
    pin_prefix: &'static str,
}

impl Role {
    fn hooks(self) -> &'static [Hook] {
        const POD: &[Hook] = &[
            Hook { program: "mbt_from_pod", direction: TcAttachType::Ingress, pin_prefix: "link" },
            Hook { program: "mbt_to_pod", direction: TcAttachType::Egress, pin_prefix: "egress" },
        ];
        const UPLINK: &[Hook] = &[Hook {
            program: "mbt_from_uplink",
            direction: TcAttachType::Ingress,
            pin_prefix: "link",
        }];
        match self {
            Role::Pod => POD,
            Role::Uplink => UPLINK,
        }
    }
}

impl Role {
    /// The name on the command line and in the admin API.
    pub fn name(self) -> &'static str {
        match self {
            Role::Pod => "pod",
            Role::Uplink => "uplink",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Role, String> {
        [Role::Pod, Role::Uplink]
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| format!("unknown role '{s}' (pod or uplink)"))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    #[error("eBPF redirect unavailable: {what}: {detail}. {HINT}")]
    Unavailable { what: &'static str, detail: String },
    #[error("cannot attach to interface {iface}: {detail}")]
    Attach { iface: String, detail: String },
    #[error("interface {iface} is already attached as {role:?}")]
    AttachedAs { iface: String, role: Role },
    #[error("interface {0} is not attached")]
    NotAttached(String),
    #[error("eBPF map {map}: {detail}")]
    Map { map: &'static str, detail: String },
    #[error("policy route for redirected packets: {0}")]
    Route(#[from] RedirectError),
    #[error(
        "eBPF pin directory {dir}: {detail} (fail-closed mode pins maps and links on a BPF \
         filesystem: mount one with `mount -t bpf bpf /sys/fs/bpf`, in Kubernetes a hostPath \
         volume of /sys/fs/bpf; or set ebpf_fail_closed: false to fail open)"
    )]
    Pin { dir: PathBuf, detail: String },
}

/// An error and its causes on one line (aya's errors keep the OS error in `source`).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s = format!("{s}: {t}");
        }
        cur = c.source();
    }
    if !s.contains("Verifier output")
        && (s.contains("Operation not permitted") || s.contains("Permission denied"))
    {
        s += " (the process lacks CAP_BPF/CAP_SYS_ADMIN or CAP_NET_ADMIN)";
    }
    s
}

fn unavailable(what: &'static str, e: &dyn std::error::Error) -> EbpfError {
    EbpfError::Unavailable { what, detail: chain(e) }
}

fn map_err(map: &'static str) -> impl Fn(aya::maps::MapError) -> EbpfError {
    move |e| EbpfError::Map { map, detail: chain(&e) }
}

/// The key of a pod address in `mbt_pods`: IPv6, or IPv4 mapped into IPv6.
fn pod_key(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabel {
    mode: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

/// Redirect metrics, registered whatever the mode (`mbtunnel_redirect_info{mode}` says which).
#[derive(Clone, Default)]
pub struct RedirectMetrics {
    info: Family<ModeLabel, Gauge>,
    enrolled: Gauge,
    interfaces: Gauge,
    packets: Family<KindLabel, Counter<u64, AtomicU64>>,
}

impl RedirectMetrics {
    /// `mode`: ebpf, inpod or external (rules installed by someone else, or none).
    pub fn register(registry: &mut Registry, mode: &str) -> RedirectMetrics {
        let m = RedirectMetrics::default();
        m.info.get_or_create(&ModeLabel { mode: mode.into() }).set(1);
        registry.register(
            "mbtunnel_redirect_info",
            "How pod traffic reaches this proxy: ebpf, inpod or external",
            m.info.clone(),
        );
        registry.register(
            "mbtunnel_redirect_enrolled_pods",
            "Pod addresses enrolled in the eBPF redirect map",
            m.enrolled.clone(),
        );
        registry.register(
            "mbtunnel_redirect_attached_interfaces",
            "Interfaces with an eBPF redirect classifier attached",
            m.interfaces.clone(),
        );
        registry.register(
            "mbtunnel_redirect_ebpf_packets",
            "Packets the eBPF classifiers acted on, by kind: new connections handed to the \
             outbound, inbound_hbone or inbound_plaintext listener, later segments steered to \
             the proxy's sockets, same_node (new connections into an enrolled pod from this \
             node turned back to the inbound listeners), drops for no_listener, assign_failed, \
             malformed (TCP of an enrolled pod hidden behind IPv6 extension headers or in a \
             truncated fragment), or unattached (a new connection into an enrolled pod from a \
             pod veth without the pod classifier)",
            m.packets.clone(),
        );
        m
    }
}

/// One classifier attached to an interface.
struct Link {
    program: &'static str,
    how: Attached,
}

/// How a classifier is attached to an interface.
enum Attached {
    /// By this process, detached when it exits (fail open, or a kernel without tcx links).
    Owned(SchedClassifierLinkId),
    /// Through the link pinned at this path; `inherited`: a previous proxy pinned it (its
    /// program runs until the interface is attached again, which replaces it).
    Pinned { path: PathBuf, inherited: bool },
}

struct Inner {
    bpf: aya::Ebpf,
    links: BTreeMap<String, (Role, Vec<Link>)>,
    pods: BTreeSet<IpAddr>,
    /// Per-CPU counter totals already added to the metrics.
    seen: [u64; STAT_NAMES.len()],
}

/// The loaded eBPF redirect. Dropping it detaches every classifier, frees the maps and removes
/// the policy route.
pub struct EbpfRedirect {
    inner: Mutex<Inner>,
    pin: PinMode,
    /// The namespace the proxy (and its policy route) lives in.
    netns: Netns,
    v6: bool,
    metrics: RedirectMetrics,
}

/// The proxy's listeners the classifiers hand new connections to.
pub struct Listeners<'a> {
    pub outbound: &'a dyn AsRawFd,
    pub hbone: &'a dyn AsRawFd,
    pub plaintext: &'a dyn AsRawFd,
}

impl EbpfRedirect {
    /// Loads the classifiers and maps and installs the policy route in the calling thread's
    /// network namespace. Fails with [`EbpfError::Unavailable`] (which says what to use instead)
    /// when the kernel or the capabilities do not allow it.
    /// `own_mark`: the socket mark of the proxy's dials toward applications (`socket_mark`),
    /// which the pod egress classifier lets through; it must not be 0.
    pub fn load(
        listeners: Listeners<'_>,
        hbone_port: u16,
        own_mark: u32,
        metrics: RedirectMetrics,
        pin: PinMode,
    ) -> Result<EbpfRedirect, EbpfError> {
        if own_mark == 0 {
            return Err(EbpfError::Unavailable {
                what: "socket_mark",
                detail: "it is 0, and the classifier that captures connections into enrolled \
                    pods tells the proxy's own connections by that mark (set socket_mark, \
                    default 0x539)"
                    .into(),
            });
        }
        let mut bpf = match &pin {
            PinMode::FailClosed(dir) => {
                prepare_pin_dir(dir)?;
                aya::EbpfLoader::new()
                    .map_pin_path(dir)
                    .load(OBJECT_PINNED)
                    .map_err(|e| unavailable("loading the eBPF object (pinned maps)", &e))?
            }
            PinMode::FailOpen(dir) => {
                remove_pinned(dir);
                aya::Ebpf::load(OBJECT)
                    .map_err(|e| unavailable("loading the eBPF object (maps)", &e))?
            }
        };
        for name in PROGRAMS {
            let prog: &mut SchedClassifier = bpf
                .program_mut(name)
                .ok_or(EbpfError::Unavailable {
                    what: "loading the eBPF object",
                    detail: format!("program {name} missing"),
                })?
                .try_into()
                .map_err(|e| unavailable("loading the classifiers", &e))?;
            prog.load().map_err(|e| unavailable("loading the classifiers", &e))?;
        }
        {
            let mut socks =
                SockMap::try_from(bpf.map_mut("mbt_listeners").ok_or(EbpfError::Map {
                    map: "mbt_listeners",
                    detail: "missing from the object".into(),
                })?)
                .map_err(map_err("mbt_listeners"))?;
            for (i, l) in [
                (LISTENER_OUTBOUND, listeners.outbound),
                (LISTENER_HBONE, listeners.hbone),
                (LISTENER_PLAINTEXT, listeners.plaintext),
            ] {
                socks.set(i, &l.as_raw_fd(), 0).map_err(map_err("mbt_listeners"))?;
            }
        }
        {
            let mut cfg: Array<_, u32> =
                Array::try_from(bpf.map_mut("mbt_config").ok_or(EbpfError::Map {
                    map: "mbt_config",
                    detail: "missing from the object".into(),
                })?)
                .map_err(map_err("mbt_config"))?;
            cfg.set(CONFIG_MARK, MARK, 0).map_err(map_err("mbt_config"))?;
            cfg.set(CONFIG_HBONE_PORT, u32::from(hbone_port), 0).map_err(map_err("mbt_config"))?;
            cfg.set(CONFIG_OWN_MARK, own_mark, 0).map_err(map_err("mbt_config"))?;
        }
        {
            let mut bypass: BpfHashMap<_, [u8; 16], u32> =
                BpfHashMap::try_from(bpf.map_mut("mbt_bypass").ok_or(EbpfError::Map {
                    map: "mbt_bypass",
                    detail: "missing from the object".into(),
                })?)
                .map_err(map_err("mbt_bypass"))?;
            for ip in PROBE_SOURCES {
                bypass.insert(pod_key(ip), 1, 0).map_err(map_err("mbt_bypass"))?;
            }
        }
        let here = netns::open(std::path::Path::new("/proc/thread-self/ns/net")).map_err(|e| {
            EbpfError::Unavailable {
                what: "opening the proxy's network namespace",
                detail: e.to_string(),
            }
        })?;
        let netns = Netns::enter(here, "proxy").map_err(|e| EbpfError::Unavailable {
            what: "opening the proxy's network namespace",
            detail: e.to_string(),
        })?;
        let v6 = super::ipv6_available();
        let mut inner = Inner {
            bpf,
            links: BTreeMap::new(),
            pods: BTreeSet::new(),
            seen: [0; STAT_NAMES.len()],
        };
        if let PinMode::FailClosed(dir) = &pin {
            // What a previous proxy left: its links stay until their interfaces are attached
            // again, its enrolled pods stay enrolled.
            for (iface, role, program, path) in pinned_links(dir) {
                tracing::info!(
                    iface,
                    role = role.name(),
                    program,
                    "eBPF classifier inherited from a previous proxy"
                );
                let how = Attached::Pinned { path, inherited: true };
                inner
                    .links
                    .entry(iface)
                    .or_insert((role, Vec::new()))
                    .1
                    .push(Link { program, how });
            }
            let keys: Vec<[u8; 16]> =
                Self::pods_map(&mut inner)?.keys().filter_map(Result::ok).collect();
            for k in keys {
                let a = std::net::Ipv6Addr::from(k);
                inner.pods.insert(a.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(a)));
            }
        }
        metrics.enrolled.set(inner.pods.len() as i64);
        metrics.interfaces.set(inner.links.len() as i64);
        let r = EbpfRedirect { inner: Mutex::new(inner), pin, netns, v6, metrics };
        r.routes(true)?;
        tracing::info!(
            mark = format!("{MARK:#x}"),
            table = ROUTE_TABLE,
            hbone_port,
            pin = ?r.pin,
            "eBPF redirect loaded: classifiers ready to attach, policy route installed"
        );
        Ok(r)
    }

    /// Installs (or removes) `fwmark MARK/MARK lookup TABLE` and `local default dev lo table
    /// TABLE`, in the proxy's namespace. Installing first removes a stale copy.
    fn routes(&self, add: bool) -> Result<(), EbpfError> {
        let v6 = self.v6;
        let r = self.netns.run_blocking(move || {
            let del = super::route_cmds(false, v6, MARK, MARK, ROUTE_TABLE, RULE_PRIORITY);
            for c in &del {
                let _ = super::run("ip", c, None);
            }
            if add {
                for c in super::route_cmds(true, v6, MARK, MARK, ROUTE_TABLE, RULE_PRIORITY) {
                    super::run("ip", &c, None)?;
                }
            }
            Ok::<_, RedirectError>(())
        });
        match r {
            Ok(r) => Ok(r?),
            Err(e) => Err(EbpfError::Unavailable {
                what: "entering the proxy's network namespace",
                detail: e.to_string(),
            }),
        }
    }

    /// Attaches the classifiers of `role` to `iface` (pod: ingress and egress; uplink:
    /// ingress). Attaching an interface again with the same role does nothing, except to an
    /// interface whose links a previous proxy left (fail closed): this proxy's classifiers
    /// replace them. A pod interface gets `accept_local=1` and `rp_filter=0`, so that the
    /// connections its egress classifier turns back (whose sources may be this node's own
    /// addresses or pods behind other interfaces) are delivered to the proxy; with the node's
    /// `net.ipv4.conf.all.rp_filter` not 0 they are dropped instead (closed, logged).
    pub fn attach(&self, iface: &str, role: Role) -> Result<(), EbpfError> {
        let mut inner = self.inner.lock().unwrap();
        let mut replaces = Vec::new();
        if let Some((r, links)) = inner.links.get(iface) {
            if *r != role {
                return Err(EbpfError::AttachedAs { iface: iface.into(), role: *r });
            }
            let inherited: Vec<PathBuf> = links
                .iter()
                .filter_map(|l| match &l.how {
                    Attached::Pinned { path, inherited: true } => Some(path.clone()),
                    _ => None,
                })
                .collect();
            if inherited.is_empty() && links.len() == role.hooks().len() {
                return Ok(());
            }
            replaces = inherited;
        }
        let attach_err = |detail: String| EbpfError::Attach { iface: iface.into(), detail };
        if role == Role::Pod {
            same_node_sysctls(iface).map_err(|e| attach_err(e.to_string()))?;
        }
        // tcx (Linux >= 6.6) needs no qdisc; the netlink path before it needs clsact.
        if KernelVersion::current().is_ok_and(|v| v < KernelVersion::new(6, 6, 0)) {
            let _ = tc::qdisc_add_clsact(iface);
        }
        let mut links = Vec::new();
        for hook in role.hooks() {
            let prog: &mut SchedClassifier = inner
                .bpf
                .program_mut(hook.program)
                .ok_or_else(|| attach_err("program missing".into()))?
                .try_into()
                .map_err(|e| attach_err(chain(&e)))?;
            let id = prog.attach(iface, hook.direction).map_err(|e| attach_err(chain(&e)))?;
            let how = match &self.pin {
                PinMode::FailOpen(_) => Attached::Owned(id),
                PinMode::FailClosed(dir) => {
                    let link = prog.take_link(id).map_err(|e| attach_err(chain(&e)))?;
                    match FdLink::try_from(link) {
                        Ok(fd) => {
                            let path = link_path(dir, hook.pin_prefix, role, iface);
                            let _ = std::fs::remove_file(&path);
                            fd.pin(&path)
                                .map_err(|e| attach_err(format!("pinning its link: {e}")))?;
                            Attached::Pinned { path, inherited: false }
                        }
                        Err(e) => {
                            // Netlink attachments (kernels without tcx) cannot be pinned.
                            tracing::warn!(iface, error = %chain(&e),
                                "this kernel has no tcx links (Linux < 6.6): the classifier \
                                 cannot outlive the proxy, so this interface fails open when it \
                                 exits");
                            return Err(attach_err(
                                "fail-closed mode needs tcx links (Linux >= 6.6); \
                                set ebpf_fail_closed: false on this kernel"
                                    .into(),
                            ));
                        }
                    }
                }
            };
            links.push(Link { program: hook.program, how });
        }
        // The predecessor's links go only once ours are attached: the interface is never
        // without a classifier. (A pin file ours just replaced is already ours.)
        let ours: Vec<PathBuf> = links
            .iter()
            .filter_map(|l| match &l.how {
                Attached::Pinned { path, .. } => Some(path.clone()),
                Attached::Owned(_) => None,
            })
            .collect();
        for old in replaces.iter().filter(|p| !ours.contains(p)) {
            unpin_link(old);
        }
        inner.links.insert(iface.into(), (role, links));
        self.metrics.interfaces.set(inner.links.len() as i64);
        tracing::info!(iface, role = ?role, replaced_inherited = !replaces.is_empty(), "eBPF classifiers attached");
        Ok(())
    }

    /// Detaches the classifiers from `iface` (this proxy's, or those a previous proxy pinned).
    pub fn detach(&self, iface: &str) -> Result<(), EbpfError> {
        let mut inner = self.inner.lock().unwrap();
        let (role, links) =
            inner.links.remove(iface).ok_or_else(|| EbpfError::NotAttached(iface.into()))?;
        self.metrics.interfaces.set(inner.links.len() as i64);
        for link in links {
            match link.how {
                Attached::Pinned { path, .. } => unpin_link(&path),
                Attached::Owned(id) => {
                    let prog: &mut SchedClassifier = inner
                        .bpf
                        .program_mut(link.program)
                        .ok_or_else(|| EbpfError::NotAttached(iface.into()))?
                        .try_into()
                        .map_err(|e| EbpfError::Attach {
                            iface: iface.into(),
                            detail: chain(&e),
                        })?;
                    prog.detach(id).map_err(|e| EbpfError::Attach {
                        iface: iface.into(),
                        detail: chain(&e),
                    })?;
                }
            }
        }
        tracing::info!(iface, role = ?role, "eBPF classifiers detached");
        Ok(())
    }

    fn pods_map(
        inner: &mut Inner,
    ) -> Result<BpfHashMap<&mut aya::maps::MapData, [u8; 16], u32>, EbpfError> {
        BpfHashMap::try_from(
            inner.bpf.map_mut("mbt_pods").ok_or(EbpfError::Map {
                map: "mbt_pods",
                detail: "missing from the object".into(),
            })?,
        )
        .map_err(map_err("mbt_pods"))
    }

    /// Captures the next connections of the pod with address `ip` (both directions).
    pub fn enrol(&self, ip: IpAddr) -> Result<(), EbpfError> {
        let mut inner = self.inner.lock().unwrap();
        Self::pods_map(&mut inner)?.insert(pod_key(ip), 1, 0).map_err(map_err("mbt_pods"))?;
        inner.pods.insert(ip);
        self.metrics.enrolled.set(inner.pods.len() as i64);
        tracing::info!(%ip, "pod address enrolled");
        Ok(())
    }

    /// Stops capturing new connections of `ip`; connections already through the proxy go on.
    /// Returns whether it was enrolled.
    pub fn unenrol(&self, ip: IpAddr) -> Result<bool, EbpfError> {
        let mut inner = self.inner.lock().unwrap();
        if !inner.pods.remove(&ip) {
            return Ok(false);
        }
        Self::pods_map(&mut inner)?.remove(&pod_key(ip)).map_err(map_err("mbt_pods"))?;
        self.metrics.enrolled.set(inner.pods.len() as i64);
        tracing::info!(%ip, "pod address removed");
        Ok(true)
    }

    /// Sums the classifiers' per-CPU counters.
    fn stats(inner: &mut Inner) -> Result<[u64; STAT_NAMES.len()], EbpfError> {
        let m: PerCpuArray<_, u64> =
            PerCpuArray::try_from(inner.bpf.map_mut("mbt_stats").ok_or(EbpfError::Map {
                map: "mbt_stats",
                detail: "missing from the object".into(),
            })?)
            .map_err(map_err("mbt_stats"))?;
        let mut out = [0u64; STAT_NAMES.len()];
        for (i, o) in out.iter_mut().enumerate() {
            *o = m.get(&(i as u32), 0).map_err(map_err("mbt_stats"))?.iter().sum();
        }
        Ok(out)
    }

    /// Brings the packet counters in the metrics up to date (called before each scrape).
    pub fn refresh_metrics(&self) {
        let mut inner = self.inner.lock().unwrap();
        let Ok(now) = Self::stats(&mut inner) else { return };
        for (i, name) in STAT_NAMES.iter().enumerate() {
            let d = now[i].saturating_sub(inner.seen[i]);
            if d > 0 {
                self.metrics.packets.get_or_create(&KindLabel { kind: (*name).into() }).inc_by(d);
            }
        }
        inner.seen = now;
    }

    /// State for the config dump and `mbtunnel redirect ebpf status`.
    pub fn status(&self) -> serde_json::Value {
        let mut inner = self.inner.lock().unwrap();
        let stats = Self::stats(&mut inner).ok();
        json!({
            "mode": "ebpf",
            "interfaces": inner.links.iter().map(|(i, (r, links))| json!({
                "iface": i,
                "role": r,
                "programs": links.iter().map(|l| l.program).collect::<Vec<_>>(),
                "pinned": links.iter().all(|l| matches!(l.how, Attached::Pinned { .. })),
                "inherited": links.iter().any(|l| matches!(l.how, Attached::Pinned { inherited: true, .. })),
            })).collect::<Vec<_>>(),
            "fail_closed": matches!(self.pin, PinMode::FailClosed(_)),
            "pin_dir": self.pin.dir().display().to_string(),
            "pods": inner.pods.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
            "mark": format!("{MARK:#x}"),
            "route_table": ROUTE_TABLE,
            "packets": stats.map(|s| STAT_NAMES.iter().zip(s).map(|(n, v)| (n.to_string(), json!(v))).collect::<serde_json::Map<_, _>>()),
        })
    }
}

/// The pin file of the link attaching `role`'s classifier with pin prefix `prefix` to `iface`
/// (`link-<role>-<iface>` for ingress, `egress-<role>-<iface>` for egress).
fn link_path(dir: &Path, prefix: &str, role: Role, iface: &str) -> PathBuf {
    dir.join(format!("{prefix}-{}-{iface}", role.name()))
}

/// Links pinned in `dir` by a previous proxy: (interface, role, program, path).
fn pinned_links(dir: &Path) -> Vec<(String, Role, &'static str, PathBuf)> {
    let Ok(rd) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut v = Vec::new();
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some((prefix, rest)) = name.split_once('-') else { continue };
        let Some((role, iface)) = rest.split_once('-') else { continue };
        let Ok(role) = role.parse::<Role>() else { continue };
        if let Some(h) = role.hooks().iter().find(|h| h.pin_prefix == prefix) {
            v.push((iface.to_string(), role, h.program, e.path()));
        }
    }
    v.sort();
    v
}

/// Lets a pod interface deliver what its egress classifier turns back (IPv4: sources that are
/// this node's own addresses need `accept_local`, sources behind other interfaces need the
/// reverse-path filter off). Warns when the node-wide filter overrides it.
fn same_node_sysctls(iface: &str) -> std::io::Result<()> {
    let conf = Path::new("/proc/sys/net/ipv4/conf");
    if !conf.join(iface).exists() {
        return Ok(()); // no IPv4 on it
    }
    std::fs::write(conf.join(iface).join("accept_local"), "1")?;
    std::fs::write(conf.join(iface).join("rp_filter"), "0")?;
    let all = std::fs::read_to_string(conf.join("all/rp_filter")).unwrap_or_default();
    if all.trim() != "0" {
        tracing::warn!(
            iface,
            all_rp_filter = all.trim(),
            "net.ipv4.conf.all.rp_filter is not 0: connections into enrolled pods from this \
             node (other pods, hostNetwork pods, node processes) are dropped by the kernel \
             instead of reaching the proxy; set it to 0 for them to be proxied"
        );
    }
    Ok(())
}

/// Removes a pinned link: the classifier it attached is detached.
fn unpin_link(path: &Path) {
    match PinnedLink::from_pin(path).map(PinnedLink::unpin) {
        Ok(Ok(fd)) => drop(fd),
        Ok(Err(e)) => tracing::warn!(path = %path.display(), error = %e, "cannot unpin eBPF link"),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %chain(&e), "cannot open pinned eBPF link");
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Creates `dir` and checks it is on a BPF filesystem.
fn prepare_pin_dir(dir: &Path) -> Result<(), EbpfError> {
    let err = |detail: String| EbpfError::Pin { dir: dir.to_path_buf(), detail };
    std::fs::create_dir_all(dir).map_err(|e| err(e.to_string()))?;
    let real = dir.canonicalize().map_err(|e| err(e.to_string()))?;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| err(e.to_string()))?;
    match fs_type_of(&mounts, &real) {
        Some(t) if t == "bpf" => Ok(()),
        Some(t) => Err(err(format!("not on a BPF filesystem (it is on {t})"))),
        None => Err(err("no mount found for it".into())),
    }
}

/// The filesystem type of the mount holding `path`, from `/proc/self/mountinfo` text: the
/// longest mount point that is a prefix of it.
fn fs_type_of(mountinfo: &str, path: &Path) -> Option<String> {
    let mut best: Option<(usize, String)> = None;
    for line in mountinfo.lines() {
        // id parent major:minor root mount-point options [optional...] - fstype source super
        let mut f = line.split_whitespace();
        let point = f.nth(4)?;
        let fstype = line.split(" - ").nth(1)?.split_whitespace().next()?;
        let point = Path::new(point);
        if path.starts_with(point) {
            let depth = point.components().count();
            if best.as_ref().is_none_or(|(d, _)| depth >= *d) {
                best = Some((depth, fstype.to_string()));
            }
        }
    }
    best.map(|(_, t)| t)
}

/// Fail-open start: removes the links and maps a fail-closed proxy pinned in `dir`, so that
/// nothing of it keeps dropping pods' connections.
fn remove_pinned(dir: &Path) {
    let links = pinned_links(dir);
    for (iface, _, _, path) in &links {
        tracing::info!(iface, "removing an eBPF classifier a fail-closed proxy pinned");
        unpin_link(path);
    }
    for m in MAP_NAMES {
        let _ = std::fs::remove_file(dir.join(m));
    }
    if !links.is_empty() {
        let _ = std::fs::remove_dir(dir);
    }
}

impl Drop for EbpfRedirect {
    fn drop(&mut self) {
        if let PinMode::FailClosed(dir) = &self.pin {
            tracing::info!(pin_dir = %dir.display(),
                "eBPF redirect fails closed: classifiers and maps stay pinned; enrolled pods' \
                 new connections are dropped until a proxy listens again");
        }
        // Unpinned links and maps close with `inner`; the route is ours to remove.
        if let Err(e) = self.routes(false) {
            tracing::warn!(error = %e, "could not remove the eBPF redirect policy route");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_dir_filesystem_is_the_innermost_mount() {
        let info = "22 1 0:21 / / rw - ext4 /dev/vda1 rw\n\
                    30 22 0:26 / /sys rw,nosuid - sysfs sysfs rw\n\
                    41 30 0:35 / /sys/fs/bpf rw - bpf bpf rw,mode=700\n";
        assert_eq!(fs_type_of(info, Path::new("/sys/fs/bpf/mbtunnel")).as_deref(), Some("bpf"));
        assert_eq!(fs_type_of(info, Path::new("/sys/fs/bpfx")).as_deref(), Some("sysfs"));
        assert_eq!(fs_type_of(info, Path::new("/tmp/x")).as_deref(), Some("ext4"));
        let link = link_path(Path::new("/p"), "link", Role::Uplink, "eth0");
        assert_eq!(link, Path::new("/p/link-uplink-eth0"));
    }

    #[test]
    fn pinned_links_name_their_role_and_direction() {
        let dir = std::env::temp_dir().join(format!("mbt-pins-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in [
            "link-pod-veth1",
            "egress-pod-veth1",
            "link-uplink-eth0",
            "egress-uplink-x",
            "mbt_pods",
        ] {
            std::fs::write(dir.join(name), "").unwrap();
        }
        let got: Vec<_> = pinned_links(&dir).into_iter().map(|(i, r, p, _)| (i, r, p)).collect();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            got,
            [
                ("eth0".to_string(), Role::Uplink, "mbt_from_uplink"),
                ("veth1".to_string(), Role::Pod, "mbt_from_pod"),
                ("veth1".to_string(), Role::Pod, "mbt_to_pod"),
            ]
        );
        assert_eq!(
            link_path(Path::new("/p"), "egress", Role::Pod, "veth1"),
            Path::new("/p/egress-pod-veth1")
        );
    }

    #[test]
    fn pod_keys_map_ipv4_into_ipv6() {
        let k = pod_key("10.0.1.2".parse().unwrap());
        assert_eq!(&k[..12], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
        assert_eq!(&k[12..], &[10, 0, 1, 2]);
        let k6 = pod_key("fd00:1::2".parse().unwrap());
        assert_eq!(k6[0], 0xfd);
        assert_eq!(k6[15], 2);
    }

    #[test]
    fn object_holds_both_classifiers_and_maps() {
        // Parsing needs no privileges: the embedded object is what build.rs compiled.
        let obj = aya_obj::Object::parse(OBJECT).expect("valid eBPF object");
        for p in PROGRAMS {
            assert!(obj.programs.contains_key(p), "program {p} in the object");
        }
        for m in MAP_NAMES {
            assert!(obj.maps.contains_key(m), "map {m} in the object");
        }
    }

    #[test]
    fn unavailable_error_says_what_to_use_instead() {
        let e =
            unavailable("loading the classifiers", &std::io::Error::from_raw_os_error(libc::EPERM));
        let s = e.to_string();
        assert!(s.contains("CAP_BPF"), "{s}");
        assert!(s.contains("INPOD_ENABLED=true"), "{s}");
        assert!(s.contains("iptables"), "{s}");
    }
}
