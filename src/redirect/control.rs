//! `mbtunnel redirect ebpf ...`: the command-line side of the eBPF redirect. The classifiers and
//! maps belong to the running proxy (it holds its listening sockets, which go into the socket
//! map), so the command asks the proxy's admin API (127.0.0.1:15000) to attach, detach, enrol or
//! remove; `--pod-netns` first finds, from the pod's namespace, the host side of its veth and its
//! addresses (what a CNI plugin knows when it adds a pod).
#![forbid(unsafe_code)]

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};

use crate::net::netns::{self, Netns};

/// The running proxy's admin API, and the token its changes need.
pub struct Admin {
    pub addr: SocketAddr,
    /// The proxy's `ebpf_token_file`, read for changes (not for `status`).
    pub token_file: std::path::PathBuf,
}

impl Admin {
    /// One request; returns the body, or an error with it.
    fn call(&self, method: &str, path_and_query: &str) -> anyhow::Result<String> {
        let admin = self.addr;
        let token = if method == "GET" {
            String::new()
        } else {
            let t = std::fs::read_to_string(&self.token_file).with_context(|| {
                format!(
                    "cannot read the proxy's admin token at {} (root only; --token-file names another)",
                    self.token_file.display()
                )
            })?;
            format!("{}: {}\r\n", super::ebpf::TOKEN_HEADER, t.trim())
        };
        let mut s = TcpStream::connect_timeout(&admin, Duration::from_secs(5)).with_context(|| {
            format!("cannot reach the proxy's admin API at {admin} (is mbtunnel running, and is --admin right?)")
        })?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        write!(
            s,
            "{method} {path_and_query} HTTP/1.1\r\nHost: {admin}\r\n{token}Content-Length: 0\r\nConnection: close\r\n\r\n"
        )?;
        let mut resp = String::new();
        s.read_to_string(&mut resp).context("reading the admin API's answer")?;
        let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
        let status: u16 = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| anyhow!("malformed answer from {admin}: {head}"))?;
        if status != 200 {
            bail!("{}", body.trim());
        }
        Ok(body.to_string())
    }

    pub fn attach(&self, iface: &str, role: super::ebpf::Role) -> anyhow::Result<String> {
        let role = role.name();
        self.call("POST", &format!("/redirect/ebpf/attach?iface={}&role={role}", esc(iface)))
    }

    pub fn detach(&self, iface: &str) -> anyhow::Result<String> {
        self.call("POST", &format!("/redirect/ebpf/detach?iface={}", esc(iface)))
    }

    pub fn enrol(&self, ip: IpAddr, add: bool) -> anyhow::Result<String> {
        let verb = if add { "enrol" } else { "unenrol" };
        self.call("POST", &format!("/redirect/ebpf/{verb}?ip={}", esc(&ip.to_string())))
    }

    pub fn status(&self) -> anyhow::Result<String> {
        self.call("GET", "/redirect/ebpf")
    }

    /// `GET /authz/check`: the authorization decision for a hypothetical connection.
    /// `src_ip`: the source's address (required with a SPIFFE `src`).
    pub fn check_policy(
        &self,
        src: &str,
        src_ip: Option<IpAddr>,
        dst: &str,
    ) -> anyhow::Result<String> {
        let ip = src_ip.map(|a| format!("&src_ip={}", esc(&a.to_string()))).unwrap_or_default();
        self.call("GET", &format!("/authz/check?src={}{ip}&dst={}", esc(src), esc(dst)))
    }
}

/// Query-string escaping for the values we send (interface names, addresses).
fn esc(v: &str) -> String {
    crate::admin::percent_encode(v)
}

/// A pod as seen from its namespace: the host-side name of its veth (in this process's
/// namespace) and its global addresses.
#[derive(Debug)]
pub struct PodLink {
    pub host_iface: String,
    pub ips: Vec<IpAddr>,
}

fn ip_json(args: &[&str]) -> anyhow::Result<serde_json::Value> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .with_context(|| format!("cannot run ip {} (iproute2 installed?)", args.join(" ")))?;
    if !out.status.success() {
        bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Finds the pod's veth peer and addresses: `ip -j addr` inside the pod's namespace gives the
/// peer's ifindex (`link_index`), `ip -j link` here gives its name.
pub fn pod_link(pod_netns: &Path) -> anyhow::Result<PodLink> {
    let fd = netns::open(pod_netns)
        .with_context(|| format!("cannot open pod namespace {}", pod_netns.display()))?;
    let ns = Netns::enter(fd, "pod")?;
    let links = ns
        .run_blocking(|| ip_json(&["-j", "addr", "show"]))
        .map_err(|e| anyhow!("cannot enter {}: {e}", pod_netns.display()))??;
    let link = links
        .as_array()
        .into_iter()
        .flatten()
        .find(|l| l["link_index"].is_u64() && l["ifname"] != "lo")
        .ok_or_else(|| anyhow!("no veth with a peer in {}", pod_netns.display()))?;
    let peer = link["link_index"].as_u64().unwrap_or(0);
    let ips: Vec<IpAddr> = link["addr_info"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|a| a["scope"] == "global")
        .filter_map(|a| a["local"].as_str()?.parse().ok())
        .collect();
    if ips.is_empty() {
        bail!("the pod's interface {} has no global address", link["ifname"]);
    }
    let here = ip_json(&["-j", "link", "show"])?;
    let host_iface = here
        .as_array()
        .into_iter()
        .flatten()
        .find(|l| l["ifindex"].as_u64() == Some(peer))
        .and_then(|l| l["ifname"].as_str().map(String::from))
        .ok_or_else(|| {
            anyhow!("the pod's veth peer (ifindex {peer}) is not in this namespace: run where the proxy runs")
        })?;
    Ok(PodLink { host_iface, ips })
}
