//! The proxy's handling of a ZDS session (`inpod::client::Session`), on a sequence of packets as
//! the CNI's socket delivers them — bytes, a truncation flag, and a number of attached fds —
//! against a stand-in pod table (uids `pod-*` are known; an add needs a namespace fd).
//! Invariants: nothing panics; a malformed or truncated packet is nacked; an acked add or keep
//! leaves the pod held; after an acked snapshot every held pod was added or kept in this session;
//! every fd is either held by the table or closed (none leaks, none is held twice); every ack
//! encodes to a response that decodes back.
#![no_main]

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::rc::Rc;

use libfuzzer_sys::fuzz_target;
use mbtunnel::inpod::client::{PodTable, Session};
use mbtunnel::inpod::zds::{WorkloadInfo, WorkloadResponse};
use prost::Message;

/// A stand-in for a namespace fd: counts how many are alive.
struct FakeFd(Rc<Cell<usize>>);

impl Drop for FakeFd {
    fn drop(&mut self) {
        self.0.set(self.0.get() - 1);
    }
}

#[derive(Default)]
struct Table {
    pods: RefCell<HashMap<String, FakeFd>>,
    /// Pods added or kept since the session started, as the table saw them.
    touched: RefCell<HashSet<String>>,
}

impl PodTable for Table {
    type Fd = FakeFd;
    async fn add(
        &self,
        uid: &str,
        _info: Option<&WorkloadInfo>,
        netns: Option<FakeFd>,
    ) -> Result<(), String> {
        if !uid.starts_with("pod-") {
            return Err(format!("unknown uid {uid}"));
        }
        let fd = netns.ok_or("no netns fd")?;
        self.pods.borrow_mut().insert(uid.to_string(), fd);
        self.touched.borrow_mut().insert(uid.to_string());
        Ok(())
    }
    fn holds(&self, uid: &str) -> bool {
        let held = self.pods.borrow().contains_key(uid);
        if held {
            self.touched.borrow_mut().insert(uid.to_string());
        }
        held
    }
    async fn remove(&self, uid: &str) -> bool {
        self.touched.borrow_mut().remove(uid);
        self.pods.borrow_mut().remove(uid).is_some()
    }
    async fn reconcile(&self, seen: &HashSet<String>) -> Vec<String> {
        let stale: Vec<String> =
            self.pods.borrow().keys().filter(|u| !seen.contains(*u)).cloned().collect();
        for u in &stale {
            self.pods.borrow_mut().remove(u);
        }
        stale
    }
    fn count(&self) -> usize {
        self.pods.borrow().len()
    }
}

fuzz_target!(|data: &[u8]| {
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    rt.block_on(async {
        let table = Table::default();
        let live = Rc::new(Cell::new(0usize));
        let mut session = Session::default();
        let mut rest = data;
        // Framing: [flags][len][len bytes]...; flags & 3 = fds attached, flags == 0xff = truncated.
        while rest.len() >= 2 {
            let (flags, len) = (rest[0], rest[1] as usize);
            let body = &rest[2..(2 + len).min(rest.len())];
            rest = &rest[(2 + len).min(rest.len())..];
            let truncated = flags == 0xff;
            let fds: Vec<FakeFd> = (0..(flags & 3))
                .map(|_| {
                    live.set(live.get() + 1);
                    FakeFd(live.clone())
                })
                .collect();
            let (kind, result) = session.handle(&table, body, truncated, fds).await;
            if truncated {
                assert!(result.is_err(), "a truncated packet is nacked");
            }
            if kind == "malformed" {
                assert!(result.is_err(), "a malformed packet is nacked");
            }
            if kind == "snapshot_sent" && result.is_ok() {
                assert!(session.snapshot_done);
                for uid in table.pods.borrow().keys() {
                    assert!(table.touched.borrow().contains(uid), "{uid} survived the snapshot");
                }
            }
            // No fd leaks and none is held twice: the live ones are exactly the table's.
            assert_eq!(live.get(), table.pods.borrow().len(), "fds alive vs pods held");
            let ack = WorkloadResponse::ack(result.err()).encode_to_vec();
            WorkloadResponse::decode(&ack[..]).expect("an ack decodes");
        }
    });
});
