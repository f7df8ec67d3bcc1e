//! Authorization policy end to end on loopback, with policies pushed over xDS by our control
//! plane: an ALLOW for one principal lets it through and refuses another (401 on CONNECT,
//! counted with response_flags="DENY", reported as a denial by the client side); a DENY pushed
//! live closes an open connection; a STRICT-style policy refuses plaintext while HBONE works;
//! `/authz/check` explains a decision. (The semantic table is in src/authz/tests.rs; the same
//! enforcement in pod namespaces is in tests/inpod.rs.)

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::cp::{self, echo_ok, from, ControlPlane};
use common::{ip, metric, start_echo, wait_for};
use mbtunnel::xds::{ADDRESS_TYPE, AUTHORIZATION_TYPE};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CLIENT: &str = "cluster.local/ns/demo/sa/client";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_deny_live_and_strict() {
    let net = 44;
    let cp = ControlPlane::start().await;
    let never = common::temp_dir("authz-never-ca");
    cp.upsert(
        ADDRESS_TYPE,
        vec![
            cp::workload("c1", "client", "client", ip(net, 2), "node-a", &[]),
            cp::workload("c2", "intruder", "intruder", ip(net, 6), "node-a", &[]),
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
        vec![cp::policy("allow-client", "demo", false, &[CLIENT], false)],
    );
    let _peers = start_echo(SocketAddr::new(ip(net, 3), 8080)).await;
    let (a, b) = cp::start_pair(net, &cp, &never).await;

    // ALLOW for one principal: it passes, another is refused with 401.
    assert!(echo_ok(net, 2).await, "the allowed principal is refused");
    assert!(!echo_ok(net, 6).await, "a principal the ALLOW does not name got through");
    assert!(
        wait_for(|| {
            metric(
                &b.metrics_text(),
                "istio_tcp_connections_failed_total",
                &["response_flags=\"DENY\"", "sa/intruder"],
            ) == Some(1.0)
        })
        .await,
        "{}",
        b.metrics_text()
    );
    let bm = b.metrics_text();
    assert_eq!(
        metric(&bm, "mbtunnel_connections_refused_total", &["authorization_denied"]),
        Some(1.0),
        "{bm}"
    );
    let am = a.metrics_text();
    assert_eq!(
        metric(&am, "mbtunnel_connections_refused_total", &["denied_by_destination"]),
        Some(1.0),
        "{am}"
    );

    // /authz/check explains it, naming the policy.
    let admin =
        mbtunnel::redirect::control::Admin { addr: b.bound.admin, token_file: Default::default() };
    let echo_addr = SocketAddr::new(ip(net, 3), 8080).to_string();
    let v: serde_json::Value = serde_json::from_str(
        &tokio::task::spawn_blocking({
            let a = mbtunnel::redirect::control::Admin {
                addr: admin.addr,
                token_file: Default::default(),
            };
            let d = echo_addr.clone();
            move || {
                let from = Some(ip(net, 9));
                a.check_policy("spiffe://cluster.local/ns/demo/sa/intruder", from, &d).unwrap()
            }
        })
        .await
        .unwrap(),
    )
    .unwrap();
    assert_eq!(v["allowed"], false, "{v}");
    assert_eq!(v["reason"], "allow policies exist, but none allowed", "{v}");
    assert_eq!(v["source_ip"], ip(net, 9).to_string(), "{v}");
    assert_eq!(v["policies"][0]["policy"], "demo/allow-client", "{v}");
    assert_eq!(v["policies"][0]["matched"], false, "{v}");

    // A DENY pushed live closes the allowed principal's open connection.
    let long = from(net, 2).await;
    let (mut r, mut w) = long.into_split();
    w.write_all(b"ping").await.unwrap();
    let mut buf = [0u8; 4];
    r.read_exact(&mut buf).await.unwrap();
    cp.upsert(AUTHORIZATION_TYPE, vec![cp::policy("deny-client", "demo", true, &[CLIENT], false)]);
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), r.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the open connection was not closed after the DENY");
    assert!(
        wait_for(|| metric(
            &b.metrics_text(),
            "mbtunnel_connections_refused_total",
            &["authorization_revoked"]
        ) == Some(1.0))
        .await
    );
    assert!(!echo_ok(net, 2).await, "a new connection passes a DENY");

    // STRICT-style: only the DENY of identity-less peers remains. HBONE passes, plaintext does not.
    cp.remove(AUTHORIZATION_TYPE, &["demo/allow-client", "demo/deny-client"], true);
    cp.upsert(AUTHORIZATION_TYPE, vec![cp::policy("strict", "demo", true, &[], true)]);
    assert!(wait_for(|| b.ctx.state.policies().len() == 1).await);
    assert!(echo_ok(net, 2).await, "mTLS must pass a STRICT policy");
    // A plaintext connection to the echo workload, handed to B's plaintext inbound path as a
    // capture would: a listener standing for the redirect, on the app's address (port 8081).
    let l = tokio::net::TcpListener::bind(SocketAddr::new(ip(net, 3), 8081)).await.unwrap();
    let ctx = b.ctx.clone();
    tokio::spawn(async move {
        let (s, peer) = l.accept().await.unwrap();
        mbtunnel::proxy::inbound::handle_plaintext(ctx, s, peer, None).await
    });
    // The refusal is a reset, which may arrive before the connect completes on this side.
    match tokio::net::TcpStream::connect(SocketAddr::new(ip(net, 3), 8081)).await {
        Ok(mut p) => {
            let _ = p.write_all(b"hello").await;
            let mut got = Vec::new();
            let r = tokio::time::timeout(Duration::from_secs(10), p.read_to_end(&mut got))
                .await
                .unwrap();
            assert!(got.is_empty(), "plaintext got an answer under STRICT: {r:?}");
        }
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }
    let bm = b.metrics_text();
    assert!(
        metric(
            &bm,
            "istio_tcp_connections_failed_total",
            &["response_flags=\"DENY\"", "connection_security_policy=\"unknown\""]
        )
        .unwrap_or(0.0)
            >= 1.0,
        "{bm}"
    );
    a.shutdown().await;
    b.shutdown().await;
}

/// A DENY pushed while B is still dialling the app applies to that connection: it is
/// registered for the live re-check before the dial, so when the dial would complete the
/// connection is already revoked and never reaches the app (issue 30 item 7).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deny_pushed_during_the_dial_to_the_app_applies_to_that_connection() {
    let net = 49;
    let cp = ControlPlane::start().await;
    let never = common::temp_dir("authz-dial-never-ca");
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
    cp.upsert(AUTHORIZATION_TYPE, vec![]);
    // The app: a listener whose accept queue (backlog 0) is already full, so B's dial hangs in
    // SYN retransmission until the queue is drained below.
    let app = SocketAddr::new(ip(net, 3), 8080);
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.set_reuse_address(true).unwrap();
    sock.bind(&app.into()).unwrap();
    sock.listen(0).unwrap();
    sock.set_nonblocking(true).unwrap();
    let listener = tokio::net::TcpListener::from_std(sock.into()).unwrap();
    let _filler = tokio::net::TcpStream::connect(app).await.unwrap();
    let (a, b) = cp::start_pair(net, &cp, &never).await;

    let mut s = from(net, 2).await;
    s.write_all(b"ping").await.unwrap();
    assert!(
        wait_for(|| !b.ctx.conns.is_empty()).await,
        "B never registered the connection it is dialling for"
    );
    cp.upsert(AUTHORIZATION_TYPE, vec![cp::policy("deny-client", "demo", true, &[CLIENT], false)]);
    assert!(
        wait_for(|| metric(
            &b.metrics_text(),
            "mbtunnel_connections_refused_total",
            &["authorization_revoked"]
        ) == Some(1.0))
        .await,
        "the DENY did not reach the connection being dialled: {}",
        b.metrics_text()
    );
    // Now let the app accept: had the dial not been revoked, the retransmitted SYN would get
    // through and the ping would be echoed.
    let served = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = served.clone();
    tokio::spawn(async move {
        while let Ok((mut c, _)) = listener.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let (mut r, mut w) = c.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    let mut got = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got)).await;
    assert!(r.is_ok(), "the revoked connection stayed open");
    assert!(got.is_empty(), "the revoked connection reached the app: {got:?}");
    // Wait out the SYN retransmissions (1 s, 3 s): the app saw only the filler.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(served.load(std::sync::atomic::Ordering::SeqCst), 1, "the app got B's dial");
    a.shutdown().await;
    b.shutdown().await;
}
