//! TLS options between two `TlsProvider`s on loopback, certificates from one dev CA: TLS 1.3
//! resumption between mbtunnel peers (what is resumed, what never is, the bounds on tickets) and
//! the key-exchange groups.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::{metric, temp_dir};
use mbtunnel::config::KeyAlgorithm;
use mbtunnel::identity::ca::DevCa;
use mbtunnel::identity::store::CertStore;
use mbtunnel::identity::Identity;
use mbtunnel::metrics::Metrics;
use mbtunnel::signer::Signer;
use mbtunnel::tls::TlsProvider;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SERVER: &str = "spiffe://cluster.local/ns/default/sa/server";
const CLIENT: &str = "spiffe://cluster.local/ns/default/sa/client";

struct Side {
    tls: Arc<TlsProvider>,
    store: Arc<CertStore>,
    registry: Arc<Registry>,
}

impl Side {
    fn new(ca_dir: &std::path::Path, lifetime: Duration, resumption: bool) -> Side {
        Side::with_groups(ca_dir, lifetime, resumption, &[])
    }

    fn with_groups(
        ca_dir: &std::path::Path,
        lifetime: Duration,
        resumption: bool,
        groups: &[&str],
    ) -> Side {
        Side::build(ca_dir, lifetime, resumption, groups, true, None)
    }

    fn build(
        ca_dir: &std::path::Path,
        lifetime: Duration,
        resumption: bool,
        groups: &[&str],
        verify_cache: bool,
        ciphers: Option<&[&str]>,
    ) -> Side {
        let ca = DevCa::load_or_create(ca_dir, "cluster.local").unwrap();
        let store = Arc::new(CertStore::new(ca, KeyAlgorithm::EcdsaP256, lifetime));
        let mut reg = Registry::default();
        let metrics = Arc::new(Metrics::new(&mut reg));
        let signer =
            Signer::start(mbtunnel::signer::SignerConfig { threads: 1, ..Default::default() });
        let mut tls = TlsProvider::new(store.clone(), signer, "cluster.local".into(), metrics)
            .with_resumption(resumption)
            .with_verify_cache(verify_cache)
            .with_groups(&groups.iter().map(|g| g.to_string()).collect::<Vec<_>>());
        if let Some(c) = ciphers {
            tls = tls.with_ciphers(&c.iter().map(|c| c.to_string()).collect::<Vec<_>>());
        }
        Side { tls: Arc::new(tls), store, registry: Arc::new(reg) }
    }

    fn metrics(&self) -> String {
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &self.registry).unwrap();
        s
    }

    /// Peer chains judged with `result` (verified, cached, refused).
    fn chains(&self, result: &str) -> f64 {
        let want = format!("result=\"{result}\"");
        metric(&self.metrics(), "mbtunnel_tls_peer_chains_total", &[&want]).unwrap_or(0.0)
    }

    fn handshakes(&self, side: &str, kind: &str) -> f64 {
        let want = [format!("side=\"{side}\""), format!("kind=\"{kind}\""), "success".into()];
        let want: Vec<&str> = want.iter().map(String::as_str).collect();
        metric(&self.metrics(), "mbtunnel_tls_handshakes_total", &want).unwrap_or(0.0)
    }
}

/// A TLS server as `SERVER`: sends one byte after each handshake (the tickets go before it),
/// then waits for the client to close.
async fn serve(server: &Side) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let tls = server.tls.clone();
    tokio::spawn(async move {
        let me: Identity = SERVER.parse().unwrap();
        loop {
            let (tcp, _) = l.accept().await.unwrap();
            let (tls, me) = (tls.clone(), me.clone());
            tokio::spawn(async move {
                if let Ok((mut s, _peer)) = tls.accept(tcp, &me).await {
                    let _ = s.write_all(b"!").await;
                    let _ = s.flush().await;
                    let mut rest = Vec::new();
                    let _ = s.read_to_end(&mut rest).await;
                }
            });
        }
    });
    addr
}

/// One connection from `client` to `addr` expecting `expected`; whether it resumed.
async fn once(client: &Side, addr: SocketAddr, expected: &str) -> Result<bool, String> {
    once_with_group(client, addr, expected).await.map(|(resumed, _, _)| resumed)
}

/// The same, with the negotiated key-exchange group and cipher suite.
async fn once_with_group(
    client: &Side,
    addr: SocketAddr,
    expected: &str,
) -> Result<(bool, String, String), String> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let me: Identity = CLIENT.parse().unwrap();
    let want: Identity = expected.parse().unwrap();
    let mut s = client.tls.connect_to(tcp, &me, &want, Some(addr)).await.map_err(|e| {
        assert_eq!(e.reason(), "tls_wrong_identity", "{e}");
        e.to_string()
    })?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b).await.unwrap();
    let resumed = s.ssl().session_reused();
    let group = s.ssl().curve_name().unwrap_or("none").to_string();
    let cipher = s.ssl().current_cipher().and_then(|c| c.standard_name()).unwrap_or("none");
    let _ = s.shutdown().await;
    Ok((resumed, group, cipher.to_string()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_connection_resumes_and_is_counted_and_rechecked() {
    let dir = temp_dir("resume1");
    let server = Side::new(&dir, Duration::from_secs(7200), true);
    let client = Side::new(&dir, Duration::from_secs(7200), true);
    let addr = serve(&server).await;
    let me: Identity = CLIENT.parse().unwrap();

    assert_eq!(once(&client, addr, SERVER).await, Ok(false), "the first handshake is full");
    assert!(client.tls.cached_sessions(&me).unwrap() >= 1, "the server's tickets were kept");
    let hint = client.tls.longest_ticket_lifetime(&me).unwrap();
    assert!(hint <= Duration::from_secs(3600) && hint > Duration::from_secs(3000), "{hint:?}");

    assert_eq!(once(&client, addr, SERVER).await, Ok(true), "the second one resumes");
    assert_eq!(client.handshakes("client", "resumed"), 1.0, "{}", client.metrics());
    assert_eq!(server.handshakes("server", "resumed"), 1.0, "{}", server.metrics());
    assert_eq!(server.handshakes("server", "full"), 1.0, "{}", server.metrics());

    // A session is offered only for the identity it was made with: expecting another identity
    // at the same address is a full handshake, refused on the certificate.
    let other = "spiffe://cluster.local/ns/default/sa/other";
    assert!(once(&client, addr, other).await.is_err(), "the server is not `other`");
    assert_eq!(server.handshakes("server", "resumed"), 1.0, "{}", server.metrics());

    // `connect` (no destination) never offers a session.
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let s = client.tls.connect(tcp, &me, &SERVER.parse().unwrap()).await.unwrap();
    assert!(!s.ssl().session_reused());
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_server_certificate_ends_its_tickets() {
    let dir = temp_dir("resume2");
    let server = Side::new(&dir, Duration::from_secs(7200), true);
    let client = Side::new(&dir, Duration::from_secs(7200), true);
    let addr = serve(&server).await;
    assert_eq!(once(&client, addr, SERVER).await, Ok(false));
    assert_eq!(once(&client, addr, SERVER).await, Ok(true));
    server.store.renew(&SERVER.parse().unwrap()).await.unwrap();
    // The client still holds a ticket from the old context; the server cannot open it.
    assert_eq!(once(&client, addr, SERVER).await, Ok(false), "renewal forces a full handshake");
    assert_eq!(once(&client, addr, SERVER).await, Ok(true), "and its tickets resume");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tickets_live_no_longer_than_the_client_certificate() {
    let dir = temp_dir("resume3");
    let server = Side::new(&dir, Duration::from_secs(7200), true);
    // The client's certificate expires in 5 minutes: the server must not give it a ticket for
    // longer (the client also caps its own use, which this does not look at).
    let client = Side::new(&dir, Duration::from_secs(300), true);
    let addr = serve(&server).await;
    assert_eq!(once(&client, addr, SERVER).await, Ok(false));
    let me: Identity = CLIENT.parse().unwrap();
    let hint = client.tls.longest_ticket_lifetime(&me).expect("a ticket");
    assert!(hint <= Duration::from_secs(300), "ticket lifetime {hint:?} outlives the certificate");
    assert!(hint >= Duration::from_secs(200), "{hint:?}");
    assert_eq!(once(&client, addr, SERVER).await, Ok(true));
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_on_either_side_means_full_handshakes() {
    let dir = temp_dir("resume4");
    let me: Identity = CLIENT.parse().unwrap();
    // Server off: it sends no tickets.
    let server = Side::new(&dir, Duration::from_secs(7200), false);
    let client = Side::new(&dir, Duration::from_secs(7200), true);
    let addr = serve(&server).await;
    for _ in 0..2 {
        assert_eq!(once(&client, addr, SERVER).await, Ok(false));
    }
    assert_eq!(client.tls.cached_sessions(&me), Some(0));
    // Client off: it keeps none.
    let server = Side::new(&dir, Duration::from_secs(7200), true);
    let client = Side::new(&dir, Duration::from_secs(7200), false);
    let addr = serve(&server).await;
    for _ in 0..2 {
        assert_eq!(once(&client, addr, SERVER).await, Ok(false));
    }
    assert_eq!(client.tls.cached_sessions(&me), Some(0));
    assert_eq!(server.handshakes("server", "full"), 2.0, "{}", server.metrics());
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_exchange_follows_tls_groups() {
    let dir = temp_dir("groups");
    let long = Duration::from_secs(7200);
    // Defaults on both sides: the post-quantum hybrid (two ztunnels agree on X25519 instead).
    let server = Side::new(&dir, long, false);
    let client = Side::new(&dir, long, false);
    let addr = serve(&server).await;
    let (_, g, _) = once_with_group(&client, addr, SERVER).await.unwrap();
    assert_eq!(g, "X25519MLKEM768");
    // A client limited to X25519.
    let classical = Side::with_groups(&dir, long, false, &["X25519", "P-256"]);
    let (_, g, _) = once_with_group(&classical, addr, SERVER).await.unwrap();
    assert_eq!(g, "X25519");
    // A server that accepts P-256 only: the default client is asked to retry with it.
    let p256 = Side::with_groups(&dir, long, false, &["P-256"]);
    let addr = serve(&p256).await;
    let (_, g, _) = once_with_group(&client, addr, SERVER).await.unwrap();
    assert_eq!(g, "P-256");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_that_verified_is_remembered_and_the_identity_still_checked() {
    let dir = temp_dir("chains1");
    // Resumption off: every handshake below is a full one and presents its chain.
    let server = Side::new(&dir, Duration::from_secs(7200), false);
    let client = Side::new(&dir, Duration::from_secs(7200), false);
    let addr = serve(&server).await;
    for _ in 0..3 {
        assert_eq!(once(&client, addr, SERVER).await, Ok(false));
    }
    for side in [&client, &server] {
        assert_eq!(side.chains("verified"), 1.0, "{}", side.metrics());
        assert_eq!(side.chains("cached"), 2.0, "{}", side.metrics());
    }
    // The server's chain is remembered, yet a client expecting another identity refuses it.
    let other = "spiffe://cluster.local/ns/default/sa/other";
    let e = once(&client, addr, other).await.unwrap_err();
    assert!(e.contains("other"), "{e}");
    assert_eq!(client.chains("cached"), 3.0, "{}", client.metrics());

    // A chain from another root is refused each time, never remembered (here by a client of
    // another mesh, which refuses our server's chain before sending its own).
    let stranger_dir = temp_dir("chains1-stranger");
    let stranger = Side::new(&stranger_dir, Duration::from_secs(7200), false);
    for _ in 0..2 {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let me: Identity = CLIENT.parse().unwrap();
        let e = stranger.tls.connect(tcp, &me, &SERVER.parse().unwrap()).await.unwrap_err();
        assert_eq!(e.reason(), "tls_untrusted_chain", "{e}");
    }
    assert_eq!(stranger.chains("refused"), 2.0, "{}", stranger.metrics());
    assert_eq!(stranger.chains("cached"), 0.0, "{}", stranger.metrics());
    assert_eq!(server.chains("cached"), 2.0, "{}", server.metrics());
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(stranger_dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_chain_cache_off_every_chain_is_verified() {
    let dir = temp_dir("chains2");
    let server = Side::build(&dir, Duration::from_secs(7200), false, &[], false, None);
    let client = Side::build(&dir, Duration::from_secs(7200), false, &[], false, None);
    let addr = serve(&server).await;
    for _ in 0..3 {
        assert_eq!(once(&client, addr, SERVER).await, Ok(false));
    }
    for side in [&client, &server] {
        assert_eq!(side.chains("verified"), 3.0, "{}", side.metrics());
        assert_eq!(side.chains("cached"), 0.0, "{}", side.metrics());
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_picks_the_first_of_tls_ciphers_that_the_client_offers() {
    let dir = temp_dir("ciphers");
    let side = |ciphers: Option<&[&str]>| {
        Side::build(&dir, Duration::from_secs(7200), false, &[], true, ciphers)
    };
    // A client preferring AES-256 (as ztunnel and OpenSSL do).
    let aes256_first = side(Some(&["TLS_AES_256_GCM_SHA384", "TLS_AES_128_GCM_SHA256"]));
    async fn cipher(client: &Side, addr: SocketAddr) -> String {
        once_with_group(client, addr, SERVER).await.unwrap().2
    }
    let by_default = serve(&side(None)).await;
    assert_eq!(cipher(&side(None), by_default).await, "TLS_AES_128_GCM_SHA256");
    assert_eq!(cipher(&aes256_first, by_default).await, "TLS_AES_128_GCM_SHA256", "server order");
    // An empty list: BoringSSL's defaults, where the server follows the client.
    let boringssl = serve(&side(Some(&[]))).await;
    assert_eq!(cipher(&aes256_first, boringssl).await, "TLS_AES_256_GCM_SHA384");
    assert_eq!(cipher(&side(None), boringssl).await, "TLS_AES_128_GCM_SHA256");
    // A server that requires AES-256.
    let only256 = serve(&side(Some(&["TLS_AES_256_GCM_SHA384"]))).await;
    assert_eq!(cipher(&side(None), only256).await, "TLS_AES_256_GCM_SHA384");
    let _ = std::fs::remove_dir_all(dir);
}

/// Tickets a plain BoringSSL client (our certificate, no verification) receives from `addr`
/// when it offers `alpn` (wire format; `None`: no ALPN extension, as `openssl s_time`).
async fn tickets_received(client: &Side, addr: SocketAddr, alpn: Option<&[u8]>) -> usize {
    use boring::ssl::{Ssl, SslContext, SslMethod, SslSessionCacheMode, SslVerifyMode};
    use std::sync::atomic::{AtomicUsize, Ordering};
    let bundle = client.store.fetch(&CLIENT.parse().unwrap()).await.unwrap();
    let mut b = SslContext::builder(SslMethod::tls()).unwrap();
    b.set_certificate(&boring::x509::X509::from_der(&bundle.cert_der).unwrap()).unwrap();
    b.set_private_key(&bundle.key).unwrap();
    b.set_verify(SslVerifyMode::NONE);
    if let Some(a) = alpn {
        b.set_alpn_protos(a).unwrap();
    }
    b.set_session_cache_mode(SslSessionCacheMode::CLIENT | SslSessionCacheMode::NO_INTERNAL);
    let n = Arc::new(AtomicUsize::new(0));
    let seen = n.clone();
    b.set_new_session_callback(move |_, _| {
        seen.fetch_add(1, Ordering::SeqCst);
    });
    let ctx = b.build();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut s =
        tokio_boring::SslStreamBuilder::new(Ssl::new(&ctx).unwrap(), tcp).connect().await.unwrap();
    let mut byte = [0u8; 1];
    s.read_exact(&mut byte).await.unwrap(); // the server's tickets come before its byte
    let _ = s.shutdown().await;
    n.load(Ordering::SeqCst)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tickets_go_only_to_clients_that_say_they_keep_them() {
    let dir = temp_dir("tickets-alpn");
    let server = Side::new(&dir, Duration::from_secs(7200), true);
    let client = Side::new(&dir, Duration::from_secs(7200), true);
    let addr = serve(&server).await;
    let token = mbtunnel::tls::resume::client_alpn(true);
    assert!(tickets_received(&client, addr, Some(&token)).await >= 1, "an mbtunnel peer");
    assert_eq!(tickets_received(&client, addr, Some(b"\x02h2")).await, 0, "h2 only (ztunnel)");
    assert_eq!(tickets_received(&client, addr, None).await, 0, "no ALPN (openssl s_time)");
    // …and an mbtunnel client with resumption off does not offer the token.
    assert_eq!(mbtunnel::tls::resume::client_alpn(false), b"\x02h2");
    let _ = std::fs::remove_dir_all(dir);
}

/// A waypoint may present its own identity or one of its service's SANs: the client accepts any
/// identity of the list it was given — on a full handshake and on a resumed one — and no other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_accepts_any_of_the_identities_it_lists_and_no_other() {
    let dir = temp_dir("anyof");
    let server = Side::new(&dir, Duration::from_secs(7200), true);
    let client = Side::new(&dir, Duration::from_secs(7200), true);
    let addr = serve(&server).await;
    let me: Identity = CLIENT.parse().unwrap();
    let id = |s: &str| -> Identity { s.parse().unwrap() };
    let alt = id("spiffe://cluster.local/ns/default/sa/waypoint");
    let other = id("spiffe://cluster.local/ns/default/sa/other");
    for (expected, ok) in [
        (vec![alt.clone(), id(SERVER)], true),
        (vec![alt.clone(), id(SERVER)], true), // resumed
        (vec![alt.clone(), other.clone()], false),
    ] {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        match client.tls.connect_to_any(tcp, &me, &expected, Some(addr)).await {
            Ok(mut s) => {
                assert!(ok, "{expected:?} accepted a server that is none of them");
                let mut b = [0u8; 1];
                s.read_exact(&mut b).await.unwrap();
                let _ = s.shutdown().await;
            }
            Err(e) => {
                assert!(!ok, "{expected:?}: {e}");
                assert_eq!(e.reason(), "tls_wrong_identity", "{e}");
                assert!(e.to_string().contains("waypoint or"), "names every identity: {e}");
            }
        }
    }
    assert_eq!(client.handshakes("client", "resumed"), 1.0, "{}", client.metrics());
    assert!(
        client
            .tls
            .connect_to_any(tokio::net::TcpStream::connect(addr).await.unwrap(), &me, &[], None)
            .await
            .is_err(),
        "an empty list accepts nobody"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A TCP relay in front of `upstream` that keeps the first 64 KiB each client sent (its
/// plaintext ClientHello records lead), one capture per connection, in accept order.
async fn capturing_relay(
    upstream: SocketAddr,
) -> (SocketAddr, Arc<std::sync::Mutex<Vec<Arc<std::sync::Mutex<Vec<u8>>>>>>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let captures = Arc::new(std::sync::Mutex::new(Vec::new()));
    let all = captures.clone();
    tokio::spawn(async move {
        loop {
            let (down, _) = l.accept().await.unwrap();
            let up = tokio::net::TcpStream::connect(upstream).await.unwrap();
            let cap = Arc::new(std::sync::Mutex::new(Vec::new()));
            all.lock().unwrap().push(cap.clone());
            let (mut dr, mut dw) = down.into_split();
            let (mut ur, mut uw) = up.into_split();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut ur, &mut dw).await;
            });
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16384];
                loop {
                    let n = match dr.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    {
                        let mut c = cap.lock().unwrap();
                        let room = 65536usize.saturating_sub(c.len());
                        c.extend_from_slice(&buf[..n.min(room)]);
                    }
                    if uw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                let _ = uw.shutdown().await;
            });
        }
    });
    (addr, captures)
}

/// The key-share groups of each plaintext ClientHello in `bytes` (a client's side of a
/// connection): one list per ClientHello, two ClientHellos after a HelloRetryRequest.
fn client_hello_key_shares(bytes: &[u8]) -> Vec<Vec<u16>> {
    let u16at = |b: &[u8], i: usize| u16::from_be_bytes([b[i], b[i + 1]]);
    let mut out = Vec::new();
    let mut r = 0;
    while r + 5 <= bytes.len() {
        let (kind, len) = (bytes[r], u16at(bytes, r + 3) as usize);
        let rec = &bytes[r + 5..(r + 5 + len).min(bytes.len())];
        r += 5 + len;
        if kind != 22 || rec.first() != Some(&1) {
            continue; // not a handshake record holding a ClientHello
        }
        let mut p = 4 + 2 + 32; // handshake header, legacy_version, random
        p += 1 + rec[p] as usize; // session id
        p += 2 + u16at(rec, p) as usize; // cipher suites
        p += 1 + rec[p] as usize; // compression methods
        let end = p + 2 + u16at(rec, p) as usize;
        p += 2;
        let mut groups = Vec::new();
        while p + 4 <= end {
            let (typ, elen) = (u16at(rec, p), u16at(rec, p + 2) as usize);
            if typ == 51 {
                let mut q = p + 6; // extension header, client_shares length
                while q + 4 <= p + 4 + elen {
                    groups.push(u16at(rec, q));
                    q += 4 + u16at(rec, q + 2) as usize;
                }
            }
            p += 4 + elen;
        }
        out.push(groups);
    }
    out
}

/// The key shares of every ClientHello each connection through a relay sent.
fn key_shares_seen(
    captures: &std::sync::Mutex<Vec<Arc<std::sync::Mutex<Vec<u8>>>>>,
) -> Vec<Vec<Vec<u16>>> {
    captures.lock().unwrap().iter().map(|c| client_hello_key_shares(&c.lock().unwrap())).collect()
}

const X25519MLKEM768: u16 = 0x11ec;
const X25519: u16 = 0x001d;
const SECP256R1: u16 = 0x0017;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sends_one_key_share_for_the_group_its_destination_chose_last() {
    let dir = temp_dir("keyshare");
    let long = Duration::from_secs(7200);
    let server = Side::new(&dir, long, false);
    let client = Side::new(&dir, long, false);
    let (addr, captures) = capturing_relay(serve(&server).await).await;
    // First contact: BoringSSL's default shares, the hybrid and X25519, one ClientHello.
    let (_, g, _) = once_with_group(&client, addr, SERVER).await.unwrap();
    assert_eq!(g, "X25519MLKEM768");
    // Then only the hybrid's share, and the same group, without a retry.
    let (_, g, _) = once_with_group(&client, addr, SERVER).await.unwrap();
    assert_eq!(g, "X25519MLKEM768");
    let seen = key_shares_seen(&captures);
    assert_eq!(seen, [vec![vec![X25519MLKEM768, X25519]], vec![vec![X25519MLKEM768]]]);

    // A destination that accepts P-256 only: the first handshake needs a HelloRetryRequest
    // (two ClientHellos); the next sends the P-256 share at once.
    let p256 = Side::with_groups(&dir, long, false, &["P-256"]);
    let (addr, captures) = capturing_relay(serve(&p256).await).await;
    for _ in 0..2 {
        let (_, g, _) = once_with_group(&client, addr, SERVER).await.unwrap();
        assert_eq!(g, "P-256");
    }
    let seen = key_shares_seen(&captures);
    assert_eq!(seen, [vec![vec![X25519MLKEM768, X25519], vec![SECP256R1]], vec![vec![SECP256R1]]]);
    let _ = std::fs::remove_dir_all(dir);
}
