//! Inbound: HBONE (15008) — mutual TLS as the destination workload, then one HTTP/2 `CONNECT`
//! per tunnelled connection, answered 200 only once the upstream connection is up — and
//! plaintext passthrough (15006).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use h2::server::SendResponse;
use h2::RecvStream;
use http::{Request, Response, StatusCode};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tracing::Instrument;

use super::{drain_cut, relay, reset_on_close, ConnRecord, Copied, Ctx, Ends, Leg};
use crate::hbone::{server_builder, ConnectRefusal, H2Stream};
use crate::identity::Identity;
use crate::metrics::{ConnLabels, Reporter, SecurityPolicy};
use crate::net::netns::Netns;
use crate::net::socket::{destination, dial};
use crate::state::Workload;
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
    // Until its handshake is done the connection holds a place in the pending budget (per
    // source and in total: see `admission`); one over budget is refused, counted.
    let Some(pending) = ctx.pending.enter(peer.ip()) else {
        crate::log_limited!(ctx.peer_logs, ("hbone", "pending_saturated"), warn,
            src = %peer, "refused: every pending TLS handshake is being worked on (the pending budget is full)");
        return;
    };
    // A connection that never speaks is cheap to hold and the first to go when room is needed.
    tokio::select! {
        r = crate::net::socket::first_bytes(&tcp) => if !matches!(r, Ok(true)) {
            ctx.metrics.refuse("tls_peer_closed");
            tracing::debug!(src = %peer, "HBONE connection closed before its ClientHello");
            return;
        },
        // Counted by reason when it happened.
        _ = pending.evicted() => {
            tracing::debug!(src = %peer, "HBONE connection dropped before its ClientHello: evicted");
            return;
        }
        _ = tokio::time::sleep(ctx.limits.handshake_timeout) => {
            ctx.metrics.refuse("tls_timeout");
            tracing::debug!(src = %peer, "HBONE connection dropped: no ClientHello in time");
            return;
        }
    }
    serve_hbone_pending(ctx, tcp, peer, reached, netns, Some(pending)).await
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
    serve_hbone_pending(ctx, stream, peer, reached, netns, None).await
}

async fn serve_hbone_pending<S: Stream>(
    ctx: Arc<Ctx>,
    stream: S,
    peer: SocketAddr,
    reached: SocketAddr,
    netns: Option<Arc<Netns>>,
    pending: Option<super::Pending>,
) {
    let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let span = tracing::info_span!("inbound", id, src = %peer, dst = %reached);
    async move {
        if !crate::authz::wait_synced(&ctx.state, &ctx.metrics, &ctx.peer_logs, "hbone").await {
            return;
        }
        let Some(local) = ctx.state.local_workload_by_ip(reached.ip()) else {
            ctx.metrics.refuse("no_local_workload");
            crate::log_limited!(ctx.peer_logs, ("hbone", "no_local_workload"), warn,
                "refused: {} is not a workload on this node", reached.ip());
            return;
        };
        let local_id = ctx.state.identity_of(&local);
        let evicted = async {
            match &pending {
                Some(p) => p.evicted().await,
                None => std::future::pending().await,
            }
        };
        let peer_turn = pending.as_ref().map(|p| p.peer_turn());
        let accepted = tokio::select! {
            r = ctx.tls.accept_with(stream, &local_id, peer_turn) => r,
            _ = evicted => {
                tracing::debug!("handshake dropped: evicted while waiting on its peer, to make room");
                return;
            }
        };
        drop(pending);
        let (tls, peer_id) = match accepted {
            Ok(x) => x,
            Err(e) => {
                ctx.metrics.refuse(e.reason());
                crate::log_limited!(ctx.peer_logs, ("tls", e.reason()), warn,
                    error = %e, reason = e.reason(), "refused: TLS handshake with peer failed");
                return;
            }
        };
        tracing::debug!(peer = %peer_id, "mTLS established");
        // Until the socket is closed: a drain waits for this connection's GOAWAY and
        // close_notify.
        let _live = ctx.drain.hbone_connection();
        let peer_id = Arc::new(peer_id);
        let mut tls = tls;
        async {
            let preface = server_builder().handshake::<_, Bytes>(&mut tls);
            let mut conn = match tokio::time::timeout(ctx.limits.handshake_timeout, preface).await {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    let kind = ctx.metrics.h2_error("server", &e);
                    crate::log_limited!(ctx.peer_logs, ("h2", kind), info,
                        error = %e, kind, "HBONE connection ended by an HTTP/2 error");
                    return;
                }
                Err(_) => {
                    ctx.metrics.refuse("h2_preface_timeout");
                    crate::log_limited!(ctx.peer_logs, ("h2", "preface_timeout"), info,
                        "HBONE connection closed: no HTTP/2 preface in time");
                    return;
                }
            };
            let keepalive = crate::hbone::server::keepalive(conn.ping_pong());
            tokio::pin!(keepalive);
            let mut draining = false;
            loop {
                tokio::select! {
                    next = conn.accept() => match next {
                        Some(Ok((req, respond))) => {
                            let ctx = ctx.clone();
                            let peer_id = peer_id.clone();
                            let netns = netns.clone();
                            let span = tracing::Span::current();
                            tokio::spawn(async move {
                                serve_connect(ctx, req, respond, peer, reached, &peer_id, netns.as_deref(), span).await
                            });
                        }
                        Some(Err(e)) => {
                            let kind = ctx.metrics.h2_error("server", &e);
                            crate::log_limited!(ctx.peer_logs, ("h2", kind), info,
                                error = %e, kind, "HBONE connection ended by an HTTP/2 error");
                            break;
                        }
                        // Closed by the peer, or (draining) every stream has finished.
                        None => break,
                    },
                    why = &mut keepalive => {
                        crate::log_limited!(ctx.peer_logs, ("keepalive", why), info,
                            why, "HBONE connection closed: keepalive failed");
                        break;
                    }
                    _ = ctx.drain.signaled(), if !draining => {
                        // GOAWAY: no new streams; streams in flight finish, then h2 sends the
                        // final GOAWAY and shuts TLS down (close_notify), and `accept` ends.
                        draining = true;
                        conn.graceful_shutdown();
                    }
                    // The drain deadline passed: the streams were cut; close_notify below.
                    _ = ctx.drain.cut(), if draining => break,
                }
            }
        }
        .await;
        // h2 is done with the connection, or never started (a bad preface): end TLS with
        // close_notify, so that the peer does not see a truncation (an OpenSSL client also
        // drops a TLS 1.3 session that ended without it).
        let _ = tokio::time::timeout(Duration::from_secs(1), tls.shutdown()).await;
    }
    .instrument(span)
    .await
}

fn status(code: StatusCode) -> Response<()> {
    let mut r = Response::new(());
    *r.status_mut() = code;
    r
}

/// Answers one `CONNECT`: a refusal ends the stream with its status; an accepted one is answered
/// 200 once the upstream connection is up, then copied until either side ends. A side that ends
/// abnormally (reset, cut, revoked) is passed on as a reset: `RST_STREAM(CONNECT_ERROR)` toward
/// the peer, RST toward the app. Set-up runs in `span` (the HBONE connection's), the relay after
/// it outside (see `ConnRecord`).
#[allow(clippy::too_many_arguments)]
async fn serve_connect(
    ctx: Arc<Ctx>,
    req: Request<RecvStream>,
    respond: SendResponse<Bytes>,
    peer: SocketAddr,
    reached: SocketAddr,
    peer_id: &Identity,
    netns: Option<&Netns>,
    span: tracing::Span,
) {
    // Boxed: set-up is most of this future's size, and a task's future is copied whole when it
    // is spawned and when it completes.
    let ready = Box::pin(
        accept_connect(&ctx, req, respond, peer, reached, peer_id, netns).instrument(span),
    )
    .await;
    if let Some((mut tunnel, mut upstream, tracked, rec)) = ready {
        rec.finish(copy_until_revoked(&mut tunnel, &mut upstream, tracked, &ctx.drain).await);
    }
}

/// `serve_connect`'s checks, dial and answer: the two legs and their records when the CONNECT
/// was accepted.
async fn accept_connect(
    ctx: &Arc<Ctx>,
    req: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
    peer: SocketAddr,
    reached: SocketAddr,
    peer_id: &Identity,
    netns: Option<&Netns>,
) -> Option<(H2Stream, TcpStream, crate::proxy::Registered, ConnRecord)> {
    let mut answer = |code: StatusCode| {
        if let Err(e) = respond.send_response(status(code), true) {
            tracing::debug!(error = %e, "CONNECT answer not sent: stream gone");
        }
    };
    let refuse = |e: ConnectRefusal, answer: &mut dyn FnMut(StatusCode)| {
        ctx.metrics.refuse(e.reason());
        tracing::warn!(peer = %peer_id, error = %e, status = e.status().as_u16(), "CONNECT refused");
        answer(e.status())
    };
    let own_ports: &[u16] = if netns.is_some() { &crate::inpod::PROXY_PORTS } else { &[] };
    let accepted = match super::target::accept(&ctx.state, &req, reached, own_ports) {
        Ok(a) => a,
        Err(e) => {
            refuse(e, &mut answer);
            return None;
        }
    };
    let (target, dst_wl) = (accepted.authz_dst, accepted.workload.clone());
    let src_wl = ctx.state.workload_by_ip(peer.ip());
    let ends = || Ends::new(peer, reached).hbone(target).workloads(src_wl.as_ref(), Some(&dst_wl));
    let labels = ConnLabels::new(Reporter::destination, SecurityPolicy::mutual_tls)
        .with_source(src_wl.as_deref(), Some(peer_id.to_string()))
        .with_destination(Some(&dst_wl), Some(ctx.state.identity_of(&dst_wl).to_string()));
    // Registered before it is decided: a policy pushed from here on re-checks it, while it is
    // being dialled too.
    let tracked = ctx.conns.register(&dst_wl.uid, Some(peer_id), peer.ip(), target);
    // Authorization, before the app is dialled: a denial answers 401 on this stream only.
    if let Err(reason) = authorize(ctx, &dst_wl, Some(peer_id), peer.ip(), target) {
        ConnRecord::denied(ctx, ends(), labels, &reason);
        answer(StatusCode::UNAUTHORIZED);
        return None;
    }
    // An application tunnel inside a pod is dialled on loopback (it binds there, so nothing
    // reaches it but this proxy); the PROXY header carries the source.
    let (dial_to, source) = match (accepted.tunnel, netns) {
        (true, Some(_)) => {
            let lo = if accepted.upstream.is_ipv4() {
                std::net::IpAddr::from(std::net::Ipv4Addr::LOCALHOST)
            } else {
                std::net::IpAddr::from(std::net::Ipv6Addr::LOCALHOST)
            };
            (SocketAddr::new(lo, accepted.upstream.port()), None)
        }
        (true, None) => (accepted.upstream, None),
        (false, _) => (accepted.upstream, ctx.transparent.then_some(peer.ip())),
    };
    let mut upstream =
        match dial_unless_revoked(dial_to, ctx.dial_opts(source, netns), &tracked).await {
            Dialled::Up(u) => u,
            Dialled::Failed(e) => {
                refuse(ConnectRefusal::Upstream(dial_to, e.to_string()), &mut answer);
                return None;
            }
            Dialled::Revoked(reason) => {
                // Denied by a policy that arrived while the app was being dialled: the dial is
                // abandoned, the app never sees the connection.
                ConnRecord::denied(ctx, ends(), labels, &reason);
                answer(StatusCode::UNAUTHORIZED);
                return None;
            }
        };
    if let Some(dst) = accepted.proxy_destination {
        let sent = match super::target::proxy_header(peer, dst, Some(peer_id)) {
            Ok(h) => upstream.write_all(&h).await,
            Err(e) => Err(e),
        };
        if let Err(e) = sent {
            reset_on_close(&upstream);
            refuse(ConnectRefusal::Upstream(dial_to, format!("PROXY header: {e}")), &mut answer);
            return None;
        }
    }
    let rec = ConnRecord::open(ctx, ends(), labels);
    let send = match respond.send_response(status(StatusCode::OK), false) {
        Ok(s) => s,
        Err(e) => {
            reset_on_close(&upstream);
            rec.close(0, 0, Err(format!("CONNECT answer: {e}")));
            return None;
        }
    };
    Some((H2Stream::new(send, req.into_body()), upstream, tracked, rec))
}

/// How a dial toward the app ended.
enum Dialled {
    Up(tokio::net::TcpStream),
    Failed(std::io::Error),
    /// The connection's authorization was revoked first (the reason).
    Revoked(String),
}

/// Dials the app unless the tracked connection is revoked first (a policy pushed during the
/// dial): then the half-open socket is dropped and the app never sees the connection.
async fn dial_unless_revoked(
    target: SocketAddr,
    opts: crate::net::socket::DialOpts<'_>,
    tracked: &crate::proxy::Registered,
) -> Dialled {
    let mut closed = tracked.closed.clone();
    tokio::select! {
        biased;
        r = closed.wait_for(|c| c.is_some()) => {
            Dialled::Revoked(r.map(|c| c.clone().unwrap_or_default()).unwrap_or_default())
        }
        r = dial(target, opts) => match r {
            Ok(u) => match tracked.closed.borrow().clone() {
                Some(reason) => {
                    reset_on_close(&u);
                    Dialled::Revoked(reason)
                }
                None => Dialled::Up(u),
            },
            Err(e) => Dialled::Failed(e),
        },
    }
}

/// Checks a connection to local workload `dst_wl` against the authorization policies that apply
/// to it. A denial is logged with its reason, which is returned.
fn authorize(
    ctx: &Ctx,
    dst_wl: &Workload,
    src: Option<&Identity>,
    src_ip: std::net::IpAddr,
    dst: SocketAddr,
) -> Result<(), String> {
    let principal = src.map(crate::authz::principal_of);
    let c = crate::authz::Conn {
        src,
        principal: principal.as_deref(),
        src_ip,
        dst_ip: dst.ip(),
        dst_port: dst.port(),
    };
    let d = crate::authz::decide(&ctx.state, dst_wl, &c, None);
    if d.allowed() {
        return Ok(());
    }
    let reason = d.reason();
    tracing::warn!(src = %src_ip, dst = %dst, identity = ?src.map(|i| i.to_string()),
        reason = %reason, "connection denied by authorization policy");
    Err(reason)
}

/// Relays both ways until done, until the registry says the connection must close (its
/// authorization was revoked), or until the drain deadline cuts it; a cut resets both legs.
async fn copy_until_revoked<A: Leg, B: Leg>(
    a: &mut A,
    b: &mut B,
    mut tracked: crate::proxy::Registered,
    drain: &super::Drain,
) -> Copied {
    let revoked = async {
        let r =
            tracked.closed.wait_for(|c| c.is_some()).await.map(|r| r.clone().unwrap_or_default());
        match r {
            Ok(reason) => format!("closed: authorization revoked ({reason})"),
            Err(_) => std::future::pending().await,
        }
    };
    let stop = Box::pin(async {
        tokio::select! {
            r = revoked => r,
            r = drain_cut(drain) => r,
        }
    });
    relay(a, b, stop).await
}

/// Inbound plaintext (15006): a connection redirected to a local workload, passed through as is.
pub async fn handle_plaintext(
    ctx: Arc<Ctx>,
    client: TcpStream,
    peer: SocketAddr,
    netns: Option<Arc<Netns>>,
) {
    let Some(dst) = destination(&client) else { return };
    let span = tracing::info_span!("inbound_plaintext", src = %peer, dst = %dst);
    // Set-up runs in the connection's span; the relay after it runs outside (see `ConnRecord`).
    let drain = ctx.drain.clone();
    let ready = Box::pin(
        async move {
            if ctx
                .own_addrs
                .iter()
                .any(|a| a.port() == dst.port() && (a.ip() == dst.ip() || a.ip().is_unspecified()))
                || (netns.is_some() && crate::inpod::PROXY_PORTS.contains(&dst.port()))
            {
                ctx.metrics.refuse("loop");
                crate::log_limited!(
                    ctx.peer_logs,
                    ("plaintext", "loop"),
                    warn,
                    "refused: plaintext connection to the proxy's own listener would loop"
                );
                return None;
            }
            if !crate::authz::wait_synced(&ctx.state, &ctx.metrics, &ctx.peer_logs, "plaintext")
                .await
            {
                return None;
            }
            let Some(dst_wl) = ctx.state.local_workload_by_ip(dst.ip()) else {
                ctx.metrics.refuse("no_local_workload");
                crate::log_limited!(
                    ctx.peer_logs,
                    ("plaintext", "no_local_workload"),
                    warn,
                    "refused: {} is not a workload on this node",
                    dst.ip()
                );
                return None;
            };
            // No identity: the source workload is only what its address says.
            let src_wl = ctx.state.workload_by_ip(peer.ip());
            let ends = || Ends::new(peer, dst).workloads(src_wl.as_ref(), Some(&dst_wl));
            let labels = ConnLabels::new(Reporter::destination, SecurityPolicy::unknown)
                .with_source(src_wl.as_deref(), None)
                .with_destination(Some(&dst_wl), Some(ctx.state.identity_of(&dst_wl).to_string()));
            // Registered before it is decided (see `accept_connect`).
            let tracked = ctx.conns.register(&dst_wl.uid, None, peer.ip(), dst);
            // No verified identity: only address and port fields can allow it.
            if let Err(reason) = authorize(&ctx, &dst_wl, None, peer.ip(), dst) {
                ConnRecord::denied(&ctx, ends(), labels, &reason);
                // Reset, not FIN: the client must not mistake a refusal for an empty answer.
                reset_on_close(&client);
                return None;
            }
            let source = ctx.transparent.then_some(peer.ip());
            match dial_unless_revoked(dst, ctx.dial_opts(source, netns.as_deref()), &tracked).await
            {
                Dialled::Up(up) => {
                    Some((client, up, tracked, ConnRecord::open(&ctx, ends(), labels)))
                }
                Dialled::Failed(e) => {
                    reset_on_close(&client);
                    let rec = ConnRecord::open(&ctx, ends(), labels);
                    rec.close(0, 0, Err(format!("connect {dst}: {e}")));
                    None
                }
                Dialled::Revoked(reason) => {
                    ConnRecord::denied(&ctx, ends(), labels, &reason);
                    reset_on_close(&client);
                    None
                }
            }
        }
        .instrument(span),
    )
    .await;
    if let Some((mut client, mut up, tracked, rec)) = ready {
        rec.finish(copy_until_revoked(&mut client, &mut up, tracked, &drain).await);
    }
}
