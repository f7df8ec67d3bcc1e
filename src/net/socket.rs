//! Socket helpers: listeners with `IP_TRANSPARENT` where allowed and a backlog sized from
//! `somaxconn`, original destination recovery, outbound sockets with `SO_MARK`, an optional
//! original source address (`IP_BIND_ADDRESS_NO_PORT`) and a connect timeout.

use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use socket2::{Domain, Protocol, SockRef, Socket, Type};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use crate::net::netns::Netns;

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
    s.listen(backlog())?;
    TcpListener::from_std(s.into())
}

/// The listen backlog: the kernel's `net.core.somaxconn` (which caps any larger value anyway), so
/// a burst of connections waits in the accept queue instead of waiting for a SYN retry.
pub fn backlog() -> i32 {
    std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
        .filter(|n| *n > 0)
        .unwrap_or(4096)
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
    original_dst_of(s, s.local_addr().ok()?)
}

/// [`original_dst`] of `s`, whose local address is `local`.
fn original_dst_of(s: &TcpStream, local: SocketAddr) -> Option<SocketAddr> {
    let r = SockRef::from(s);
    let a = if local.is_ipv4() { r.original_dst_v4() } else { r.original_dst_v6() };
    a.ok().and_then(|a| a.as_socket())
}

/// IPv4-mapped IPv6 addresses (what dual-stack sockets report for IPv4) as plain IPv4.
pub fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// Waits until `s` has bytes to read (true) or the peer ended it (false). Unlike
/// `TcpStream::readable`, which may wake without data, this looks at the data (`MSG_PEEK`,
/// nothing consumed): a handshake admitted on it has a ClientHello to work on. Admitting a
/// connection on a spurious wake-up can deadlock bounded handshakes: server slots held by
/// connections whose clients are still queued for a client slot, while the clients holding
/// the client slots queue for a server slot.
pub async fn first_bytes(s: &TcpStream) -> std::io::Result<bool> {
    let mut b = [0u8; 1];
    Ok(s.peek(&mut b).await? > 0)
}

/// Where a captured connection was going: the NAT original destination, else (TPROXY, eBPF
/// socket assignment, or a direct connection) the accepted socket's local address.
pub fn destination(s: &TcpStream) -> Option<SocketAddr> {
    addresses(s).map(|a| a.destination())
}

/// An accepted socket's own address and its NAT original destination, both canonical.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Addresses {
    pub local: SocketAddr,
    /// `SO_ORIGINAL_DST`, when conntrack knows the connection (redirected or not).
    pub original: Option<SocketAddr>,
}

impl Addresses {
    /// See [`destination`].
    pub fn destination(&self) -> SocketAddr {
        self.original.unwrap_or(self.local)
    }

    /// The original destination when the connection was NAT-redirected: conntrack answers
    /// `SO_ORIGINAL_DST` for any tracked connection, and for one that was not redirected the
    /// answer is the socket's own address.
    pub fn redirected(&self) -> Option<SocketAddr> {
        self.original.filter(|d| *d != self.local)
    }
}

/// [`Addresses`] of `s`: one `getsockname` and one `SO_ORIGINAL_DST` lookup.
pub fn addresses(s: &TcpStream) -> Option<Addresses> {
    let local = s.local_addr().ok()?;
    let original = original_dst_of(s, local).map(canonical);
    Some(Addresses { local: canonical(local), original })
}

/// Options for sockets the proxy opens toward the network.
#[derive(Clone, Copy, Debug)]
pub struct DialOpts<'a> {
    pub mark: u32,
    /// Source address to present (kept only when `IP_TRANSPARENT` or a local address allows it).
    pub source: Option<IpAddr>,
    /// In-pod mode: open the socket in this pod's network namespace (else the proxy's own).
    pub netns: Option<&'a Netns>,
    /// Give up the TCP connect after this long.
    pub timeout: Duration,
}

fn new_socket(v6: bool, netns: Option<&Netns>) -> std::io::Result<TcpSocket> {
    match netns {
        None if v6 => TcpSocket::new_v6(),
        None => TcpSocket::new_v4(),
        Some(ns) => {
            let s = ns.tcp_socket(v6)?;
            Ok(TcpSocket::from_std_stream(std::net::TcpStream::from(s)))
        }
    }
}

/// A listener inside `netns` on `addr` (in-pod mode).
pub async fn listen_in(netns: &Netns, addr: SocketAddr) -> std::io::Result<TcpListener> {
    let s = netns.run(move || pod_listener(addr)).await??;
    TcpListener::from_std(s.into())
}

/// A pod's listener, in the calling thread's namespace: `SO_REUSEADDR` and `SO_REUSEPORT`, as
/// ztunnel's in-pod listeners (its `INPOD_PORT_REUSE`, on by default). The port is shared with
/// whichever node proxy listened there before: its connections left in TIME-WAIT (which keep the
/// socket options of the listener that accepted them, and a ztunnel's carry `SO_REUSEPORT` only)
/// do not keep this proxy out of the pod for a minute, and an old and a new proxy can both listen
/// while one replaces the other.
fn pod_listener(addr: SocketAddr) -> std::io::Result<Socket> {
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    s.set_reuse_address(true)?;
    s.set_reuse_port(true)?;
    if addr.is_ipv6() {
        s.set_only_v6(true)?;
    }
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    s.listen(backlog())?;
    Ok(s)
}

/// A UDP socket bound to `addr` inside `netns` (the proxy's own namespace when `None`).
pub async fn udp_bind_in(
    netns: Option<&Netns>,
    addr: SocketAddr,
) -> std::io::Result<tokio::net::UdpSocket> {
    let make = move || {
        let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
        if addr.is_ipv6() {
            s.set_only_v6(true)?;
        }
        s.set_nonblocking(true)?;
        s.bind(&addr.into())?;
        Ok::<_, std::io::Error>(s)
    };
    let s = match netns {
        Some(ns) => ns.run(make).await??,
        None => make()?,
    };
    tokio::net::UdpSocket::from_std(s.into())
}

/// A TCP listener on `addr` inside `netns` (the proxy's own namespace when `None`).
pub async fn listen_maybe_in(
    netns: Option<&Netns>,
    addr: SocketAddr,
) -> std::io::Result<TcpListener> {
    match netns {
        Some(ns) => listen_in(ns, addr).await,
        None => TcpListener::bind(addr).await,
    }
}

/// Connects to `dst` with `SO_MARK` (so redirect rules skip the proxy's own traffic) and, when
/// asked, from `source` (`IP_TRANSPARENT`) so that the destination sees the original client.
/// Fails with `TimedOut` after `opts.timeout`.
pub async fn dial(dst: SocketAddr, opts: DialOpts<'_>) -> std::io::Result<TcpStream> {
    match tokio::time::timeout(opts.timeout, dial_now(dst, opts)).await {
        Ok(r) => r,
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("connect to {dst} timed out after {:?}", opts.timeout),
        )),
    }
}

fn mark(sock: &TcpSocket, mark: u32) {
    if mark != 0 {
        // Needs CAP_NET_ADMIN; without it redirect rules cannot tell our traffic apart.
        if let Err(e) = SockRef::from(sock).set_mark(mark) {
            tracing::debug!(error = %e, "SO_MARK not set");
        }
    }
}

async fn dial_now(dst: SocketAddr, opts: DialOpts<'_>) -> std::io::Result<TcpStream> {
    let sock = new_socket(dst.is_ipv6(), opts.netns)?;
    mark(&sock, opts.mark);
    SockRef::from(&sock).set_tcp_nodelay(true)?;
    if let Some(src) = opts.source.filter(|s| s.is_ipv4() == dst.is_ipv4()) {
        let r = SockRef::from(&sock);
        let _ = if src.is_ipv4() {
            r.set_ip_transparent_v4(true)
        } else {
            r.set_ip_transparent_v6(true)
        };
        // The port is chosen at connect, per destination: one source address can then carry
        // as many connections as there are ports for each destination, not 28k in all.
        if let Err(e) = super::sys::set_bind_address_no_port(sock.as_fd()) {
            tracing::debug!(error = %e, "IP_BIND_ADDRESS_NO_PORT not set");
        }
        if let Err(e) = sock.bind(SocketAddr::new(src, 0)) {
            tracing::debug!(error = %e, source = %src, "cannot bind original source; using the proxy's address");
            // A failed bind leaves the socket unusable for a new bind: start over unbound.
            let sock = new_socket(dst.is_ipv6(), opts.netns)?;
            mark(&sock, opts.mark);
            SockRef::from(&sock).set_tcp_nodelay(true)?;
            return sock.connect(dst).await;
        }
    }
    sock.connect(dst).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(source: Option<IpAddr>) -> DialOpts<'static> {
        DialOpts { mark: 0, source, netns: None, timeout: Duration::from_secs(5) }
    }

    #[test]
    fn a_connection_is_redirected_only_when_its_original_destination_is_elsewhere() {
        let local: SocketAddr = "10.0.0.1:15001".parse().unwrap();
        let svc: SocketAddr = "10.96.0.10:80".parse().unwrap();
        let nat = Addresses { local, original: Some(svc) };
        assert_eq!((nat.redirected(), nat.destination()), (Some(svc), svc));
        // Conntrack active, no redirect: the original destination is the socket's own address.
        let tracked = Addresses { local, original: Some(local) };
        assert_eq!((tracked.redirected(), tracked.destination()), (None, local));
        // TPROXY / eBPF assignment / no conntrack: no original destination at all.
        let untracked = Addresses { local, original: None };
        assert_eq!((untracked.redirected(), untracked.destination()), (None, local));
    }

    /// A proxy that listened on a pod's port before (ztunnel: `SO_REUSEPORT` only) and closed
    /// connections there leaves them in TIME-WAIT on that port; the pod's next listener must
    /// still bind (without `SO_REUSEPORT` it fails with EADDRINUSE for the TIME-WAIT minute).
    #[test]
    fn a_pod_listener_binds_over_a_previous_proxys_time_wait() {
        use std::io::Read;
        let before = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
        before.set_reuse_port(true).unwrap();
        before.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into()).unwrap();
        before.listen(16).unwrap();
        let addr = before.local_addr().unwrap().as_socket().unwrap();
        let l = std::net::TcpListener::from(before);
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        let (s, _) = l.accept().unwrap();
        // The proxy's side closes first, so the TIME-WAIT is on the listener's port.
        drop(s);
        let mut end = [0u8; 1];
        assert_eq!(c.read(&mut end).unwrap(), 0);
        drop(c);
        drop(l);
        let again = pod_listener(addr).expect("the pod's port is held by a TIME-WAIT");
        assert_eq!(again.local_addr().unwrap().as_socket(), Some(addr));
    }

    #[tokio::test]
    async fn addresses_of_a_direct_connection_name_the_listener() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = l.local_addr().unwrap();
        let _c = tokio::net::TcpStream::connect(at).await.unwrap();
        let (s, _) = l.accept().await.unwrap();
        let a = addresses(&s).unwrap();
        assert_eq!((a.local, a.redirected(), a.destination()), (at, None, at));
    }

    #[tokio::test]
    async fn transparent_dial_defers_the_port_choice() {
        let l = listen("127.0.0.1:0".parse().unwrap(), false).unwrap();
        let dst = l.local_addr().unwrap();
        let s = dial(dst, opts(Some("127.0.0.1".parse().unwrap()))).await.unwrap();
        assert!(super::super::sys::bind_address_no_port(s.as_fd()).unwrap());
        let plain = dial(dst, opts(None)).await.unwrap();
        assert!(!super::super::sys::bind_address_no_port(plain.as_fd()).unwrap());
    }

    #[tokio::test]
    async fn dial_gives_up_after_its_timeout() {
        // A listener that never accepts, with a backlog of 0: once one connection fills its
        // accept queue, the kernel drops further SYNs, so the next connect never completes.
        let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
        s.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into()).unwrap();
        s.listen(0).unwrap();
        let dst = s.local_addr().unwrap().as_socket().unwrap();
        let mut held = Vec::new();
        let mut o = opts(None);
        o.timeout = Duration::from_millis(300);
        let mut timed_out = false;
        for _ in 0..4 {
            match dial(dst, o).await {
                Ok(c) => held.push(c),
                Err(e) => {
                    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
                    timed_out = true;
                    break;
                }
            }
        }
        assert!(timed_out, "a connect to a full accept queue must time out");
    }

    #[test]
    fn listeners_take_their_backlog_from_somaxconn() {
        let want: i32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert_eq!(backlog(), want);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _g = rt.enter();
        let l = listen("127.0.0.1:0".parse().unwrap(), false).unwrap();
        let port = l.local_addr().unwrap().port();
        // `ss` shows a listener's backlog as its Send-Q.
        let out = std::process::Command::new("ss")
            .args(["-ltnH", &format!("sport = :{port}")])
            .output()
            .expect("ss (iproute2) runs");
        let text = String::from_utf8_lossy(&out.stdout);
        let send_q: i32 = text.split_whitespace().nth(2).and_then(|v| v.parse().ok()).unwrap();
        assert_eq!(send_q, want, "{text}");
    }
}
