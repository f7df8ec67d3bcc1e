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

/// Parses `level=...` from a query string.
pub fn level_param(query: Option<&str>) -> Option<String> {
    query?
        .split('&')
        .find_map(|kv| kv.strip_prefix("level="))
        .map(|v| v.replace("%3D", "=").replace("%2C", ","))
}
