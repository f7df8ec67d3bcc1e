//! ZDS messages from the CNI (istio-cni's protocol over a SEQPACKET socket): any bytes must decode
//! or fail cleanly, never panic; a message that decodes re-encodes to bytes that decode to the same
//! message, so what the proxy acts on is exactly what it logs and acks.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mbtunnel::inpod::zds::{WorkloadRequest, WorkloadResponse};
use prost::Message;

fuzz_target!(|data: &[u8]| {
    if let Ok(req) = WorkloadRequest::decode(data) {
        let again =
            WorkloadRequest::decode(&req.encode_to_vec()[..]).expect("re-encoded request decodes");
        assert_eq!(again, req, "request changed through encode/decode");
    }
    if let Ok(resp) = WorkloadResponse::decode(data) {
        let again = WorkloadResponse::decode(&resp.encode_to_vec()[..])
            .expect("re-encoded response decodes");
        assert_eq!(again, resp, "response changed through encode/decode");
    }
});
