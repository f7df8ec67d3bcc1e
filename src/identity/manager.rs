//! Keeps a certificate for every identity of this node's workloads as the mesh state changes:
//! asks the store for one when a workload appears, and forgets certificates — and through
//! `on_forget` the TLS contexts built on them — when no local workload uses the identity any
//! more; `on_held` hears of the identities holding a certificate after every change (the TLS
//! contexts are built from them ahead of the first connection). The store owns the requests
//! themselves: one in flight per identity, and after a failure the next only when its backoff
//! ends (see [`CertStore::request`]).

use std::sync::Arc;

use tokio::sync::watch;

use super::store::CertStore;
use super::Identity;
use crate::state::Store;

/// Runs until the returned future is dropped. `ready` turns true the first time every local
/// identity holds a certificate once the state's source is complete (`source_ready`: the first
/// xDS responses applied, or the file read), and stays true.
pub async fn run(
    state: Arc<Store>,
    certs: Arc<CertStore>,
    mut source_ready: watch::Receiver<bool>,
    ready: watch::Sender<bool>,
    on_forget: Arc<dyn Fn(&Identity) + Send + Sync>,
    on_held: Arc<dyn Fn(Vec<Identity>) + Send + Sync>,
) {
    let mut changes = state.subscribe();
    let mut slots = certs.changes();
    let mut source_open = true;
    loop {
        slots.borrow_and_update();
        let want = state.local_identities();
        for id in certs.identities() {
            if !want.contains(&id) && certs.forget(&id) {
                on_forget(&id);
            }
        }
        for id in &want {
            // Nothing new while one is held, in flight or backing off.
            certs.request(id);
        }
        let held: Vec<Identity> =
            want.iter().filter(|id| certs.current(id).is_some()).cloned().collect();
        if !held.is_empty() {
            on_held(held);
        }
        if !*ready.borrow()
            && *source_ready.borrow_and_update()
            && want.iter().all(|id| certs.current(id).is_some())
        {
            tracing::info!(certificates = want.len(), "certificates held for every local workload");
            ready.send_replace(true);
        }
        tokio::select! {
            r = changes.changed() => if r.is_err() { return },
            r = slots.changed() => if r.is_err() { return },
            r = source_ready.changed(), if source_open => source_open = r.is_ok(),
        }
    }
}
