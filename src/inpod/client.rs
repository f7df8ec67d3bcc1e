//! The ZDS client: connects to the CNI's socket, says hello, applies each request and acks it,
//! reconnects with backoff. A malformed request is nacked with the reason; the connection and
//! the pods stay.
#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prost::Message;

use super::uds::SeqPacket;
use super::zds::{Payload, Version, WorkloadInfo, WorkloadRequest, WorkloadResponse, ZdsHello};
use super::InPod;
use crate::proxy::Drain;

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Runs until drain. `ready` turns true once connected and the CNI's first snapshot is applied.
pub async fn run_client(pods: Arc<InPod>, path: PathBuf, ready: Arc<AtomicBool>, drain: Drain) {
    let mut backoff = BACKOFF_MIN;
    let mut failures = 0u32;
    loop {
        let attempt = async {
            match SeqPacket::connect(&path).await {
                Ok(conn) => {
                    tracing::info!(socket = %path.display(), "connected to the CNI (ZDS)");
                    pods.metrics.connections.inc();
                    failures = 0;
                    backoff = BACKOFF_MIN;
                    match serve(&pods, &conn, &ready).await {
                        Ok(()) => tracing::warn!("CNI closed the ZDS connection; reconnecting"),
                        Err(e) => tracing::warn!(error = %e, "ZDS connection failed; reconnecting"),
                    }
                }
                Err(e) => {
                    failures += 1;
                    // Loud at first and then now and again, not at every retry.
                    if failures == 1 || failures.is_power_of_two() {
                        tracing::warn!(socket = %path.display(), error = %e, attempts = failures,
                            retry_in_ms = backoff.as_millis() as u64,
                            "cannot connect to the CNI's ZDS socket: pods cannot be enrolled");
                    }
                }
            }
        };
        tokio::select! {
            _ = attempt => {}
            _ = drain.signaled() => return,
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = drain.signaled() => return,
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

async fn serve(pods: &InPod, conn: &SeqPacket, ready: &AtomicBool) -> std::io::Result<()> {
    conn.send(&ZdsHello { version: Version::V1 as i32 }.encode_to_vec(), &[]).await?;
    let mut session = Session::default();
    while let Some(p) = conn.recv().await? {
        let (kind, result) = session.handle(pods, &p.data, p.truncated, p.fds).await;
        if kind == "snapshot_sent" && result.is_ok() {
            ready.store(true, Ordering::Release);
        }
        let outcome = if result.is_ok() { "ok" } else { "error" };
        pods.metrics.requests.get_or_create(&super::ZdsLabels { kind, result: outcome }).inc();
        if let Err(e) = &result {
            tracing::warn!(error = %e, snapshot_done = session.snapshot_done, "ZDS request rejected (nack sent)");
        }
        conn.send(&WorkloadResponse::ack(result.err()).encode_to_vec(), &[]).await?;
    }
    Ok(())
}

/// What a ZDS session acts on: the proxy's pods ([`InPod`]), or a stand-in in tests and fuzzing
/// (so the message handling runs without namespaces or real descriptors).
pub trait PodTable {
    /// A pod's network namespace as the CNI sent it (an fd).
    type Fd;
    fn add(
        &self,
        uid: &str,
        info: Option<&WorkloadInfo>,
        netns: Option<Self::Fd>,
    ) -> impl std::future::Future<Output = Result<(), String>>;
    fn holds(&self, uid: &str) -> bool;
    /// Whether the pod was held.
    fn remove(&self, uid: &str) -> impl std::future::Future<Output = bool>;
    /// Removes every pod not in `seen`; returns the removed uids.
    fn reconcile(&self, seen: &HashSet<String>) -> impl std::future::Future<Output = Vec<String>>;
    /// Pods held.
    fn count(&self) -> usize;
}

impl PodTable for InPod {
    type Fd = OwnedFd;
    async fn add(
        &self,
        uid: &str,
        info: Option<&WorkloadInfo>,
        netns: Option<OwnedFd>,
    ) -> Result<(), String> {
        InPod::add(self, uid, info, netns).await.map_err(|e| e.to_string())
    }
    fn holds(&self, uid: &str) -> bool {
        InPod::holds(self, uid)
    }
    async fn remove(&self, uid: &str) -> bool {
        InPod::remove(self, uid).await
    }
    async fn reconcile(&self, seen: &HashSet<String>) -> Vec<String> {
        InPod::reconcile(self, seen).await
    }
    fn count(&self) -> usize {
        self.uids().len()
    }
}

/// One connection's worth of ZDS state: the pods added or kept since it started (the snapshot
/// drops the rest), and whether the snapshot has been applied.
#[derive(Default)]
pub struct Session {
    seen: HashSet<String>,
    pub snapshot_done: bool,
}

impl Session {
    /// Applies one message (its bytes, whether the socket truncated it, the fds it carried) to
    /// `pods`; returns its kind (a metrics label) and the result the ack carries. Fds not taken by
    /// an add are closed here.
    pub async fn handle<T: PodTable>(
        &mut self,
        pods: &T,
        data: &[u8],
        truncated: bool,
        mut fds: Vec<T::Fd>,
    ) -> (&'static str, Result<(), String>) {
        if truncated {
            let e = format!(
                "message truncated (over {} bytes or too many fds)",
                super::uds::MAX_PACKET
            );
            return ("malformed", Err(e));
        }
        let req = match WorkloadRequest::decode(data) {
            Err(e) => return ("malformed", Err(format!("malformed WorkloadRequest: {e}"))),
            Ok(WorkloadRequest { payload: None }) => {
                let e = "WorkloadRequest without a payload (unknown message type?)";
                return ("malformed", Err(e.into()));
            }
            Ok(WorkloadRequest { payload: Some(req) }) => req,
        };
        match req {
            Payload::Add(a) if a.uid.is_empty() => ("add", Err("add without a uid".into())),
            Payload::Add(a) if fds.len() > 1 => {
                ("add", Err(format!("add for {} carries {} fds; expected one", a.uid, fds.len())))
            }
            Payload::Add(a) => {
                let r = pods.add(&a.uid, a.workload_info.as_ref(), fds.pop()).await;
                if r.is_ok() {
                    self.seen.insert(a.uid);
                }
                ("add", r)
            }
            Payload::Keep(k) => {
                if pods.holds(&k.uid) {
                    self.seen.insert(k.uid);
                    ("keep", Ok(()))
                } else {
                    ("keep", Err(super::PodError::KeepUnknown(k.uid).to_string()))
                }
            }
            Payload::Del(d) => {
                self.seen.remove(&d.uid);
                if !pods.remove(&d.uid).await {
                    tracing::info!(uid = %d.uid, "delete for a pod not held (already gone)");
                }
                ("del", Ok(()))
            }
            Payload::SnapshotSent(_) => {
                let removed = pods.reconcile(&self.seen).await;
                self.snapshot_done = true;
                tracing::info!(
                    pods = pods.count(),
                    removed = removed.len(),
                    "CNI snapshot applied: ready"
                );
                ("snapshot_sent", Ok(()))
            }
        }
    }
}
