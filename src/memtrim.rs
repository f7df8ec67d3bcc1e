//! Giving memory freed after a burst back to the kernel.
//!
//! glibc's `malloc` keeps what a burst freed (relay chunks of up to 256 KiB, TLS records, h2
//! frames) in its arena and returns to the kernel only free space at the top of the heap beyond
//! a pad: a proxy that served a burst and went quiet keeps the burst's pages resident although
//! nothing uses them. `malloc_trim(0)` hands every whole free page back (`MADV_DONTNEED`), and
//! the main arena's free top too, so the next burst takes fresh zero pages instead. It cannot
//! shrink the top of a per-thread arena, which is why the proxy runs with one arena
//! ([`crate::net::sys::tune_allocator`]). ztunnel
//! gets the same from jemalloc, which purges what stayed unused for 10 s; here a timer on the
//! control runtime trims every [`INTERVAL`], after checking that the process's resident size is
//! worth it, and counts what each trim gave back.
//!
//! Only glibc has `malloc_trim`; with another C library the timer is not started.
#![allow(unsafe_code)]

use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;

/// How often the heap is trimmed.
pub const INTERVAL: Duration = Duration::from_secs(10);

/// What the trims did: `mbtunnel_memory_trims_total`, `mbtunnel_memory_released_bytes_total`.
#[derive(Clone, Default)]
pub struct TrimMetrics {
    pub trims: Counter,
    pub released: Counter,
}

impl TrimMetrics {
    pub fn register(registry: &mut Registry) -> TrimMetrics {
        let m = TrimMetrics::default();
        let r = registry.sub_registry_with_prefix("mbtunnel");
        r.register(
            "memory_trims",
            "Times freed heap memory was handed back to the kernel (glibc malloc_trim)",
            m.trims.clone(),
        );
        r.register(
            "memory_released_bytes",
            "Resident memory the heap trims gave back (resident size before minus after)",
            m.released.clone(),
        );
        m
    }
}

/// Whether this build can trim (linked against glibc).
pub const AVAILABLE: bool = cfg!(all(target_os = "linux", target_env = "gnu"));

/// The process's resident size in bytes, from `/proc/self/statm`.
pub fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * page_size())
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// Trims the heap once; returns the resident bytes it gave back (0 when it could not tell).
pub fn trim_once() -> u64 {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let before = resident_bytes();
        // SAFETY: malloc_trim takes the arenas' own locks; any thread may call it at any time.
        unsafe { libc::malloc_trim(0) };
        match (before, resident_bytes()) {
            (Some(b), Some(a)) => b.saturating_sub(a),
            _ => 0,
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        0
    }
}

/// Trims every [`INTERVAL`] for as long as the process runs. The trim runs on a blocking
/// thread: it takes each arena's lock in turn, and a large heap takes a while to walk.
pub async fn run(metrics: TrimMetrics) {
    if !AVAILABLE {
        tracing::debug!("not linked against glibc: freed heap memory is not trimmed");
        return;
    }
    let mut tick = tokio::time::interval(INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Ok(released) = tokio::task::spawn_blocking(trim_once).await else { continue };
        metrics.trims.inc();
        metrics.released.inc_by(released);
        if released >= 1 << 20 {
            tracing::debug!(released_kib = released >> 10, "gave freed heap memory back");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Memory a burst allocated and freed stays resident until the trim hands it back.
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn a_trim_gives_a_freed_burst_back() {
        // Allocate and touch 64 MiB in 64 KiB blocks (below the mmap threshold, so they come
        // from the heap), then free every block but the last, which pins the heap's top.
        let blocks: Vec<Vec<u8>> = (0..1024).map(|i| vec![i as u8 | 1; 64 * 1024]).collect();
        let mut blocks = blocks;
        let last = blocks.pop();
        drop(blocks);
        let resident = resident_bytes().unwrap();
        let released = trim_once();
        assert!(
            released >= 32 << 20,
            "the trim gave back {released} bytes of a 64 MiB freed burst (resident was {resident})"
        );
        drop(last);
    }

    #[test]
    fn resident_size_is_read() {
        assert!(resident_bytes().unwrap() > 1 << 20);
    }
}
