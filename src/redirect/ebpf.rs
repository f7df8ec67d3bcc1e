//! eBPF redirect (node-level capture without NAT): loads the tc classifiers of
//! `mbtunnel.bpf.c`, puts the proxy's three listening sockets in their socket map, installs the
//! policy route that delivers marked packets locally, and then, on request, attaches the
//! classifiers to interfaces and enrols pod addresses.
//!
//! - `pod` role: the host side of a pod's veth (ingress = what the pod sends). New outbound
//!   connections of enrolled pods go to the outbound listener.
//! - `uplink` role: the node's interface toward other nodes. New connections to enrolled pods go
//!   to the HBONE listener (HBONE port) or the plaintext inbound listener (any other port).
//!
//! Enrolment is a map update: a pod removed from the map is not captured for its next
//! connection, while connections the proxy already owns keep flowing (later segments are steered
//! by socket lookup, not by enrolment). Everything the loader creates belongs to this process:
//! links and maps go away when it exits or [`EbpfRedirect`] is dropped, and the policy route is
//! removed then.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use aya::maps::{Array, HashMap as BpfHashMap, PerCpuArray, SockMap};
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

/// The compiled classifiers (build.rs runs clang on `mbtunnel.bpf.c`).
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/mbtunnel.bpf.o"));

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
const STAT_NAMES: [&str; 7] = [
    "outbound",
    "inbound_hbone",
    "inbound_plaintext",
    "no_listener",
    "assign_failed",
    "steered",
    "malformed",
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

impl Role {
    fn program(self) -> &'static str {
        match self {
            Role::Pod => "mbt_from_pod",
            Role::Uplink => "mbt_from_uplink",
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
    if s.contains("Operation not permitted") || s.contains("Permission denied") {
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
             the proxy's sockets, drops for no_listener, assign_failed, or malformed (TCP of an \
             enrolled pod hidden behind IPv6 extension headers or in a truncated fragment)",
            m.packets.clone(),
        );
        m
    }
}

struct Inner {
    bpf: aya::Ebpf,
    links: BTreeMap<String, (Role, SchedClassifierLinkId)>,
    pods: BTreeSet<IpAddr>,
    /// Per-CPU counter totals already added to the metrics.
    seen: [u64; STAT_NAMES.len()],
}

/// The loaded eBPF redirect. Dropping it detaches every classifier, frees the maps and removes
/// the policy route.
pub struct EbpfRedirect {
    inner: Mutex<Inner>,
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
    pub fn load(
        listeners: Listeners<'_>,
        hbone_port: u16,
        metrics: RedirectMetrics,
    ) -> Result<EbpfRedirect, EbpfError> {
        let mut bpf = aya::Ebpf::load(OBJECT)
            .map_err(|e| unavailable("loading the eBPF object (maps)", &e))?;
        for role in [Role::Pod, Role::Uplink] {
            let prog: &mut SchedClassifier = bpf
                .program_mut(role.program())
                .ok_or(EbpfError::Unavailable {
                    what: "loading the eBPF object",
                    detail: format!("program {} missing", role.program()),
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
        let r = EbpfRedirect {
            inner: Mutex::new(Inner {
                bpf,
                links: BTreeMap::new(),
                pods: BTreeSet::new(),
                seen: [0; STAT_NAMES.len()],
            }),
            netns,
            v6,
            metrics,
        };
        r.routes(true)?;
        tracing::info!(
            mark = format!("{MARK:#x}"),
            table = ROUTE_TABLE,
            hbone_port,
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

    /// Attaches the classifier for `role` to `iface` (tc ingress). Attaching an interface again
    /// with the same role does nothing.
    pub fn attach(&self, iface: &str, role: Role) -> Result<(), EbpfError> {
        let mut inner = self.inner.lock().unwrap();
        if let Some((r, _)) = inner.links.get(iface) {
            return if *r == role {
                Ok(())
            } else {
                Err(EbpfError::AttachedAs { iface: iface.into(), role: *r })
            };
        }
        let attach_err = |detail: String| EbpfError::Attach { iface: iface.into(), detail };
        let prog: &mut SchedClassifier = inner
            .bpf
            .program_mut(role.program())
            .ok_or_else(|| attach_err("program missing".into()))?
            .try_into()
            .map_err(|e| attach_err(chain(&e)))?;
        // tcx (Linux >= 6.6) needs no qdisc; the netlink path before it needs clsact.
        if KernelVersion::current().is_ok_and(|v| v < KernelVersion::new(6, 6, 0)) {
            let _ = tc::qdisc_add_clsact(iface);
        }
        let id = prog.attach(iface, TcAttachType::Ingress).map_err(|e| attach_err(chain(&e)))?;
        inner.links.insert(iface.into(), (role, id));
        self.metrics.interfaces.set(inner.links.len() as i64);
        tracing::info!(iface, role = ?role, "eBPF classifier attached");
        Ok(())
    }

    /// Detaches the classifier from `iface`.
    pub fn detach(&self, iface: &str) -> Result<(), EbpfError> {
        let mut inner = self.inner.lock().unwrap();
        let (role, id) =
            inner.links.remove(iface).ok_or_else(|| EbpfError::NotAttached(iface.into()))?;
        self.metrics.interfaces.set(inner.links.len() as i64);
        let prog: &mut SchedClassifier = inner
            .bpf
            .program_mut(role.program())
            .ok_or_else(|| EbpfError::NotAttached(iface.into()))?
            .try_into()
            .map_err(|e| EbpfError::Attach { iface: iface.into(), detail: chain(&e) })?;
        prog.detach(id)
            .map_err(|e| EbpfError::Attach { iface: iface.into(), detail: chain(&e) })?;
        tracing::info!(iface, role = ?role, "eBPF classifier detached");
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
            "interfaces": inner.links.iter().map(|(i, (r, _))| json!({"iface": i, "role": r})).collect::<Vec<_>>(),
            "pods": inner.pods.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
            "mark": format!("{MARK:#x}"),
            "route_table": ROUTE_TABLE,
            "packets": stats.map(|s| STAT_NAMES.iter().zip(s).map(|(n, v)| (n.to_string(), json!(v))).collect::<serde_json::Map<_, _>>()),
        })
    }
}

impl Drop for EbpfRedirect {
    fn drop(&mut self) {
        // Links and maps close with `inner`; the route is ours to remove.
        if let Err(e) = self.routes(false) {
            tracing::warn!(error = %e, "could not remove the eBPF redirect policy route");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        for p in ["mbt_from_pod", "mbt_from_uplink"] {
            assert!(obj.programs.contains_key(p), "program {p} in the object");
        }
        for m in ["mbt_listeners", "mbt_pods", "mbt_config", "mbt_stats"] {
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
