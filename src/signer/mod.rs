//! The signing service behind every TLS handshake. Handshakes never sign inline: the `boring`
//! `AsyncPrivateKeyMethod` ([`KeyMethod`]) parks the handshake and sends the message to dedicated
//! signer threads (never tokio workers), which answer through a oneshot channel.
//!
//! Today each request is signed on its own with BoringSSL; the batching signer over the `mb`
//! core plugs in behind the same [`Signer`] handle.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use boring::hash::MessageDigest;
use boring::pkey::{PKey, Private};
use boring::rsa::Padding;
use boring::sign::RsaPssSaltlen;
use boring::ssl::{
    AsyncPrivateKeyMethod, AsyncPrivateKeyMethodError, BoxPrivateKeyMethodFuture, SslRef,
    SslSignatureAlgorithm,
};
use tokio::sync::oneshot;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SignError {
    #[error("unsupported signature algorithm {0}")]
    UnsupportedAlgorithm(String),
    #[error("signer is shut down")]
    ShutDown,
    #[error("signing failed: {0}")]
    Failed(String),
}

struct Job {
    key: Arc<PKey<Private>>,
    msg: Vec<u8>,
    alg: SslSignatureAlgorithm,
    reply: oneshot::Sender<Result<Vec<u8>, SignError>>,
    span: tracing::Span,
}

/// Handle to the signer threads. Cheap to clone.
#[derive(Clone)]
pub struct Signer {
    tx: Arc<Mutex<mpsc::Sender<Job>>>,
    stats: Arc<Stats>,
}

#[derive(Default)]
pub struct Stats {
    pub ops: AtomicU64,
    pub errors: AtomicU64,
}

impl Signer {
    /// Starts `threads` signer threads.
    pub fn start(threads: usize) -> Signer {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let stats = Arc::new(Stats::default());
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            let stats = stats.clone();
            std::thread::Builder::new()
                .name(format!("mbt-signer-{i}"))
                .spawn(move || loop {
                    let job = match rx.lock().unwrap().recv() {
                        Ok(j) => j,
                        Err(_) => return,
                    };
                    let _g = job.span.enter();
                    let r = sign_one(&job.key, &job.msg, job.alg);
                    stats.ops.fetch_add(1, Ordering::Relaxed);
                    if r.is_err() {
                        stats.errors.fetch_add(1, Ordering::Relaxed);
                    }
                    let _ = job.reply.send(r);
                })
                .expect("spawn signer thread");
        }
        Signer { tx: Arc::new(Mutex::new(tx)), stats }
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Signs `msg` with `key` for the TLS signature algorithm `alg`.
    pub async fn sign(
        &self,
        key: Arc<PKey<Private>>,
        msg: Vec<u8>,
        alg: SslSignatureAlgorithm,
    ) -> Result<Vec<u8>, SignError> {
        let (reply, rx) = oneshot::channel();
        let job = Job { key, msg, alg, reply, span: tracing::Span::current() };
        self.tx.lock().unwrap().send(job).map_err(|_| SignError::ShutDown)?;
        rx.await.map_err(|_| SignError::ShutDown)?
    }

    /// The `AsyncPrivateKeyMethod` for a context whose certificate's key is `key`.
    pub fn key_method(&self, key: PKey<Private>) -> KeyMethod {
        KeyMethod { key: Arc::new(key), signer: self.clone() }
    }
}

/// Signs one message with BoringSSL (the scalar path).
pub fn sign_one(
    key: &PKey<Private>,
    msg: &[u8],
    alg: SslSignatureAlgorithm,
) -> Result<Vec<u8>, SignError> {
    let fail = |e: boring::error::ErrorStack| SignError::Failed(e.to_string());
    let (digest, pss) = match alg {
        SslSignatureAlgorithm::RSA_PKCS1_SHA256 => (MessageDigest::sha256(), false),
        SslSignatureAlgorithm::RSA_PKCS1_SHA384 => (MessageDigest::sha384(), false),
        SslSignatureAlgorithm::RSA_PKCS1_SHA512 => (MessageDigest::sha512(), false),
        SslSignatureAlgorithm::RSA_PSS_RSAE_SHA256 => (MessageDigest::sha256(), true),
        SslSignatureAlgorithm::RSA_PSS_RSAE_SHA384 => (MessageDigest::sha384(), true),
        SslSignatureAlgorithm::RSA_PSS_RSAE_SHA512 => (MessageDigest::sha512(), true),
        SslSignatureAlgorithm::ECDSA_SECP256R1_SHA256 => (MessageDigest::sha256(), false),
        other => return Err(SignError::UnsupportedAlgorithm(format!("{other:?}"))),
    };
    let mut s = boring::sign::Signer::new(digest, key).map_err(fail)?;
    if pss {
        s.set_rsa_padding(Padding::PKCS1_PSS).map_err(fail)?;
        s.set_rsa_pss_saltlen(RsaPssSaltlen::DIGEST_LENGTH).map_err(fail)?;
        s.set_rsa_mgf1_md(digest).map_err(fail)?;
    }
    s.sign_oneshot_to_vec(msg).map_err(fail)
}

/// `boring` async private-key method: the handshake parks until the signer answers.
pub struct KeyMethod {
    key: Arc<PKey<Private>>,
    signer: Signer,
}

impl AsyncPrivateKeyMethod for KeyMethod {
    fn sign(
        &self,
        _ssl: &mut SslRef,
        input: &[u8],
        alg: SslSignatureAlgorithm,
        _output: &mut [u8],
    ) -> Result<BoxPrivateKeyMethodFuture, AsyncPrivateKeyMethodError> {
        let signer = self.signer.clone();
        let key = self.key.clone();
        let msg = input.to_vec();
        Ok(Box::pin(async move {
            let sig = signer.sign(key, msg, alg).await.map_err(|e| {
                tracing::warn!(error = %e, "handshake signature failed");
                AsyncPrivateKeyMethodError
            })?;
            Ok(Box::new(move |_: &mut SslRef, out: &mut [u8]| {
                if sig.len() > out.len() {
                    return Err(AsyncPrivateKeyMethodError);
                }
                out[..sig.len()].copy_from_slice(&sig);
                Ok(sig.len())
            }) as boring::ssl::BoxPrivateKeyMethodFinish)
        }))
    }

    fn decrypt(
        &self,
        _ssl: &mut SslRef,
        _input: &[u8],
        _output: &mut [u8],
    ) -> Result<BoxPrivateKeyMethodFuture, AsyncPrivateKeyMethodError> {
        // TLS 1.3 never decrypts with the certificate key.
        Err(AsyncPrivateKeyMethodError)
    }
}
