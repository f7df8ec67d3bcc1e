//! Keeps a certificate for every identity of this node's workloads as the mesh state changes:
//! requests one when a workload appears (retrying with backoff while the CA is unreachable), and
//! forgets certificates — and through `on_forget` the TLS contexts built on them — when no local
//! workload uses the identity any more.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use super::store::CertStore;
use super::Identity;
use crate::state::Store;

/// Retry of a failed first request: doubling from the first to the last.
const RETRY_FIRST: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// Runs until the returned future is dropped. `ready` turns true the first time every local
/// identity holds a certificate once the state's source is complete (`source_ready`: the first
/// xDS responses applied, or the file read), and stays true.
pub async fn run(
    state: Arc<Store>,
    certs: Arc<CertStore>,
    mut source_ready: watch::Receiver<bool>,
    ready: watch::Sender<bool>,
    on_forget: Arc<dyn Fn(&Identity) + Send + Sync>,
) {
    let mut changes = state.subscribe();
    let inflight: Arc<Mutex<HashSet<Identity>>> = Arc::default();
    let (done_tx, mut done_rx) = watch::channel(0u64);
    let done_tx = Arc::new(done_tx);
    let mut source_open = true;
    loop {
        let want = state.local_identities();
        for id in certs.identities() {
            if !want.contains(&id) && !inflight.lock().unwrap().contains(&id) && certs.forget(&id) {
                on_forget(&id);
            }
        }
        for id in &want {
            if certs.current(id).is_some() || !inflight.lock().unwrap().insert(id.clone()) {
                continue;
            }
            let (state, certs, inflight, done) =
                (state.clone(), certs.clone(), inflight.clone(), done_tx.clone());
            let id = id.clone();
            tokio::spawn(async move {
                let mut backoff = RETRY_FIRST;
                loop {
                    match certs.fetch(&id).await {
                        Ok(_) => break,
                        Err(e) => {
                            if !state.local_identities().contains(&id) {
                                break;
                            }
                            tracing::warn!(identity = %id, error = %e, retry_in_ms = backoff.as_millis() as u64,
                                "cannot get a certificate for a local workload; retrying");
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(RETRY_MAX);
                        }
                    }
                }
                inflight.lock().unwrap().remove(&id);
                done.send_modify(|n| *n += 1);
            });
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
            _ = done_rx.changed() => {}
            r = source_ready.changed(), if source_open => source_open = r.is_ok(),
        }
    }
}
