//! End-to-end tests of the node proxy: two proxies in one process, real listeners on loopback,
//! HBONE over TLS 1.3 mutual TLS between them.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::{Method, Request, StatusCode};
use http_body_util::Empty;
use hyper_util::rt::{TokioExecutor, TokioIo};
use mbtunnel::config::KeyAlgorithm;
use mbtunnel::identity::ca::DevCa;
use mbtunnel::identity::store::CertStore;
use mbtunnel::identity::Identity;
use mbtunnel::metrics::Metrics;
use mbtunnel::signer::Signer;
use mbtunnel::tls::TlsProvider;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CLIENT: &str = "spiffe://cluster.local/ns/demo/sa/client";
const ECHO: &str = "spiffe://cluster.local/ns/demo/sa/echo";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_mebibyte_each_way_with_matching_metrics() {
    let m = start_mesh(11, "echo", "ecdsa-p256").await;
    let data = pattern(1 << 20, 7);
    let back = round_trip(client(11).await, data.clone()).await;
    assert_eq!(back.len(), data.len());
    assert!(back == data, "echoed bytes differ");

    // The app saw the client's own address, not the proxy's.
    assert_eq!(m.echo_peers.lock().unwrap()[0].ip(), ip(11, 2));
    let n = (1u64 << 20) as f64;
    // Both reporters close their record when their side of the copy ends.
    let closed = |t: String| metric(&t, "istio_tcp_connections_closed_total", &[]) == Some(1.0);
    assert!(wait_for(|| closed(m.a.metrics_text()) && closed(m.b.metrics_text())).await);
    let (ta, tb) = (m.a.metrics_text(), m.b.metrics_text());
    for (t, reporter) in [(&ta, "source"), (&tb, "destination")] {
        let l = [
            &*format!("reporter=\"{reporter}\""),
            &*format!("source_principal=\"{CLIENT}\""),
            &*format!("destination_principal=\"{ECHO}\""),
            "connection_security_policy=\"mutual_tls\"",
            "source_workload=\"client\"",
            "destination_workload=\"echo\"",
        ];
        assert_eq!(
            metric(t, "istio_tcp_connections_opened_total", &l),
            Some(1.0),
            "{reporter}\n{t}"
        );
        assert_eq!(metric(t, "istio_tcp_connections_closed_total", &l), Some(1.0), "{reporter}");
        assert_eq!(metric(t, "istio_tcp_received_bytes_total", &l), Some(n), "{reporter}");
        assert_eq!(metric(t, "istio_tcp_sent_bytes_total", &l), Some(n), "{reporter}");
    }
    assert_eq!(
        metric(&ta, "mbtunnel_tls_handshakes_total", &["side=\"client\"", "success"]),
        Some(1.0)
    );
    assert_eq!(
        metric(&tb, "mbtunnel_tls_handshakes_total", &["side=\"server\"", "success"]),
        Some(1.0)
    );
    assert_eq!(
        metric(&tb, "mbtunnel_tls_handshake_duration_seconds_count", &["side=\"server\""]),
        Some(1.0)
    );

    // A second connection reuses the pooled HBONE connection: no new handshake.
    let back = round_trip(client(11).await, b"again".to_vec()).await;
    assert_eq!(back, b"again");
    assert_eq!(
        metric(&m.a.metrics_text(), "mbtunnel_tls_handshakes_total", &["side=\"client\""]),
        Some(1.0)
    );

    // The admin endpoints answer.
    let dump = http_get(m.a.bound.admin, "/config_dump").await;
    assert!(
        dump.contains(CLIENT) && dump.contains("not_after") && dump.contains("\"signer\""),
        "{dump}"
    );
    assert!(http_get(m.b.bound.readiness, "/healthz/ready").await.contains("ready"));
    assert!(http_get(m.b.bound.metrics, "/metrics").await.contains("istio_tcp_sent_bytes_total"));
    assert_eq!(m.a.shutdown().await, 0);
    assert_eq!(m.b.shutdown().await, 0);
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// A TLS client of our own: an identity with a certificate from `ca_dir`'s CA.
fn tls_client(ca_dir: &std::path::Path) -> (Arc<TlsProvider>, Arc<Metrics>) {
    let ca = DevCa::load_or_create(ca_dir, "cluster.local").unwrap();
    let store = Arc::new(CertStore::new(ca, KeyAlgorithm::EcdsaP256, Duration::from_secs(3600)));
    let mut reg = Registry::default();
    let metrics = Arc::new(Metrics::new(&mut reg));
    (
        Arc::new(TlsProvider::new(
            store,
            Signer::start(mbtunnel::signer::SignerConfig { threads: 1, ..Default::default() }),
            "cluster.local".into(),
            metrics.clone(),
        )),
        metrics,
    )
}

async fn h2_to(
    tls: &TlsProvider,
    me: &str,
    inbound: std::net::SocketAddr,
) -> hyper::client::conn::http2::SendRequest<Empty<Bytes>> {
    let tcp = tokio::net::TcpStream::connect(inbound).await.unwrap();
    let s =
        tls.connect(tcp, &me.parse().unwrap(), &ECHO.parse().unwrap()).await.expect("mTLS to B");
    let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .handshake(TokioIo::new(s))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

async fn connect_status(
    sender: &mut hyper::client::conn::http2::SendRequest<Empty<Bytes>>,
    method: Method,
    uri: &str,
) -> StatusCode {
    let req = Request::builder().method(method).uri(uri).body(Empty::new()).unwrap();
    sender.ready().await.unwrap();
    sender.send_request(req).await.unwrap().status()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_connect_gets_status_and_proxy_keeps_serving() {
    let m = start_mesh(12, "echo", "ecdsa-p256").await;
    let (tls, _) = tls_client(&m.ca_dir);
    let me = "spiffe://cluster.local/ns/test/sa/prober";
    let mut h2 = h2_to(&tls, me, m.b.bound.inbound).await;
    let echo = "127.0.12.3:8080";
    assert_eq!(
        connect_status(&mut h2, Method::GET, &format!("http://{echo}/")).await,
        StatusCode::METHOD_NOT_ALLOWED
    );
    assert_eq!(
        connect_status(&mut h2, Method::CONNECT, "echo.demo:8080").await,
        StatusCode::BAD_REQUEST
    );
    // Not a workload of this node (the client's own workload, and an address outside the mesh).
    for target in ["127.0.12.2:8080", "192.0.2.1:80"] {
        assert_eq!(connect_status(&mut h2, Method::CONNECT, target).await, StatusCode::BAD_REQUEST);
    }
    // A workload of this node, but not the one whose address the connection reached.
    assert_eq!(
        connect_status(&mut h2, Method::CONNECT, "127.0.12.4:8080").await,
        StatusCode::BAD_REQUEST
    );
    // Right workload, nothing listening.
    assert_eq!(
        connect_status(&mut h2, Method::CONNECT, "127.0.12.3:9").await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    // The same h2 connection still works for a good request.
    assert_eq!(connect_status(&mut h2, Method::CONNECT, echo).await, StatusCode::OK);
    let t = m.b.metrics_text();
    for (reason, n) in [
        ("bad_method", 1.0),
        ("bad_authority", 1.0),
        ("unknown_target", 2.0),
        ("address_mismatch", 1.0),
        ("upstream_unreachable", 1.0),
    ] {
        assert_eq!(
            metric(&t, "mbtunnel_connections_refused_total", &[reason]),
            Some(n),
            "{reason}\n{t}"
        );
    }
    // And the mesh path keeps working.
    assert_eq!(round_trip(client(12).await, b"still here".to_vec()).await, b"still here");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_http2_preface_ends_tls_with_close_notify() {
    let m = start_mesh(31, "echo", "ecdsa-p256").await;
    let (tls, _) = tls_client(&m.ca_dir);
    let tcp = tokio::net::TcpStream::connect(m.b.bound.inbound).await.unwrap();
    let me: Identity = "spiffe://cluster.local/ns/test/sa/prober".parse().unwrap();
    let mut s = tls.connect(tcp, &me, &ECHO.parse().unwrap()).await.expect("mTLS to B");
    // Longer than the 24-byte HTTP/2 preface, so the server refuses it at once.
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    s.flush().await.unwrap();
    let mut got = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got)).await;
    assert!(matches!(r, Ok(Ok(_))), "{r:?}");
    // BoringSSL reads a bare TCP close as end of stream too: ask it whether close_notify came.
    // SAFETY: SSL_get_shutdown reads a field of the live SSL the stream owns.
    let state =
        unsafe { boring_sys::SSL_get_shutdown(foreign_types::ForeignTypeRef::as_ptr(s.ssl())) };
    assert_ne!(state & boring_sys::SSL_RECEIVED_SHUTDOWN, 0, "no close_notify");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_from_another_ca_is_refused_and_counted() {
    let m = start_mesh(14, "echo", "ecdsa-p256").await;
    let other = temp_dir("otherca14");
    let (tls, client_metrics) = tls_client(&other);
    let tcp = tokio::net::TcpStream::connect(m.b.bound.inbound).await.unwrap();
    let r = tls
        .connect(tcp, &"spiffe://cluster.local/ns/x/sa/y".parse().unwrap(), &ECHO.parse().unwrap())
        .await;
    let e = r.expect_err("a peer from another CA must not be accepted");
    // The client sees B's chain first (TLS 1.3) and refuses it: its reason is the chain, and B
    // learns why from the alert (both CAs have the same name, so what fails is the signature of
    // B's certificate under the other root: decrypt_error).
    assert_eq!(e.reason(), "tls_untrusted_chain", "{e}");
    assert!(e.to_string().contains("certificate"), "{e}");
    assert!(refused_once(&m.b, "reason=\"tls_alert_received\"").await, "{}", m.b.metrics_text());
    assert_eq!(
        metric(
            &m.b.metrics_text(),
            "mbtunnel_tls_alerts_total",
            &["direction=\"received\"", "alert=\"decrypt_error\""]
        ),
        Some(1.0),
        "{}",
        m.b.metrics_text()
    );
    assert_eq!(
        metric(&m.b.metrics_text(), "mbtunnel_tls_handshakes_total", &["failure"]),
        Some(1.0)
    );
    drop(client_metrics);
    let _ = std::fs::remove_dir_all(other);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_with_wrong_spiffe_id_is_refused() {
    // Node A believes the echo workload runs as `expected-echo`; B presents `echo`.
    let m = start_mesh(15, "expected-echo", "ecdsa-p256").await;
    // The refusal may reset the connection before connect() returns, or after the write.
    if let Ok(mut s) = common::try_client(15).await {
        let _ = s.write_all(b"hello").await;
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
            .await
            .expect("closed");
        assert!(buf.is_empty(), "no byte may cross to an unverified server");
    }
    let t = m.a.metrics_text();
    assert_eq!(
        metric(&t, "mbtunnel_tls_handshakes_total", &["side=\"client\"", "failure"]),
        Some(1.0),
        "{t}"
    );
    assert_eq!(
        metric(&t, "mbtunnel_connections_refused_total", &["reason=\"tls_wrong_identity\""]),
        Some(1.0),
        "{t}"
    );
    assert_eq!(
        metric(&t, "istio_tcp_connections_closed_total", &["response_flags=\"CONNECT\""]),
        Some(1.0)
    );
    assert!(m.echo_peers.lock().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_outside_trust_domain_is_refused() {
    let m = start_mesh(16, "echo", "ecdsa-p256").await;
    let (tls, _) = tls_client(&m.ca_dir);
    let tcp = tokio::net::TcpStream::connect(m.b.bound.inbound).await.unwrap();
    let me: Identity = "spiffe://other.domain/ns/x/sa/y".parse().unwrap();
    // TLS 1.3: the client may finish before the server's verdict; the server must then close.
    match tls.connect(tcp, &me, &ECHO.parse().unwrap()).await {
        Err(_) => {}
        Ok(mut s) => {
            let mut b = [0u8; 1];
            let r = tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await.unwrap();
            assert!(!matches!(r, Ok(n) if n > 0), "server must not talk to a foreign trust domain");
        }
    }
    assert!(
        refused_once(&m.b, "reason=\"tls_wrong_trust_domain\"").await,
        "{}",
        m.b.metrics_text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_keeps_live_connections_and_new_ones_use_the_new_cert() {
    let m = start_mesh(17, "echo", "rsa-2048").await;
    let long = client(17).await;
    let (mut r, mut w) = long.into_split();
    w.write_all(b"before").await.unwrap();
    let mut buf = [0u8; 6];
    r.read_exact(&mut buf).await.unwrap();
    let echo_id: Identity = ECHO.parse().unwrap();
    let old = m.b.store.fetch(&echo_id).await.unwrap().serial.clone();
    let new = m.b.store.renew(&echo_id).await.unwrap().serial.clone();
    assert_ne!(old, new);
    // The long connection survives the renewal.
    w.write_all(b"after!").await.unwrap();
    r.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"after!");
    // A new TLS connection to B sees the new certificate.
    let (tls, _) = tls_client(&m.ca_dir);
    let tcp = tokio::net::TcpStream::connect(m.b.bound.inbound).await.unwrap();
    let s = tls
        .connect(tcp, &"spiffe://cluster.local/ns/t/sa/t".parse().unwrap(), &echo_id)
        .await
        .unwrap();
    let serial = s
        .ssl()
        .peer_certificate()
        .unwrap()
        .serial_number()
        .to_bn()
        .unwrap()
        .to_hex_str()
        .unwrap()
        .to_lowercase();
    assert_eq!(serial.trim_start_matches('0'), new.trim_start_matches('0'));
    w.shutdown().await.unwrap();
    let mut rest = Vec::new();
    r.read_to_end(&mut rest).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_lets_in_flight_connections_finish_and_refuses_new_ones() {
    let m = start_mesh(18, "echo", "ecdsa-p256").await;
    let (mut r, mut w) = client(18).await.into_split();
    w.write_all(b"x").await.unwrap();
    let mut b = [0u8; 1];
    r.read_exact(&mut b).await.unwrap();
    let inbound = m.b.bound.inbound;
    let shutdown = tokio::spawn(m.b.shutdown());
    // Listeners close at once...
    assert!(
        wait_for(|| std::net::TcpStream::connect(inbound).is_err()).await,
        "B still accepts after drain started"
    );
    // ...while the connection in flight keeps flowing (GOAWAY lets open streams finish).
    w.write_all(b"y").await.unwrap();
    r.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"y");
    assert!(!shutdown.is_finished(), "drain must wait for the open connection");
    w.shutdown().await.unwrap();
    let mut rest = Vec::new();
    r.read_to_end(&mut rest).await.unwrap();
    assert_eq!(shutdown.await.unwrap(), 0, "drained with nothing left open");
}

/// Waits until `proxy` has counted exactly one refusal for `reason`.
async fn refused_once(proxy: &mbtunnel::app::Running, reason: &str) -> bool {
    wait_for(|| {
        metric(&proxy.metrics_text(), "mbtunnel_connections_refused_total", &[reason]) == Some(1.0)
    })
    .await
}

/// Local mode: the file's workloads are re-read when it changes (a new workload gets its
/// certificate, a removed one is forgotten); an invalid file is reported and the state held
/// stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_file_reload_applies_changes_and_keeps_state_on_errors() {
    let dir = temp_dir("reload");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("mesh.yaml");
    let base = format!(
        "node_name: n\nca_dir: {}\noutbound_addr: 127.0.19.1:0\ninbound_addr: 127.0.19.1:0\n\
         inbound_plaintext_addr: 127.0.19.1:0\nmetrics_addr: 127.0.19.1:0\n\
         readiness_addr: 127.0.19.1:0\nadmin_addr: 127.0.19.1:0\nworkloads:\n\
         - {{uid: a, name: a, namespace: demo, service_account: a, ips: [127.0.19.2], node: n}}\n",
        dir.join("ca").display()
    );
    std::fs::write(&file, &base).unwrap();
    let cfg = mbtunnel::config::Config::from_file(&file).unwrap();
    let r = mbtunnel::app::start(cfg, None).await.unwrap();
    assert!(r.wait_ready(Duration::from_secs(20)).await);
    let id = |sa: &str| -> Identity {
        format!("spiffe://cluster.local/ns/demo/sa/{sa}").parse().unwrap()
    };
    assert!(r.store.current(&id("a")).is_some());
    // Its TLS contexts are built as its certificate arrives, before any connection needs them.
    assert!(wait_for(|| r.ctx.tls.cached_sessions(&id("a")).is_some()).await);
    // Replace a with b.
    std::fs::write(
        &file,
        base.replace(
            "{uid: a, name: a, namespace: demo, service_account: a, ips: [127.0.19.2]",
            "{uid: b, name: b, namespace: demo, service_account: b, ips: [127.0.19.3]",
        ),
    )
    .unwrap();
    assert!(
        wait_for(|| r.store.current(&id("b")).is_some() && r.store.current(&id("a")).is_none())
            .await
    );
    assert!(r.ctx.state.workload_by_uid("a").is_none());
    assert!(
        wait_for(|| r.ctx.tls.cached_sessions(&id("b")).is_some()
            && r.ctx.tls.cached_sessions(&id("a")).is_none())
        .await,
        "b's contexts built ahead, a's forgotten"
    );
    // An invalid file: reported, nothing changes.
    std::fs::write(&file, format!("{base}  - {{uid: c, name: c, ips: []}}\n")).unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(r.ctx.state.workload_by_uid("b").is_some(), "an invalid file dropped the state");
    assert!(r.ctx.state.workload_by_uid("c").is_none());
    r.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}
