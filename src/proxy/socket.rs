//! Socket helpers: listeners with `IP_TRANSPARENT` where allowed, original destination recovery,
//! outbound sockets with `SO_MARK` and an optional spoofed source address.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};

use socket2::{Domain, Protocol, SockRef, Socket, Type};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use crate::inpod::netns::Netns;

/// Binds a TCP listener. With `transparent`, tries `IP_TRANSPARENT` (needs CAP_NET_ADMIN) and
/// warns once when it is not allowed.
pub fn listen(addr: SocketAddr, transparent: bool) -> std::io::Result<TcpListener> {
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    s.set_reuse_address(true)?;
    s.set_nonblocking(true)?;
    if transparent {
        set_transparent(&s, addr.is_ipv4());
    }
    s.bind(&addr.into())?;
    s.listen(1024)?;
    TcpListener::from_std(s.into())
}

/// Whether `l` carries `IP_TRANSPARENT` (IPv4) / `IPV6_TRANSPARENT` (IPv6).
pub fn is_transparent(l: &TcpListener) -> bool {
    let r = SockRef::from(l);
    match l.local_addr() {
        Ok(a) if a.is_ipv4() => r.ip_transparent_v4().unwrap_or(false),
        Ok(_) => r.ip_transparent_v6().unwrap_or(false),
        Err(_) => false,
    }
}

static TRANSPARENT_WARNED: AtomicBool = AtomicBool::new(false);

fn set_transparent(s: &Socket, v4: bool) -> bool {
    let r = if v4 { s.set_ip_transparent_v4(true) } else { s.set_ip_transparent_v6(true) };
    match r {
        Ok(()) => true,
        Err(e) => {
            if !TRANSPARENT_WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(error = %e,
                    "IP_TRANSPARENT not allowed (needs CAP_NET_ADMIN): applications will see the proxy's address as the source");
            }
            false
        }
    }
}

/// The original destination of a redirected connection (`SO_ORIGINAL_DST`, IPv4 or IPv6), or
/// `None` when the connection was not NAT-redirected.
pub fn original_dst(s: &TcpStream) -> Option<SocketAddr> {
    let r = SockRef::from(s);
    let local = s.local_addr().ok()?;
    let a = if local.is_ipv4() { r.original_dst_v4() } else { r.original_dst_v6() };
    a.ok().and_then(|a| a.as_socket())
}

/// IPv4-mapped IPv6 addresses (what dual-stack sockets report for IPv4) as plain IPv4.
pub fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// Where a captured connection was going: the NAT original destination, else (TPROXY, eBPF
/// socket assignment, or a direct connection) the accepted socket's local address.
pub fn destination(s: &TcpStream) -> Option<SocketAddr> {
    original_dst(s).or_else(|| s.local_addr().ok()).map(canonical)
}

/// Options for sockets the proxy opens toward the network.
#[derive(Clone, Copy, Debug)]
pub struct DialOpts<'a> {
    pub mark: u32,
    /// Source address to present (kept only when `IP_TRANSPARENT` or a local address allows it).
    pub source: Option<IpAddr>,
    /// In-pod mode: open the socket in this pod's network namespace (else the proxy's own).
    pub netns: Option<&'a Netns>,
}

async fn new_socket(v6: bool, netns: Option<&Netns>) -> std::io::Result<TcpSocket> {
    match netns {
        None if v6 => TcpSocket::new_v6(),
        None => TcpSocket::new_v4(),
        Some(ns) => {
            let s = ns.tcp_socket(v6).await?;
            Ok(TcpSocket::from_std_stream(std::net::TcpStream::from(s)))
        }
    }
}

/// A listener inside `netns` on `addr` (in-pod mode).
pub async fn listen_in(netns: &Netns, addr: SocketAddr) -> std::io::Result<TcpListener> {
    let s = netns
        .run(move || {
            let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
            s.set_reuse_address(true)?;
            if addr.is_ipv6() {
                s.set_only_v6(true)?;
            }
            s.set_nonblocking(true)?;
            s.bind(&addr.into())?;
            s.listen(1024)?;
            Ok::<_, std::io::Error>(s)
        })
        .await??;
    TcpListener::from_std(s.into())
}

/// Connects to `dst` with `SO_MARK` (so redirect rules skip the proxy's own traffic) and, when
/// asked, from `source` (`IP_TRANSPARENT`) so that the destination sees the original client.
pub async fn dial(dst: SocketAddr, opts: DialOpts<'_>) -> std::io::Result<TcpStream> {
    let sock = new_socket(dst.is_ipv6(), opts.netns).await?;
    {
        let r = SockRef::from(&sock);
        if opts.mark != 0 {
            // Needs CAP_NET_ADMIN; without it redirect rules cannot tell our traffic apart.
            if let Err(e) = r.set_mark(opts.mark) {
                tracing::debug!(error = %e, "SO_MARK not set");
            }
        }
        r.set_tcp_nodelay(true)?;
    }
    if let Some(src) = opts.source.filter(|s| s.is_ipv4() == dst.is_ipv4()) {
        let r = SockRef::from(&sock);
        let _ = if src.is_ipv4() {
            r.set_ip_transparent_v4(true)
        } else {
            r.set_ip_transparent_v6(true)
        };
        if let Err(e) = sock.bind(SocketAddr::new(src, 0)) {
            tracing::debug!(error = %e, source = %src, "cannot bind original source; using the proxy's address");
            // A failed bind leaves the socket unusable for a new bind: start over unbound.
            let sock = new_socket(dst.is_ipv6(), opts.netns).await?;
            if opts.mark != 0 {
                let _ = SockRef::from(&sock).set_mark(opts.mark);
            }
            return sock.connect(dst).await;
        }
    }
    sock.connect(dst).await
}
