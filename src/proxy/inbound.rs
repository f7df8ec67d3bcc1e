//! Inbound: HBONE (15008) — mutual TLS as the destination workload, then one HTTP/2 `CONNECT`
//! per tunnelled connection, answered 200 only once the upstream connection is up — and
//! plaintext passthrough (15006).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Empty;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tracing::Instrument;

use super::socket::{destination, dial, DialOpts};
use super::{copy_both, ConnRecord, Ctx};
use crate::hbone::{parse_connect, server_builder, ConnectRefusal};
use crate::identity::Identity;
use crate::inpod::netns::Netns;
use crate::metrics::{ConnLabels, Reporter, SecurityPolicy};
use crate::tls::Stream;

static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// One HBONE TLS connection.
/// `netns`: the pod whose listener accepted (in-pod mode); the app is dialled from inside it.
pub async fn handle_hbone(
    ctx: Arc<Ctx>,
    tcp: TcpStream,
    peer: SocketAddr,
    netns: Option<Arc<Netns>>,
) {
    // The address the client dialled: redirected (pod ip:15008) or the listener's own.
    let Some(reached) = destination(&tcp) else { return };
    serve_hbone(ctx, tcp, peer, reached, netns).await
}

/// Serves HBONE on `stream` from `peer`, which dialled `reached`: a TCP connection, or the
/// in-memory pipe of a same-node tunnel (eBPF mode).
pub async fn serve_hbone<S: Stream>(
    ctx: Arc<Ctx>,
    stream: S,
    peer: SocketAddr,
    reached: SocketAddr,
    netns: Option<Arc<Netns>>,
) {
    let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let span = tracing::info_span!("inbound", id, src = %peer, dst = %reached);
    async move {
        let Some(local) = ctx.state.local_workload_by_ip(reached.ip()) else {
            ctx.metrics.refuse("no_local_workload");
            tracing::warn!("refused: {} is not a workload on this node", reached.ip());
            return;
        };
        let local_id = ctx.state.identity_of(&local);
        let (tls, peer_id) = match ctx.tls.accept(stream, &local_id).await {
            Ok(x) => x,
            Err(e) => {
                ctx.metrics.refuse("tls_handshake");
                tracing::warn!(error = %e, "refused: TLS handshake with peer failed");
                return;
            }
        };
        tracing::debug!(peer = %peer_id, "mTLS established");
        let svc_ctx = ctx.clone();
        let peer_id = Arc::new(peer_id);
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let ctx = svc_ctx.clone();
            let peer_id = peer_id.clone();
            let netns = netns.clone();
            async move {
                Ok::<_, Infallible>(
                    serve_connect(ctx, req, peer, reached, &peer_id, netns.as_deref()).await,
                )
            }
        });
        let conn = server_builder().serve_connection(TokioIo::new(tls), service);
        tokio::pin!(conn);
        tokio::select! {
            r = conn.as_mut() => if let Err(e) = r { tracing::debug!(error = %e, "HBONE connection ended") },
            _ = ctx.drain.signaled() => {
                // GOAWAY: no new streams; streams in flight finish.
                conn.as_mut().graceful_shutdown();
                let _ = conn.await;
            }
        }
    }
    .instrument(span)
    .await
}

fn status(code: StatusCode) -> Response<Empty<Bytes>> {
    let mut r = Response::new(Empty::new());
    *r.status_mut() = code;
    r
}

async fn serve_connect(
    ctx: Arc<Ctx>,
    mut req: Request<Incoming>,
    peer: SocketAddr,
    reached: SocketAddr,
    peer_id: &Identity,
    netns: Option<&Netns>,
) -> Response<Empty<Bytes>> {
    let refuse = |e: ConnectRefusal| {
        ctx.metrics.refuse(e.reason());
        tracing::warn!(peer = %peer_id, error = %e, status = e.status().as_u16(), "CONNECT refused");
        status(e.status())
    };
    let target = match parse_connect(&req) {
        Ok(t) => t,
        Err(e) => return refuse(e),
    };
    let Some(dst_wl) = ctx.state.local_workload_by_ip(target.ip()) else {
        return refuse(ConnectRefusal::UnknownTarget(target));
    };
    if target.ip() != reached.ip() {
        return refuse(ConnectRefusal::AddressMismatch {
            authority: target.ip(),
            reached: reached.ip(),
        });
    }
    if netns.is_some() && crate::inpod::PROXY_PORTS.contains(&target.port()) {
        return refuse(ConnectRefusal::Loop(target));
    }
    let source = ctx.transparent.then_some(peer.ip());
    let upstream = match dial(target, DialOpts { mark: ctx.mark, source, netns }).await {
        Ok(u) => u,
        Err(e) => return refuse(ConnectRefusal::Upstream(target, e.to_string())),
    };
    let src_wl = ctx.state.workload_by_ip(peer.ip());
    let labels = ConnLabels::new(Reporter::destination, SecurityPolicy::mutual_tls)
        .with_source(src_wl.as_deref(), Some(peer_id.to_string()))
        .with_destination(Some(&dst_wl), Some(ctx.state.identity_of(&dst_wl).to_string()));
    let rec = ConnRecord::open(&ctx, peer, target, labels);
    let upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(
        async move {
            let mut upstream = upstream;
            match upgrade.await {
                Ok(up) => {
                    let mut up = TokioIo::new(up);
                    let (rx, tx, r) = copy_both(&mut up, &mut upstream).await;
                    rec.close(rx, tx, r);
                }
                Err(e) => rec.close(0, 0, Err(format!("upgrade: {e}"))),
            }
        }
        .in_current_span(),
    );
    status(StatusCode::OK)
}

/// Inbound plaintext (15006): a connection redirected to a local workload, passed through as is.
pub async fn handle_plaintext(
    ctx: Arc<Ctx>,
    mut client: TcpStream,
    peer: SocketAddr,
    netns: Option<Arc<Netns>>,
) {
    let Some(dst) = destination(&client) else { return };
    let span = tracing::info_span!("inbound_plaintext", src = %peer, dst = %dst);
    async move {
        if ctx
            .own_addrs
            .iter()
            .any(|a| a.port() == dst.port() && (a.ip() == dst.ip() || a.ip().is_unspecified()))
            || (netns.is_some() && crate::inpod::PROXY_PORTS.contains(&dst.port()))
        {
            ctx.metrics.refuse("loop");
            tracing::warn!("refused: plaintext connection to the proxy's own listener would loop");
            return;
        }
        let Some(dst_wl) = ctx.state.local_workload_by_ip(dst.ip()) else {
            ctx.metrics.refuse("no_local_workload");
            tracing::warn!("refused: {} is not a workload on this node", dst.ip());
            return;
        };
        // No identity: the source workload is only what its address says.
        let labels = ConnLabels::new(Reporter::destination, SecurityPolicy::unknown)
            .with_source(ctx.state.workload_by_ip(peer.ip()).as_deref(), None)
            .with_destination(Some(&dst_wl), Some(ctx.state.identity_of(&dst_wl).to_string()));
        let rec = ConnRecord::open(&ctx, peer, dst, labels);
        let source = ctx.transparent.then_some(peer.ip());
        match dial(dst, DialOpts { mark: ctx.mark, source, netns: netns.as_deref() }).await {
            Ok(mut up) => {
                let (rx, tx, r) = copy_both(&mut client, &mut up).await;
                rec.close(rx, tx, r);
            }
            Err(e) => rec.close(0, 0, Err(format!("connect {dst}: {e}"))),
        }
    }
    .instrument(span)
    .await
}
