//! Two node proxies configured only with a control-plane address, token and root (no workload
//! file, no CA key) against a control plane of our own (tests/common/cp.rs): workloads pushed
//! live, NACK of a malformed resource, readiness after both types, CA outage and renewal under
//! traffic, a control-plane restart with `initial_resource_versions`, and a refused token.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::cp::{self, echo_ok, from, node_config, ControlPlane, Seen};
use common::{ip, metric, start_echo, wait_for};
use mbtunnel::app::Running;
use mbtunnel::identity::Identity;
use mbtunnel::xds::{ADDRESS_TYPE, AUTHORIZATION_TYPE};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpSocket;

fn id(sa: &str) -> Identity {
    format!("spiffe://cluster.local/ns/demo/sa/{sa}").parse().unwrap()
}

fn count(cp: &ControlPlane, f: impl Fn(&Seen) -> bool) -> usize {
    cp.seen().iter().filter(|s| f(s)).count()
}

async fn wait_ready(r: &Running) -> bool {
    r.wait_ready(Duration::from_secs(20)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_proxies_from_the_control_plane_alone() {
    let net = 41;
    let cp = ControlPlane::start().await;
    let never = common::temp_dir("xds-never-ca");
    cp.upsert(
        ADDRESS_TYPE,
        vec![
            cp::workload("c1", "client", "client", ip(net, 2), "node-a", &[]),
            cp::workload(
                "e1",
                "echo",
                "echo",
                ip(net, 3),
                "node-b",
                &[("demo/echo.demo.svc.cluster.local", 8080)],
            ),
            cp::service("echo", ip(net, 50), 8080),
        ],
    );
    let echo_peers = start_echo(SocketAddr::new(ip(net, 3), 8080)).await;
    // Readiness waits for both types: the policies are held back at first.
    cp.shared.hold_policies.store(true, std::sync::atomic::Ordering::SeqCst);
    let b = mbtunnel::app::start(node_config(net, "node-b", &cp, cp::TOKEN, &never), None)
        .await
        .expect("start B");
    let a = mbtunnel::app::start(node_config(net, "node-a", &cp, cp::TOKEN, &never), None)
        .await
        .expect("start A");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!a.is_ready() && !b.is_ready(), "ready before the Authorization type arrived");
    assert!(
        count(&cp, |s| matches!(s, Seen::Initial { has_node: true, .. })) >= 4,
        "{:?}",
        cp.seen()
    );
    cp.release_policies();
    assert!(wait_ready(&a).await && wait_ready(&b).await, "not ready: {:?}", cp.seen());
    assert!(!never.exists(), "the proxy must not create or use a CA directory");

    // Traffic over HBONE with certificates from the control plane's CA (leaf + intermediate).
    assert!(echo_ok(net, 2).await, "client → echo through A and B");
    assert_eq!(
        echo_peers.lock().unwrap().last().unwrap().ip(),
        ip(net, 2),
        "the app sees the client pod"
    );
    let echo_cert = b.store.current(&id("echo")).expect("B holds echo's certificate");
    assert_eq!(echo_cert.chain_der.len(), 1, "the intermediate is kept and served");
    assert!(!b.store.source().holds_ca_key());
    assert!(
        count(
            &cp,
            |s| matches!(s, Seen::Csr { san, impersonated } if san == impersonated && san.ends_with("/sa/echo"))
        ) >= 1
    );
    let bm = b.metrics_text();
    assert!(
        metric(
            &bm,
            "istio_tcp_connections_opened_total",
            &["spiffe://cluster.local/ns/demo/sa/client"]
        )
        .unwrap_or(0.0)
            >= 1.0,
        "{bm}"
    );

    // Istio's labels, filled from the workload and service state as ztunnel fills them.
    let am = a.metrics_text();
    let want = [
        "reporter=\"source\"",
        "source_workload_namespace=\"demo\"",
        "source_canonical_service=\"client\"",
        // Empty in the xDS workload: `unknown`, as ztunnel reports it.
        "source_canonical_revision=\"unknown\"",
        "destination_service=\"echo.demo.svc.cluster.local\"",
        "destination_service_namespace=\"demo\"",
        "destination_service_name=\"echo\"",
        "destination_canonical_service=\"echo\"",
        "destination_cluster=\"unknown\"",
        "source_workload=\"client\"",
        "request_protocol=\"tcp\"",
    ];
    assert!(metric(&am, "istio_tcp_connections_opened_total", &want).unwrap_or(0.0) >= 1.0, "{am}");
    // A new pod on node A, pushed live: its identity gets a certificate and its traffic flows.
    assert!(!echo_ok(net, 6).await, "an unknown source is refused");
    cp.upsert(
        ADDRESS_TYPE,
        vec![cp::workload("c2", "client2", "client2", ip(net, 6), "node-a", &[])],
    );
    assert!(
        wait_for(|| a.store.current(&id("client2")).is_some()).await,
        "no certificate for the new pod"
    );
    assert!(echo_ok(net, 6).await, "new pod reachable");
    let bm = b.metrics_text();
    assert!(
        metric(&bm, "istio_tcp_connections_opened_total", &["sa/client2"]).unwrap_or(0.0) >= 1.0,
        "{bm}"
    );
    // ... and removed: refused again, its certificate forgotten.
    cp.remove(ADDRESS_TYPE, &["c2"], true);
    assert!(
        wait_for(|| a.store.current(&id("client2")).is_none()).await,
        "certificate kept after removal"
    );
    assert!(!echo_ok(net, 6).await, "a removed pod is not served");

    // NACK: a malformed resource (a 3-byte IP) beside a good one; the good one applies.
    let (_, mut bad) = cp::workload("bad", "bad", "bad", ip(net, 9), "node-a", &[]);
    {
        use prost::Message;
        let mut a = mbtunnel::proto::workload::Address::decode(&bad[..]).unwrap();
        if let Some(mbtunnel::proto::workload::address::Type::Workload(w)) = &mut a.r#type {
            w.addresses = vec![vec![10, 0, 0]];
        }
        bad = a.encode_to_vec();
    }
    cp.upsert(
        ADDRESS_TYPE,
        vec![
            ("bad".into(), bad),
            cp::workload("c3", "client3", "client3", ip(net, 7), "node-a", &[]),
        ],
    );
    assert!(wait_for(|| count(&cp, |s| matches!(s, Seen::Nack { message, .. } if message.contains("bad:") && message.contains("3 bytes"))) > 0).await, "{:?}", cp.seen());
    assert!(
        wait_for(|| a.ctx.state.workload_by_uid("c3").is_some()).await,
        "the good resource of a NACKed response applies"
    );
    assert!(a.ctx.state.workload_by_uid("bad").is_none());
    let am = a.metrics_text();
    assert!(metric(&am, "mbtunnel_xds_messages_total", &["nack"]).unwrap_or(0.0) >= 1.0, "{am}");
    assert_eq!(metric(&am, "mbtunnel_xds_connection_state", &[]), Some(1.0), "{am}");

    // CA outage: renewal fails, traffic keeps flowing on the current certificate; then renewal
    // through the CA under traffic, on a long-lived connection.
    let long = from(net, 2).await;
    let (mut r, mut w) = long.into_split();
    cp.shared.ca_down.store(true, std::sync::atomic::Ordering::SeqCst);
    let before = a.store.current(&id("client")).unwrap().serial.clone();
    assert!(a.store.renew(&id("client")).await.is_err(), "renewal must fail while the CA is down");
    assert_eq!(a.store.current(&id("client")).unwrap().serial, before, "current certificate kept");
    assert!(echo_ok(net, 2).await, "traffic continues through a CA outage");
    cp.shared.ca_down.store(false, std::sync::atomic::Ordering::SeqCst);
    let after =
        a.store.renew(&id("client")).await.expect("renewal after the outage").serial.clone();
    assert_ne!(before, after);
    w.write_all(b"still-here").await.unwrap();
    let mut buf = [0u8; 10];
    r.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"still-here", "a live connection survives the renewal");
    drop((r, w));

    // Control-plane restart: the stream breaks, the proxies keep serving; a workload removed
    // meanwhile is removed on reconnect thanks to initial_resource_versions.
    let streams_before = a.xds.as_ref().unwrap().status().streams_opened;
    cp.set_down(true);
    assert!(wait_for(|| !a.xds.as_ref().unwrap().status().connected).await);
    cp.remove(ADDRESS_TYPE, &["c3"], false);
    assert!(echo_ok(net, 2).await, "traffic continues while the control plane is down");
    assert!(a.is_ready(), "readiness holds through a control-plane outage");
    cp.set_down(false);
    for _ in 0..200 {
        if a.xds.as_ref().unwrap().status().streams_opened > streams_before
            && a.ctx.state.workload_by_uid("c3").is_none()
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(a.ctx.state.workload_by_uid("c3").is_none(), "removal during the outage not applied");
    assert!(cp.seen().iter().any(|s| matches!(s, Seen::Initial { type_url, versions, .. }
        if type_url == ADDRESS_TYPE && versions.contains_key("c3") && versions.contains_key("e1") && !versions.contains_key("bad"))),
        "reconnect did not announce the versions held: {:?}", cp.seen());
    assert!(echo_ok(net, 2).await, "traffic after the control plane returned");
    let am = a.metrics_text();
    assert!(metric(&am, "mbtunnel_xds_reconnects_total", &[]).unwrap_or(0.0) >= 1.0, "{am}");
    assert!(
        count(&cp, |s| matches!(s, Seen::Ack { type_url, .. } if type_url == AUTHORIZATION_TYPE))
            >= 2
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_token_is_reported_and_never_ready() {
    let net = 42;
    let cp = ControlPlane::start().await;
    let never = common::temp_dir("xds-never-ca2");
    let a = mbtunnel::app::start(node_config(net, "node-a", &cp, "wrong-token", &never), None)
        .await
        .expect("start");
    assert!(
        wait_for(|| count(&cp, |s| matches!(s, Seen::Unauthenticated)) >= 2).await,
        "no retry after Unauthenticated"
    );
    assert!(!a.is_ready());
    let st = a.xds.as_ref().unwrap().status();
    assert!(st.last_error.as_deref().unwrap_or_default().contains("Unauthenticated"), "{st:?}");
    let am = a.metrics_text();
    assert_eq!(metric(&am, "mbtunnel_xds_connection_state", &[]), Some(0.0), "{am}");
    a.shutdown().await;
}

/// In-pod mode binds a pod's listeners to its workload: a connection accepted for pod `c1` gets
/// c1's identity even when it comes from another local workload's address (a pod that adds its
/// neighbour's IP must not get the neighbour's certificate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pods_listener_speaks_for_that_pod_whatever_the_source_address() {
    let net = 43;
    let cp = ControlPlane::start().await;
    let never = common::temp_dir("xds-never-ca3");
    cp.upsert(
        ADDRESS_TYPE,
        vec![
            cp::workload("c1", "client", "client", ip(net, 2), "node-a", &[]),
            cp::workload("v1", "victim", "victim", ip(net, 8), "node-a", &[]),
            cp::workload(
                "e1",
                "echo",
                "echo",
                ip(net, 3),
                "node-b",
                &[
                    ("demo/echo.demo.svc.cluster.local", 8080),
                    ("demo/echo2.demo.svc.cluster.local", 8080),
                ],
            ),
            cp::service("echo", ip(net, 50), 8080),
            cp::service("echo2", ip(net, 60), 8080),
        ],
    );
    let _peers = start_echo(SocketAddr::new(ip(net, 3), 8080)).await;
    let (a, b) = cp::start_pair(net, &cp, &never).await;
    // A listener standing for pod c1 (as in-pod mode opens one per pod), reached from v1's IP.
    let l = tokio::net::TcpListener::bind(SocketAddr::new(ip(net, 60), 8080)).await.unwrap();
    let ctx = a.ctx.clone();
    tokio::spawn(async move {
        let (s, peer) = l.accept().await.unwrap();
        mbtunnel::proxy::outbound::handle(ctx, s, peer, None, Some(std::sync::Arc::from("c1")))
            .await
    });
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::new(ip(net, 8), 0)).unwrap();
    let mut c = s.connect(SocketAddr::new(ip(net, 60), 8080)).await.unwrap();
    c.write_all(b"whoami").await.unwrap();
    let mut buf = [0u8; 6];
    c.read_exact(&mut buf).await.unwrap();
    drop(c);
    let bm = b.metrics_text();
    assert!(
        metric(
            &bm,
            "istio_tcp_connections_opened_total",
            &["source_principal=\"spiffe://cluster.local/ns/demo/sa/client\""]
        )
        .unwrap_or(0.0)
            >= 1.0,
        "{bm}"
    );
    assert!(!bm.contains("sa/victim"), "the neighbour's identity was used: {bm}");
    a.shutdown().await;
    b.shutdown().await;
}

/// A pooled HBONE connection belongs to one pod: a second pod of the same service account that
/// sends from the first pod's address gets a connection of its own, not the first pod's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_connections_belong_to_a_pod_not_to_a_source_address() {
    let net = 48;
    let cp = ControlPlane::start().await;
    let never = common::temp_dir("xds-never-ca48");
    cp.upsert(
        ADDRESS_TYPE,
        vec![
            cp::workload("c1", "client", "client", ip(net, 2), "node-a", &[]),
            cp::workload("c2", "client2", "client", ip(net, 9), "node-a", &[]),
            cp::workload(
                "e1",
                "echo",
                "echo",
                ip(net, 3),
                "node-b",
                &[
                    ("demo/echo.demo.svc.cluster.local", 8080),
                    ("demo/echo2.demo.svc.cluster.local", 8080),
                    ("demo/echo3.demo.svc.cluster.local", 8080),
                ],
            ),
            cp::service("echo", ip(net, 50), 8080),
            cp::service("echo2", ip(net, 60), 8080),
            cp::service("echo3", ip(net, 70), 8080),
        ],
    );
    let _peers = start_echo(SocketAddr::new(ip(net, 3), 8080)).await;
    let (a, b) = cp::start_pair(net, &cp, &never).await;
    // Listeners standing for pods c1 and c2 (as in-pod mode opens one per pod).
    for (pod, vip) in [("c1", 60u8), ("c2", 70)] {
        let l = tokio::net::TcpListener::bind(SocketAddr::new(ip(net, vip), 8080)).await.unwrap();
        let ctx = a.ctx.clone();
        tokio::spawn(async move {
            loop {
                let Ok((s, _)) = l.accept().await else { return };
                let peer = s.peer_addr().unwrap();
                let ctx = ctx.clone();
                tokio::spawn(mbtunnel::proxy::outbound::handle(
                    ctx,
                    s,
                    peer,
                    None,
                    Some(std::sync::Arc::from(pod)),
                ));
            }
        });
    }
    // Both send from c1's address.
    let round = |vip: u8| async move {
        let s = TcpSocket::new_v4().unwrap();
        s.bind(SocketAddr::new(ip(net, 2), 0)).unwrap();
        s.connect(SocketAddr::new(ip(net, vip), 8080)).await.unwrap()
    };
    let mut c1 = round(60).await;
    c1.write_all(b"one").await.unwrap();
    let mut buf = [0u8; 3];
    c1.read_exact(&mut buf).await.unwrap();
    assert_eq!(a.ctx.pool.len(), 1);
    let mut c2 = round(70).await;
    c2.write_all(b"two").await.unwrap();
    c2.read_exact(&mut buf).await.unwrap();
    assert_eq!(a.ctx.pool.len(), 2, "pod c2 rode pod c1's pooled connection");
    a.shutdown().await;
    b.shutdown().await;
}

/// `cp::policy` with a source block of /33 added to its match: a version the proxy refuses.
fn refused(p: (String, Vec<u8>)) -> (String, Vec<u8>) {
    use mbtunnel::proto::security as pb;
    use prost::Message;
    let mut a = pb::Authorization::decode(&p.1[..]).unwrap();
    a.rules[0].clauses[0].matches[0]
        .source_ips
        .push(pb::Address { address: vec![10, 0, 0, 0], length: 33 });
    (p.0, a.encode_to_vec())
}

async fn nacked(cp: &ControlPlane, name: &str) -> bool {
    let want = format!("{name}:");
    wait_for(|| {
        count(cp, |s| matches!(s, Seen::Nack { message, .. } if message.contains(&want))) > 0
    })
    .await
}

/// A refused policy never widens access: a refused new version of a DENY still denies (now
/// everyone in its namespace), and a refused only-ALLOW allows nobody, until a good version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_policy_fails_closed() {
    let net = 45;
    let cp = ControlPlane::start().await;
    let never = common::temp_dir("xds-never-ca4");
    cp.upsert(
        ADDRESS_TYPE,
        vec![
            cp::workload("c1", "client", "client", ip(net, 2), "node-a", &[]),
            cp::workload(
                "e1",
                "echo",
                "echo",
                ip(net, 3),
                "node-b",
                &[("demo/echo.demo.svc.cluster.local", 8080)],
            ),
            cp::service("echo", ip(net, 50), 8080),
        ],
    );
    let _peers = start_echo(SocketAddr::new(ip(net, 3), 8080)).await;
    let (a, b) = cp::start_pair(net, &cp, &never).await;
    assert!(echo_ok(net, 2).await, "no policy: allowed");
    // A DENY of another identity: the client still passes.
    let deny = || cp::policy("d", "demo", true, &["cluster.local/ns/demo/sa/intruder"], false);
    cp.upsert(AUTHORIZATION_TYPE, vec![deny()]);
    assert!(wait_for(|| b.ctx.state.policy("demo/d").is_some()).await);
    assert!(echo_ok(net, 2).await, "a DENY of another identity lets the client through");
    // Its refused new version: NACKed, and it denies everything in namespace demo.
    cp.upsert(AUTHORIZATION_TYPE, vec![refused(deny())]);
    assert!(nacked(&cp, "demo/d").await, "{:?}", cp.seen());
    assert!(
        wait_for(|| b.ctx.state.policy("demo/d").is_some_and(|p| p.fail_closed.is_some())).await
    );
    assert!(!echo_ok(net, 2).await, "a refused DENY must keep denying (its whole scope)");
    let bm = b.metrics_text();
    assert_eq!(metric(&bm, "mbtunnel_xds_policies_failed_closed", &[]), Some(1.0), "{bm}");
    // A good version lifts it.
    cp.upsert(AUTHORIZATION_TYPE, vec![deny()]);
    assert!(
        wait_for(|| b.ctx.state.policy("demo/d").is_some_and(|p| p.fail_closed.is_none())).await
    );
    assert!(echo_ok(net, 2).await, "the good version applies again");
    // A refused ALLOW of the client, the only ALLOW: nobody is allowed.
    cp.remove(AUTHORIZATION_TYPE, &["demo/d"], true);
    cp.upsert(
        AUTHORIZATION_TYPE,
        vec![refused(cp::policy("a", "demo", false, &["cluster.local/ns/demo/sa/client"], false))],
    );
    assert!(nacked(&cp, "demo/a").await, "{:?}", cp.seen());
    assert!(
        wait_for(
            || b.ctx.state.policy("demo/d").is_none() && b.ctx.state.policy("demo/a").is_some()
        )
        .await
    );
    assert!(!echo_ok(net, 2).await, "a refused only-ALLOW must allow nothing");
    a.shutdown().await;
    b.shutdown().await;
}

/// Workloads c1 (client), c2 (client2) on node A, e1 (echo) on node B behind service echo; one
/// DENY of client2, held back by the control plane until released; the proxies started with
/// `sync_timeout_ms` and not waited for.
async fn start_unsynced(
    net: u8,
    cp: &ControlPlane,
    sync_timeout_ms: u64,
    dir: &str,
) -> (Running, Running) {
    let never = common::temp_dir(dir);
    cp.upsert(
        ADDRESS_TYPE,
        vec![
            cp::workload("c1", "client", "client", ip(net, 2), "node-a", &[]),
            cp::workload("c2", "client2", "client2", ip(net, 6), "node-a", &[]),
            cp::workload(
                "e1",
                "echo",
                "echo",
                ip(net, 3),
                "node-b",
                &[("demo/echo.demo.svc.cluster.local", 8080)],
            ),
            cp::service("echo", ip(net, 50), 8080),
        ],
    );
    cp.upsert(
        AUTHORIZATION_TYPE,
        vec![cp::policy("d", "demo", true, &["cluster.local/ns/demo/sa/client2"], false)],
    );
    cp.shared.hold_policies.store(true, std::sync::atomic::Ordering::SeqCst);
    let start = |node| {
        let mut c = node_config(net, node, cp, cp::TOKEN, &never);
        c.xds_sync_timeout_ms = sync_timeout_ms;
        mbtunnel::app::start(c, None)
    };
    let b = start("node-b").await.expect("start B");
    let a = start("node-a").await.expect("start A");
    // Addresses arrive; Authorization is held back.
    assert!(
        wait_for(|| a.ctx.state.workload_by_uid("e1").is_some()
            && b.ctx.state.workload_by_uid("c1").is_some())
        .await
    );
    assert!(a.ctx.state.policy("demo/d").is_none());
    (a, b)
}

/// Before the first Authorization response a connection is never decided against an empty
/// policy set: past the bound it is refused as `xds_not_synced`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_before_the_first_sync_is_refused_past_the_bound() {
    let net = 46;
    let cp = ControlPlane::start().await;
    let _peers = start_echo(SocketAddr::new(ip(net, 3), 8080)).await;
    let (a, b) = start_unsynced(net, &cp, 200, "xds-never-ca5").await;
    assert!(!echo_ok(net, 6).await, "decided before the policies arrived");
    assert!(!echo_ok(net, 2).await, "decided before the policies arrived");
    let am = a.metrics_text();
    assert!(
        metric(&am, "mbtunnel_connections_refused_total", &["xds_not_synced"]).unwrap_or(0.0)
            >= 2.0,
        "{am}"
    );
    cp.release_policies();
    assert!(
        a.wait_ready(Duration::from_secs(20)).await && b.wait_ready(Duration::from_secs(20)).await
    );
    assert!(echo_ok(net, 2).await, "allowed once synced");
    assert!(!echo_ok(net, 6).await, "denied by the policy once synced");
    a.shutdown().await;
    b.shutdown().await;
}

/// A connection made while Authorization is held back waits, and is decided against the
/// policies once they arrive within the bound: the client allowed, client2 denied (an empty
/// policy set would have allowed it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_before_the_first_sync_waits_for_the_policies() {
    let net = 47;
    let cp = ControlPlane::start().await;
    let _peers = start_echo(SocketAddr::new(ip(net, 3), 8080)).await;
    let (a, b) = start_unsynced(net, &cp, 60_000, "xds-never-ca6").await;
    let allowed = tokio::spawn(echo_ok(net, 2));
    let denied = tokio::spawn(echo_ok(net, 6));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!allowed.is_finished() && !denied.is_finished(), "decided before the policies arrived");
    cp.release_policies();
    assert!(allowed.await.unwrap(), "the client waits, then is allowed");
    assert!(!denied.await.unwrap(), "client2 waits, then is denied by the policy");
    let am = a.metrics_text();
    assert_eq!(
        metric(&am, "mbtunnel_connections_refused_total", &["xds_not_synced"]),
        None,
        "{am}"
    );
    a.shutdown().await;
    b.shutdown().await;
}

/// `cp::service` with `waypoint` set.
fn with_waypoint(
    s: (String, Vec<u8>),
    waypoint: Option<mbtunnel::proto::workload::GatewayAddress>,
) -> (String, Vec<u8>) {
    use mbtunnel::proto::workload as pb;
    use prost::Message;
    let mut a = pb::Address::decode(&s.1[..]).unwrap();
    let Some(pb::address::Type::Service(svc)) = a.r#type.as_mut() else { panic!() };
    svc.waypoint = waypoint;
    (s.0, a.encode_to_vec())
}

/// Waypoint fields over xDS: a reference the state cannot resolve is accepted (it may arrive in
/// a later push) but every connection to the service is refused, counted, never sent direct; a
/// malformed waypoint is NACKed and its service held fail-closed; a good version applies again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waypoint_references_fail_closed() {
    use mbtunnel::proto::workload as pb;
    let net = 108;
    let cp = ControlPlane::start().await;
    let never = common::temp_dir("xds-never-ca-wp");
    let echo = || cp::service("echo", ip(net, 50), 8080);
    let unknown = pb::GatewayAddress {
        destination: Some(pb::gateway_address::Destination::Hostname(pb::NamespacedHostname {
            namespace: "demo".into(),
            hostname: "waypoint.demo.svc.cluster.local".into(),
        })),
        hbone_mtls_port: 15008,
    };
    cp.upsert(
        ADDRESS_TYPE,
        vec![
            cp::workload("c1", "client", "client", ip(net, 2), "node-a", &[]),
            cp::workload(
                "e1",
                "echo",
                "echo",
                ip(net, 3),
                "node-b",
                &[("demo/echo.demo.svc.cluster.local", 8080)],
            ),
            with_waypoint(echo(), Some(unknown.clone())),
        ],
    );
    let peers = start_echo(SocketAddr::new(ip(net, 3), 8080)).await;
    let (a, b) = cp::start_pair(net, &cp, &never).await;
    let svc = a.ctx.state.service_by_vip(ip(net, 50)).expect("service decoded");
    assert_eq!(
        svc.waypoint.as_ref().map(|w| w.to_string()).as_deref(),
        Some("demo/waypoint.demo.svc.cluster.local (HBONE port 15008)")
    );
    assert!(!echo_ok(net, 2).await, "a service with an unknown waypoint was reached");
    let am = a.metrics_text();
    assert_eq!(
        metric(&am, "mbtunnel_connections_refused_total", &["waypoint_unknown"]),
        Some(1.0),
        "{am}"
    );
    assert!(peers.lock().unwrap().is_empty(), "sent direct to the endpoint");

    // A waypoint that names nothing: NACKed; the service stands in fail-closed.
    cp.upsert(
        ADDRESS_TYPE,
        vec![with_waypoint(
            echo(),
            Some(pb::GatewayAddress { destination: None, hbone_mtls_port: 15008 }),
        )],
    );
    assert!(nacked(&cp, "demo/echo.demo.svc.cluster.local").await, "{:?}", cp.seen());
    assert!(
        wait_for(|| a
            .ctx
            .state
            .service_by_vip(ip(net, 50))
            .is_some_and(|s| s.fail_closed.is_some()))
        .await
    );
    assert!(!echo_ok(net, 2).await, "a service refused for its waypoint was reached");
    let am = a.metrics_text();
    assert_eq!(
        metric(&am, "mbtunnel_connections_refused_total", &["destination_fail_closed"]),
        Some(1.0),
        "{am}"
    );
    assert!(peers.lock().unwrap().is_empty(), "sent direct to the endpoint");

    // A good version without a waypoint: straight to the endpoint again.
    cp.upsert(ADDRESS_TYPE, vec![echo()]);
    assert!(
        wait_for(|| a
            .ctx
            .state
            .service_by_vip(ip(net, 50))
            .is_some_and(|s| s.fail_closed.is_none()))
        .await
    );
    assert!(echo_ok(net, 2).await, "the good version applies");
    a.shutdown().await;
    b.shutdown().await;
}

/// An encoded hostname workload (a ServiceEntry endpoint with DNS resolution): no address, plain
/// TCP, backing `demo/<svc>.demo.svc.cluster.local` on `port`.
fn hostname_workload(uid: &str, hostname: &str, svc: &str, port: u32) -> (String, Vec<u8>) {
    use mbtunnel::proto::workload as pb;
    use prost::Message;
    let w = pb::Workload {
        uid: uid.into(),
        name: "ext".into(),
        namespace: "demo".into(),
        hostname: hostname.into(),
        tunnel_protocol: pb::TunnelProtocol::None as i32,
        services: [(
            format!("demo/{svc}.demo.svc.cluster.local"),
            pb::PortList { ports: vec![pb::Port { service_port: port, target_port: port }] },
        )]
        .into(),
        ..Default::default()
    };
    (uid.into(), pb::Address { r#type: Some(pb::address::Type::Workload(w)) }.encode_to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostname_workloads_are_accepted_and_resolved_when_connected_to() {
    use mbtunnel::dns::tools::{parse_records, StaticServer};
    use std::sync::atomic::Ordering;
    let net = 109;
    let cp = ControlPlane::start().await;
    let never = common::temp_dir("xds-never-ca-host");
    // The node's resolver: ext.example.test → the echo's address, with a 1 s TTL.
    let records = parse_records(&[format!("ext.example.test={}", ip(net, 70))]).unwrap();
    let up = StaticServer::start(SocketAddr::new(ip(net, 60), 0), records, 1).await.unwrap();
    let peers = start_echo(SocketAddr::new(ip(net, 70), 8080)).await;
    cp.upsert(
        ADDRESS_TYPE,
        vec![
            cp::workload("c1", "client", "client", ip(net, 2), "node-a", &[]),
            hostname_workload("h1", "ext.example.test", "ext", 8080),
            cp::service("ext", ip(net, 50), 8080),
        ],
    );
    let mut cfg = node_config(net, "node-a", &cp, cp::TOKEN, &never);
    cfg.dns_upstreams = vec![up.addr];
    // Node mode's DNS proxy, in the proxy's namespace: the client is found by source address
    // (a query to the client's own loopback address comes from it).
    cfg.dns_capture = Some(true);
    cfg.dns_proxy_addr = SocketAddr::new(ip(net, 2), 15053);
    let a = mbtunnel::app::start(cfg, None).await.expect("start A");
    assert!(wait_ready(&a).await, "not ready: {:?}", cp.seen());
    // Accepted, not NACKed (before, a workload without addresses was refused).
    let w = a.ctx.state.workload_by_uid("h1").expect("hostname workload held");
    assert_eq!((w.hostname.as_str(), w.ips.len()), ("ext.example.test", 0));
    assert_eq!(count(&cp, |s| matches!(s, Seen::Nack { .. })), 0, "{:?}", cp.seen());
    {
        use hickory_proto::rr::RecordType::A;
        use mbtunnel::dns::tools::{query, Ask};
        let dns = SocketAddr::new(ip(net, 2), 15053);
        let ask = Ask::udp().from(ip(net, 2));
        let m = query(dns, "ext.demo.svc.cluster.local.", A, ask).await.unwrap();
        assert!(m.authoritative());
        assert_eq!(m.answers()[0].data().to_string(), ip(net, 50).to_string());
        let m = query(dns, "ext.example.test.", A, ask.tcp(true)).await.unwrap();
        assert!(!m.authoritative(), "forwarded");
        assert_eq!(m.answers()[0].data().to_string(), ip(net, 70).to_string());
    }

    assert!(echo_ok(net, 2).await, "the hostname workload was not reached");
    assert!(echo_ok(net, 2).await);
    assert_eq!(peers.lock().unwrap().len(), 2, "both connections reach the resolved address");
    // The second connection used the cached answer; after its TTL the name is asked again.
    let asked = up.queries.load(Ordering::Relaxed);
    assert!(asked >= 2, "the resolver was never asked");
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert!(echo_ok(net, 2).await);
    assert!(up.queries.load(Ordering::Relaxed) > asked, "the TTL was not honoured");
    let am = a.metrics_text();
    assert_eq!(
        metric(&am, "istio_on_demand_dns_total", &["hostname=\"ext.example.test\""]),
        Some(3.0),
        "{am}"
    );

    // A hostname that does not resolve: refused with the reason, never sent anywhere.
    cp.upsert(ADDRESS_TYPE, vec![hostname_workload("h1", "gone.example.test", "ext", 8080)]);
    assert!(
        wait_for(|| a
            .ctx
            .state
            .workload_by_uid("h1")
            .is_some_and(|w| w.hostname == "gone.example.test"))
        .await
    );
    assert!(!echo_ok(net, 2).await, "an unresolvable hostname workload was reached");
    let am = a.metrics_text();
    assert_eq!(
        metric(&am, "mbtunnel_connections_refused_total", &["dns_resolution_failed"]),
        Some(1.0),
        "{am}"
    );
    assert_eq!(peers.lock().unwrap().len(), 3);
    a.shutdown().await;
}
