//! Generated protocol code (build.rs, from `proto/`): Istio's workload and authorization
//! resources, the delta ADS service and istiod's certificate service.
#![allow(clippy::all, clippy::pedantic, missing_docs)]

pub mod workload {
    tonic::include_proto!("istio.workload");
}
pub mod security {
    tonic::include_proto!("istio.security");
}
pub mod discovery {
    tonic::include_proto!("envoy.service.discovery.v3");
}
pub mod ca {
    tonic::include_proto!("istio.v1.auth");
}
