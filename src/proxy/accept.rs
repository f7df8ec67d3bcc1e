//! Accept loops: one per listener, on a worker, handing each connection to the next worker.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Drain;
use crate::metrics::{Metrics, Reporter};
use crate::net::Workers;

/// Accepts one connection, backing off on errors (EMFILE and the like would otherwise spin):
/// 5 ms doubling to 1 s while errors repeat. Each error is counted and logged at most once a
/// second.
pub async fn accept_backing_off(
    name: &'static str,
    listener: &tokio::net::TcpListener,
    errors: &prometheus_client::metrics::counter::Counter,
    backoff: &mut Duration,
    last_log: &mut Option<Instant>,
) -> (tokio::net::TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(x) => {
                *backoff = Duration::ZERO;
                return x;
            }
            Err(e) => {
                errors.inc();
                if last_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                    *last_log = Some(Instant::now());
                    tracing::warn!(listener = name, error = %e, total = errors.get(),
                        "accept failed; backing off");
                }
                *backoff = (*backoff * 2).clamp(Duration::from_millis(5), Duration::from_secs(1));
                tokio::time::sleep(*backoff).await;
            }
        }
    }
}

/// Accepts on `listener` until drain, on one of `workers`, running `handle` per connection on
/// the next of them.
pub fn spawn_accept_loop<F, Fut>(
    name: &'static str,
    listener: tokio::net::TcpListener,
    drain: Drain,
    metrics: Arc<Metrics>,
    workers: Arc<Workers>,
    handle: F,
) -> tokio::task::JoinHandle<()>
where
    F: Fn(tokio::net::TcpStream, SocketAddr) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let w = workers.clone();
    w.spawn_listener(name, listener, move |listener| async move {
        let handle = Arc::new(handle);
        let errors = metrics.accept_error_counter(name);
        // The outbound listeners report as the source, the others as the destination.
        let reporter = if name.ends_with("outbound") { Reporter::source } else { Reporter::destination };
        let (mut backoff, mut last_log) = (Duration::ZERO, None);
        loop {
            tokio::select! {
                biased;
                _ = drain.signaled() => {
                    tracing::info!(listener = name, "draining: stopped accepting");
                    return;
                }
                (s, peer) = accept_backing_off(name, &listener, &errors, &mut backoff, &mut last_log) => {
                    let _ = s.set_nodelay(true);
                    // A dual-stack listener reports IPv4 peers as ::ffff:a.b.c.d.
                    let peer = crate::net::socket::canonical(peer);
                    let handle = handle.clone();
                    // `istio_tcp_sockets_open`: up on accept, down when the handler is done
                    // with the socket (or dropped unpolled), as ztunnel counts it.
                    let open = metrics.socket_opened(reporter);
                    workers.spawn_conn(s, move |s| async move {
                        let _open = open;
                        handle(s, peer).await
                    });
                }
            }
        }
    })
}
