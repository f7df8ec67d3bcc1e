//! The DNS proxy's listeners: one UDP socket and one TCP listener per address (per pod in
//! in-pod mode). Each UDP query and each TCP connection runs in its own task, within a bound on
//! how many are in flight; a TCP connection carries length-prefixed queries and is closed after
//! 5 s without one (ztunnel's request timeout).
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::Semaphore;

use super::{Dns, Transport};
use crate::proxy::drain::Drain;
use crate::state::Workload;

/// Queries (UDP) or connections (TCP) answered at once per listener; past it the listener stops
/// reading until one finishes (the kernel's buffer, then the client's retry, absorb a burst).
const IN_FLIGHT: usize = 256;
/// A TCP connection without a complete query for this long is closed.
const TCP_IDLE: Duration = Duration::from_secs(5);
/// How long a query from a pod enrolled before its workload arrived waits for it.
const PENDING_WAIT: Duration = Duration::from_secs(2);

/// Who is asking.
#[derive(Clone, Debug)]
pub enum Clients {
    /// In-pod mode: every query on this listener comes from this pod (its namespace).
    Pod(Arc<str>),
    /// The proxy's own namespace: the local workload with the query's source address.
    Node,
}

impl Clients {
    async fn find(&self, dns: &Dns, src: SocketAddr) -> Option<Arc<Workload>> {
        let state = &dns.state;
        match self {
            Clients::Pod(uid) => match state.workload_by_uid(uid) {
                Some(w) => Some(w),
                None => state.wait_workload(uid, PENDING_WAIT).await,
            },
            Clients::Node => state.local_workload_by_ip(crate::net::socket::canonical(src).ip()),
        }
    }
}

/// Serves UDP queries on `sock` until the drain starts.
pub async fn serve_udp(sock: UdpSocket, dns: Arc<Dns>, clients: Clients, drain: Drain) {
    let sock = Arc::new(sock);
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut buf = vec![0u8; 65535];
    loop {
        let permit = tokio::select! {
            biased;
            _ = drain.signaled() => return,
            p = slots.clone().acquire_owned() => p.expect("never closed"),
        };
        let (n, src) = tokio::select! {
            biased;
            _ = drain.signaled() => return,
            r = sock.recv_from(&mut buf) => match r {
                Ok(r) => r,
                Err(e) => {
                    tracing::debug!(error = %e, "DNS: UDP receive failed");
                    continue;
                }
            },
        };
        let packet = buf[..n].to_vec();
        let (sock, dns, clients) = (sock.clone(), dns.clone(), clients.clone());
        tokio::spawn(async move {
            let client = clients.find(&dns, src).await;
            if let Some(out) = dns.answer(client.as_deref(), &packet, Transport::Udp).await {
                if let Err(e) = sock.send_to(&out, src).await {
                    tracing::debug!(error = %e, %src, "DNS: UDP send failed");
                }
            }
            drop(permit);
        });
    }
}

/// Serves TCP connections on `listener` until the drain starts.
pub async fn serve_tcp(listener: TcpListener, dns: Arc<Dns>, clients: Clients, drain: Drain) {
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    loop {
        let permit = tokio::select! {
            biased;
            _ = drain.signaled() => return,
            p = slots.clone().acquire_owned() => p.expect("never closed"),
        };
        let (s, src) = tokio::select! {
            biased;
            _ = drain.signaled() => return,
            r = listener.accept() => match r {
                Ok(r) => r,
                Err(e) => {
                    tracing::debug!(error = %e, "DNS: TCP accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let (dns, clients) = (dns.clone(), clients.clone());
        tokio::spawn(async move {
            if let Err(e) = tcp_conn(s, src, &dns, &clients).await {
                tracing::debug!(error = %e, %src, "DNS: TCP connection ended");
            }
            drop(permit);
        });
    }
}

async fn tcp_conn(
    mut s: TcpStream,
    src: SocketAddr,
    dns: &Dns,
    clients: &Clients,
) -> std::io::Result<()> {
    let client = clients.find(dns, src).await;
    let mut len = [0u8; 2];
    loop {
        match tokio::time::timeout(TCP_IDLE, s.read_exact(&mut len)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Ok(Err(e)) => return Err(e),
            Err(_) => return Ok(()),
        }
        let mut packet = vec![0u8; usize::from(u16::from_be_bytes(len))];
        match tokio::time::timeout(TCP_IDLE, s.read_exact(&mut packet)).await {
            Ok(r) => r?,
            Err(_) => return Ok(()),
        };
        let Some(out) = dns.answer(client.as_deref(), &packet, Transport::Tcp).await else {
            // Not even a header: nothing to answer on this stream.
            return Ok(());
        };
        let n = u16::try_from(out.len()).unwrap_or(u16::MAX);
        let mut framed = Vec::with_capacity(out.len() + 2);
        framed.extend_from_slice(&n.to_be_bytes());
        framed.extend_from_slice(&out[..usize::from(n)]);
        s.write_all(&framed).await?;
    }
}

/// Opens the DNS proxy's UDP socket and TCP listener on `addr` (and, for the default loopback
/// address, on `[::1]` too when the namespace has IPv6: the pod's AAAA-first resolvers and its
/// IPv6 capture rule reach that one) in `netns` (`None`: the proxy's own), and serves them.
pub async fn listen(
    dns: &Arc<Dns>,
    netns: Option<&crate::net::netns::Netns>,
    addr: SocketAddr,
    clients: Clients,
    drain: &Drain,
) -> std::io::Result<Vec<tokio::task::JoinHandle<()>>> {
    use crate::net::socket::{listen_maybe_in, udp_bind_in};
    let mut addrs = vec![addr];
    if addr.ip() == std::net::IpAddr::from([127, 0, 0, 1]) {
        addrs.push(SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, addr.port())));
    }
    let mut tasks = Vec::new();
    for (i, a) in addrs.into_iter().enumerate() {
        let pair = async {
            let u = udp_bind_in(netns, a).await?;
            let t = listen_maybe_in(netns, a).await?;
            Ok::<_, std::io::Error>((u, t))
        };
        let (u, t) = match pair.await {
            Ok(p) => p,
            // The extra [::1]: only when the namespace has IPv6.
            Err(e) if i > 0 => {
                tracing::debug!(addr = %a, error = %e, "DNS proxy: no IPv6 loopback here");
                continue;
            }
            Err(e) => {
                for t in &tasks {
                    tokio::task::JoinHandle::abort(t);
                }
                return Err(e);
            }
        };
        tasks.push(tokio::spawn(serve_udp(u, dns.clone(), clients.clone(), drain.clone())));
        tasks.push(tokio::spawn(serve_tcp(t, dns.clone(), clients.clone(), drain.clone())));
    }
    Ok(tasks)
}
