//! HTTP endpoints: metrics (:15020 `/metrics`), readiness (:15021 `/healthz/ready`), and the admin
//! interface (127.0.0.1:15000: `/config_dump`, `/logging?level=...`, `/redirect/ebpf`). Accept
//! errors (e.g. EMFILE) back off instead of spinning.
//!
//! Secrets stay out of the dump: the bearer token and header values are `config::Secret`s, which
//! serialise as `<redacted>`. Requests that change state (a log level, the eBPF redirect) are
//! served to loopback peers only, whatever address the admin port is bound to.
#![forbid(unsafe_code)]

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use prometheus_client::registry::Registry;

use crate::config::Config;
use crate::identity::store::CertStore;
use crate::inpod::InPod;
use crate::proxy::{Ctx, Drain};
use crate::redirect::ebpf::{EbpfRedirect, Role};
use crate::signer::Signer;

pub mod dump;
pub use dump::config_dump;

pub type Body = Full<Bytes>;

pub fn text(code: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = code;
    r
}

/// An HTTP endpoint's listener: its name (the `listener` label of the accept-error counter),
/// the drain that stops it, and that counter.
pub struct Endpoint {
    pub name: &'static str,
    pub listener: TcpListener,
    pub drain: Drain,
    pub accept_errors: prometheus_client::metrics::counter::Counter,
}

/// Serves HTTP/1 on the endpoint with `handler` (given each request and the peer's address) until
/// drain. Accept errors (out of descriptors) back off and are counted.
pub async fn serve<H, Fut>(ep: Endpoint, handler: H)
where
    H: Fn(Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    let (mut backoff, mut last_log) = (std::time::Duration::ZERO, None);
    loop {
        tokio::select! {
            _ = ep.drain.signaled() => return,
            (s, peer) = crate::proxy::accept_backing_off(
                ep.name, &ep.listener, &ep.accept_errors, &mut backoff, &mut last_log) => {
                let h = handler.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let h = h.clone();
                        async move { Ok::<_, Infallible>(h(req, peer).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                });
            }
        }
    }
}

/// Changes the log filter at run time (`/logging?level=debug`).
pub type LogControl = Arc<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// The value of `name=...` in a query string (the few escapes our values need decoded).
pub fn query_param(query: Option<&str>, name: &str) -> Option<String> {
    query?.split('&').find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')).map(percent_decode)
}

/// Decodes `%XX` escapes (and `+` as a space); a malformed escape stays as written.
pub fn percent_decode(v: &str) -> String {
    let b = v.as_bytes();
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match (b[i], b.get(i + 1).copied().and_then(hex), b.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(h), Some(l)) => {
                out.push(h << 4 | l);
                i += 3;
            }
            (b'+', _, _) => {
                out.push(b' ');
                i += 1;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Encodes everything but unreserved characters, for query values.
pub fn percent_encode(v: &str) -> String {
    v.bytes()
        .map(|c| match c {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (c as char).to_string()
            }
            _ => format!("%{c:02X}"),
        })
        .collect()
}

/// Parses `level=...` from a query string.
pub fn level_param(query: Option<&str>) -> Option<String> {
    query_param(query, "level")
}

/// Whether `peer` may change the proxy's state through the admin API: loopback only (IPv4
/// 127.0.0.0/8, `::1`, and IPv4-mapped loopback), so binding the admin port wider (or running
/// with `hostNetwork`, where the node's other processes share loopback anyway) never lets another
/// machine change a log level or a pod's capture.
pub fn may_change_state(peer: SocketAddr) -> bool {
    match peer.ip() {
        std::net::IpAddr::V4(v4) => v4.is_loopback(),
        std::net::IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// Whether a request to the admin API would change state: setting a log level, or a POST under
/// `/redirect/ebpf` (attach, detach, enrol, unenrol). Anything else only reads.
pub fn changes_state(method: &http::Method, path: &str, query: Option<&str>) -> bool {
    match path {
        "/logging" => level_param(query).is_some(),
        p if p == "/redirect/ebpf" || p.starts_with("/redirect/ebpf/") => {
            method == http::Method::POST
        }
        _ => false,
    }
}

/// The answer to a state-changing request from a peer that is not on loopback.
pub fn refuse_remote(peer: SocketAddr, path: &str) -> Response<Body> {
    text(
        StatusCode::FORBIDDEN,
        format!(
            "{path} changes the proxy's state and is served to loopback peers only; {} is not \
             loopback: run the request on the node itself (or kubectl port-forward to the \
             admin port)\n",
            peer.ip()
        ),
    )
}

/// The eBPF redirect's admin endpoints (what `mbtunnel redirect ebpf ...` calls):
/// `GET /redirect/ebpf`, `POST /redirect/ebpf/attach?iface=..&role=pod|uplink`,
/// `POST /redirect/ebpf/detach?iface=..`, `POST /redirect/ebpf/enrol?ip=..`,
/// `POST /redirect/ebpf/unenrol?ip=..`.
/// Changes (POST) need `token` in the `x-mbtunnel-token` header.
pub fn ebpf_endpoint(
    ebpf: Option<&EbpfRedirect>,
    method: &http::Method,
    path: &str,
    query: Option<&str>,
    presented: Option<&str>,
    token: Option<&str>,
) -> Response<Body> {
    let Some(e) = ebpf else {
        return text(
            StatusCode::CONFLICT,
            "eBPF redirect is not enabled on this proxy (ebpf_enabled: true / MBTUNNEL_EBPF_ENABLED=true)\n",
        );
    };
    let action = path.strip_prefix("/redirect/ebpf").unwrap_or("");
    if action.is_empty() || action == "/" {
        return text(StatusCode::OK, format!("{:#}\n", e.status()));
    }
    if method != http::Method::POST {
        return text(StatusCode::METHOD_NOT_ALLOWED, "use POST\n");
    }
    if token.is_none() || presented != token {
        return text(
            StatusCode::UNAUTHORIZED,
            "missing or wrong token: send the contents of the proxy's ebpf_token_file (root only) \
             in x-mbtunnel-token\n",
        );
    }
    let missing = |what: &str| text(StatusCode::BAD_REQUEST, format!("missing {what}=...\n"));
    let result = match action {
        "/attach" | "/detach" => {
            let Some(iface) = query_param(query, "iface") else { return missing("iface") };
            if action == "/detach" {
                e.detach(&iface).map(|()| format!("detached {iface}\n"))
            } else {
                let role =
                    match query_param(query, "role").as_deref().unwrap_or("pod").parse::<Role>() {
                        Ok(r) => r,
                        Err(m) => return text(StatusCode::BAD_REQUEST, m + "\n"),
                    };
                e.attach(&iface, role).map(|()| format!("attached {iface} as {role:?}\n"))
            }
        }
        "/enrol" | "/unenrol" => {
            let Some(ip) = query_param(query, "ip") else { return missing("ip") };
            let Ok(ip) = ip.parse::<std::net::IpAddr>() else {
                return text(StatusCode::BAD_REQUEST, format!("'{ip}' is not an IP address\n"));
            };
            if action == "/enrol" {
                e.enrol(ip).map(|()| format!("enrolled {ip}\n"))
            } else {
                e.unenrol(ip).map(|was| {
                    if was {
                        format!("removed {ip}\n")
                    } else {
                        format!("{ip} was not enrolled\n")
                    }
                })
            }
        }
        _ => {
            return text(
                StatusCode::NOT_FOUND,
                "try /redirect/ebpf[/attach|/detach|/enrol|/unenrol]\n",
            )
        }
    };
    match result {
        Ok(m) => text(StatusCode::OK, m),
        Err(err) => text(StatusCode::BAD_REQUEST, format!("{err}\n")),
    }
}

/// What the admin endpoint shows and changes.
pub struct AdminState {
    /// Requests refused because they would change state from a non-loopback peer
    /// (`mbtunnel_admin_refused_total`).
    pub refused: prometheus_client::metrics::counter::Counter,
    pub cfg: Arc<Config>,
    pub store: Arc<CertStore>,
    pub ctx: Arc<Ctx>,
    pub signer: Signer,
    pub inpod: Option<Arc<InPod>>,
    pub xds: Option<Arc<crate::xds::Client>>,
    pub ebpf: Option<Arc<EbpfRedirect>>,
    pub ebpf_token: Option<Arc<String>>,
    pub log: Option<LogControl>,
}

/// `:15020/metrics` (also `/stats/prometheus`).
pub async fn serve_metrics(ep: Endpoint, registry: Arc<Registry>, ebpf: Option<Arc<EbpfRedirect>>) {
    serve(ep, move |req, _| {
        let (reg, ebpf) = (registry.clone(), ebpf.clone());
        async move {
            match req.uri().path() {
                "/metrics" | "/stats/prometheus" => {
                    if let Some(e) = &ebpf {
                        e.refresh_metrics();
                    }
                    let mut s = String::new();
                    match prometheus_client::encoding::text::encode(&mut s, &reg) {
                        Ok(()) => with_type(
                            text(StatusCode::OK, s),
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        ),
                        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
                    }
                }
                _ => text(StatusCode::NOT_FOUND, "try /metrics\n"),
            }
        }
    })
    .await
}

/// `:15021/healthz/ready`: 200 while `ready()` holds, 500 otherwise (ztunnel's codes: probes and
/// tooling built for it read them), 405 to anything but GET.
pub async fn serve_readiness(ep: Endpoint, ready: Arc<dyn Fn() -> bool + Send + Sync>) {
    serve(ep, move |req, _| {
        let ready = ready();
        async move {
            match req.uri().path() {
                "/healthz/ready" if req.method() != http::Method::GET => {
                    text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n")
                }
                "/healthz/ready" if ready => text(StatusCode::OK, "ready\n"),
                "/healthz/ready" => text(StatusCode::INTERNAL_SERVER_ERROR, "not ready\n"),
                _ => text(StatusCode::NOT_FOUND, "try /healthz/ready\n"),
            }
        }
    })
    .await
}

fn with_type(mut r: Response<Body>, content_type: &'static str) -> Response<Body> {
    r.headers_mut()
        .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static(content_type));
    r
}

/// `127.0.0.1:15000`: `/config_dump`, `/logging?level=...`, `/redirect/ebpf...`. Changes
/// ([`changes_state`]) from a peer that is not on loopback are refused with 403 and counted.
pub async fn serve_admin(ep: Endpoint, st: Arc<AdminState>) {
    serve(ep, move |req, peer| {
        let st = st.clone();
        async move {
            let path = req.uri().path();
            if changes_state(req.method(), path, req.uri().query()) && !may_change_state(peer) {
                st.refused.inc();
                tracing::warn!(%peer, path, "admin: refused a state-changing request from a \
                    non-loopback peer (only loopback may change state)");
                return refuse_remote(peer, path);
            }
            if path == "/redirect/ebpf" || path.starts_with("/redirect/ebpf/") {
                // Attaching runs netlink and bpf syscalls: off the async workers.
                let (method, path, query) =
                    (req.method().clone(), path.to_string(), req.uri().query().map(String::from));
                let presented = req
                    .headers()
                    .get(crate::redirect::ebpf::TOKEN_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .map(String::from);
                return tokio::task::spawn_blocking(move || {
                    ebpf_endpoint(
                        st.ebpf.as_deref(),
                        &method,
                        &path,
                        query.as_deref(),
                        presented.as_deref(),
                        st.ebpf_token.as_deref().map(String::as_str),
                    )
                })
                .await
                .unwrap_or_else(|e| text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()));
            }
            match path {
                "/authz/check" => {
                    let q = req.uri().query();
                    match authz_check(&st, query_param(q, "src"), query_param(q, "src_ip"), query_param(q, "dst")) {
                        Ok(v) => with_type(
                            text(StatusCode::OK, serde_json::to_string_pretty(&v).unwrap_or_default()),
                            "application/json",
                        ),
                        Err(e) => text(StatusCode::BAD_REQUEST, format!("{e}\n")),
                    }
                }
                "/config_dump" => with_type(
                    text(
                        StatusCode::OK,
                        serde_json::to_string_pretty(&config_dump(&st)).unwrap_or_default(),
                    ),
                    "application/json",
                ),
                "/logging" => match (level_param(req.uri().query()), &st.log) {
                    (Some(level), Some(ctl)) => match ctl(&level) {
                        Ok(()) => {
                            tracing::info!(%level, "log level changed");
                            text(StatusCode::OK, format!("log level set to {level}\n"))
                        }
                        Err(e) => {
                            text(StatusCode::BAD_REQUEST, format!("invalid level '{level}': {e}\n"))
                        }
                    },
                    (None, _) => text(
                        StatusCode::BAD_REQUEST,
                        "usage: /logging?level=<filter, e.g. debug or mbtunnel=trace>\n",
                    ),
                    (_, None) => {
                        text(StatusCode::NOT_IMPLEMENTED, "log level control not available\n")
                    }
                },
                _ => text(
                    StatusCode::NOT_FOUND,
                    "endpoints: /config_dump /logging?level=... /authz/check?src=..&dst=.. /redirect/ebpf\n",
                ),
            }
        }
    })
    .await
}

/// `/authz/check?src=<spiffe id | ip>[&src_ip=<ip>]&dst=<ip:port>`: see `authz::explain`.
pub fn authz_check(
    st: &AdminState,
    src: Option<String>,
    src_ip: Option<String>,
    dst: Option<String>,
) -> Result<serde_json::Value, String> {
    crate::authz::explain(&st.ctx.state, src.as_deref(), src_ip.as_deref(), dst.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_peers_may_change_state() {
        for p in ["127.0.0.1:1", "127.9.8.7:15000", "[::1]:2", "[::ffff:127.0.0.1]:3"] {
            assert!(may_change_state(p.parse().unwrap()), "{p} is loopback");
        }
        for p in ["10.0.0.7:1", "0.0.0.0:1", "192.168.1.1:1", "[::ffff:10.0.0.7]:1", "[fe80::1]:1"]
        {
            assert!(!may_change_state(p.parse().unwrap()), "{p} is not loopback");
        }
        let r = refuse_remote("10.0.0.7:4444".parse().unwrap(), "/logging");
        assert_eq!(r.status(), StatusCode::FORBIDDEN);
    }

    #[test]
    fn which_admin_requests_change_state() {
        use http::Method;
        assert!(changes_state(&Method::GET, "/logging", Some("level=debug")));
        assert!(changes_state(&Method::POST, "/logging", Some("level=info")));
        assert!(changes_state(&Method::POST, "/redirect/ebpf/enrol", Some("ip=10.0.0.1")));
        assert!(changes_state(&Method::POST, "/redirect/ebpf/attach", None));
        assert!(!changes_state(&Method::GET, "/redirect/ebpf", None), "status only reads");
        assert!(!changes_state(&Method::GET, "/logging", None), "usage only");
        assert!(!changes_state(&Method::GET, "/config_dump", None));
        assert!(!changes_state(&Method::GET, "/authz/check", Some("src=a&dst=b")));
    }
}
