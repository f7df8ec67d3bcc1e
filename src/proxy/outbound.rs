//! Outbound (15001): a local workload's connection, captured by redirect, goes to its original
//! destination — over HBONE to the destination node for mesh workloads, directly otherwise.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpStream;
use tracing::Instrument;

use super::{drain_cut, relay, reset_on_close, ConnRecord, Ctx, Ends};
use crate::hbone::HboneError;
use crate::hbone::{ConnectHeaders, PoolKey, Tunnel};
use crate::metrics::{ConnLabels, OnDemandDnsLabels, Reporter, SecurityPolicy};
use crate::net::netns::Netns;
use crate::net::socket::dial;
use crate::state::Protocol;

static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// How long a connection from a pod enrolled before its workload arrived waits for it.
pub const PENDING_POD_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// `netns`: the pod whose listener accepted (in-pod mode); sockets toward the network are opened
/// there so they leave with the pod's address. `pod_uid`: that pod's workload, which is then the
/// source identity whatever source address the packets carry (a pod that adds a neighbour's IP
/// must not get the neighbour's certificate).
pub async fn handle(
    ctx: Arc<Ctx>,
    client: TcpStream,
    peer: SocketAddr,
    netns: Option<Arc<Netns>>,
    pod_uid: Option<Arc<str>>,
) {
    let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let Some(addrs) = crate::net::socket::addresses(&client) else { return };
    let (redirected, dst) = (addrs.redirected(), addrs.destination());
    let span = tracing::info_span!("outbound", id, src = %peer, dst = %dst);
    // Set-up runs in the connection's span; the relay after it runs outside (see `ConnRecord`).
    // Boxed: set-up is most of this future's size (pool, TLS, dial), and a task's future is
    // copied whole when it is spawned, moved to a worker and completed.
    let ctx2 = ctx.clone();
    let ready = Box::pin(async move {
        if !crate::authz::wait_synced(&ctx.state, &ctx.metrics, &ctx.peer_logs, "outbound").await {
            return None;
        }
        let src_wl = match &pod_uid {
            Some(uid) => {
                let w = match ctx.state.workload_by_uid(uid) {
                    Some(w) => Some(w),
                    // Enrolled before its workload arrived: held until it does, within a bound.
                    None => {
                        tracing::debug!(pod = %uid, "source pod's workload not in the mesh state yet: waiting");
                        let w = ctx.state.wait_workload(uid, PENDING_POD_WAIT).await;
                        if w.is_none() {
                            ctx.metrics.refuse("pod_workload_pending");
                            tracing::warn!(pod = %uid, waited = ?PENDING_POD_WAIT,
                                "refused: the source pod's workload is still not in the mesh state");
                            reset_on_close(&client);
                            return None;
                        }
                        w
                    }
                };
                if let Some(w) = w.as_ref().filter(|w| !w.ips.contains(&peer.ip())) {
                    tracing::warn!(pod = %w.uid, source = %peer.ip(), ips = ?w.ips,
                        "source address is not the pod's own: the pod's identity is used");
                }
                w
            }
            None => ctx.state.local_workload_by_ip(peer.ip()),
        };
        let upstream = match ctx.state.resolve(dst, src_wl.as_deref(), peer.ip()) {
            Ok(u) => u,
            Err(e) => {
                // Never sent direct: a destination whose waypoint cannot be resolved, or that is
                // held fail-closed, is refused like one with no route.
                ctx.metrics.refuse(e.reason());
                tracing::warn!(error = %e, reason = e.reason(), "refused: no route for destination");
                reset_on_close(&client);
                return None;
            }
        };
        // A redirected connection to the proxy's own ports, or a passthrough to them, is a loop.
        let is_own = ctx
            .own_addrs
            .iter()
            .any(|a| *a == dst || (a.ip().is_unspecified() && a.port() == dst.port()));
        // In a pod, a connection that reached 15001 without being redirected was dialled to the
        // proxy's port itself (e.g. 127.0.0.1:15001): passing it through would dial it again.
        let direct_in_pod = netns.is_some() && redirected.is_none();
        if direct_in_pod || (is_own && (redirected.is_some() || upstream.is_none())) {
            ctx.metrics.refuse("loop");
            tracing::warn!("refused: connection to the proxy's own listener would loop");
            return None;
        }
        let Some(upstream) = upstream else {
            // Not a mesh destination: pass through unchanged.
            let labels = ConnLabels::new(Reporter::source, SecurityPolicy::unknown).with_source(
                src_wl.as_deref(),
                src_wl.as_ref().map(|w| ctx.state.identity_of(w).to_string()),
            );
            let ends = Ends::new(peer, dst).workloads(src_wl.as_ref(), None);
            let rec = ConnRecord::open(&ctx, ends, labels);
            return match dial(dst, ctx.dial_opts(None, netns.as_deref())).await {
                Ok(up) => Some(Ready::Direct(client, up, rec)),
                Err(e) => {
                    reset_on_close(&client);
                    rec.close(0, 0, Err(format!("connect {dst}: {e}")));
                    None
                }
            };
        };
        let Some(src_wl) = src_wl else {
            ctx.metrics.refuse("unknown_source");
            tracing::warn!(source = %peer.ip(), "refused: source is not a workload on this node");
            return None;
        };
        let src_id = ctx.state.identity_of(&src_wl);
        let mut upstream = upstream;
        if let Some(host) = upstream.resolve.clone() {
            // A hostname workload: its address now (cached for the records' TTL).
            let labels = OnDemandDnsLabels::new(&src_wl, src_id.to_string(), &host);
            ctx.metrics.on_demand_dns.get_or_create(&labels).inc();
            match ctx.upstream.lookup_ip(&host).await {
                Ok(ips) => match pick_family(&ips, dst) {
                    Some(ip) => upstream.resolved(ip),
                    None => {
                        ctx.metrics.refuse("dns_no_addresses");
                        tracing::warn!(workload = %upstream.workload.uid, hostname = %host,
                            "refused: the workload's hostname resolved to no address");
                        reset_on_close(&client);
                        return None;
                    }
                },
                Err(e) => {
                    ctx.metrics.refuse("dns_resolution_failed");
                    tracing::warn!(workload = %upstream.workload.uid, hostname = %host, error = %e,
                        "refused: the workload's hostname does not resolve");
                    reset_on_close(&client);
                    return None;
                }
            }
        }
        let dst_id = upstream.identity.clone();
        let (policy, hop) = match upstream.protocol {
            Protocol::Hbone => (SecurityPolicy::mutual_tls, upstream.hbone_addr),
            Protocol::Tcp => (SecurityPolicy::unknown, upstream.target),
        };
        // Through a waypoint, the waypoint is the destination reported; the service stays the
        // intended one (as ztunnel reports them).
        let labels = ConnLabels::new(Reporter::source, policy)
            .with_source(Some(&src_wl), Some(src_id.to_string()))
            .with_destination(Some(&upstream.workload), Some(dst_id.to_string()))
            .with_service(upstream.service.as_deref());
        let ends = Ends::new(peer, hop).workloads(Some(&src_wl), Some(&upstream.workload));
        let ends = match upstream.protocol {
            Protocol::Hbone => ends.hbone(upstream.target),
            Protocol::Tcp => ends,
        };
        let rec = ConnRecord::open(&ctx, ends, labels);
        match upstream.protocol {
            Protocol::Tcp => {
                match dial(upstream.target, ctx.dial_opts(None, netns.as_deref())).await {
                    Ok(up) => Some(Ready::Direct(client, up, rec)),
                    Err(e) => {
                        reset_on_close(&client);
                        rec.close(0, 0, Err(format!("connect {}: {e}", upstream.target)));
                        None
                    }
                }
            }
            Protocol::Hbone => {
                // The pod's own pool (in-pod mode: the pod whose listener accepted, whatever
                // source address it used).
                let key = PoolKey {
                    src_id,
                    src_pod: src_wl.uid.as_str().into(),
                    dst_id,
                    dst_sans: upstream.sans.clone(),
                    dst: hop,
                    src_ip: peer.ip(),
                };
                let headers = ConnectHeaders {
                    source: peer,
                    baggage: crate::hbone::baggage(&src_wl),
                    host: upstream.service.as_ref().map(|s| s.hostname()),
                    network: upstream.double.as_ref().map(|_| src_wl.network.clone()),
                };
                let opened = match &upstream.double {
                    // Another network: through its gateway, mTLS with the destination inside.
                    Some(d) => {
                        ctx.pool
                            .double(&key, &d.authority, &headers, &d.identities, netns.as_deref())
                            .await
                    }
                    None => {
                        let target = upstream.target.to_string();
                        ctx.pool.tunnel(&key, &target, &headers, netns.as_deref()).await
                    }
                };
                match opened {
                    Ok(tunnel) => Some(Ready::Tunnel(client, tunnel, rec)),
                    Err(HboneError::Status(http::StatusCode::UNAUTHORIZED)) => {
                        reset_on_close(&client);
                        ctx.metrics.refuse("denied_by_destination");
                        rec.close(
                            0,
                            0,
                            Err(format!(
                                "HBONE to {hop} for {}: denied by the destination's \
                                 authorization policy (CONNECT answered 401)",
                                upstream.target
                            )),
                        );
                        None
                    }
                    Err(e) => {
                        reset_on_close(&client);
                        if let HboneError::Tls(t) = &e {
                            ctx.metrics.refuse(t.reason());
                        }
                        rec.close(
                            0,
                            0,
                            Err(format!("HBONE to {hop} for {}: {e}", upstream.target)),
                        );
                        None
                    }
                }
            }
        }
    }
    .instrument(span))
    .await;
    match ready {
        Some(Ready::Direct(mut client, mut up, rec)) => {
            rec.finish(relay(&mut client, &mut up, drain_cut(&ctx2.drain)).await)
        }
        Some(Ready::Tunnel(client, tunnel, rec)) => relay_beside(&ctx2, client, tunnel, rec).await,
        None => {}
    }
}

/// One of `ips`, in the family of the address dialled when there is one (as ztunnel picks),
/// taken in turn.
fn pick_family(ips: &[std::net::IpAddr], dst: SocketAddr) -> Option<std::net::IpAddr> {
    static TURN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let same: Vec<_> = ips.iter().filter(|ip| ip.is_ipv4() == dst.is_ipv4()).collect();
    let from = if same.is_empty() { ips.iter().collect() } else { same };
    let turn = TURN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    from.get(turn % from.len().max(1)).map(|ip| **ip)
}

/// A connection set up and ready to relay.
enum Ready {
    /// To its destination directly (not a mesh destination, or one without HBONE).
    Direct(TcpStream, TcpStream, ConnRecord),
    /// Through an HBONE tunnel.
    Tunnel(TcpStream, Tunnel, ConnRecord),
}

/// Relays `client` through `tunnel` on the worker thread that runs the tunnel's HBONE
/// connection: when that is another worker than this one, the client socket and the record move
/// there, so that the relay and the h2 task it feeds never wake each other across threads, and
/// this task ends (waiting for the moved one would cost a wake-up of this thread at its end).
async fn relay_beside(ctx: &Arc<Ctx>, client: TcpStream, tunnel: Tunnel, rec: ConnRecord) {
    let home = tunnel.home().filter(|h| Some(*h) != crate::net::workers::current());
    if home.is_none() {
        let (mut client, mut tunnel) = (client, tunnel);
        return rec.finish(relay(&mut client, &mut tunnel, drain_cut(&ctx.drain)).await);
    }
    let c = ctx.clone();
    // Detached: the record (with its drain guard) and both legs went with it.
    drop(ctx.workers.spawn_moved(home, client, move |client| async move {
        let mut tunnel = tunnel;
        match client {
            Ok(mut client) => {
                rec.finish(relay(&mut client, &mut tunnel, drain_cut(&c.drain)).await)
            }
            Err(e) => {
                tunnel.reset();
                rec.close(0, 0, Err(format!("moving the connection to a worker: {e}")))
            }
        }
    }));
}
