//! Authorization policies, close to Istio's `istio.security.Authorization` (what istiod derives
//! from AuthorizationPolicy and PeerAuthentication). The store holds them by `namespace/name`;
//! evaluation lives with the inbound path.
#![forbid(unsafe_code)]

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Scope {
    /// Every workload.
    #[default]
    Global,
    /// The workloads of the policy's namespace.
    Namespace,
    /// The workloads whose `authorization_policies` name it.
    WorkloadSelector,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Action {
    #[default]
    Allow,
    Deny,
}

/// A string comparison on a source identity field. Written `{exact: x}`, `{prefix: x}`,
/// `{suffix: x}` or `presence` in the local file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "StringMatchRepr", into = "StringMatchRepr")]
pub enum StringMatch {
    Exact(String),
    Prefix(String),
    Suffix(String),
    /// Any non-empty value.
    Presence,
}

#[derive(Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum StringMatchRepr {
    Word(String),
    Map(std::collections::BTreeMap<String, String>),
}

impl TryFrom<StringMatchRepr> for StringMatch {
    type Error = String;
    fn try_from(r: StringMatchRepr) -> Result<StringMatch, String> {
        match r {
            StringMatchRepr::Word(w) if w == "presence" => Ok(StringMatch::Presence),
            StringMatchRepr::Word(w) => Err(format!(
                "string match '{w}': expected {{exact: ...}}, {{prefix: ...}}, {{suffix: ...}} or presence"
            )),
            StringMatchRepr::Map(m) if m.len() == 1 => {
                let (k, v) = m.into_iter().next().unwrap();
                match k.as_str() {
                    "exact" => Ok(StringMatch::Exact(v)),
                    "prefix" => Ok(StringMatch::Prefix(v)),
                    "suffix" => Ok(StringMatch::Suffix(v)),
                    _ => Err(format!("unknown string match '{k}': expected exact, prefix or suffix")),
                }
            }
            StringMatchRepr::Map(_) => Err("a string match has exactly one of exact, prefix, suffix".into()),
        }
    }
}

impl From<StringMatch> for StringMatchRepr {
    fn from(m: StringMatch) -> StringMatchRepr {
        let one = |k: &str, v: String| StringMatchRepr::Map([(k.to_string(), v)].into());
        match m {
            StringMatch::Exact(v) => one("exact", v),
            StringMatch::Prefix(v) => one("prefix", v),
            StringMatch::Suffix(v) => one("suffix", v),
            StringMatch::Presence => StringMatchRepr::Word("presence".into()),
        }
    }
}

/// An address block: `ip/length`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    pub ip: IpAddr,
    pub len: u8,
}

impl Cidr {
    pub fn new(ip: IpAddr, len: u8) -> Result<Cidr, String> {
        let max = if ip.is_ipv4() { 32 } else { 128 };
        if len > max {
            return Err(format!("prefix length {len} is too long for {ip}"));
        }
        Ok(Cidr { ip, len })
    }
}

impl std::str::FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Cidr, String> {
        let (ip, len) = match s.split_once('/') {
            Some((ip, len)) => (ip, Some(len)),
            None => (s, None),
        };
        let ip: IpAddr = ip.parse().map_err(|_| format!("'{s}' is not an IP address or CIDR"))?;
        let len = match len {
            Some(l) => l.parse().map_err(|_| format!("'{s}': bad prefix length"))?,
            None if ip.is_ipv4() => 32,
            None => 128,
        };
        Cidr::new(ip, len)
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.ip, self.len)
    }
}

impl Serialize for Cidr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Cidr, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceAccountMatch {
    pub namespace: String,
    pub service_account: String,
}

/// Every non-empty field must match.
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Match {
    pub namespaces: Vec<StringMatch>,
    pub not_namespaces: Vec<StringMatch>,
    pub principals: Vec<StringMatch>,
    pub not_principals: Vec<StringMatch>,
    pub service_accounts: Vec<ServiceAccountMatch>,
    pub not_service_accounts: Vec<ServiceAccountMatch>,
    pub source_ips: Vec<Cidr>,
    pub not_source_ips: Vec<Cidr>,
    pub destination_ips: Vec<Cidr>,
    pub not_destination_ips: Vec<Cidr>,
    pub destination_ports: Vec<u16>,
    pub not_destination_ports: Vec<u16>,
}

/// Any of its matches.
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Clause {
    pub matches: Vec<Match>,
}

/// All of its clauses.
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Rule {
    pub clauses: Vec<Clause>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Authorization {
    pub name: String,
    #[serde(default = "super::workload::default_namespace")]
    pub namespace: String,
    #[serde(default)]
    pub scope: Scope,
    #[serde(default)]
    pub action: Action,
    #[serde(default)]
    pub rules: Vec<Rule>,
    #[serde(default)]
    pub dry_run: bool,
    /// Set when this is not the policy as written but a fail-closed stand-in (why): its xDS
    /// version was refused, or it carries fields this proxy does not know. A DENY stand-in
    /// matches every connection, an ALLOW one none. Never read from the local file.
    #[serde(default, skip_deserializing, skip_serializing_if = "Option::is_none")]
    pub fail_closed: Option<String>,
}

impl Authorization {
    /// The store's key and the xDS resource name: `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}
