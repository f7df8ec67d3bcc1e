//! The control plane's gRPC plumbing shared by the xDS client and istiod's CA client: one TLS
//! channel (BoringSSL, verified against the configured root and the host name of the address; the
//! system trust store is never read), the `authorization: Bearer` token read at every call, and
//! the `clusterid` and extra metadata.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use boring::ssl::{Ssl, SslContextBuilder, SslMethod, SslVerifyMode, SslVersion};
use boring::x509::store::X509StoreBuilder;
use boring::x509::X509;
use http::Uri;
use hyper_util::rt::TokioIo;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::transport::{Channel, Endpoint};

use crate::config::Secret;

/// Where the bearer token comes from (`Debug` shows the file's path, never a token).
#[derive(Clone, Debug)]
pub enum TokenSource {
    /// Read at every call (Kubernetes rotates projected tokens).
    File(PathBuf),
    Static(Secret),
    /// No `authorization` header (tests of the Unauthenticated path).
    None,
}

impl TokenSource {
    /// The token, trimmed: a file ending in a newline is the classic failure.
    pub fn read(&self) -> Result<Option<String>, String> {
        match self {
            TokenSource::File(p) => {
                let t = std::fs::read_to_string(p)
                    .map_err(|e| format!("cannot read the token file {}: {e}", p.display()))?;
                // As ztunnel: an empty file is an error, not a call without a token.
                match t.trim() {
                    "" => Err(format!("the token file {} is empty", p.display())),
                    t => Ok(Some(t.to_string())),
                }
            }
            TokenSource::Static(t) => Ok(Some(t.expose().trim().to_string())),
            TokenSource::None => Ok(None),
        }
    }
}

/// One control-plane endpoint and how to call it (`Debug` redacts the token and header values).
#[derive(Clone, Debug)]
pub struct Endpoints {
    pub address: String,
    /// PEM root certificate(s) that verify the server.
    pub roots_pem: Vec<u8>,
    pub token: TokenSource,
    pub cluster_id: String,
    pub headers: BTreeMap<String, Secret>,
}

/// Reads roots given as a file path or inline PEM.
pub fn load_roots(spec: &str) -> Result<Vec<u8>, String> {
    let pem = if spec.trim_start().starts_with("-----BEGIN") {
        spec.as_bytes().to_vec()
    } else {
        std::fs::read(spec).map_err(|e| format!("cannot read root certificate file {spec}: {e}"))?
    };
    let certs = X509::stack_from_pem(&pem).map_err(|e| format!("root certificates {spec}: {e}"))?;
    if certs.is_empty() {
        return Err(format!("root certificates {spec}: no PEM certificate found"));
    }
    Ok(pem)
}

impl Endpoints {
    /// Adds the metadata every call carries.
    pub fn decorate(&self, md: &mut MetadataMap) -> Result<(), String> {
        if let Some(t) = self.token.read()? {
            let v = MetadataValue::try_from(format!("Bearer {t}"))
                .map_err(|_| "the token holds characters not allowed in a header".to_string())?;
            md.insert("authorization", v);
        }
        if let Ok(v) = MetadataValue::try_from(self.cluster_id.as_str()) {
            md.insert("clusterid", v);
        }
        for (k, v) in &self.headers {
            let key = tonic::metadata::MetadataKey::from_bytes(k.as_bytes())
                .map_err(|_| format!("header name '{k}' is not valid"))?;
            let val = MetadataValue::try_from(v.expose()).map_err(|_| {
                format!("the value of header '{k}' holds characters not allowed in a header")
            })?;
            md.insert(key, val);
        }
        Ok(())
    }

    /// A lazily connecting channel: errors show at the first call, which the callers retry.
    pub fn channel(&self) -> Result<Channel, String> {
        let uri: Uri =
            self.address.parse().map_err(|e| format!("address {}: {e}", self.address))?;
        let tls = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => {
                return Err(format!("address {} must start with https:// or http://", self.address))
            }
        };
        let host = uri.host().ok_or_else(|| format!("address {} has no host", self.address))?;
        let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
        let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
        let ctx = if tls {
            let mut b = SslContextBuilder::new(SslMethod::tls()).map_err(|e| e.to_string())?;
            b.set_min_proto_version(Some(SslVersion::TLS1_2)).map_err(|e| e.to_string())?;
            let mut store = X509StoreBuilder::new().map_err(|e| e.to_string())?;
            for c in X509::stack_from_pem(&self.roots_pem).map_err(|e| e.to_string())? {
                store.add_cert(c).map_err(|e| e.to_string())?;
            }
            b.set_verify_cert_store(store.build()).map_err(|e| e.to_string())?;
            b.set_verify(SslVerifyMode::PEER);
            b.set_alpn_protos(b"\x02h2").map_err(|e| e.to_string())?;
            Some(b.build())
        } else {
            None
        };
        let endpoint = Endpoint::from_shared(self.address.clone())
            .map_err(|e| format!("address {}: {e}", self.address))?
            .connect_timeout(Duration::from_secs(5))
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10))
            .keep_alive_while_idle(true);
        let connector = tower::service_fn(move |_: Uri| {
            let (host, ctx) = (host.clone(), ctx.clone());
            async move {
                let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
                tcp.set_nodelay(true)?;
                let io = |e: String| std::io::Error::other(e);
                let Some(ctx) = ctx else { return Ok(Box::new(TokioIo::new(tcp)) as Box<dyn Io>) };
                let mut ssl = Ssl::new(&ctx).map_err(|e| io(e.to_string()))?;
                match host.parse::<IpAddr>() {
                    Ok(ip) => ssl.param_mut().set_ip(ip),
                    Err(_) => {
                        ssl.set_hostname(&host).map_err(|e| io(e.to_string()))?;
                        ssl.param_mut().set_host(&host)
                    }
                }
                .map_err(|e| io(e.to_string()))?;
                let s =
                    tokio_boring::SslStreamBuilder::new(ssl, tcp).connect().await.map_err(|e| {
                        io(format!("TLS to the control plane at {host}:{port}: {}", tls_error(&e)))
                    })?;
                Ok::<_, std::io::Error>(Box::new(TokioIo::new(s)) as Box<dyn Io>)
            }
        });
        Ok(endpoint.connect_with_connector_lazy(connector))
    }
}

/// A connection the channel can use, TLS or not.
pub trait Io: hyper::rt::Read + hyper::rt::Write + Send + Unpin {}
impl<T: hyper::rt::Read + hyper::rt::Write + Send + Unpin> Io for T {}

fn tls_error<S>(e: &tokio_boring::HandshakeError<S>) -> String {
    if let Some(Err(v)) = e.ssl().map(|s| s.verify_result()) {
        return format!("server certificate not accepted: {v}");
    }
    match e.as_io_error() {
        Some(io) => io.to_string(),
        None => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_token_or_header_values() {
        let ep = Endpoints {
            address: "https://istiod:15012".into(),
            roots_pem: Vec::new(),
            token: TokenSource::Static(Secret::new("tok-4be1")),
            cluster_id: "Kubernetes".into(),
            headers: [("x-tenant".to_string(), Secret::new("hv-90aa"))].into_iter().collect(),
        };
        let d = format!("{ep:?}");
        assert!(!d.contains("tok-4be1") && !d.contains("hv-90aa"), "{d}");
        assert!(d.contains("x-tenant") && d.contains(crate::config::REDACTED), "{d}");
        // The wire still carries both.
        let mut md = MetadataMap::new();
        ep.decorate(&mut md).unwrap();
        assert_eq!(md.get("authorization").unwrap(), "Bearer tok-4be1");
        assert_eq!(md.get("x-tenant").unwrap(), "hv-90aa");
    }
}
