//! TLS with BoringSSL: TLS 1.3 only, ALPN h2, client certificates required, chains verified
//! against the mesh root, and the peer's SPIFFE id checked on both sides — the client requires
//! exactly the expected destination identity, the server requires its own trust domain.
//! Private keys never sign inline: every context uses the signer's async key method.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use boring::ssl::{
    SslAcceptor, SslConnector, SslContextBuilder, SslMethod, SslOptions, SslSessionCacheMode,
    SslVerifyMode, SslVersion,
};
use boring::x509::store::X509StoreBuilder;
use boring::x509::{X509StoreContextRef, X509};
use tokio_boring::SslStream;

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
    #[error("TLS handshake failed: {0}")]
    Handshake(String),
    #[error("peer presented no certificate")]
    NoPeerCert,
    #[error("peer identity {got} is not the expected {want}")]
    WrongIdentity { got: String, want: String },
    #[error("peer identity {0} is outside trust domain {1}")]
    WrongTrustDomain(String, String),
    #[error("peer certificate has no valid SPIFFE id")]
    NoSpiffeId,
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

/// The single SPIFFE id of a peer certificate.
fn peer_identity_of(der: &[u8]) -> Result<Identity, TlsError> {
    let mut ids = spiffe_ids_of(der)?;
    if ids.len() != 1 {
        return Err(TlsError::NoSpiffeId);
    }
    Ok(ids.remove(0))
}

fn leaf_der(ctx: &X509StoreContextRef) -> Option<Vec<u8>> {
    ctx.current_cert().and_then(|c| c.to_der().ok())
}

/// Verify callback body: the chain verdict for intermediate certificates, and for the leaf the
/// chain verdict plus `accept` on its single SPIFFE id. Every refusal is logged with its reason.
fn check_leaf(
    ok: bool,
    ctx: &mut X509StoreContextRef,
    peer: &'static str,
    accept: impl Fn(&Identity) -> Result<(), TlsError>,
) -> bool {
    if !ok {
        let e = ctx.verify_result().err().map(|e| e.to_string()).unwrap_or_default();
        tracing::warn!(peer, error = %e, "peer certificate chain rejected");
        return false;
    }
    if ctx.error_depth() != 0 {
        return true;
    }
    let r = leaf_der(ctx).ok_or(TlsError::NoPeerCert).and_then(|d| peer_identity_of(&d));
    match r.and_then(|id| accept(&id)) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(peer, error = %e, "peer certificate rejected");
            false
        }
    }
}

/// Prebuilt contexts for one certificate.
struct Contexts {
    serial: String,
    acceptor: Arc<SslAcceptor>,
    connector: Arc<SslConnector>,
}

/// Builds TLS contexts from the certificate store, cached per certificate serial.
pub struct TlsProvider {
    store: Arc<CertStore>,
    signer: Signer,
    trust_domain: String,
    metrics: Arc<Metrics>,
    cache: Mutex<HashMap<Identity, Arc<Contexts>>>,
    inline_signing: bool,
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
        }
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

    async fn contexts(&self, id: &Identity) -> Result<Arc<Contexts>, TlsError> {
        let bundle = self.store.fetch(id).await.map_err(|e| TlsError::Cert(e.to_string()))?;
        if let Some(c) = self.cache.lock().unwrap().get(id) {
            if c.serial == bundle.serial {
                return Ok(c.clone());
            }
        }
        let c = Arc::new(Contexts {
            serial: bundle.serial.clone(),
            acceptor: Arc::new(self.build_acceptor(&bundle)?),
            connector: Arc::new(self.build_connector(&bundle)?),
        });
        self.cache.lock().unwrap().insert(id.clone(), c.clone());
        Ok(c)
    }

    fn root_store(bundle: &CertBundle) -> Result<boring::x509::store::X509Store, TlsError> {
        let mut b = X509StoreBuilder::new()?;
        for r in &bundle.roots_der {
            b.add_cert(X509::from_der(r)?)?;
        }
        Ok(b.build())
    }

    /// Settings both sides share: TLS 1.3 only, no resumption, the certificate, its key through
    /// the signer, and the mesh root for verifying the peer.
    fn common(&self, b: &mut SslContextBuilder, bundle: &CertBundle) -> Result<(), TlsError> {
        b.set_min_proto_version(Some(SslVersion::TLS1_3))?;
        b.set_max_proto_version(Some(SslVersion::TLS1_3))?;
        b.set_options(SslOptions::NO_TICKET);
        b.set_session_cache_mode(SslSessionCacheMode::OFF);
        b.set_certificate(X509::from_der(&bundle.cert_der)?.as_ref())?;
        for c in &bundle.chain_der {
            b.add_extra_chain_cert(X509::from_der(c)?)?;
        }
        if self.inline_signing {
            b.set_private_key(&bundle.key)?;
        } else {
            b.set_async_private_key_method(self.signer.key_method(bundle.key.clone()));
        }
        b.set_verify_cert_store(Self::root_store(bundle)?)?;
        Ok(())
    }

    fn build_acceptor(&self, bundle: &CertBundle) -> Result<SslAcceptor, TlsError> {
        let mut b = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls())?;
        self.common(&mut b, bundle)?;
        b.set_alpn_select_callback(|_, client| {
            boring::ssl::select_next_proto(b"\x02h2", client)
                .ok_or(boring::ssl::AlpnError::ALERT_FATAL)
        });
        let td = self.trust_domain.clone();
        b.set_verify_callback(
            SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT,
            move |ok, ctx| {
                check_leaf(ok, ctx, "client", |id| {
                    if id.trust_domain == td {
                        Ok(())
                    } else {
                        Err(TlsError::WrongTrustDomain(id.to_string(), td.clone()))
                    }
                })
            },
        );
        Ok(b.build())
    }

    fn build_connector(&self, bundle: &CertBundle) -> Result<SslConnector, TlsError> {
        let mut b = SslConnector::builder(SslMethod::tls())?;
        self.common(&mut b, bundle)?;
        b.set_alpn_protos(b"\x02h2")?;
        Ok(b.build())
    }

    fn record(&self, side: &'static str, ok: bool, start: Instant) {
        let l = HandshakeLabels { side, result: if ok { "success" } else { "failure" } };
        self.metrics.handshakes.get_or_create(&l).inc();
        self.metrics.handshake_seconds.get_or_create(&l).observe(start.elapsed().as_secs_f64());
    }

    /// Server side: handshake as `local` and return the peer's identity.
    pub async fn accept<S: Stream>(
        &self,
        stream: S,
        local: &Identity,
    ) -> Result<(SslStream<S>, Identity), TlsError> {
        let start = Instant::now();
        let r = async {
            let ctx = self.contexts(local).await?;
            let s = tokio_boring::accept(&ctx.acceptor, stream)
                .await
                .map_err(|e| TlsError::Handshake(handshake_error_text(&e)))?;
            let der = s
                .ssl()
                .peer_certificate()
                .ok_or(TlsError::NoPeerCert)?
                .to_der()
                .map_err(TlsError::from)?;
            let peer = peer_identity_of(&der)?;
            Ok((s, peer))
        }
        .await;
        self.record("server", r.is_ok(), start);
        r
    }

    /// Client side: handshake as `local`, requiring the server to be exactly `expected`.
    pub async fn connect<S: Stream>(
        &self,
        stream: S,
        local: &Identity,
        expected: &Identity,
    ) -> Result<SslStream<S>, TlsError> {
        let start = Instant::now();
        let r = async {
            let ctx = self.contexts(local).await?;
            let mut cfg = ctx.connector.configure()?;
            cfg.set_verify_hostname(false);
            cfg.set_use_server_name_indication(false);
            let want = expected.clone();
            cfg.set_verify_callback(SslVerifyMode::PEER, move |ok, ctx| {
                check_leaf(ok, ctx, "server", |id| {
                    if *id == want {
                        Ok(())
                    } else {
                        Err(TlsError::WrongIdentity { got: id.to_string(), want: want.to_string() })
                    }
                })
            });
            tokio_boring::connect(cfg, "", stream)
                .await
                .map_err(|e| TlsError::Handshake(handshake_error_text(&e)))
        }
        .await;
        self.record("client", r.is_ok(), start);
        r
    }
}

fn handshake_error_text<S>(e: &tokio_boring::HandshakeError<S>) -> String {
    if let Some(Err(v)) = e.ssl().map(|s| s.verify_result()) {
        return format!("certificate verification failed: {v}");
    }
    match e.as_io_error() {
        Some(io) => format!("{io}"),
        None => e.to_string(),
    }
}
