//! L4 authorization with Istio's semantics, as ztunnel applies them (see docs/DESIGN.md and the
//! README, "Authorization policy"):
//! - policies that apply to a destination workload: GLOBAL ones, its namespace's NAMESPACE ones,
//!   and the WORKLOAD_SELECTOR ones it names;
//! - any matching DENY denies; else no ALLOW policy allows; else a matching ALLOW allows and
//!   nothing else does (an ALLOW without rules exists and matches nothing). Dry-run policies are
//!   evaluated and logged, never enforced, and a dry-run ALLOW does not count as existing;
//! - policy: any rule (none: nothing); rule: all clauses (none: everything); clause: any of its
//!   non-empty matches (none at all: everything; only empty ones: nothing); match: every
//!   non-empty field; field: some positive entry matches (or none given) and no negative entry
//!   matches. A connection without a verified identity matches no positive identity entry and
//!   every negative one.
//!
//! A check allocates nothing: the caller renders the peer's principal once per connection.
#![forbid(unsafe_code)]

use std::net::IpAddr;
use std::sync::Arc;

use crate::identity::Identity;
use crate::state::policy::{Action, Authorization, Cidr, Clause, Match, Rule, StringMatch};
use crate::state::{Store, Workload};

/// What is known of a connection when it is checked.
#[derive(Clone, Copy, Debug)]
pub struct Conn<'a> {
    /// The verified peer identity (HBONE), or none (plaintext).
    pub src: Option<&'a Identity>,
    /// `src` without `spiffe://` (what principals are compared with).
    pub principal: Option<&'a str>,
    pub src_ip: IpAddr,
    pub dst_ip: IpAddr,
    pub dst_port: u16,
}

/// The peer's principal as policies write it: the SPIFFE id without `spiffe://`.
pub fn principal_of(id: &Identity) -> String {
    format!("{}/ns/{}/sa/{}", id.trust_domain, id.namespace, id.service_account)
}

/// The outcome of a check.
#[derive(Clone, Debug)]
pub enum Decision {
    Allow,
    /// A DENY policy matched.
    ExplicitDeny(Arc<Authorization>),
    /// ALLOW policies apply and none matched.
    NoAllowMatched,
    /// The destination is a held workload whose newest xDS version was refused (why).
    DestinationFailedClosed(String),
}

impl Decision {
    pub fn allowed(&self) -> bool {
        matches!(self, Decision::Allow)
    }

    /// Ztunnel's wording, for logs and error texts.
    pub fn reason(&self) -> String {
        match self {
            Decision::Allow => "allowed".into(),
            Decision::ExplicitDeny(p) => {
                format!("explicitly denied by: {}/{}", p.namespace, p.name)
            }
            Decision::NoAllowMatched => "allow policies exist but none matched".into(),
            Decision::DestinationFailedClosed(why) => format!(
                "destination workload enforced fail-closed ({why}); denied until the control plane \
                 sends a version this proxy accepts"
            ),
        }
    }
}

fn string_matches(m: &StringMatch, v: &str) -> bool {
    match m {
        StringMatch::Exact(s) => v == s,
        StringMatch::Prefix(s) => v.starts_with(s.as_str()),
        StringMatch::Suffix(s) => v.ends_with(s.as_str()),
        StringMatch::Presence => !v.is_empty(),
    }
}

fn cidr_contains(c: &Cidr, ip: IpAddr) -> bool {
    match (c.ip, ip) {
        (IpAddr::V4(n), IpAddr::V4(a)) => {
            let mask = if c.len == 0 { 0 } else { u32::MAX << (32 - c.len as u32) };
            u32::from(n) & mask == u32::from(a) & mask
        }
        (IpAddr::V6(n), IpAddr::V6(a)) => {
            let mask = if c.len == 0 { 0 } else { u128::MAX << (128 - c.len as u32) };
            u128::from(n) & mask == u128::from(a) & mask
        }
        _ => false,
    }
}

/// One field: positives (any, or none given) and negatives (none). `value` is `None` when the
/// connection has nothing to compare (no identity): positives fail, negatives hold.
fn field<T, V: Copy>(pos: &[T], neg: &[T], value: Option<V>, m: impl Fn(&T, V) -> bool) -> bool {
    let pos_ok = pos.is_empty() || value.is_some_and(|v| pos.iter().any(|p| m(p, v)));
    let neg_ok = neg.is_empty() || value.is_none_or(|v| !neg.iter().any(|n| m(n, v)));
    pos_ok && neg_ok
}

fn match_is_empty(m: &Match) -> bool {
    m.namespaces.is_empty()
        && m.not_namespaces.is_empty()
        && m.principals.is_empty()
        && m.not_principals.is_empty()
        && m.service_accounts.is_empty()
        && m.not_service_accounts.is_empty()
        && m.source_ips.is_empty()
        && m.not_source_ips.is_empty()
        && m.destination_ips.is_empty()
        && m.not_destination_ips.is_empty()
        && m.destination_ports.is_empty()
        && m.not_destination_ports.is_empty()
}

fn match_matches(m: &Match, c: &Conn) -> bool {
    let ns = c.src.map(|i| i.namespace.as_str());
    field(&m.namespaces, &m.not_namespaces, ns, string_matches)
        && field(&m.principals, &m.not_principals, c.principal, string_matches)
        && field(&m.service_accounts, &m.not_service_accounts, c.src, |p, id: &Identity| {
            p.namespace == id.namespace && p.service_account == id.service_account
        })
        && field(&m.source_ips, &m.not_source_ips, Some(c.src_ip), cidr_contains)
        && field(&m.destination_ips, &m.not_destination_ips, Some(c.dst_ip), cidr_contains)
        && field(&m.destination_ports, &m.not_destination_ports, Some(c.dst_port), |p, v| *p == v)
}

fn clause_matches(cl: &Clause, c: &Conn) -> bool {
    if cl.matches.is_empty() {
        return true;
    }
    cl.matches.iter().filter(|m| !match_is_empty(m)).any(|m| match_matches(m, c))
}

fn rule_matches(r: &Rule, c: &Conn) -> bool {
    r.clauses.iter().all(|cl| clause_matches(cl, c))
}

/// Whether one policy matches the connection (its action aside).
pub fn policy_matches(p: &Authorization, c: &Conn) -> bool {
    p.rules.iter().any(|r| rule_matches(r, c))
}

/// The hook every new connection passes before its destination is looked up or authorized
/// (inbound HBONE, inbound plaintext, outbound): waits for the mesh state's first complete sync
/// ([`Store::wait_synced`], bounded by `xds_sync_timeout_ms`). `false`: the bound passed; the
/// connection is counted as refused (`xds_not_synced`) and logged, and the caller drops it.
pub async fn wait_synced(
    state: &Store,
    metrics: &crate::metrics::Metrics,
    logs: &crate::ratelog::RateLog<(&'static str, &'static str)>,
    site: &'static str,
) -> bool {
    if state.is_synced() {
        return true;
    }
    tracing::debug!(site, "connection waits for the first complete xDS response of each type");
    match state.wait_synced().await {
        Ok(()) => true,
        Err(e) => {
            metrics.refuse(e.reason());
            crate::log_limited!(logs, (site, e.reason()), warn, site, error = %e,
                "refused: connection arrived before the mesh state was synced");
            false
        }
    }
}

/// One applicable policy's part in a decision, for explanations.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Considered {
    pub policy: String,
    pub action: Action,
    pub dry_run: bool,
    pub matched: bool,
}

/// Decides a connection to `dst`. `explain`, when given, receives every applicable policy.
pub fn decide(
    store: &Store,
    dst: &Workload,
    c: &Conn,
    mut explain: Option<&mut Vec<Considered>>,
) -> Decision {
    if let Some(why) = &dst.fail_closed {
        return Decision::DestinationFailedClosed(why.clone());
    }
    let mut deny: Option<Arc<Authorization>> = None;
    let mut allow_exists = false;
    let mut allow_matched = false;
    store.for_each_policy_of(dst, |p| {
        let matched = policy_matches(p, c);
        if let Some(e) = explain.as_deref_mut() {
            e.push(Considered { policy: p.key(), action: p.action, dry_run: p.dry_run, matched });
        }
        if p.dry_run {
            if matched {
                tracing::info!(policy = %format_args!("{}/{}", p.namespace, p.name), action = ?p.action,
                    dst = %dst.uid, "dry-run authorization policy matched (not enforced)");
            }
            return;
        }
        match p.action {
            Action::Deny => {
                if matched && deny.is_none() {
                    deny = Some(p.clone());
                }
            }
            Action::Allow => {
                allow_exists = true;
                allow_matched |= matched;
            }
        }
    });
    match deny {
        Some(p) => Decision::ExplicitDeny(p),
        None if !allow_exists || allow_matched => Decision::Allow,
        None => Decision::NoAllowMatched,
    }
}

#[cfg(test)]
mod tests;
