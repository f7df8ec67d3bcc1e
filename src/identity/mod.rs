//! Workload identities (SPIFFE ids), certificate sources (the development CA, istiod's CA), the
//! certificate store, and the manager that keeps certificates for the node's workloads.
#![forbid(unsafe_code)]

pub mod ca;
pub mod istio;
pub mod manager;
pub mod source;
pub mod store;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Key algorithm of the workload certificates the node requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum KeyAlgorithm {
    #[default]
    #[serde(rename = "ecdsa-p256")]
    EcdsaP256,
    #[serde(rename = "rsa-2048")]
    Rsa2048,
    #[serde(rename = "rsa-3072")]
    Rsa3072,
    #[serde(rename = "rsa-4096")]
    Rsa4096,
}

impl std::str::FromStr for KeyAlgorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ecdsa-p256" => Ok(KeyAlgorithm::EcdsaP256),
            "rsa-2048" => Ok(KeyAlgorithm::Rsa2048),
            "rsa-3072" => Ok(KeyAlgorithm::Rsa3072),
            "rsa-4096" => Ok(KeyAlgorithm::Rsa4096),
            _ => Err(format!(
                "unknown key algorithm '{s}': expected ecdsa-p256, rsa-2048, rsa-3072 or rsa-4096"
            )),
        }
    }
}

/// Errors parsing a SPIFFE id.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error("SPIFFE id '{0}' must start with spiffe://")]
    Scheme(String),
    #[error("SPIFFE id '{0}' has an empty or invalid trust domain")]
    TrustDomain(String),
    #[error("SPIFFE id '{0}' must have the path /ns/<namespace>/sa/<service-account>")]
    Path(String),
}

/// A workload identity `spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Identity {
    pub trust_domain: String,
    pub namespace: String,
    pub service_account: String,
}

impl Identity {
    pub fn new(trust_domain: &str, namespace: &str, service_account: &str) -> Self {
        Identity {
            trust_domain: trust_domain.to_string(),
            namespace: namespace.to_string(),
            service_account: service_account.to_string(),
        }
    }
}

fn valid_segment(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
}

impl FromStr for Identity {
    type Err = IdentityError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let rest = s.strip_prefix("spiffe://").ok_or_else(|| IdentityError::Scheme(s.into()))?;
        let (td, path) = rest.split_once('/').ok_or_else(|| IdentityError::Path(s.into()))?;
        if !valid_segment(td) || td.bytes().any(|b| b.is_ascii_uppercase()) {
            return Err(IdentityError::TrustDomain(s.into()));
        }
        let parts: Vec<&str> = path.split('/').collect();
        match parts.as_slice() {
            ["ns", ns, "sa", sa] if valid_segment(ns) && valid_segment(sa) => {
                Ok(Identity::new(td, ns, sa))
            }
            _ => Err(IdentityError::Path(s.into())),
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "spiffe://{}/ns/{}/sa/{}",
            self.trust_domain, self.namespace, self.service_account
        )
    }
}

impl Serialize for Identity {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Identity {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let s = "spiffe://cluster.local/ns/default/sa/echo";
        let id: Identity = s.parse().unwrap();
        assert_eq!(id, Identity::new("cluster.local", "default", "echo"));
        assert_eq!(id.to_string(), s);
    }

    #[test]
    fn malformed() {
        for (s, want) in [
            ("http://cluster.local/ns/a/sa/b", "must start with spiffe://"),
            ("spiffe://cluster.local", "must have the path"),
            ("spiffe:///ns/a/sa/b", "trust domain"),
            ("spiffe://Cluster.Local/ns/a/sa/b", "trust domain"),
            ("spiffe://cluster.local/ns/a/sb/b", "must have the path"),
            ("spiffe://cluster.local/ns/a/sa/", "must have the path"),
            ("spiffe://cluster.local/ns/a/sa/b/c", "must have the path"),
            ("spiffe://cluster.local/ns/a b/sa/c", "must have the path"),
        ] {
            let err = s.parse::<Identity>().unwrap_err().to_string();
            assert!(err.contains(want), "{s}: {err}");
            assert!(err.contains(s), "error names the input: {err}");
        }
    }
}
