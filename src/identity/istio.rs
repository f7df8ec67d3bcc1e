//! istiod's CA as a certificate source: a fresh key per certificate (generated off the async
//! workers), a PEM CSR with one URI SAN (the SPIFFE id) and an empty subject, sent to
//! `/istio.v1.auth.IstioCertificateService/CreateCertificate` with the node's token; in shared
//! (node) mode the request names the identity it impersonates. The answer is checked before use:
//! leaf first, root(s) last, a chain of one refused, the leaf must carry exactly the requested
//! identity and our public key, and chain to the roots it came with.

use std::time::{Duration, SystemTime};

use boring::stack::Stack;
use boring::x509::store::X509StoreBuilder;
use boring::x509::{X509StoreContext, X509};
use futures::future::BoxFuture;
use rcgen::{CertificateParams, DistinguishedName, SanType};

use super::ca::{generate_key, BoringKey, CaError};
use super::source::CertSource;
use super::store::CertBundle;
use super::Identity;
use super::KeyAlgorithm;
use crate::grpc::Endpoints;
use crate::proto::ca::istio_certificate_service_client::IstioCertificateServiceClient;
use crate::proto::ca::IstioCertificateRequest;

/// How long one CSR call may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

pub struct IstioCa {
    endpoints: Endpoints,
    channel: tonic::transport::Channel,
    algorithm: KeyAlgorithm,
    lifetime: Duration,
}

impl IstioCa {
    pub fn new(
        endpoints: Endpoints,
        algorithm: KeyAlgorithm,
        lifetime: Duration,
    ) -> Result<IstioCa, String> {
        let channel = endpoints.channel()?;
        Ok(IstioCa { endpoints, channel, algorithm, lifetime })
    }

    async fn request(&self, id: &Identity) -> Result<CertBundle, CaError> {
        let err = |message: String| CaError::Remote { identity: id.to_string(), message };
        let alg = self.algorithm;
        let sid = id.clone();
        let (key, csr) = tokio::task::spawn_blocking(move || -> Result<_, CaError> {
            let pkey = generate_key(alg)?;
            let signer = BoringKey::new(pkey.clone()).map_err(CaError::KeyGen)?;
            let mut params = CertificateParams::default();
            params.distinguished_name = DistinguishedName::new();
            let uri = rcgen::string::Ia5String::try_from(sid.to_string())
                .map_err(|e| CaError::KeyGen(e.to_string()))?;
            params.subject_alt_names = vec![SanType::URI(uri)];
            let csr = params
                .serialize_request(&signer)
                .and_then(|c| c.pem())
                .map_err(|e| CaError::KeyGen(format!("CSR: {e}")))?;
            Ok((pkey, csr))
        })
        .await
        .map_err(|e| CaError::KeyGen(format!("key generation task failed: {e}")))??;
        let metadata = prost_types::Struct {
            fields: [(
                "ImpersonatedIdentity".to_string(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue(id.to_string())),
                },
            )]
            .into(),
        };
        let mut req = tonic::Request::new(IstioCertificateRequest {
            csr,
            validity_duration: self.lifetime.as_secs() as i64,
            metadata: Some(metadata),
        });
        self.endpoints.decorate(req.metadata_mut()).map_err(err)?;
        req.set_timeout(CALL_TIMEOUT);
        let issued_at = SystemTime::now();
        let mut client = IstioCertificateServiceClient::new(self.channel.clone());
        let resp = tokio::time::timeout(CALL_TIMEOUT, client.create_certificate(req))
            .await
            .map_err(|_| {
                err(format!("no answer from {} within {CALL_TIMEOUT:?}", self.endpoints.address))
            })?
            .map_err(|s| {
                if s.code() == tonic::Code::Unauthenticated {
                    err(format!("the CA refused our token (Unauthenticated): {}", s.message()))
                } else {
                    err(format!("{:?}: {}", s.code(), s.message()))
                }
            })?;
        let chain = resp.into_inner().cert_chain;
        let b = verify_answer(id, &key, &chain, self.algorithm, issued_at)?;
        Ok(b)
    }
}

impl CertSource for IstioCa {
    fn issue<'a>(&'a self, id: &'a Identity) -> BoxFuture<'a, Result<CertBundle, CaError>> {
        Box::pin(self.request(id))
    }

    fn describe(&self) -> String {
        format!("istiod CA ({})", self.endpoints.address)
    }

    fn holds_ca_key(&self) -> bool {
        false
    }
}

/// Checks a CA answer and turns it into a bundle: `chain[0]` the leaf, `chain[last]` the
/// root(s), anything between intermediates.
pub fn verify_answer(
    id: &Identity,
    key: &boring::pkey::PKey<boring::pkey::Private>,
    chain: &[String],
    algorithm: KeyAlgorithm,
    issued_at: SystemTime,
) -> Result<CertBundle, CaError> {
    let bad = |message: String| CaError::BadResponse { identity: id.to_string(), message };
    if chain.len() < 2 {
        return Err(bad(format!(
            "cert_chain has {} entr{}: expected the leaf first and the root last",
            chain.len(),
            if chain.len() == 1 { "y" } else { "ies" }
        )));
    }
    let parse = |pem: &str| -> Result<Vec<X509>, CaError> {
        let v = X509::stack_from_pem(pem.as_bytes()).map_err(|e| bad(format!("not PEM: {e}")))?;
        if v.is_empty() {
            return Err(bad("an empty cert_chain entry".into()));
        }
        Ok(v)
    };
    let mut first = parse(&chain[0])?;
    let leaf = first.remove(0);
    let mut inter: Vec<X509> = first;
    for pem in &chain[1..chain.len() - 1] {
        inter.extend(parse(pem)?);
    }
    let roots = parse(&chain[chain.len() - 1])?;
    let leaf_der = leaf.to_der().map_err(|e| bad(e.to_string()))?;
    let ids = crate::tls::spiffe_ids_of(&leaf_der).map_err(|e| bad(e.to_string()))?;
    if ids.as_slice() != std::slice::from_ref(id) {
        let got: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
        return Err(bad(format!("the leaf names {got:?}, not {id}")));
    }
    let leaf_pub = leaf.public_key().and_then(|k| k.public_key_to_der()).ok();
    if leaf_pub.is_none() || leaf_pub != key.public_key_to_der().ok() {
        return Err(bad("the leaf does not carry the key of our request".into()));
    }
    let mut store = X509StoreBuilder::new().map_err(|e| bad(e.to_string()))?;
    for r in &roots {
        store.add_cert(r.clone()).map_err(|e| bad(e.to_string()))?;
    }
    let store = store.build();
    let mut stack = Stack::new().map_err(|e| bad(e.to_string()))?;
    for c in &inter {
        stack.push(c.clone()).map_err(|e| bad(e.to_string()))?;
    }
    let mut ctx = X509StoreContext::new().map_err(|e| bad(e.to_string()))?;
    let verdict = ctx
        .init(&store, &leaf, &stack, |c| {
            Ok(c.verify_cert()?
                .then_some(())
                .ok_or_else(|| c.verify_result().err().map(|e| e.to_string()).unwrap_or_default()))
        })
        .map_err(|e| bad(e.to_string()))?;
    if let Err(e) = verdict {
        return Err(bad(format!("the leaf does not chain to the roots sent with it: {e}")));
    }
    use x509_parser::prelude::*;
    let (_, parsed) = X509Certificate::from_der(&leaf_der).map_err(|e| bad(e.to_string()))?;
    let t = |ts: i64| SystemTime::UNIX_EPOCH + Duration::from_secs(ts.max(0) as u64);
    let not_before = t(parsed.validity().not_before.timestamp());
    let not_after = t(parsed.validity().not_after.timestamp());
    if not_after <= SystemTime::now() {
        return Err(bad("the leaf has already expired".into()));
    }
    let serial = parsed.raw_serial().iter().map(|b| format!("{b:02x}")).collect();
    let der = |c: &X509| c.to_der().map_err(|e| bad(e.to_string()));
    Ok(CertBundle {
        identity: id.clone(),
        cert_der: leaf_der,
        chain_der: inter.iter().map(der).collect::<Result<_, _>>()?,
        key: key.clone(),
        roots_der: roots.iter().map(der).collect::<Result<_, _>>()?,
        issued_at,
        not_before,
        not_after,
        serial,
        algorithm,
    })
}
