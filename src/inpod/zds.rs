//! ZDS messages (`proto/zds.proto`, package `istio.workload.zds`) as hand-written `prost`
//! structs: no protoc in the build. Field numbers match istio-cni's so the two interoperate.
#![forbid(unsafe_code)]

/// Protocol version announced in [`ZdsHello`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Version {
    NotUsed = 0,
    V1 = 1,
}

/// First message on a connection, from the proxy.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ZdsHello {
    #[prost(enumeration = "Version", tag = "1")]
    pub version: i32,
}

/// Who the pod is (before the control plane may have told the proxy).
#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadInfo {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub namespace: String,
    #[prost(string, tag = "3")]
    pub service_account: String,
}

/// A pod to capture; its network namespace fd travels as SCM_RIGHTS ancillary data.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AddWorkload {
    #[prost(string, tag = "1")]
    pub uid: String,
    #[prost(message, optional, tag = "2")]
    pub workload_info: Option<WorkloadInfo>,
}

/// Keep a pod the proxy already holds (snapshot replay without a netns).
#[derive(Clone, PartialEq, prost::Message)]
pub struct KeepWorkload {
    #[prost(string, tag = "1")]
    pub uid: String,
}

/// A pod is gone.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DelWorkload {
    #[prost(string, tag = "2")]
    pub uid: String,
}

/// The CNI has replayed every pod it knows: the proxy drops the ones not replayed.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SnapshotSent {}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Payload {
    #[prost(message, tag = "1")]
    Add(AddWorkload),
    #[prost(message, tag = "2")]
    Del(DelWorkload),
    #[prost(message, tag = "3")]
    SnapshotSent(SnapshotSent),
    #[prost(message, tag = "5")]
    Keep(KeepWorkload),
}

/// CNI → proxy.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadRequest {
    #[prost(oneof = "Payload", tags = "1, 2, 3, 5")]
    pub payload: Option<Payload>,
}

/// The answer to one request: empty `error` = success.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Ack {
    #[prost(string, tag = "1")]
    pub error: String,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum ResponsePayload {
    #[prost(message, tag = "1")]
    Ack(Ack),
}

/// Proxy → CNI.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadResponse {
    #[prost(oneof = "ResponsePayload", tags = "1")]
    pub payload: Option<ResponsePayload>,
}

impl WorkloadResponse {
    pub fn ack(error: Option<String>) -> WorkloadResponse {
        WorkloadResponse {
            payload: Some(ResponsePayload::Ack(Ack { error: error.unwrap_or_default() })),
        }
    }
}

impl WorkloadRequest {
    pub fn add(uid: &str, info: Option<WorkloadInfo>) -> WorkloadRequest {
        WorkloadRequest {
            payload: Some(Payload::Add(AddWorkload { uid: uid.into(), workload_info: info })),
        }
    }
    pub fn del(uid: &str) -> WorkloadRequest {
        WorkloadRequest { payload: Some(Payload::Del(DelWorkload { uid: uid.into() })) }
    }
    pub fn keep(uid: &str) -> WorkloadRequest {
        WorkloadRequest { payload: Some(Payload::Keep(KeepWorkload { uid: uid.into() })) }
    }
    pub fn snapshot_sent() -> WorkloadRequest {
        WorkloadRequest { payload: Some(Payload::SnapshotSent(SnapshotSent {})) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    /// Bytes worked out by hand from the protobuf wire format (tag = field << 3 | wire type).
    #[test]
    fn wire_bytes_match_the_proto() {
        let hello = ZdsHello { version: Version::V1 as i32 };
        assert_eq!(hello.encode_to_vec(), [0x08, 0x01]);

        let info =
            WorkloadInfo { name: "a".into(), namespace: "b".into(), service_account: "c".into() };
        let add = WorkloadRequest::add("u1", Some(info.clone()));
        let want = [
            0x0a, 0x0f, // field 1 (add), 15 bytes
            0x0a, 0x02, b'u', b'1', // uid
            0x12, 0x09, // workload_info, 9 bytes
            0x0a, 0x01, b'a', 0x12, 0x01, b'b', 0x1a, 0x01, b'c',
        ];
        assert_eq!(add.encode_to_vec(), want);
        assert_eq!(WorkloadRequest::decode(&want[..]).unwrap(), add);

        // DelWorkload's uid is field 2 (as in istio's file), keep is field 5 of the oneof.
        assert_eq!(
            WorkloadRequest::del("u1").encode_to_vec(),
            [0x12, 0x04, 0x12, 0x02, b'u', b'1']
        );
        assert_eq!(
            WorkloadRequest::keep("u1").encode_to_vec(),
            [0x2a, 0x04, 0x0a, 0x02, b'u', b'1']
        );
        assert_eq!(WorkloadRequest::snapshot_sent().encode_to_vec(), [0x1a, 0x00]);
        assert_eq!(WorkloadResponse::ack(None).encode_to_vec(), [0x0a, 0x00]);
        assert_eq!(
            WorkloadResponse::ack(Some("x".into())).encode_to_vec(),
            [0x0a, 0x03, 0x0a, 0x01, b'x']
        );
        // A field this side does not know (AddWorkload's Windows compartment, 3) is skipped.
        let mut with_unknown = want.to_vec();
        with_unknown[1] += 4;
        with_unknown.extend_from_slice(&[0x1a, 0x02, b'w', b'n']);
        assert_eq!(WorkloadRequest::decode(&with_unknown[..]).unwrap(), add);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(WorkloadRequest::decode(&[0x0a, 0x7f, 0x01][..]).is_err());
        assert!(WorkloadRequest::decode(&[0xff, 0xff, 0xff][..]).is_err());
        // An empty message decodes to "no payload"; the client rejects that itself.
        assert_eq!(WorkloadRequest::decode(&[][..]).unwrap().payload, None);
    }
}
