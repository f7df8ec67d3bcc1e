//! Storms, floods and faults on loopback (issue 15): per-identity TLS contexts never load the
//! system trust store; the HBONE pool is single-flight, opens a second connection before a full
//! one blocks, and closes idle connections by a timer; silent and stalled handshakes are evicted
//! or timed out without locking clients out; TLS failures carry their real reason and the alert
//! ztunnel sends; bytes are counted when a connection fails, and a cut connection is reset, on
//! either side of an HBONE tunnel.
//!
//! Loopback blocks used here: 127.0.71.x – 127.0.79.x (79 inside a namespace of its own),
//! 127.0.81.x – 127.0.83.x.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::{ip, metric, round_trip, start_echo, temp_dir, Mesh};
use mbtunnel::config::Config;
use mbtunnel::identity::Identity;
use mbtunnel::proxy::admission::{EVICTED_PER_SOURCE, EVICTED_TOTAL};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Two proxies as `common::start_mesh` makes them, with `tweak` applied to both configs and no
/// echo server started (tests that need one start it).
async fn mesh_with(net: u8, a_expects_echo_sa: &str, tweak: impl Fn(&mut Config)) -> Mesh {
    let ca_dir = temp_dir(&format!("ca{net}"));
    let mut cb = common::config(net, "node-b", &ca_dir, "echo", "ecdsa-p256");
    let mut ca = common::config(net, "node-a", &ca_dir, a_expects_echo_sa, "ecdsa-p256");
    tweak(&mut cb);
    tweak(&mut ca);
    let b = mbtunnel::app::start(cb, None).await.expect("start B");
    let a = mbtunnel::app::start(ca, None).await.expect("start A");
    assert!(
        a.wait_ready(Duration::from_secs(30)).await && b.wait_ready(Duration::from_secs(30)).await
    );
    Mesh { net, a, b, echo_peers: Default::default(), ca_dir }
}

async fn client(net: u8) -> TcpStream {
    common::client(net).await
}

fn id(sa: &str) -> Identity {
    format!("spiffe://cluster.local/ns/demo/sa/{sa}").parse().unwrap()
}

async fn wait_until(what: &str, f: impl Fn() -> bool) {
    for _ in 0..300 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

fn refused(text: &str, reason: &str) -> f64 {
    metric(text, "mbtunnel_connections_refused_total", &[&format!("reason=\"{reason}\"")])
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_contexts_never_load_the_system_trust_store() {
    let m = mesh_with(71, "echo", |_| {}).await;
    start_echo(SocketAddr::new(ip(71, 3), 8080)).await;
    assert_eq!(round_trip(client(71).await, b"hello".to_vec()).await, b"hello");
    // Both sides built their contexts for the handshake; their default stores stay empty (a
    // connector from SslConnector::builder holds the whole system bundle there).
    assert_eq!(m.a.ctx.tls.default_store_objects(&id("client")), Some(0));
    assert_eq!(m.b.ctx.tls.default_store_objects(&id("echo")), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_is_single_flight_and_opens_another_connection_when_streams_run_out() {
    const N: usize = 1000;
    let m = mesh_with(72, "echo", |_| {}).await;
    start_echo(SocketAddr::new(ip(72, 3), 8080)).await;
    // N connections open at once on one pool key, each held open until all have echoed.
    let all_echoed = Arc::new(tokio::sync::Barrier::new(N + 1));
    let mut tasks = Vec::new();
    for i in 0..N {
        let b = all_echoed.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = client(72).await;
            let msg = format!("conn {i}");
            s.write_all(msg.as_bytes()).await.unwrap();
            let mut back = vec![0; msg.len()];
            s.read_exact(&mut back).await.unwrap();
            assert_eq!(back, msg.as_bytes());
            b.wait().await;
            drop(s);
        }));
    }
    // A hang (the 101st stream waiting behind the peer's limit) fails here instead of blocking.
    tokio::time::timeout(Duration::from_secs(120), all_echoed.wait())
        .await
        .expect("every one of the concurrent connections echoed");
    for t in tasks {
        t.await.unwrap();
    }
    let text = m.a.metrics_text();
    let handshakes =
        metric(&text, "mbtunnel_tls_handshakes_total", &["side=\"client\"", "result=\"success\""])
            .unwrap();
    // 100 streams per connection: exactly ceil(N / 100) handshakes, not one per caller.
    assert_eq!(handshakes, N.div_ceil(100) as f64, "{text}");
    assert_eq!(m.a.ctx.pool.len(), N.div_ceil(100));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_pool_connections_are_closed_by_a_timer() {
    let m = mesh_with(73, "echo", |c| c.pool_idle_timeout_secs = 1).await;
    start_echo(SocketAddr::new(ip(73, 3), 8080)).await;
    assert_eq!(round_trip(client(73).await, b"x".to_vec()).await, b"x");
    assert_eq!(m.a.ctx.pool.len(), 1);
    // No further traffic: only the timer can close it.
    wait_until("the idle connection to close", || m.a.ctx.pool.is_empty()).await;
    let text = m.a.metrics_text();
    assert_eq!(metric(&text, "mbtunnel_hbone_pool_connections", &[]), Some(0.0), "{text}");
    // The pool still works afterwards.
    assert_eq!(round_trip(client(73).await, b"y".to_vec()).await, b"y");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_evicted_and_clients_still_get_through() {
    let m = mesh_with(74, "echo", |c| {
        c.max_pending_handshakes = 64;
        c.handshake_timeout_ms = 60_000;
    })
    .await;
    start_echo(SocketAddr::new(ip(74, 3), 8080)).await;
    let hbone = SocketAddr::new(ip(74, 3), 15008);
    // 500 connections to B's HBONE port that never send a byte.
    let mut silent = Vec::new();
    for _ in 0..500 {
        silent.push(TcpStream::connect(hbone).await.unwrap());
    }
    // All from one address, under its own budget (512) but over the total (64).
    wait_until("evictions", || refused(&m.b.metrics_text(), EVICTED_TOTAL) >= 400.0).await;
    assert!(m.b.ctx.pending.len() <= 64);
    // The first silent connection was evicted: closed by the proxy.
    let mut buf = [0u8; 1];
    let r = tokio::time::timeout(Duration::from_secs(10), silent[0].read(&mut buf))
        .await
        .expect("an evicted connection is closed");
    assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    // Legitimate clients through A still succeed while the silent ones hold their slots.
    for i in 0..20u8 {
        assert_eq!(round_trip(client(74).await, vec![i; 10]).await, vec![i; 10]);
    }
}

/// The first bytes of a ClientHello: a record header announcing 512 bytes and 66 of them. The
/// server has to wait for the rest of the record.
fn half_client_hello() -> Vec<u8> {
    let mut b = vec![0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03];
    b.resize(71, 0x5a);
    b
}

/// Connections that send part of a ClientHello and stop hold no CPU turn while they wait: with
/// four turns and fifty such connections, a client's handshake still runs at once (before, each
/// held its turn until its deadline, and every new handshake on the node waited behind them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_client_hellos_hold_no_handshake_turn() {
    let m = mesh_with(82, "echo", |c| {
        c.max_concurrent_handshakes = 4;
        c.handshake_timeout_ms = 120_000;
    })
    .await;
    start_echo(SocketAddr::new(ip(82, 3), 8080)).await;
    let hbone = SocketAddr::new(ip(82, 3), 15008);
    let mut stalled = Vec::new();
    for _ in 0..50 {
        let mut s = TcpStream::connect(hbone).await.unwrap();
        s.write_all(&half_client_hello()).await.unwrap();
        stalled.push(s);
    }
    wait_until("the stalled handshakes to be pending", || m.b.ctx.pending.len() >= 50).await;
    let r = tokio::time::timeout(
        Duration::from_secs(30),
        round_trip(client(82).await, b"through".to_vec()),
    )
    .await
    .expect("a handshake waited behind connections that wait on their peers");
    assert_eq!(r, b"through");
    // They are still pending: nothing evicted them, they just hold nothing.
    assert!(m.b.ctx.pending.len() >= 50);
}

/// One source over its own budget loses its own oldest connections; another source's pending
/// handshakes keep their places.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_source_over_its_budget_evicts_only_its_own_connections() {
    let m = mesh_with(83, "echo", |c| {
        c.max_pending_handshakes_per_source = 20;
        c.handshake_timeout_ms = 120_000;
    })
    .await;
    let hbone = SocketAddr::new(ip(83, 3), 15008);
    let from = |host: u8| async move {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind(SocketAddr::new(ip(83, host), 0)).unwrap();
        let mut c = s.connect(hbone).await.unwrap();
        c.write_all(&half_client_hello()).await.unwrap();
        c
    };
    let mut other = Vec::new();
    for _ in 0..5 {
        other.push(from(101).await);
    }
    let mut flood = Vec::new();
    for _ in 0..200 {
        flood.push(from(100).await);
    }
    wait_until("per-source evictions", || {
        refused(&m.b.metrics_text(), EVICTED_PER_SOURCE) >= 180.0
    })
    .await;
    assert_eq!(m.b.ctx.pending.from_source(ip(83, 100)), 20);
    assert_eq!(m.b.ctx.pending.from_source(ip(83, 101)), 5, "another source keeps its places");
    let mut buf = [0u8; 1];
    let r = tokio::time::timeout(Duration::from_secs(10), flood[0].read(&mut buf))
        .await
        .expect("the flood's oldest connection is closed");
    assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_handshake_times_out_with_its_reason() {
    let m = mesh_with(75, "echo", |c| c.handshake_timeout_ms = 500).await;
    let hbone = SocketAddr::new(ip(75, 3), 15008);
    // Half a TLS record header: the server waits for the rest until its timeout.
    let mut s = TcpStream::connect(hbone).await.unwrap();
    s.write_all(&[0x16, 0x03, 0x01]).await.unwrap();
    let mut buf = [0u8; 64];
    let r = tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf))
        .await
        .expect("the proxy gives up on a stalled handshake");
    assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    wait_until("tls_timeout counted", || refused(&m.b.metrics_text(), "tls_timeout") >= 1.0).await;
    // A silent one is timed out too, before its ClientHello.
    let mut s = TcpStream::connect(hbone).await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf))
        .await
        .expect("the proxy gives up on a silent connection");
    assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    wait_until("second tls_timeout", || refused(&m.b.metrics_text(), "tls_timeout") >= 2.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_failures_carry_their_real_reason_and_the_refusal_alert_is_certificate_unknown() {
    // A expects the echo service to be "someone-else": B's certificate is refused by A.
    let m = mesh_with(76, "someone-else", |_| {}).await;
    start_echo(SocketAddr::new(ip(76, 3), 8080)).await;
    let hbone = SocketAddr::new(ip(76, 3), 15008);

    // Plain HTTP on the TLS port: a bad record, not a certificate problem.
    let mut s = TcpStream::connect(hbone).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let mut sink = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut sink)).await;
    wait_until("tls_bad_record", || refused(&m.b.metrics_text(), "tls_bad_record") >= 1.0).await;

    // A client that closes after half a ClientHello: the peer closed.
    let mut s = TcpStream::connect(hbone).await.unwrap();
    s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01]).await.unwrap();
    drop(s);
    wait_until("tls_peer_closed", || refused(&m.b.metrics_text(), "tls_peer_closed") >= 1.0).await;

    // The wrong identity: A refuses B's certificate and says so with certificate_unknown.
    // (The refusal may reset the client's connection before connect() returns.)
    if let Ok(mut s) = common::try_client(76).await {
        let _ = s.write_all(b"x").await;
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut sink)).await;
    }
    wait_until("A's refusal", || refused(&m.a.metrics_text(), "tls_wrong_identity") >= 1.0).await;
    let (ta, tb) = (m.a.metrics_text(), m.b.metrics_text());
    let alert = |t: &str, dir: &str| {
        metric(
            t,
            "mbtunnel_tls_alerts_total",
            &[&format!("direction=\"{dir}\""), "alert=\"certificate_unknown\""],
        )
        .unwrap_or(0.0)
    };
    assert!(alert(&ta, "sent") >= 1.0, "{ta}");
    wait_until("B to record the alert", || alert(&m.b.metrics_text(), "received") >= 1.0).await;
    wait_until("B's reason", || refused(&m.b.metrics_text(), "tls_alert_received") >= 1.0).await;
    // No internal_error anywhere.
    for t in [&ta, &tb] {
        assert!(!t.contains("alert=\"internal_error\""), "{t}");
    }
}

/// A server that sends `n` bytes, waits a moment, then resets the connection.
async fn start_resetting_server(addr: SocketAddr, n: usize) {
    let l = TcpListener::bind(addr).await.unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else { return };
            tokio::spawn(async move {
                let _ = s.write_all(&vec![7u8; n]).await;
                tokio::time::sleep(Duration::from_millis(300)).await;
                let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
                drop(s);
            });
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_connection_reports_the_bytes_it_moved() {
    const N: usize = 1 << 20;
    let m = mesh_with(77, "echo", |_| {}).await;
    start_resetting_server(SocketAddr::new(ip(77, 3), 8080), N).await;
    let mut s = client(77).await;
    let mut got = 0usize;
    let mut buf = vec![0u8; 64 * 1024];
    let end = loop {
        match tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf)).await {
            Ok(Ok(0)) => break Ok(()),
            Ok(Ok(n)) => got += n,
            Ok(Err(e)) => break Err(e),
            Err(_) => panic!(
                "the connection neither ended nor failed after {got} bytes\nA: {}\nB: {}",
                m.a.metrics_text(),
                m.b.metrics_text()
            ),
        }
    };
    assert!(got > 0, "the client received part of the transfer");
    // The upstream's reset crosses HBONE (B resets the CONNECT stream, A resets the client):
    // the client must not mistake the truncated transfer for a complete one.
    let e = end.expect_err("a reset upstream reaches the client as a reset, not an EOF");
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
    drop(s);
    // Both proxies counted what they moved before the failure.
    let sent = |t: &str| metric(t, "istio_tcp_sent_bytes_total", &[]).unwrap_or(0.0);
    wait_until("A's close record", || sent(&m.a.metrics_text()) >= got as f64).await;
    wait_until("B's close record", || sent(&m.b.metrics_text()) >= got as f64).await;
    // B's upstream leg failed: its record says so.
    let tb = m.b.metrics_text();
    assert!(
        metric(&tb, "istio_tcp_connections_closed_total", &["response_flags=\"CONNECT\""])
            .is_some(),
        "{tb}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_cut_at_the_drain_deadline_is_reset() {
    let m = mesh_with(78, "echo", |c| c.drain_timeout_secs = 1).await;
    start_echo(SocketAddr::new(ip(78, 3), 8080)).await;
    let mut s = client(78).await;
    s.write_all(b"ping").await.unwrap();
    let mut b4 = [0u8; 4];
    s.read_exact(&mut b4).await.unwrap();
    // The client keeps its connection open past A's drain deadline.
    let left = m.a.shutdown().await;
    assert_eq!(left, 1, "one connection was open at the deadline");
    let mut buf = [0u8; 16];
    let r = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
        .await
        .expect("the cut reaches the client");
    let e = r.expect_err("a cut connection is reset, not ended cleanly");
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
    drop(m.b);
}

/// Row 10. With conntrack active in a namespace (any NAT rule loads it) SO_ORIGINAL_DST answers
/// for every tracked connection, redirected or not; for a direct one it is the socket's own
/// address. The demo layout puts A's outbound listener on the service VIP, so such a connection
/// must go through — before the fix every one was refused as a loop.
#[test]
fn conntrack_in_the_namespace_does_not_make_a_direct_connection_a_loop() {
    require_netns!();
    let lone = common::netns::Lone::new("ct");
    // A NAT rule for a port nothing here uses: it only makes the kernel track connections.
    common::netns::sh(&[
        "ip",
        "netns",
        "exec",
        &lone.name,
        "iptables",
        "-t",
        "nat",
        "-A",
        "OUTPUT",
        "-p",
        "tcp",
        "--dport",
        "9",
        "-j",
        "REDIRECT",
        "--to-ports",
        "10",
    ]);
    common::netns::ip(&lone.name, "link set lo up");
    lone.run(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            // Precondition: conntrack answers for a connection nothing redirected.
            let l = TcpListener::bind("127.0.79.9:7000").await.unwrap();
            let _c = TcpStream::connect("127.0.79.9:7000").await.unwrap();
            let (accepted, _) = l.accept().await.unwrap();
            assert_eq!(
                mbtunnel::net::socket::original_dst(&accepted),
                Some("127.0.79.9:7000".parse().unwrap()),
                "conntrack is not tracking loopback connections in this namespace"
            );
            let m = mesh_with(79, "echo", |_| {}).await;
            start_echo(SocketAddr::new(ip(79, 3), 8080)).await;
            for i in 0..3u8 {
                assert_eq!(round_trip(client(79).await, vec![i; 100]).await, vec![i; 100]);
            }
            assert_eq!(refused(&m.a.metrics_text(), "loop"), 0.0);
        });
    });
}

/// Row 8, the other direction: a client that resets its connection makes B reset the app's
/// connection, which would otherwise see a clean FIN and take the partial request as whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_reset_reaches_the_app_as_a_reset() {
    let m = mesh_with(81, "echo", |_| {}).await;
    let l = TcpListener::bind(SocketAddr::new(ip(81, 3), 8080)).await.unwrap();
    let mut s = client(81).await;
    s.write_all(b"half a request").await.unwrap();
    let (mut app, _) = tokio::time::timeout(Duration::from_secs(10), l.accept())
        .await
        .expect("B dials the app")
        .unwrap();
    let mut buf = [0u8; 14];
    app.read_exact(&mut buf).await.unwrap();
    socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO)).unwrap();
    drop(s);
    let r = tokio::time::timeout(Duration::from_secs(10), app.read(&mut buf))
        .await
        .expect("the client's reset reaches the app");
    let e = r.expect_err("a reset, not an EOF");
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
    drop(m);
}
