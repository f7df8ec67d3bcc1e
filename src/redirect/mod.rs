//! Redirect rules for a pod's network namespace, as istio-cni installs them for in-pod mode
//! (iptables by default, nftables as an option):
//!
//! - outbound TCP the app opens → REDIRECT to 15001 (the proxy's outbound listener in the pod);
//! - inbound TCP from the network → REDIRECT to 15006 (plaintext), except 15008 (HBONE), which
//!   reaches the proxy's listener directly;
//! - packets carrying the proxy's mark 0x539 (its own sockets) are never redirected;
//! - replies to the proxy's transparent (spoofed-source) connections toward the app: the first
//!   packet marked 0x539 sets connmark 0x111; the app's replies get it back as their mark, and a
//!   policy route (`fwmark 0x111/0xfff` → table 100: `local default dev lo`) delivers them to the
//!   proxy's socket instead of sending them out of the pod;
//! - DNS (UDP and TCP port 53) the app sends to any address but loopback → REDIRECT to 15053 (the
//!   proxy's DNS listener in the pod), when DNS capture is on (istio-cni's default);
//! - loopback traffic is left alone.
//!
//! The rules are applied from a thread that entered the namespace, by running `iptables-restore`
//! / `nft` / `ip` there (child processes inherit the thread's namespace).
#![forbid(unsafe_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::net::netns::{open, Netns};
pub mod control;
pub mod ebpf;

use crate::dns::DNS_PORT;
use crate::inpod::{INBOUND_PLAINTEXT_PORT, INBOUND_PORT, OUTBOUND_PORT};

/// The mark the proxy puts on its own sockets.
pub const PROXY_MARK: u32 = 0x539;
/// The connmark of connections the proxy opened toward the app (their replies route back to it).
pub const CONN_MARK: u32 = 0x111;
pub const MARK_MASK: u32 = 0xfff;
/// Policy routing table and rule priority for those replies.
pub const ROUTE_TABLE: u32 = 100;
pub const RULE_PRIORITY: u32 = 32764;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    Iptables,
    Nftables,
}

#[derive(Debug, thiserror::Error)]
pub enum RedirectError {
    #[error("cannot enter network namespace {path}: {source}")]
    Netns { path: PathBuf, source: std::io::Error },
    #[error("cannot run {cmd}: {source} (is it installed? scripts/deps.sh installs iptables, nftables, iproute2)")]
    Spawn { cmd: String, source: std::io::Error },
    #[error("{cmd} failed ({status}): {stderr}")]
    Command { cmd: String, status: String, stderr: String },
}

/// `iptables-restore` input for IPv4 (`v6 = false`) or IPv6; `dns`: capture port 53 too.
pub fn iptables_rules(v6: bool, dns: bool) -> String {
    let lo_net = if v6 { "::1/128" } else { "127.0.0.1/32" };
    let dns_rules = if dns {
        format!(
            "-A MBT_OUTPUT ! -d {lo_net} -p udp --dport 53 -j REDIRECT --to-ports {DNS_PORT}\n\
             -A MBT_OUTPUT ! -d {lo_net} -p tcp --dport 53 -j REDIRECT --to-ports {DNS_PORT}\n"
        )
    } else {
        String::new()
    };
    format!(
        "*mangle
:MBT_PRERT - [0:0]
:MBT_OUTPUT - [0:0]
-A PREROUTING -j MBT_PRERT
-A OUTPUT -j MBT_OUTPUT
-A MBT_PRERT -m mark --mark {mark:#x}/{mask:#x} -j CONNMARK --set-xmark {cm:#x}/{mask:#x}
-A MBT_OUTPUT -m connmark --mark {cm:#x}/{mask:#x} -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
COMMIT
*nat
:MBT_PRERT - [0:0]
:MBT_OUTPUT - [0:0]
-A PREROUTING -j MBT_PRERT
-A OUTPUT -j MBT_OUTPUT
-A MBT_PRERT -m mark --mark {mark:#x}/{mask:#x} -j ACCEPT
-A MBT_PRERT -i lo -j ACCEPT
-A MBT_PRERT -p tcp --dport {hbone} -j ACCEPT
-A MBT_PRERT ! -d {lo_net} -p tcp -j REDIRECT --to-ports {plain}
-A MBT_OUTPUT -m mark --mark {cm:#x}/{mask:#x} -j ACCEPT
-A MBT_OUTPUT -m mark --mark {mark:#x}/{mask:#x} -j ACCEPT
{dns_rules}-A MBT_OUTPUT -o lo -j ACCEPT
-A MBT_OUTPUT ! -d {lo_net} -p tcp -j REDIRECT --to-ports {out}
COMMIT
",
        mark = PROXY_MARK,
        mask = MARK_MASK,
        cm = CONN_MARK,
        hbone = INBOUND_PORT,
        plain = INBOUND_PLAINTEXT_PORT,
        out = OUTBOUND_PORT,
    )
}

/// `nft -f` input: one `inet` table covering IPv4 and IPv6; `dns`: capture port 53 too.
pub fn nft_rules(dns: bool) -> String {
    let keep = !MARK_MASK;
    let dns_rules = if dns {
        format!(
            "meta nfproto ipv4 ip daddr != 127.0.0.1 meta l4proto {{ tcp, udp }} th dport 53 redirect to :{DNS_PORT}\n    \
             meta nfproto ipv6 ip6 daddr != ::1 meta l4proto {{ tcp, udp }} th dport 53 redirect to :{DNS_PORT}\n    "
        )
    } else {
        String::new()
    };
    format!(
        "table inet mbtunnel {{
  chain prerouting_mangle {{
    type filter hook prerouting priority mangle; policy accept;
    meta mark & {mask:#x} == {mark:#x} ct mark set ct mark & {keep:#x} | {cm:#x}
  }}
  chain output_mangle {{
    type route hook output priority mangle; policy accept;
    ct mark & {mask:#x} == {cm:#x} meta mark set ct mark
  }}
  chain prerouting_nat {{
    type nat hook prerouting priority dstnat; policy accept;
    meta mark & {mask:#x} == {mark:#x} accept
    iifname \"lo\" accept
    tcp dport {hbone} accept
    meta l4proto tcp redirect to :{plain}
  }}
  chain output_nat {{
    type nat hook output priority -100; policy accept;
    meta mark & {mask:#x} == {cm:#x} accept
    meta mark & {mask:#x} == {mark:#x} accept
    {dns_rules}oifname \"lo\" accept
    meta l4proto tcp redirect to :{out}
  }}
}}
",
        mark = PROXY_MARK,
        mask = MARK_MASK,
        cm = CONN_MARK,
        hbone = INBOUND_PORT,
        plain = INBOUND_PLAINTEXT_PORT,
        out = OUTBOUND_PORT,
    )
}

/// Whether the kernel has IPv6 (without it, only the IPv4 rules are installed).
pub fn ipv6_available() -> bool {
    Path::new("/proc/sys/net/ipv6").exists()
}

/// The `ip` commands for a policy route that delivers packets marked `mark/mask` locally (both
/// families, or IPv4 only): the in-pod reply route, and the eBPF redirect's route.
pub(crate) fn route_cmds(
    add: bool,
    v6: bool,
    mark: u32,
    mask: u32,
    table: u32,
    pref: u32,
) -> Vec<Vec<String>> {
    let verb = if add { "add" } else { "del" };
    let mut v = Vec::new();
    let fams: &[&str] = if v6 { &["-4", "-6"] } else { &["-4"] };
    for &fam in fams {
        let any = if fam == "-4" { "0.0.0.0/0" } else { "::/0" };
        for cmd in [
            format!("{fam} rule {verb} fwmark {mark:#x}/{mask:#x} pref {pref} lookup {table}"),
            format!("{fam} route {verb} local {any} dev lo table {table}"),
        ] {
            v.push(cmd.split(' ').map(String::from).collect());
        }
    }
    v
}

pub(crate) fn run(cmd: &str, args: &[String], stdin: Option<&str>) -> Result<(), RedirectError> {
    let line = format!("{cmd} {}", args.join(" "));
    let mut c = Command::new(cmd);
    c.args(args).stdout(Stdio::null()).stderr(Stdio::piped());
    c.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() });
    let mut child =
        c.spawn().map_err(|source| RedirectError::Spawn { cmd: line.clone(), source })?;
    if let (Some(text), Some(mut i)) = (stdin, child.stdin.take()) {
        let _ = i.write_all(text.as_bytes());
    }
    let out = child
        .wait_with_output()
        .map_err(|source| RedirectError::Spawn { cmd: line.clone(), source })?;
    if !out.status.success() {
        return Err(RedirectError::Command {
            cmd: line,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

fn in_netns<T: Send + 'static>(
    path: &Path,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, RedirectError> {
    let err = |source| RedirectError::Netns { path: path.into(), source };
    let ns = Netns::enter(open(path).map_err(err)?, &path.display().to_string()).map_err(err)?;
    ns.run_blocking(f).map_err(err)
}

/// Installs the rules in the namespace at `netns` (removing an earlier install first, so applying
/// twice is the same as once).
pub fn apply(backend: Backend, netns: &Path, dns: bool) -> Result<(), RedirectError> {
    let v6 = ipv6_available();
    if !v6 {
        tracing::warn!("kernel without IPv6: installing the IPv4 rules only");
    }
    in_netns(netns, move || {
        remove_here(backend);
        match backend {
            Backend::Iptables => {
                run("iptables-restore", &["--noflush".into()], Some(&iptables_rules(false, dns)))?;
                if v6 {
                    run(
                        "ip6tables-restore",
                        &["--noflush".into()],
                        Some(&iptables_rules(true, dns)),
                    )?;
                }
            }
            Backend::Nftables => run("nft", &["-f".into(), "-".into()], Some(&nft_rules(dns)))?,
        }
        for c in route_cmds(true, v6, CONN_MARK, MARK_MASK, ROUTE_TABLE, RULE_PRIORITY) {
            run("ip", &c, None)?;
        }
        Ok(())
    })?
}

/// Removes the rules from the namespace at `netns` (what is not there is ignored).
pub fn remove(backend: Backend, netns: &Path) -> Result<(), RedirectError> {
    in_netns(netns, move || remove_here(backend))
}

fn remove_here(backend: Backend) {
    let quiet = |cmd: &str, args: &[&str]| {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let _ = run(cmd, &args, None);
    };
    match backend {
        Backend::Iptables => {
            for cmd in ["iptables", "ip6tables"] {
                for table in ["nat", "mangle"] {
                    quiet(cmd, &["-t", table, "-D", "PREROUTING", "-j", "MBT_PRERT"]);
                    quiet(cmd, &["-t", table, "-D", "OUTPUT", "-j", "MBT_OUTPUT"]);
                    for chain in ["MBT_PRERT", "MBT_OUTPUT"] {
                        quiet(cmd, &["-t", table, "-F", chain]);
                        quiet(cmd, &["-t", table, "-X", chain]);
                    }
                }
            }
        }
        Backend::Nftables => quiet("nft", &["delete", "table", "inet", "mbtunnel"]),
    }
    for c in route_cmds(false, ipv6_available(), CONN_MARK, MARK_MASK, ROUTE_TABLE, RULE_PRIORITY) {
        let _ = run("ip", &c, None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_name_the_ports_and_marks() {
        let r = iptables_rules(false, true);
        assert!(r.contains("--to-ports 15001") && r.contains("--to-ports 15006"), "{r}");
        assert!(r.contains("--dport 15008 -j ACCEPT") && r.contains("--mark 0x539/0xfff"));
        assert!(
            r.contains("! -d 127.0.0.1/32 -p udp --dport 53 -j REDIRECT --to-ports 15053"),
            "{r}"
        );
        assert!(
            r.contains("! -d 127.0.0.1/32 -p tcp --dport 53 -j REDIRECT --to-ports 15053"),
            "{r}"
        );
        // DNS before the TCP catch-all (else TCP 53 would reach 15001).
        assert!(r.find("--dport 53").unwrap() < r.find("--to-ports 15001").unwrap());
        assert!(!iptables_rules(false, false).contains("15053"));
        assert!(iptables_rules(true, true).contains("! -d ::1/128 -p udp --dport 53"));
        let n = nft_rules(true);
        assert!(n.contains("redirect to :15001") && n.contains("redirect to :15006"), "{n}");
        assert!(n.contains("th dport 53 redirect to :15053"), "{n}");
        assert!(!nft_rules(false).contains("15053"));
        assert!(n.contains("0xfffff000 | 0x111"), "{n}");
        assert_eq!(
            route_cmds(true, true, CONN_MARK, MARK_MASK, ROUTE_TABLE, RULE_PRIORITY)[0].join(" "),
            "-4 rule add fwmark 0x111/0xfff pref 32764 lookup 100"
        );
    }
}
