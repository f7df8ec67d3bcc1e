//! The server half of HBONE: h2 settings, and the checks on a `CONNECT` (method, authority
//! form) with the status each refusal answers.
#![forbid(unsafe_code)]

use std::net::{IpAddr, SocketAddr};

use http::{Method, Request, StatusCode};

use super::{
    CONNECTION_WINDOW, MAX_FRAME, MAX_HEADER_LIST, MAX_LOCAL_ERROR_RESETS,
    MAX_PENDING_ACCEPT_RESETS, MAX_SEND_BUFFER, MAX_STREAMS, STREAM_WINDOW,
};

/// The server-side h2 builder with ztunnel's window, frame and stream settings, and bounds on
/// what a hostile client can make the server hold (header size, reset streams, send buffer).
pub fn server_builder() -> h2::server::Builder {
    let mut b = h2::server::Builder::new();
    b.initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME)
        .max_concurrent_streams(MAX_STREAMS)
        .max_header_list_size(MAX_HEADER_LIST)
        .max_pending_accept_reset_streams(MAX_PENDING_ACCEPT_RESETS)
        .max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
        .max_send_buffer_size(MAX_SEND_BUFFER);
    b
}

/// The server pings its clients as the client pings it: a peer that stops answering for
/// `PING_TIMEOUT` is gone, and its connection is closed.
pub async fn keepalive(ping: Option<h2::PingPong>) -> &'static str {
    super::client::keepalive(ping).await
}

/// Why a `CONNECT` is refused, with its status code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnectRefusal {
    #[error("method {0} is not CONNECT")]
    Method(String),
    #[error("authority '{0}' is not ip:port")]
    Authority(String),
    #[error(
        "authority ip {authority} differs from the address the connection reached ({reached})"
    )]
    AddressMismatch { authority: IpAddr, reached: IpAddr },
    #[error("target {0} is not a workload on this node")]
    UnknownTarget(SocketAddr),
    #[error("upstream {0} unreachable: {1}")]
    Upstream(SocketAddr, String),
    #[error("target {0} is one of the proxy's own ports in the pod: would loop")]
    Loop(SocketAddr),
}

impl ConnectRefusal {
    pub fn status(&self) -> StatusCode {
        match self {
            ConnectRefusal::Method(_) => StatusCode::METHOD_NOT_ALLOWED,
            ConnectRefusal::Authority(_)
            | ConnectRefusal::AddressMismatch { .. }
            | ConnectRefusal::UnknownTarget(_)
            | ConnectRefusal::Loop(_) => StatusCode::BAD_REQUEST,
            ConnectRefusal::Upstream(..) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// Short label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            ConnectRefusal::Method(_) => "bad_method",
            ConnectRefusal::Authority(_) => "bad_authority",
            ConnectRefusal::AddressMismatch { .. } => "address_mismatch",
            ConnectRefusal::UnknownTarget(_) => "unknown_target",
            ConnectRefusal::Upstream(..) => "upstream_unreachable",
            ConnectRefusal::Loop(_) => "loop",
        }
    }
}

/// Every check on a `CONNECT` before the proxy acts on it: method and authority form
/// ([`parse_connect`]), a target that is a workload of this node (`local` finds it), an authority
/// IP equal to the address the connection reached, and (in a pod, where the proxy's own ports
/// are listed in `own_ports`) a target port that is not one of the proxy's. Returns the target
/// and what `local` found.
pub fn check_connect<B, T>(
    req: &Request<B>,
    reached: SocketAddr,
    own_ports: &[u16],
    local: impl Fn(IpAddr) -> Option<T>,
) -> Result<(SocketAddr, T), ConnectRefusal> {
    let target = parse_connect(req)?;
    let Some(found) = local(target.ip()) else {
        return Err(ConnectRefusal::UnknownTarget(target));
    };
    if target.ip() != reached.ip() {
        return Err(ConnectRefusal::AddressMismatch {
            authority: target.ip(),
            reached: reached.ip(),
        });
    }
    if own_ports.contains(&target.port()) {
        return Err(ConnectRefusal::Loop(target));
    }
    Ok((target, found))
}

/// Checks method and authority form of a `CONNECT`; returns the target.
pub fn parse_connect<B>(req: &Request<B>) -> Result<SocketAddr, ConnectRefusal> {
    if req.method() != Method::CONNECT {
        return Err(ConnectRefusal::Method(req.method().to_string()));
    }
    let auth = req.uri().authority().map(|a| a.as_str().to_string()).unwrap_or_default();
    auth.parse::<SocketAddr>().map_err(|_| ConnectRefusal::Authority(auth))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_validation() {
        let r = |m: Method, uri: &str| Request::builder().method(m).uri(uri).body(()).unwrap();
        assert_eq!(
            parse_connect(&r(Method::CONNECT, "10.1.2.3:80")),
            Ok("10.1.2.3:80".parse().unwrap())
        );
        assert_eq!(
            parse_connect(&r(Method::CONNECT, "[fd00::1]:80")),
            Ok("[fd00::1]:80".parse().unwrap())
        );
        let e = parse_connect(&r(Method::GET, "http://10.1.2.3/")).unwrap_err();
        assert_eq!(e.status(), StatusCode::METHOD_NOT_ALLOWED);
        let e = parse_connect(&r(Method::CONNECT, "example.com:80")).unwrap_err();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert!(e.to_string().contains("example.com:80"));
    }
}
