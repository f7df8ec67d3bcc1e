//! The only `unsafe` of the socket layer: entering a network namespace (`setns`) and the
//! socket options socket2 does not wrap. Each call takes a borrowed fd that is open for the call.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Moves the calling thread into the network namespace `ns` (an fd of `/proc/<pid>/ns/net` or
/// `/var/run/netns/<name>`). Only this thread moves; sockets it creates afterwards belong to `ns`.
pub fn setns_net(ns: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: setns takes an fd and a flag; the fd is borrowed and open for the call.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `IP_BIND_ADDRESS_NO_PORT`: a `bind` to an address with port 0 defers the port choice to
/// `connect`, which may then reuse a port for different destinations (as Envoy and ztunnel do).
/// Without it, every transparent dial from one busy source address searches the whole port range
/// for a port free for *any* destination.
pub fn set_bind_address_no_port(s: BorrowedFd<'_>) -> io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: a valid fd borrowed for the call, a pointer to a live c_int and its size.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_BIND_ADDRESS_NO_PORT,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Reads `IP_BIND_ADDRESS_NO_PORT` back (tests).
pub fn bind_address_no_port(s: BorrowedFd<'_>) -> io::Result<bool> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: a valid fd borrowed for the call; `v` and `len` are live and sized for the option.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_BIND_ADDRESS_NO_PORT,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(v != 0)
}

/// Keeps glibc's allocator from returning freed memory to the kernel after every large free.
///
/// The byte path allocates and frees buffers of 64–256 KiB per chunk moved (h2 frames, TLS
/// buffers). With glibc's defaults the top of the heap is trimmed when such a chunk is freed and
/// the next allocation faults its pages back in: ~16 page faults per 64 KiB moved, measured at
/// 655k faults in a 5-second 3.6 GB transfer. A 1 MiB mmap threshold keeps these buffers on the
/// heap; a 2 MiB trim threshold keeps up to that much free memory at the top of each arena for
/// reuse (16 MiB cost 7 MiB of RSS per proxy after the data-plane bench for no CPU measured).
///
/// A 4 MiB top pad is what a trim leaves behind. A stream has up to its 4 MiB h2 window in
/// flight, so the heap top of a worker's arena swings by megabytes during a transfer; with the
/// default 128 KiB pad every swing past the trim threshold gave the pages back (`madvise`) and
/// the next frames faulted them in again: 7 % of a bulk transfer's proxy samples in page faults,
/// 1.3 % in `madvise`. With the pad (Zen 3, one iperf3 stream through the bench's topology):
/// page faults 66k → 3k per 4 s, proxy CPU per GB −6 to −10 % (medians of eight interleaved
/// pairs), RSS at a fixed 1000 req/s unchanged (pages are resident only once touched). The
/// cost is up to 4 MiB of free memory kept per busy arena after a burst.
///
/// One arena for every thread. glibc gives each thread that finds the arenas busy an arena of
/// its own, and `malloc_trim` (the periodic trim, `memtrim`) gives back the free pages inside
/// every arena but the free top only of the main one: a worker's arena kept its burst-time top,
/// up to the 4 MiB pad, for as long as the proxy idled. Measured with the data-plane bench
/// (Zen 4, 3 alternating rounds of each, `PRODUCTS=mbtunnel ROUNDS=1 benches/dataplane.sh` with
/// and without `MALLOC_ARENA_MAX=1`, medians): RSS per proxy after the sequence and 12 s idle
/// 16.6 → 13.2 MiB (per-thread arena heaps 4–5 MiB → none, main heap 0.4 → 1.0 MiB), CPU per
/// GB 1.27 → 1.22 s, CPU per 1000 requests 0.0391 → 0.0380 s, req/s 28.8k → 29.3k: the arena
/// lock costs nothing measurable on a node proxy's few workers (small allocations are served by
/// each thread's cache without it).
///
/// Other allocators ignore this; it is a no-op outside glibc. glibc's own environment variables
/// (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, `MALLOC_TOP_PAD_`, `MALLOC_ARENA_MAX`),
/// when set, win.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    for (param, env, value) in [
        (libc::M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", 1 << 20),
        (libc::M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", 2 << 20),
        (libc::M_TOP_PAD, "MALLOC_TOP_PAD_", 4 << 20),
        (libc::M_ARENA_MAX, "MALLOC_ARENA_MAX", 1),
    ] {
        if std::env::var_os(env).is_none() {
            // SAFETY: mallopt takes two integers and changes allocator parameters; it is called
            // before the runtime starts, and glibc allows it at any time.
            unsafe {
                libc::mallopt(param, value);
            }
        }
    }
}
