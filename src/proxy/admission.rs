//! Inbound HBONE connections that have not finished their TLS handshake: budgeted per source
//! address and in total, so that no peer, authenticated or not, can fill the proxy's file
//! descriptors or memory and lock other clients out, while a storm of legitimate handshakes is
//! queued rather than cut.
//!
//! Every pending connection is in one of two states, which its [`Gate`](crate::net::gate::Gate)
//! keeps up to date: waiting on its peer (for the ClientHello, for the client's certificate
//! flight, for a write the peer does not take), or waiting on us (queued for a CPU turn, or
//! working). Only the first kind is ever evicted to make room: a legitimate handshake in a storm
//! is waiting on us, and keeps its place however long the queue. When a new connection puts its
//! source over `per_source`, the oldest connection of that source that waits on its peer goes;
//! when it puts the total over `total`, the oldest one waiting on its peer from the source with
//! the most pending connections goes (any source's, if that one has none waiting). Should every
//! pending connection be working, the newcomer is refused instead: the proxy is saturated with
//! real work. Each eviction is counted by reason; every connection keeps its handshake deadline.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::metrics::Metrics;

/// Refusal reasons (the `reason` label of `mbtunnel_refused_connections_total`).
pub const EVICTED_PER_SOURCE: &str = "tls_pending_source_budget";
pub const EVICTED_TOTAL: &str = "tls_pending_total_budget";
pub const REFUSED_SATURATED: &str = "tls_pending_saturated";

/// One pending connection's entry.
struct Slot {
    src: IpAddr,
    /// Set while it waits on its peer: only such connections are evicted.
    peer_turn: Arc<AtomicBool>,
    evicted: Notify,
}

#[derive(Default)]
struct Queue {
    /// By arrival (ids grow): the oldest first.
    slots: BTreeMap<u64, Arc<Slot>>,
    by_source: HashMap<IpAddr, BTreeSet<u64>>,
}

impl Queue {
    fn remove(&mut self, id: u64) -> Option<Arc<Slot>> {
        let slot = self.slots.remove(&id)?;
        if let Some(ids) = self.by_source.get_mut(&slot.src) {
            ids.remove(&id);
            if ids.is_empty() {
                self.by_source.remove(&slot.src);
            }
        }
        Some(slot)
    }

    /// The oldest of `ids` that waits on its peer.
    fn oldest_waiting<'a>(&self, mut ids: impl Iterator<Item = &'a u64>) -> Option<u64> {
        ids.find(|id| self.slots[id].peer_turn.load(Ordering::Relaxed)).copied()
    }

    /// The one to evict when the total is over budget (see the module comment).
    fn total_victim(&self) -> Option<u64> {
        let heaviest = self.by_source.values().max_by_key(|ids| ids.len())?;
        self.oldest_waiting(heaviest.iter()).or_else(|| self.oldest_waiting(self.slots.keys()))
    }
}

/// The budget; shared by every 15008 listener of the proxy.
pub struct PendingHandshakes {
    per_source: usize,
    total: usize,
    next: AtomicU64,
    queue: Mutex<Queue>,
    metrics: Arc<Metrics>,
}

/// One pending handshake's place; leaves the budget when dropped.
pub struct Pending {
    owner: Arc<PendingHandshakes>,
    id: u64,
    slot: Arc<Slot>,
}

impl Pending {
    /// Resolves when the budget evicted this connection (also when that happened already).
    pub async fn evicted(&self) {
        self.slot.evicted.notified().await
    }

    /// The flag its handshake's gate keeps: set while it waits on its peer.
    pub fn peer_turn(&self) -> Arc<AtomicBool> {
        self.slot.peer_turn.clone()
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.owner.queue.lock().unwrap().remove(self.id);
    }
}

impl PendingHandshakes {
    pub fn new(total: usize, per_source: usize, metrics: Arc<Metrics>) -> Arc<PendingHandshakes> {
        Arc::new(PendingHandshakes {
            per_source: per_source.max(1),
            total: total.max(1),
            next: Default::default(),
            queue: Default::default(),
            metrics,
        })
    }

    /// Registers a new connection from `src`, evicting another to make room when over budget.
    /// `None`: every pending connection is working, and this one is refused (counted).
    pub fn enter(self: &Arc<Self>, src: IpAddr) -> Option<Pending> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        // A new connection waits on its peer for its ClientHello.
        let slot = Arc::new(Slot {
            src,
            peer_turn: Arc::new(AtomicBool::new(true)),
            evicted: Notify::new(),
        });
        let mut q = self.queue.lock().unwrap();
        q.slots.insert(id, slot.clone());
        let own = q.by_source.entry(src).or_default();
        own.insert(id);
        let (victim, reason) = if own.len() > self.per_source {
            let own = &q.by_source[&src];
            (q.oldest_waiting(own.iter()), EVICTED_PER_SOURCE)
        } else if q.slots.len() > self.total {
            (q.total_victim(), EVICTED_TOTAL)
        } else {
            return Some(Pending { owner: self.clone(), id, slot });
        };
        match victim {
            Some(v) if v != id => {
                let gone = q.remove(v).expect("the victim is pending");
                drop(q);
                // notify_one keeps the wake-up even if the victim is not waiting yet.
                gone.evicted.notify_one();
                self.metrics.refuse(reason);
                Some(Pending { owner: self.clone(), id, slot })
            }
            // Nobody else to make room: the newcomer is the one over budget.
            _ => {
                q.remove(id);
                drop(q);
                // Over the total, every other pending connection is being worked on.
                self.metrics.refuse(if reason == EVICTED_TOTAL {
                    REFUSED_SATURATED
                } else {
                    reason
                });
                None
            }
        }
    }

    pub fn len(&self) -> usize {
        self.queue.lock().unwrap().slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Pending connections from `src`.
    pub fn from_source(&self, src: IpAddr) -> usize {
        self.queue.lock().unwrap().by_source.get(&src).map_or(0, |s| s.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(total: usize, per_source: usize) -> (Arc<PendingHandshakes>, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new(&mut Default::default()));
        (PendingHandshakes::new(total, per_source, metrics.clone()), metrics)
    }

    fn refused(m: &Metrics, reason: &'static str) -> u64 {
        m.refused.get_or_create(&crate::metrics::RefusalLabels { reason }).get()
    }

    fn ip(i: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, i])
    }

    fn is_evicted(p: &Pending) -> bool {
        let p = std::pin::pin!(p.evicted());
        futures::FutureExt::now_or_never(p).is_some()
    }

    #[test]
    fn one_source_over_its_budget_loses_its_own_oldest_connections_only() {
        let (b, m) = budget(100, 3);
        let other = b.enter(ip(2)).unwrap();
        let flood: Vec<_> = (0..5).map(|_| b.enter(ip(1)).unwrap()).collect();
        assert_eq!(b.from_source(ip(1)), 3);
        assert!(is_evicted(&flood[0]) && is_evicted(&flood[1]));
        assert!(!flood[2..].iter().any(is_evicted));
        assert!(!is_evicted(&other), "another source is untouched");
        assert_eq!(refused(&m, EVICTED_PER_SOURCE), 2);
    }

    #[test]
    fn over_the_total_the_heaviest_source_goes_first_then_anyone_waiting() {
        let (b, m) = budget(4, 10);
        let a1 = b.enter(ip(1)).unwrap();
        let heavy: Vec<_> = (0..3).map(|_| b.enter(ip(2)).unwrap()).collect();
        let a2 = b.enter(ip(3)).unwrap();
        // The oldest of the heaviest source, not the oldest overall.
        assert!(is_evicted(&heavy[0]));
        assert!(!is_evicted(&a1) && !is_evicted(&a2));
        assert_eq!(refused(&m, EVICTED_TOTAL), 1);
        // The heaviest source's remaining connections are working: someone waiting goes.
        for h in &heavy[1..] {
            h.peer_turn().store(false, Ordering::Relaxed);
        }
        let _a3 = b.enter(ip(4)).unwrap();
        assert!(is_evicted(&a1), "the oldest connection waiting on its peer");
        assert_eq!(b.len(), 4);
    }

    #[test]
    fn connections_waiting_on_us_are_never_evicted_a_newcomer_is_refused_instead() {
        let (b, m) = budget(2, 10);
        let busy: Vec<_> = (0..2).map(|i| b.enter(ip(i)).unwrap()).collect();
        for p in &busy {
            p.peer_turn().store(false, Ordering::Relaxed);
        }
        assert!(b.enter(ip(9)).is_none());
        assert!(!busy.iter().any(is_evicted));
        assert_eq!(refused(&m, REFUSED_SATURATED), 1);
        assert_eq!(b.len(), 2);
        drop(busy);
        assert!(b.is_empty());
    }
}
