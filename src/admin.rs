//! HTTP endpoints: metrics (:15020 `/metrics`), readiness (:15021 `/healthz/ready`), and the admin
//! interface (127.0.0.1:15000: `/config_dump`, `/logging?level=...`).
#![forbid(unsafe_code)]

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::proxy::Drain;
use crate::redirect::ebpf::{EbpfRedirect, Role};

pub type Body = Full<Bytes>;

pub fn text(code: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = code;
    r
}

/// Serves HTTP/1 on `listener` with `handler` until drain.
pub async fn serve<H, Fut>(listener: TcpListener, drain: Drain, handler: H)
where
    H: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    loop {
        tokio::select! {
            _ = drain.signaled() => return,
            r = listener.accept() => {
                let Ok((s, _)) = r else { continue };
                let h = handler.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let h = h.clone();
                        async move { Ok::<_, Infallible>(h(req).await) }
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
    query?
        .split('&')
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
        .map(|v| v.replace("%3D", "=").replace("%2C", ",").replace("%3A", ":"))
}

/// Parses `level=...` from a query string.
pub fn level_param(query: Option<&str>) -> Option<String> {
    query_param(query, "level")
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
