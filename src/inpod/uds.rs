//! Async Unix `SOCK_SEQPACKET` sockets (one message per packet, fds attached): the ZDS transport.
//! Both ends live here so the tests' fake CNI speaks through the same code.
#![forbid(unsafe_code)]

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use socket2::{Domain, SockAddr, Socket, Type};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::sys;

/// A connected SEQPACKET socket.
pub struct SeqPacket {
    fd: AsyncFd<Socket>,
}

/// One received packet.
#[derive(Debug)]
pub struct Packet {
    pub data: Vec<u8>,
    pub fds: Vec<OwnedFd>,
    /// The packet did not fit the buffer, or carried more fds than accepted.
    pub truncated: bool,
}

/// Largest ZDS message accepted (istio's are a few hundred bytes).
pub const MAX_PACKET: usize = 64 * 1024;

impl SeqPacket {
    fn wrap(s: Socket) -> io::Result<SeqPacket> {
        s.set_nonblocking(true)?;
        Ok(SeqPacket { fd: sys::register(s)? })
    }

    /// Connects to the listener at `path`.
    pub async fn connect(path: &Path) -> io::Result<SeqPacket> {
        let addr = SockAddr::unix(path)?;
        let s = tokio::task::spawn_blocking(move || {
            let s = Socket::new(Domain::UNIX, Type::SEQPACKET, None)?;
            s.connect(&addr)?;
            Ok::<_, io::Error>(s)
        })
        .await
        .map_err(io::Error::other)??;
        SeqPacket::wrap(s)
    }

    /// Sends one packet, with `fds` as SCM_RIGHTS.
    pub async fn send(&self, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        loop {
            let mut g = self.fd.ready(Interest::WRITABLE).await?;
            match g.try_io(|s| sys::send_with_fds(s.get_ref().as_fd(), data, fds)) {
                Ok(r) => return r.map(|_| ()),
                Err(_would_block) => continue,
            }
        }
    }

    /// Receives one packet. A zero-length packet with no fds after the peer closed is end of
    /// stream: `Ok(None)`.
    pub async fn recv(&self) -> io::Result<Option<Packet>> {
        let mut buf = vec![0u8; MAX_PACKET];
        loop {
            let mut g = self.fd.ready(Interest::READABLE).await?;
            match g.try_io(|s| sys::recv_with_fds(s.get_ref().as_fd(), &mut buf)) {
                Ok(Ok(r)) => {
                    if r.len == 0 && r.fds.is_empty() && !r.truncated {
                        // SEQPACKET: 0 bytes means the peer closed (empty packets are not sent).
                        return Ok(None);
                    }
                    buf.truncate(r.len.min(MAX_PACKET));
                    return Ok(Some(Packet {
                        data: buf,
                        fds: r.fds,
                        truncated: r.truncated || r.fds_truncated,
                    }));
                }
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }
}

/// A listening SEQPACKET socket (the CNI side; used by tests and `mbtunnel tool cni`).
pub struct SeqPacketListener {
    fd: AsyncFd<Socket>,
}

impl SeqPacketListener {
    /// Binds `path` (replacing a stale socket file) and listens.
    pub fn bind(path: &Path) -> io::Result<SeqPacketListener> {
        let _ = std::fs::remove_file(path);
        let s = Socket::new(Domain::UNIX, Type::SEQPACKET, None)?;
        s.bind(&SockAddr::unix(path)?)?;
        s.listen(16)?;
        s.set_nonblocking(true)?;
        Ok(SeqPacketListener { fd: sys::register(s)? })
    }

    pub async fn accept(&self) -> io::Result<SeqPacket> {
        loop {
            let mut g = self.fd.readable().await?;
            match g.try_io(|s| s.get_ref().accept()) {
                Ok(Ok((s, _))) => return SeqPacket::wrap(s),
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }
}
