//! Shutdown coordination: draining starts (listeners stop accepting, HBONE connections are
//! told to go away), in-flight connections are counted until they finish, and those still open
//! at the drain deadline are cut.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{watch, Notify};

use super::Stop;
use crate::hbone::{Live, LiveGuard};

/// Shutdown coordination: a trigger, watchers, and a count of in-flight connections.
#[derive(Clone)]
pub struct Drain {
    tx: Arc<watch::Sender<bool>>,
    /// Set at the drain deadline: connections still open are cut (reset).
    cut: Arc<watch::Sender<bool>>,
    active: Arc<AtomicUsize>,
    idle: Arc<Notify>,
    /// Inbound HBONE connections not yet closed (their GOAWAY and close_notify unsent).
    hbone: Live,
}

impl Default for Drain {
    fn default() -> Self {
        Drain {
            tx: Arc::new(watch::channel(false).0),
            cut: Arc::new(watch::channel(false).0),
            active: Arc::new(AtomicUsize::new(0)),
            idle: Arc::new(Notify::new()),
            hbone: Live::default(),
        }
    }
}

/// Held by each in-flight connection.
pub struct DrainGuard(Drain);

impl Drop for DrainGuard {
    fn drop(&mut self) {
        if self.0.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Drain {
    pub fn start(&self) {
        self.tx.send_replace(true);
    }

    pub fn is_draining(&self) -> bool {
        *self.tx.borrow()
    }

    /// Resolves when draining starts.
    pub async fn signaled(&self) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|d| *d).await;
    }

    /// Cuts every connection still open (the drain deadline passed).
    pub fn cut_all(&self) {
        self.cut.send_replace(true);
    }

    /// Resolves when open connections must be cut.
    pub async fn cut(&self) {
        let mut rx = self.cut.subscribe();
        let _ = rx.wait_for(|c| *c).await;
    }

    pub fn guard(&self) -> DrainGuard {
        self.active.fetch_add(1, Ordering::AcqRel);
        DrainGuard(self.clone())
    }

    /// Held by an inbound HBONE connection from its TLS handshake until its socket is closed.
    pub fn hbone_connection(&self) -> LiveGuard {
        self.hbone.enter()
    }

    /// Inbound HBONE connections still open.
    pub fn hbone_open(&self) -> usize {
        self.hbone.count()
    }

    /// Waits until every inbound HBONE connection has closed, or `until`; returns how many
    /// are left.
    pub async fn wait_hbone_closed(&self, until: tokio::time::Instant) -> usize {
        self.hbone.wait_closed(until).await
    }

    pub fn active(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }

    /// Waits until no connection is in flight or `deadline` passes; returns what is left.
    pub async fn wait_idle(&self, deadline: Duration) -> usize {
        let end = Instant::now() + deadline;
        loop {
            let notified = self.idle.notified();
            if self.active() == 0 {
                return 0;
            }
            if tokio::time::timeout_at(end.into(), notified).await.is_err() {
                return self.active();
            }
        }
    }
}

/// The reason a connection must stop early: the drain deadline passed.
pub fn drain_cut(drain: &Drain) -> Stop<'_> {
    Box::pin(async move {
        drain.cut().await;
        "cut at the drain deadline".to_string()
    })
}
