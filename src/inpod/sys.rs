//! The only `unsafe` of in-pod mode: passing file descriptors over a Unix socket
//! (`sendmsg`/`recvmsg` with `SCM_RIGHTS`) (entering a network namespace is in `net::sys`).
//!
//! Invariants the callers keep: the fds passed in are open for the duration of the call (they
//! are borrowed); received fds are wrapped in [`OwnedFd`] at once, so each is closed exactly once
//! whatever happens next (including a truncated or malformed message).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// Most fds accepted in one message (ZDS sends one).
pub const MAX_FDS: usize = 4;

/// Control buffer big enough for `MAX_FDS` fds, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct CmsgBuf([u8; 64]);

fn cmsg_space(n: usize) -> usize {
    // SAFETY: CMSG_SPACE is a pure size computation.
    unsafe { libc::CMSG_SPACE((n * std::mem::size_of::<RawFd>()) as u32) as usize }
}

/// Sends one packet with `fds` attached as `SCM_RIGHTS`.
pub fn send_with_fds(
    sock: BorrowedFd<'_>,
    data: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<usize> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "too many fds for one message"));
    }
    let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
    let mut cbuf = CmsgBuf([0; 64]);
    // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let space = cmsg_space(fds.len());
        debug_assert!(space <= cbuf.0.len());
        msg.msg_control = cbuf.0.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space as _;
        // SAFETY: msg_control points at `space` writable, aligned bytes, enough for one cmsghdr
        // followed by the fds; CMSG_FIRSTHDR/CMSG_DATA stay inside that buffer.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN((fds.len() * std::mem::size_of::<RawFd>()) as u32) as _;
            let p = libc::CMSG_DATA(c) as *mut RawFd;
            for (i, fd) in fds.iter().enumerate() {
                std::ptr::write_unaligned(p.add(i), fd.as_raw_fd());
            }
        }
    }
    // SAFETY: `msg` points at live buffers (`iov` → `data`, `cbuf`) for the call's duration.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// What one `recvmsg` brought.
#[derive(Debug)]
pub struct Received {
    pub len: usize,
    pub fds: Vec<OwnedFd>,
    /// The packet was longer than the buffer (`MSG_TRUNC`).
    pub truncated: bool,
    /// More fds were sent than fit (`MSG_CTRUNC`); the kernel closed the extra ones.
    pub fds_truncated: bool,
}

/// Receives one packet and any fds with it (non-blocking: `WouldBlock` when nothing is queued).
pub fn recv_with_fds(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<Received> {
    let mut iov =
        libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: buf.len() };
    let mut cbuf = CmsgBuf([0; 64]);
    // SAFETY: an all-zero msghdr is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.0.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = cmsg_space(MAX_FDS) as _;
    // SAFETY: `msg` points at live, writable buffers of the declared sizes.
    let n = unsafe {
        libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC)
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `msg_controllen` bytes of `cbuf` with well-formed cmsghdrs; the
    // CMSG_* macros walk only within them. Each SCM_RIGHTS fd is a new descriptor owned by this
    // process, wrapped once in OwnedFd.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let bytes = (*c).cmsg_len as usize - (data as usize - c as usize);
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(Received {
        len: n as usize,
        fds,
        truncated: msg.msg_flags & libc::MSG_TRUNC != 0,
        fds_truncated: msg.msg_flags & libc::MSG_CTRUNC != 0,
    })
}

/// Registers a socket with tokio's reactor.
pub fn register(s: socket2::Socket) -> io::Result<tokio::io::unix::AsyncFd<socket2::Socket>> {
    // SAFETY: a `socket2::Socket` owns its fd: it is open, stays open until the Socket is dropped
    // (which only the AsyncFd can do now), and `as_raw_fd` always returns that same fd.
    unsafe { tokio::io::unix::AsyncFd::register(s) }.map_err(|e| e.into_parts().1)
}
