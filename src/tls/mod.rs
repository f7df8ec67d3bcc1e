//! TLS with BoringSSL: TLS 1.3 only, ALPN h2, client certificates required, chains verified
//! against the mesh root, and the peer's SPIFFE id checked on both sides — the client requires
//! exactly the expected destination identity, the server requires its own trust domain.
//! Private keys never sign inline: every context uses the signer's async key method.
//!
//! Contexts are built from scratch, per identity: nothing reads the system trust store (a context
//! from `SslConnector::builder` would parse the whole CA bundle, ~1 MB of memory per identity).
//! Handshakes are bounded in time and in number: at most `max_concurrent_handshakes` compute at
//! once per side, later ones wait in arrival order, and a handshake waiting on its peer holds no
//! turn (see [`crate::net::gate`]). A failure carries its real reason (timeout, peer
//! closed, bad record, alert received, no certificate, wrong identity…), and a refused peer
//! certificate is answered with the `certificate_unknown` alert.
//!
//! With `tls_resumption` on, mbtunnel peers resume TLS 1.3 sessions (PSK with ECDHE): see
//! [`resume`] for what keeps that as strict as a full handshake. Chains that verified are
//! remembered per context (`tls_verify_cache`): see [`verify`] for what is still checked on
//! every handshake.
#![deny(unsafe_code)]

mod keyshare;
pub mod resume;
pub mod suites;
mod verify;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use boring::ssl::{
    Ssl, SslContext, SslContextBuilder, SslInfoCallbackMode, SslInfoCallbackValue, SslMethod,
    SslOptions, SslSessionCacheMode, SslVerifyMode, SslVersion,
};
use boring::x509::store::X509StoreBuilder;
use boring::x509::{X509Ref, X509};
use tokio::sync::Semaphore;
use tokio_boring::{SslStream, SslStreamBuilder};

use crate::net::gate::Gate;
use crate::net::io::Buffered;

/// Key-exchange groups `tls_groups` may name (BoringSSL's names).
pub const GROUPS: &[&str] = &["X25519MLKEM768", "X25519", "P-256", "P-384", "P-521"];

/// What TLS runs over: a TCP connection, or an in-memory pipe (same-node HBONE in eBPF mode).
pub trait Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static> Stream for T {}

use crate::identity::store::{CertBundle, CertStore};
use crate::identity::Identity;
use crate::metrics::{HandshakeLabels, Metrics};
use crate::signer::Signer;

#[derive(Clone, Debug, thiserror::Error)]
pub enum TlsError {
    #[error("certificate: {0}")]
    Cert(String),
    #[error("TLS setup: {0}")]
    Setup(String),
    #[error("TLS handshake failed ({reason}): {detail}")]
    Handshake { reason: &'static str, detail: String },
    #[error("TLS handshake timed out after {0:?}")]
    Timeout(Duration),
    #[error("peer certificate chain rejected: {0}")]
    Untrusted(String),
    #[error("peer presented no certificate")]
    NoPeerCert,
    #[error("peer identity {got} is not the expected {want}")]
    WrongIdentity { got: String, want: String },
    #[error("peer identity {0} is outside trust domain {1}")]
    WrongTrustDomain(String, String),
    #[error("peer certificate has no valid SPIFFE id")]
    NoSpiffeId,
}

impl TlsError {
    /// A short, fixed label for the refusal metric's `reason`.
    pub fn reason(&self) -> &'static str {
        match self {
            TlsError::Cert(_) => "tls_no_local_certificate",
            TlsError::Setup(_) => "tls_setup",
            TlsError::Handshake { reason, .. } => reason,
            TlsError::Timeout(_) => "tls_timeout",
            TlsError::Untrusted(_) => "tls_untrusted_chain",
            TlsError::NoPeerCert => "tls_no_certificate",
            TlsError::WrongIdentity { .. } => "tls_wrong_identity",
            TlsError::WrongTrustDomain(..) => "tls_wrong_trust_domain",
            TlsError::NoSpiffeId => "tls_no_spiffe_id",
        }
    }
}

impl From<boring::error::ErrorStack> for TlsError {
    fn from(e: boring::error::ErrorStack) -> Self {
        TlsError::Setup(e.to_string())
    }
}

/// SPIFFE ids in the URI SANs of a DER certificate.
pub fn spiffe_ids_of(der: &[u8]) -> Result<Vec<Identity>, TlsError> {
    use x509_parser::prelude::*;
    let (_, cert) = X509Certificate::from_der(der).map_err(|e| TlsError::Cert(e.to_string()))?;
    let mut ids = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let GeneralName::URI(uri) = name {
                if let Ok(id) = uri.parse::<Identity>() {
                    ids.push(id);
                }
            }
        }
    }
    Ok(ids)
}

/// The single SPIFFE id of a peer certificate, read from BoringSSL's own parse of it (a
/// handshake's certificate reads neither re-encode it nor parse it a second time).
fn peer_identity_of(cert: &X509Ref) -> Result<Identity, TlsError> {
    let mut ids: Vec<Identity> = cert
        .subject_alt_names()
        .map(|names| names.iter().filter_map(|n| n.uri()?.parse().ok()).collect())
        .unwrap_or_default();
    if ids.len() != 1 {
        return Err(TlsError::NoSpiffeId);
    }
    Ok(ids.remove(0))
}

/// Where a connection's chain check leaves the reason it refused the peer's certificate.
type Refusal = Arc<Mutex<Option<TlsError>>>;

/// Prebuilt contexts for one certificate.
struct Contexts {
    serial: String,
    acceptor: SslContext,
    connector: SslContext,
    /// When they were built (their ticket keys are as old).
    built: Instant,
    /// Sessions the connector may resume, by destination (empty with resumption off).
    sessions: Arc<resume::ClientSessions>,
    /// Certificates in the contexts' default stores (where a system trust bundle would go).
    default_store_objects: usize,
}

/// Builds TLS contexts from the certificate store, cached per certificate serial.
pub struct TlsProvider {
    store: Arc<CertStore>,
    signer: Signer,
    trust_domain: String,
    metrics: Arc<Metrics>,
    cache: Mutex<HashMap<Identity, Arc<Contexts>>>,
    inline_signing: bool,
    resumption: bool,
    /// Remember chains that verified (`tls_verify_cache`, see [`verify`]).
    verify_cache: bool,
    /// `tls_groups` joined for BoringSSL; empty = its defaults.
    groups: String,
    /// The group each destination chose last: its key share is the only one a client sends
    /// (see [`keyshare`]).
    key_shares: keyshare::Predictions,
    /// `tls_ciphers`: TLS 1.3 suites in strict preference order; empty = BoringSSL's defaults.
    ciphers: Vec<String>,
    handshake_timeout: Duration,
    /// One gate per side: turns at the CPU for handshakes, taken in arrival order and held only
    /// while a handshake has bytes to work on (see [`crate::net::gate`]).
    server_gate: Arc<Semaphore>,
    client_gate: Arc<Semaphore>,
}

impl TlsProvider {
    pub fn new(
        store: Arc<CertStore>,
        signer: Signer,
        trust_domain: String,
        metrics: Arc<Metrics>,
    ) -> TlsProvider {
        TlsProvider {
            store,
            signer,
            trust_domain,
            metrics,
            cache: Mutex::new(HashMap::new()),
            inline_signing: false,
            resumption: false,
            verify_cache: true,
            groups: String::new(),
            key_shares: keyshare::Predictions::default(),
            ciphers: suites::default_order(),
            handshake_timeout: crate::net::Limits::default().handshake_timeout,
            server_gate: turns(crate::net::Limits::default().max_concurrent_handshakes),
            client_gate: turns(crate::net::Limits::default().max_concurrent_handshakes),
        }
    }

    /// Applies the handshake timeout and the concurrency bound of `limits`.
    pub fn with_limits(mut self, limits: &crate::net::Limits) -> Self {
        self.handshake_timeout = limits.handshake_timeout;
        self.server_gate = turns(limits.max_concurrent_handshakes);
        self.client_gate = turns(limits.max_concurrent_handshakes);
        self
    }

    /// TLS 1.3 resumption between mbtunnel peers (off unless asked for; `tls_resumption` in the
    /// config turns it on for the proxy).
    pub fn with_resumption(mut self, on: bool) -> Self {
        self.resumption = on;
        self
    }

    /// Whether each context remembers the peer chains that verified, so that the same chain
    /// presented again skips its signature checks (on unless turned off; `tls_verify_cache` in
    /// the config). The peer's proof of its key, the validity times and the identity are
    /// checked on every handshake either way: see [`verify`].
    pub fn with_verify_cache(mut self, on: bool) -> Self {
        self.verify_cache = on;
        self
    }

    /// TLS 1.3 cipher suites in strict preference order, both sides (names from
    /// [`suites::SUITES`]); empty = BoringSSL's defaults. See [`suites`] for the default.
    pub fn with_ciphers(mut self, ciphers: &[String]) -> Self {
        self.ciphers = ciphers.to_vec();
        self
    }

    /// Key-exchange groups in preference order (names from [`GROUPS`]); empty = BoringSSL's
    /// defaults (X25519MLKEM768, X25519, P-256, P-384).
    pub fn with_groups(mut self, groups: &[String]) -> Self {
        self.groups = groups.join(":");
        self
    }

    /// Client sessions kept for `id`'s certificate (`None` before its contexts are built).
    #[doc(hidden)]
    pub fn cached_sessions(&self, id: &Identity) -> Option<usize> {
        Some(self.cache.lock().unwrap().get(id)?.sessions.len())
    }

    /// The longest ticket lifetime a server gave `id`'s kept sessions (tests).
    #[doc(hidden)]
    pub fn longest_ticket_lifetime(&self, id: &Identity) -> Option<Duration> {
        self.cache.lock().unwrap().get(id)?.sessions.longest_ticket_lifetime()
    }

    /// Benchmark baseline only: sign inside BoringSSL on the handshake's own thread instead of
    /// through the signer. Never used by the proxy.
    #[doc(hidden)]
    pub fn with_inline_signing(mut self) -> Self {
        self.inline_signing = true;
        self
    }

    pub fn store(&self) -> &Arc<CertStore> {
        &self.store
    }

    /// Drops the contexts built for `id` (its certificate was forgotten).
    pub fn forget(&self, id: &Identity) {
        self.cache.lock().unwrap().remove(id);
    }

    /// Identities with contexts built now.
    pub fn cached(&self) -> usize {
        self.cache.lock().unwrap().len()
    }

    /// The contexts of `id`'s current certificate. A handshake never requests a certificate
    /// itself: it asks the store, which starts a request only when none is in flight and no
    /// backoff runs, and waits for one in flight at most the handshake timeout. Without a
    /// certificate the handshake fails (`tls_no_local_certificate`, with the store's reason).
    async fn contexts(&self, id: &Identity) -> Result<Arc<Contexts>, TlsError> {
        let bundle = self
            .store
            .fetch_within(id, self.handshake_timeout)
            .await
            .map_err(|e| TlsError::Cert(e.to_string()))?;
        if let Some(c) = self.cache.lock().unwrap().get(id) {
            // With tickets on, contexts are rebuilt hourly so that no ticket key outlives that.
            let fresh = !self.resumption || c.built.elapsed() < resume::TICKET_KEY_ROTATION;
            if c.serial == bundle.serial && fresh {
                return Ok(c.clone());
            }
        }
        self.build(id, &bundle)
    }

    /// Builds and caches `id`'s contexts on `bundle`.
    fn build(&self, id: &Identity, bundle: &CertBundle) -> Result<Arc<Contexts>, TlsError> {
        let mut n = 0;
        let sessions = Arc::new(resume::ClientSessions::default());
        let c = Arc::new(Contexts {
            serial: bundle.serial.clone(),
            acceptor: self.build_acceptor(bundle, &mut n)?,
            connector: self.build_connector(bundle, &sessions, &mut n)?,
            built: Instant::now(),
            sessions,
            default_store_objects: n,
        });
        self.cache.lock().unwrap().insert(id.clone(), c.clone());
        Ok(c)
    }

    /// Builds the contexts of each of `ids` whose current certificate has none yet; returns how
    /// many it built. Called as certificates arrive (issued or renewed), off the connection
    /// workers, so that a new workload's first connections — or every identity's after a
    /// rotation — do not each parse a chain, a key and the roots on a worker first (measured in
    /// the handshake-storm bench: ~0.2 ms of the client proxy's CPU per first connection).
    pub fn warm(&self, ids: &[Identity]) -> usize {
        let mut built = 0;
        for id in ids {
            let Some(bundle) = self.store.current(id) else { continue };
            let have = self.cache.lock().unwrap().get(id).map(|c| c.serial.clone());
            if have.as_ref() == Some(&bundle.serial) {
                continue;
            }
            match self.build(id, &bundle) {
                Ok(_) => built += 1,
                Err(e) => tracing::warn!(identity = %id, error = %e,
                    "could not build TLS contexts ahead of the first connection"),
            }
        }
        built
    }

    fn root_store(bundle: &CertBundle) -> Result<boring::x509::store::X509Store, TlsError> {
        let mut b = X509StoreBuilder::new()?;
        for r in &bundle.roots_der {
            b.add_cert(X509::from_der(r)?)?;
        }
        Ok(b.build())
    }

    /// Settings both sides share: TLS 1.3 only, tickets only with resumption on, the
    /// certificate, its key through the signer, the mesh root for verifying the peer, and a log
    /// line for alerts.
    fn common(
        &self,
        bundle: &CertBundle,
        budget: crate::signer::Budget,
    ) -> Result<SslContextBuilder, TlsError> {
        let mut b = SslContextBuilder::new(SslMethod::tls())?;
        b.set_min_proto_version(Some(SslVersion::TLS1_3))?;
        b.set_max_proto_version(Some(SslVersion::TLS1_3))?;
        if self.resumption {
            b.set_options(SslOptions::CIPHER_SERVER_PREFERENCE);
        } else {
            b.set_options(SslOptions::NO_TICKET | SslOptions::CIPHER_SERVER_PREFERENCE);
        }
        b.set_session_cache_mode(SslSessionCacheMode::OFF);
        if !self.groups.is_empty() {
            b.set_curves_list(&self.groups)?;
        }
        suites::apply(&mut b, &self.ciphers).map_err(TlsError::Setup)?;
        b.set_certificate(X509::from_der(&bundle.cert_der)?.as_ref())?;
        for c in &bundle.chain_der {
            b.add_extra_chain_cert(X509::from_der(c)?)?;
        }
        if self.inline_signing {
            b.set_private_key(&bundle.key)?;
        } else {
            b.set_async_private_key_method(self.signer.key_method_for(bundle.key.clone(), budget));
        }
        b.set_verify_cert_store(Self::root_store(bundle)?)?;
        verify::install(&mut b, self.verify_cache.then(Default::default), self.metrics.clone());
        let metrics = self.metrics.clone();
        b.set_info_callback(move |_, mode, v| count_alert(&metrics, mode, v));
        Ok(b)
    }

    fn build_acceptor(&self, bundle: &CertBundle, n: &mut usize) -> Result<SslContext, TlsError> {
        // Server signatures are made before the client is authenticated: their own budget, so
        // a flood on 15008 cannot starve this node's outbound handshakes.
        let mut b = self.common(bundle, crate::signer::Budget::Inbound)?;
        b.set_alpn_select_callback(|_, client| {
            boring::ssl::select_next_proto(b"\x02h2", client)
                .ok_or(boring::ssl::AlpnError::ALERT_FATAL)
        });
        b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
        if self.resumption {
            // Tickets are bound to this trust domain and certificate.
            let sid = boring::sha::sha256(format!("mbtunnel {}", self.trust_domain).as_bytes());
            resume::server_context(&mut b, &sid)?;
        }
        let ctx = b.build();
        *n += store_len(&ctx);
        Ok(ctx)
    }

    fn build_connector(
        &self,
        bundle: &CertBundle,
        sessions: &Arc<resume::ClientSessions>,
        n: &mut usize,
    ) -> Result<SslContext, TlsError> {
        let mut b = self.common(bundle, crate::signer::Budget::Outbound)?;
        b.set_alpn_protos(&resume::client_alpn(self.resumption))?;
        b.set_verify(SslVerifyMode::PEER);
        if self.resumption {
            b.set_session_cache_mode(
                SslSessionCacheMode::CLIENT | SslSessionCacheMode::NO_INTERNAL,
            );
            let sessions = Arc::downgrade(sessions);
            let own_not_after = bundle.not_after;
            b.set_new_session_callback(move |ssl, session| {
                let (Some(sessions), Some(key)) = (sessions.upgrade(), resume::key_of(ssl)) else {
                    return;
                };
                let server_left =
                    ssl.peer_certificate().map(|c| resume::remaining_of(&c)).unwrap_or_default();
                let valid_for = Duration::from_secs(u64::from(session.timeout()))
                    .min(server_left)
                    .min(resume::remaining(own_not_after))
                    .min(resume::MAX_TICKET_LIFETIME);
                sessions.put(key.clone(), session, valid_for);
            });
        }
        let ctx = b.build();
        *n += store_len(&ctx);
        Ok(ctx)
    }

    /// Objects in the default certificate store of `id`'s contexts (the store the system trust
    /// bundle would be loaded into); `None` before the contexts are built. Tests check it is 0.
    #[doc(hidden)]
    pub fn default_store_objects(&self, id: &Identity) -> Option<usize> {
        Some(self.cache.lock().unwrap().get(id)?.default_store_objects)
    }

    /// Builds the contexts of `id` now (benches and start-up).
    #[doc(hidden)]
    pub async fn prepare(&self, id: &Identity) -> Result<(), TlsError> {
        self.contexts(id).await.map(|_| ())
    }

    /// Counts a handshake; `resumed` only for a successful one.
    fn record(&self, side: &'static str, ok: bool, resumed: bool, start: Instant) {
        let l = HandshakeLabels {
            side,
            result: if ok { "success" } else { "failure" },
            kind: if ok && resumed { "resumed" } else { "full" },
        };
        self.metrics.handshakes.get_or_create(&l).inc();
        self.metrics.handshake_seconds.get_or_create(&l).observe(start.elapsed().as_secs_f64());
    }

    /// `stream`, buffered, its reads taking turns at `gate` until the handshake is done.
    fn gated<S: Stream>(
        gate: &Arc<Semaphore>,
        stream: S,
        peer_turn: Option<Arc<AtomicBool>>,
    ) -> Buffered<S> {
        let mut b = Buffered::new(stream);
        b.set_gate(Gate::new(gate.clone(), peer_turn.unwrap_or_default()));
        b
    }

    /// Runs `hs` within the handshake timeout.
    async fn bounded<T>(
        &self,
        hs: impl std::future::Future<Output = Result<T, TlsError>>,
    ) -> Result<T, TlsError> {
        match tokio::time::timeout(self.handshake_timeout, hs).await {
            Ok(r) => r,
            Err(_) => Err(TlsError::Timeout(self.handshake_timeout)),
        }
    }

    /// Server side: handshake as `local` and return the peer's identity.
    pub async fn accept<S: Stream>(
        &self,
        stream: S,
        local: &Identity,
    ) -> Result<(SslStream<Buffered<S>>, Identity), TlsError> {
        self.accept_with(stream, local, None).await
    }

    /// [`TlsProvider::accept`], keeping `peer_turn` set while the handshake waits on its peer
    /// (what the pending-handshake budget reads).
    pub async fn accept_with<S: Stream>(
        &self,
        stream: S,
        local: &Identity,
        peer_turn: Option<Arc<AtomicBool>>,
    ) -> Result<(SslStream<Buffered<S>>, Identity), TlsError> {
        let ctx = self.contexts(local).await?;
        let start = Instant::now();
        let r = self
            .bounded(async {
                let mut ssl = Ssl::new(&ctx.acceptor)?;
                let refusal = Refusal::default();
                verify::expect(
                    &mut ssl,
                    verify::PeerCheck {
                        want: verify::Want::TrustDomain(self.trust_domain.clone()),
                        refusal: refusal.clone(),
                        cap_tickets: self.resumption,
                    },
                );
                let mut s =
                    SslStreamBuilder::new(ssl, Self::gated(&self.server_gate, stream, peer_turn))
                        .accept()
                        .await
                        .map_err(|e| handshake_error(&e, &refusal))?;
                s.get_mut().end_gate();
                let cert = s.ssl().peer_certificate().ok_or(TlsError::NoPeerCert)?;
                let peer = peer_identity_of(&cert)?;
                if s.ssl().session_reused() {
                    // No certificate was verified in this handshake: the session's must still
                    // pass the same checks.
                    in_trust_domain(&peer, &self.trust_domain)?;
                    still_valid(&cert)?;
                }
                Ok((s, peer))
            })
            .await;
        let resumed = r.as_ref().is_ok_and(|(s, _)| s.ssl().session_reused());
        if let Ok((s, peer)) = &r {
            log_done("server", s.ssl(), peer);
        }
        self.record("server", r.is_ok(), resumed, start);
        r
    }

    /// Client side: handshake as `local`, requiring the server to be exactly `expected`.
    /// Never resumes (see [`TlsProvider::connect_to`]).
    pub async fn connect<S: Stream>(
        &self,
        stream: S,
        local: &Identity,
        expected: &Identity,
    ) -> Result<SslStream<Buffered<S>>, TlsError> {
        self.connect_to(stream, local, expected, None).await
    }

    /// Client side, to the server at `dest`: with resumption on, offers a session from an
    /// earlier connection to the same `dest` and `expected` identity, and keeps the tickets this
    /// connection receives for the next one.
    pub async fn connect_to<S: Stream>(
        &self,
        stream: S,
        local: &Identity,
        expected: &Identity,
        dest: Option<SocketAddr>,
    ) -> Result<SslStream<Buffered<S>>, TlsError> {
        self.connect_to_any(stream, local, std::slice::from_ref(expected), dest).await
    }

    /// [`connect_to`](Self::connect_to), accepting a server that presents any identity of
    /// `expected` (a destination's own, then its service's subject alt names); sessions are
    /// kept under the first. `expected` must not be empty.
    pub async fn connect_to_any<S: Stream>(
        &self,
        stream: S,
        local: &Identity,
        expected: &[Identity],
        dest: Option<SocketAddr>,
    ) -> Result<SslStream<Buffered<S>>, TlsError> {
        let Some(primary) = expected.first() else {
            return Err(TlsError::WrongIdentity { got: String::new(), want: "(none)".into() });
        };
        let ctx = self.contexts(local).await?;
        let start = Instant::now();
        let r = self
            .bounded(async {
                let mut ssl = Ssl::new(&ctx.connector)?;
                if let Some(addr) = dest {
                    self.key_shares.hint(&mut ssl, addr);
                }
                if let (true, Some(addr)) = (self.resumption, dest) {
                    let key = resume::SessionKey { expected: primary.clone(), addr };
                    if let Some(session) = ctx.sessions.take(&key) {
                        resume::offer(&mut ssl, &session)?;
                    }
                    resume::tag(&mut ssl, key);
                }
                let refusal = Refusal::default();
                verify::expect(
                    &mut ssl,
                    verify::PeerCheck {
                        want: verify::Want::AnyOf(expected.to_vec()),
                        refusal: refusal.clone(),
                        cap_tickets: false,
                    },
                );
                let mut s =
                    SslStreamBuilder::new(ssl, Self::gated(&self.client_gate, stream, None))
                        .connect()
                        .await
                        .map_err(|e| handshake_error(&e, &refusal))?;
                s.get_mut().end_gate();
                if s.ssl().session_reused() {
                    // The server proved it holds the session's secret, not a certificate: the
                    // session's certificate must still be the expected identity, and valid.
                    let cert = s.ssl().peer_certificate().ok_or(TlsError::NoPeerCert)?;
                    let got = peer_identity_of(&cert)?;
                    if !expected.contains(&got) {
                        return Err(TlsError::WrongIdentity {
                            got: got.to_string(),
                            want: verify::wanted(expected),
                        });
                    }
                    still_valid(&cert)?;
                }
                Ok(s)
            })
            .await;
        let resumed = r.as_ref().is_ok_and(|s| s.ssl().session_reused());
        if let Ok(s) = &r {
            log_done("client", s.ssl(), primary);
            if let Some(addr) = dest {
                self.key_shares.learn(addr, s.ssl());
            }
        }
        self.record("client", r.is_ok(), resumed, start);
        r
    }
}

/// A gate of `n` turns (at least one).
fn turns(n: usize) -> Arc<Semaphore> {
    Arc::new(Semaphore::new(n.max(1)))
}

/// What a completed handshake negotiated, at debug level.
fn log_done(side: &'static str, ssl: &boring::ssl::SslRef, peer: &Identity) {
    tracing::debug!(
        side,
        %peer,
        group = ssl.curve_name().unwrap_or("none"),
        cipher = ssl.current_cipher().map(|c| c.name()).unwrap_or("none"),
        resumed = ssl.session_reused(),
        "TLS handshake complete"
    );
}

fn in_trust_domain(id: &Identity, td: &str) -> Result<(), TlsError> {
    if id.trust_domain == td {
        Ok(())
    } else {
        Err(TlsError::WrongTrustDomain(id.to_string(), td.to_string()))
    }
}

/// A resumed session's certificate must not have expired since it was verified.
fn still_valid(cert: &X509Ref) -> Result<(), TlsError> {
    if resume::remaining_of(cert).is_zero() {
        return Err(TlsError::Untrusted("the resumed session's certificate has expired".into()));
    }
    Ok(())
}

/// Certificates in a context's default store. (`objects()` is deprecated because the references
/// it returns may be invalidated by a concurrent lookup; only the length is read, at once.)
#[allow(deprecated)]
fn store_len(ctx: &SslContext) -> usize {
    ctx.cert_store().objects().len()
}

/// Counts alerts and logs them: received ones at info (the peer refused us, and says why), at
/// most once a second per alert (any peer can send one per connection; see `crate::ratelog`), a
/// `close_notify` (an orderly close, not a refusal) and sent ones at debug.
fn count_alert(metrics: &Metrics, mode: SslInfoCallbackMode, v: SslInfoCallbackValue) {
    static RECEIVED: std::sync::LazyLock<crate::ratelog::RateLog<&'static str>> =
        std::sync::LazyLock::new(Default::default);
    let SslInfoCallbackValue::Alert(a) = v else { return };
    let alert = alert_name(a.alert());
    let direction = if mode == SslInfoCallbackMode::READ_ALERT {
        if alert == "close_notify" {
            tracing::debug!(alert, "TLS alert received from the peer");
        } else {
            crate::log_limited!(RECEIVED, alert, info, alert, "TLS alert received from the peer");
        }
        "received"
    } else if mode == SslInfoCallbackMode::WRITE_ALERT {
        tracing::debug!(alert, "TLS alert sent to the peer");
        "sent"
    } else {
        return;
    };
    metrics.tls_alerts.get_or_create(&crate::metrics::AlertLabels { direction, alert }).inc();
}

/// The RFC 8446 name of an alert.
pub fn alert_name(a: boring::ssl::SslAlert) -> &'static str {
    use boring::ssl::SslAlert as A;
    const NAMES: &[(A, &str)] = &[
        (A::CLOSE_NOTIFY, "close_notify"),
        (A::UNEXPECTED_MESSAGE, "unexpected_message"),
        (A::BAD_RECORD_MAC, "bad_record_mac"),
        (A::RECORD_OVERFLOW, "record_overflow"),
        (A::HANDSHAKE_FAILURE, "handshake_failure"),
        (A::BAD_CERTIFICATE, "bad_certificate"),
        (A::UNSUPPORTED_CERTIFICATE, "unsupported_certificate"),
        (A::CERTIFICATE_REVOKED, "certificate_revoked"),
        (A::CERTIFICATE_EXPIRED, "certificate_expired"),
        (A::CERTIFICATE_UNKNOWN, "certificate_unknown"),
        (A::ILLEGAL_PARAMETER, "illegal_parameter"),
        (A::UNKNOWN_CA, "unknown_ca"),
        (A::ACCESS_DENIED, "access_denied"),
        (A::DECODE_ERROR, "decode_error"),
        (A::DECRYPT_ERROR, "decrypt_error"),
        (A::PROTOCOL_VERSION, "protocol_version"),
        (A::INSUFFICIENT_SECURITY, "insufficient_security"),
        (A::INTERNAL_ERROR, "internal_error"),
        (A::USER_CANCELLED, "user_canceled"),
        (A::MISSING_EXTENSION, "missing_extension"),
        (A::UNSUPPORTED_EXTENSION, "unsupported_extension"),
        (A::UNRECOGNIZED_NAME, "unrecognized_name"),
        (A::CERTIFICATE_REQUIRED, "certificate_required"),
        (A::NO_APPLICATION_PROTOCOL, "no_application_protocol"),
    ];
    NAMES.iter().find(|(x, _)| *x == a).map(|(_, n)| *n).unwrap_or("other")
}

/// The real reason a handshake failed: our own refusal of the peer's certificate first, then what
/// BoringSSL's error stack or the I/O error says.
fn handshake_error<S>(e: &tokio_boring::HandshakeError<S>, refusal: &Refusal) -> TlsError {
    if let Some(r) = refusal.lock().unwrap().take() {
        return r;
    }
    let stack = e.to_string();
    let has = |k: &str| stack.contains(k);
    let reason = if has("ALERT") {
        "tls_alert_received"
    } else if has("PEER_DID_NOT_RETURN_A_CERTIFICATE") {
        "tls_no_certificate"
    } else if has("WRONG_VERSION_NUMBER")
        || has("HTTP_REQUEST")
        || has("DECODE_ERROR")
        || has("RECORD")
        || has("BAD_PACKET")
        || has("UNEXPECTED_MESSAGE")
    {
        "tls_bad_record"
    } else if has("NO_SHARED") || has("APPLICATION_PROTOCOL") || has("UNSUPPORTED_PROTOCOL") {
        "tls_negotiation"
    } else if e.as_io_error().is_some_and(|io| {
        matches!(
            io.kind(),
            std::io::ErrorKind::UnexpectedEof
                | std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::BrokenPipe
        )
    }) || e.code() == Some(boring::ssl::ErrorCode::ZERO_RETURN)
        || e.code() == Some(boring::ssl::ErrorCode::SYSCALL)
    {
        "tls_peer_closed"
    } else if e.as_io_error().is_some() {
        "tls_io"
    } else {
        "tls_handshake"
    };
    TlsError::Handshake { reason, detail: handshake_error_text(e) }
}

fn handshake_error_text<S>(e: &tokio_boring::HandshakeError<S>) -> String {
    match e.as_io_error() {
        Some(io) => format!("{io}"),
        None => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use boring::asn1::Asn1Time;
    use boring::x509::extension::SubjectAlternativeName;
    use std::time::{SystemTime, UNIX_EPOCH};

    /// A self-signed EC certificate with these URI SANs, valid from `from` to `to` seconds
    /// relative to now.
    fn cert(uris: &[&str], from: i64, to: i64) -> X509 {
        use boring::{ec, hash::MessageDigest, nid::Nid, pkey::PKey};
        let group = ec::EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).unwrap();
        let key = PKey::from_ec_key(ec::EcKey::generate(&group).unwrap()).unwrap();
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() as i64;
        let mut b = X509::builder().unwrap();
        b.set_version(2).unwrap();
        b.set_pubkey(&key).unwrap();
        b.set_not_before(&Asn1Time::from_unix((now + from) as _).unwrap()).unwrap();
        b.set_not_after(&Asn1Time::from_unix((now + to) as _).unwrap()).unwrap();
        if !uris.is_empty() {
            let mut san = SubjectAlternativeName::new();
            for u in uris {
                san.uri(u);
            }
            let ext = san.build(&b.x509v3_context(None, None)).unwrap();
            b.append_extension(&ext).unwrap();
        }
        b.sign(&key, MessageDigest::sha256()).unwrap();
        b.build()
    }

    const ID: &str = "spiffe://cluster.local/ns/default/sa/client";

    #[test]
    fn a_peer_has_exactly_one_spiffe_id_read_from_the_parsed_certificate() {
        let id = peer_identity_of(&cert(&[ID], -60, 3600)).unwrap();
        assert_eq!(id.to_string(), ID);
        // URIs that are not SPIFFE ids do not count; they do not make it ambiguous either.
        let id = peer_identity_of(&cert(&["https://example.com/x", ID], -60, 3600)).unwrap();
        assert_eq!(id.to_string(), ID);
        let two = cert(&[ID, "spiffe://cluster.local/ns/default/sa/other"], -60, 3600);
        assert!(matches!(peer_identity_of(&two), Err(TlsError::NoSpiffeId)));
        assert!(matches!(peer_identity_of(&cert(&[], -60, 3600)), Err(TlsError::NoSpiffeId)));
        // The same answer as the DER path the rest of the code uses.
        let der = cert(&[ID], -60, 3600).to_der().unwrap();
        assert_eq!(spiffe_ids_of(&der).unwrap(), vec![id]);
    }

    #[test]
    fn time_left_counts_to_not_after_and_is_zero_outside_the_validity() {
        let within = |d: Duration, lo: u64, hi: u64| {
            assert!((lo..=hi).contains(&d.as_secs()), "{d:?} not in {lo}..={hi} s");
        };
        within(resume::remaining_of(&cert(&[ID], -60, 3600)), 3590, 3600);
        // Days and seconds both count.
        within(
            resume::remaining_of(&cert(&[ID], -60, 3 * 86_400 + 100)),
            3 * 86_400 + 90,
            3 * 86_400 + 100,
        );
        assert_eq!(resume::remaining_of(&cert(&[ID], -3600, -60)), Duration::ZERO, "expired");
        assert_eq!(resume::remaining_of(&cert(&[ID], 600, 3600)), Duration::ZERO, "not yet valid");
        assert!(still_valid(&cert(&[ID], -3600, -1)).is_err());
        assert!(still_valid(&cert(&[ID], -60, 60)).is_ok());
    }
}
