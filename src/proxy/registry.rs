//! The open inbound connections, kept so that authorization can re-check them when what their
//! decision rests on changes (as ztunnel's connection manager does).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::watch;

use super::Ctx;

/// Open inbound connections with what authorization needs to re-check them when the policies
/// change (as ztunnel's connection manager does); a connection now denied is told to close.
///
/// The lock is held only to add, remove or copy out entries: a re-check evaluates a snapshot,
/// so new connections never wait behind it.
#[derive(Default)]
pub struct ConnRegistry {
    next: std::sync::atomic::AtomicU64,
    open: std::sync::Mutex<std::collections::HashMap<u64, Arc<Tracked>>>,
}

struct Tracked {
    dst_uid: String,
    src: Option<crate::identity::Identity>,
    principal: Option<String>,
    src_ip: std::net::IpAddr,
    dst: SocketAddr,
    close: watch::Sender<Option<String>>,
}

/// Held by a tracked connection; deregisters on drop.
pub struct Registered {
    reg: Arc<ConnRegistry>,
    id: u64,
    /// Turns `Some(reason)` when the connection must close.
    pub closed: watch::Receiver<Option<String>>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.reg.open.lock().unwrap().remove(&self.id);
    }
}

/// What one re-check did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rechecked {
    /// Connections evaluated.
    pub checked: usize,
    /// Connections told to close.
    pub closed: usize,
}

impl ConnRegistry {
    /// Tracks a connection from `src_ip` (with identity `src`, if authenticated) to `dst` on
    /// the local workload `dst_uid`. Register before the connection is decided and dialled: a
    /// change applied in between is then seen by the next re-check.
    pub fn register(
        self: &Arc<Self>,
        dst_uid: &str,
        src: Option<&crate::identity::Identity>,
        src_ip: std::net::IpAddr,
        dst: SocketAddr,
    ) -> Registered {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (close, closed) = watch::channel(None);
        let t = Tracked {
            dst_uid: dst_uid.to_string(),
            src: src.cloned(),
            principal: src.map(crate::authz::principal_of),
            src_ip,
            dst,
            close,
        };
        self.open.lock().unwrap().insert(id, Arc::new(t));
        Registered { reg: self.clone(), id, closed }
    }

    pub fn len(&self) -> usize {
        self.open.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Re-checks every open connection against the current state; closes those now denied
    /// (or whose destination left).
    pub fn recheck(&self, state: &crate::state::Store) -> Rechecked {
        let snapshot: Vec<Arc<Tracked>> = self.open.lock().unwrap().values().cloned().collect();
        let mut done = Rechecked::default();
        for t in snapshot {
            if t.close.borrow().is_some() {
                continue;
            }
            done.checked += 1;
            let verdict = match state.workload_by_uid(&t.dst_uid) {
                None => Some("the destination workload left the mesh".to_string()),
                Some(w) => {
                    let c = crate::authz::Conn {
                        src: t.src.as_ref(),
                        principal: t.principal.as_deref(),
                        src_ip: t.src_ip,
                        dst_ip: t.dst.ip(),
                        dst_port: t.dst.port(),
                    };
                    let d = crate::authz::decide(state, &w, &c, None);
                    (!d.allowed()).then(|| d.reason())
                }
            };
            if let Some(reason) = verdict {
                tracing::warn!(src = %t.src_ip, dst = %t.dst, identity = ?t.src.as_ref().map(|i| i.to_string()),
                    reason = %reason, "authorization changed: closing an open connection");
                t.close.send_replace(Some(reason));
                done.closed += 1;
            }
        }
        done
    }
}

/// Re-checks open inbound connections whenever a decision about them can have changed (a
/// policy, or a local workload: [`crate::state::Store::subscribe_authz`]); changes that arrive
/// during a re-check are folded into the next one.
pub async fn run_recheck(ctx: Arc<Ctx>) {
    let mut rx = ctx.state.subscribe_authz();
    while rx.changed().await.is_ok() {
        rx.borrow_and_update();
        let r = ctx.conns.recheck(&ctx.state);
        ctx.metrics.rechecked.inc_by(r.checked as u64);
        if r.closed > 0 {
            ctx.metrics
                .refused
                .get_or_create(&crate::metrics::RefusalLabels { reason: "authorization_revoked" })
                .inc_by(r.closed as u64);
        }
    }
}
