//! Certificates come only through the certificate store's single flight and backoff: with the
//! CA failing, a flood of inbound HBONE connections to a local workload without a certificate is
//! refused with a reason, and the CA sees no more requests than the backoff schedule allows in
//! the time the flood took (issue 30 item 6). Addresses: 127.0.101.x.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cp::{self, node_config, ControlPlane, TOKEN};
use common::{ip, metric, temp_dir, wait_for};
use mbtunnel::config::KeyAlgorithm;
use mbtunnel::identity::ca::DevCa;
use mbtunnel::identity::store::{CertStore, FIRST_RETRY_FIRST, FIRST_RETRY_MAX};
use mbtunnel::metrics::Metrics;
use mbtunnel::signer::Signer;
use mbtunnel::tls::TlsProvider;
use mbtunnel::xds::ADDRESS_TYPE;
use prometheus_client::registry::Registry;

const NET: u8 = 101;
const CONNECTIONS: usize = 500;
/// Connections in flight at once: small, so that the flood is a long series of handshakes (on a
/// store that forgets a failure, each wave would start its own request).
const WAVE: usize = 5;

/// The most first requests for one identity that the store may start within `elapsed`: one at
/// once, then one after each backoff step (each step is counted from the previous failure, so
/// from no earlier than the previous attempt's start).
fn attempts_allowed(elapsed: Duration) -> usize {
    let (mut at, mut step, mut n) = (Duration::ZERO, FIRST_RETRY_FIRST, 1);
    loop {
        at += step;
        if at > elapsed {
            return n;
        }
        n += 1;
        step = (step * 2).min(FIRST_RETRY_MAX);
    }
}

#[test]
fn the_bound_follows_the_schedule() {
    let ms = Duration::from_millis;
    assert_eq!(attempts_allowed(Duration::ZERO), 1);
    assert_eq!(attempts_allowed(FIRST_RETRY_FIRST - ms(1)), 1);
    assert_eq!(attempts_allowed(FIRST_RETRY_FIRST), 2);
    assert_eq!(attempts_allowed(FIRST_RETRY_FIRST * 3), 3);
    assert_eq!(attempts_allowed(FIRST_RETRY_FIRST * 7 - ms(1)), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_ca_sees_backoff_not_one_csr_per_inbound_connection() {
    let cp = ControlPlane::start().await;
    cp.shared.ca_down.store(true, Ordering::SeqCst);
    cp.upsert(
        ADDRESS_TYPE,
        vec![cp::workload("echo-1", "echo", "echo", ip(NET, 3), "node-b", &[])],
    );
    let never = temp_dir("certbackoff-never-ca");
    let started = Instant::now();
    let b = mbtunnel::app::start(node_config(NET, "node-b", &cp, TOKEN, &never), None)
        .await
        .expect("start B");
    // The mesh state arrived and the manager asked for the echo workload's certificate (and was
    // refused: the CA is down).
    assert!(wait_for(|| b.ctx.state.local_workload_by_ip(ip(NET, 3)).is_some()).await);
    assert!(wait_for(|| cp.shared.ca_requests.load(Ordering::SeqCst) >= 1).await);
    assert!(!b.is_ready(), "not ready without the workload's certificate");

    // A client with a certificate of its own (another CA: B refuses before any chain check).
    let ca_dir = temp_dir("certbackoff-client-ca");
    let ca = DevCa::load_or_create(&ca_dir, "cluster.local").unwrap();
    let store = Arc::new(CertStore::new(ca, KeyAlgorithm::EcdsaP256, Duration::from_secs(3600)));
    let me: mbtunnel::identity::Identity =
        "spiffe://cluster.local/ns/demo/sa/client".parse().unwrap();
    store.fetch(&me).await.unwrap();
    let tls = Arc::new(TlsProvider::new(
        store,
        Signer::start(mbtunnel::signer::SignerConfig { threads: 1, ..Default::default() }),
        "cluster.local".into(),
        Arc::new(Metrics::new(&mut Registry::default())),
    ));
    let echo: mbtunnel::identity::Identity =
        "spiffe://cluster.local/ns/demo/sa/echo".parse().unwrap();

    for _ in 0..CONNECTIONS / WAVE {
        let mut wave = Vec::new();
        for _ in 0..WAVE {
            let (tls, me, echo, to) = (tls.clone(), me.clone(), echo.clone(), b.bound.inbound);
            wave.push(tokio::spawn(async move {
                let tcp = tokio::net::TcpStream::connect(to).await.expect("connect to B");
                // A guard against a hang, not a timing assertion.
                tokio::time::timeout(Duration::from_secs(60), tls.connect(tcp, &me, &echo)).await
            }));
        }
        for r in futures::future::join_all(wave).await {
            let r = r.unwrap().expect("B answers every connection (refuses it), none hangs");
            assert!(r.is_err(), "B has no certificate for echo: the handshake cannot succeed");
        }
    }
    let elapsed = started.elapsed();
    let calls = cp.shared.ca_requests.load(Ordering::SeqCst);

    // Every connection was refused for want of the local certificate, and counted so.
    let refused = |t: &str| {
        metric(t, "mbtunnel_connections_refused_total", &["reason=\"tls_no_local_certificate\""])
    };
    assert!(
        wait_for(|| refused(&b.metrics_text()) == Some(CONNECTIONS as f64)).await,
        "{}",
        b.metrics_text()
    );
    let allowed = attempts_allowed(elapsed);
    assert!(
        calls <= allowed,
        "{calls} certificate requests reached the CA in {elapsed:?}; the backoff allows {allowed}"
    );
    assert!(!b.is_ready());
    b.shutdown().await;
    let _ = std::fs::remove_dir_all(ca_dir);
}
