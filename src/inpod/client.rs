//! The ZDS client: connects to the CNI's socket, says hello, applies each request and acks it,
//! reconnects with backoff. A malformed request is nacked with the reason; the connection and
//! the pods stay.
#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prost::Message;

use super::uds::SeqPacket;
use super::zds::{Payload, Version, WorkloadRequest, WorkloadResponse, ZdsHello};
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
    // Pods added or kept since this connection started; the snapshot drops the rest.
    let mut seen: HashSet<String> = HashSet::new();
    let mut snapshot_done = false;
    while let Some(p) = conn.recv().await? {
        let mut fds = p.fds;
        let mut kind = "malformed";
        let result: Result<(), String> = if p.truncated {
            Err(format!(
                "message truncated (over {} bytes or too many fds)",
                super::uds::MAX_PACKET
            ))
        } else {
            match WorkloadRequest::decode(&p.data[..]) {
                Err(e) => Err(format!("malformed WorkloadRequest: {e}")),
                Ok(WorkloadRequest { payload: None }) => {
                    Err("WorkloadRequest without a payload (unknown message type?)".into())
                }
                Ok(WorkloadRequest { payload: Some(req) }) => {
                    kind = match &req {
                        Payload::Add(_) => "add",
                        Payload::Keep(_) => "keep",
                        Payload::Del(_) => "del",
                        Payload::SnapshotSent(_) => "snapshot_sent",
                    };
                    match req {
                        Payload::Add(a) if a.uid.is_empty() => Err("add without a uid".into()),
                        Payload::Add(a) => {
                            if fds.len() > 1 {
                                Err(format!(
                                    "add for {} carries {} fds; expected one",
                                    a.uid,
                                    fds.len()
                                ))
                            } else {
                                let r = pods.add(&a.uid, a.workload_info.as_ref(), fds.pop()).await;
                                if r.is_ok() {
                                    seen.insert(a.uid.clone());
                                }
                                r.map_err(|e| e.to_string())
                            }
                        }
                        Payload::Keep(k) => {
                            if pods.holds(&k.uid) {
                                seen.insert(k.uid);
                                Ok(())
                            } else {
                                Err(super::PodError::KeepUnknown(k.uid).to_string())
                            }
                        }
                        Payload::Del(d) => {
                            seen.remove(&d.uid);
                            if !pods.remove(&d.uid).await {
                                tracing::info!(uid = %d.uid, "delete for a pod not held (already gone)");
                            }
                            Ok(())
                        }
                        Payload::SnapshotSent(_) => {
                            let removed = pods.reconcile(&seen).await;
                            snapshot_done = true;
                            ready.store(true, Ordering::Release);
                            tracing::info!(
                                pods = pods.uids().len(),
                                removed = removed.len(),
                                "CNI snapshot applied: ready"
                            );
                            Ok(())
                        }
                    }
                }
            }
        };
        let outcome = if result.is_ok() { "ok" } else { "error" };
        pods.metrics.requests.get_or_create(&super::ZdsLabels { kind, result: outcome }).inc();
        // Any fd not consumed (e.g. on a delete, or a rejected add) closes here.
        drop(fds);
        if let Err(e) = &result {
            tracing::warn!(error = %e, snapshot_done, "ZDS request rejected (nack sent)");
        }
        conn.send(&WorkloadResponse::ack(result.err()).encode_to_vec(), &[]).await?;
    }
    Ok(())
}
