//! L4 authorization with Istio's semantics, as ztunnel applies them (see docs/DESIGN.md and the
//! README, "Authorization policy"):
//! - policies that apply to a destination workload, in this order: its namespace's NAMESPACE
//!   ones, GLOBAL ones, and every policy it lists by name whatever its scope (ztunnel's order, so
//!   the DENY a denial names is the same);
//! - any matching DENY denies; else no ALLOW policy allows; else a matching ALLOW allows and
//!   nothing else does (an ALLOW without rules exists and matches nothing). Dry-run policies are
//!   evaluated and logged, never enforced, and a dry-run ALLOW does not count as existing;
//! - policy: any rule (none: nothing); rule: all clauses (none: everything); clause: any of its
//!   non-empty matches (none at all: everything; only empty ones: nothing); match: every
//!   non-empty field; field: some positive entry matches (or none given) and no negative entry
//!   matches. A connection without a verified identity has the empty namespace (so
//!   `exact: ""` matches it) and no principal or service account: it matches no positive
//!   principal or service-account entry and every negative one.
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
            Decision::NoAllowMatched => "allow policies exist, but none allowed".into(),
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
    // As ztunnel: a peer without identity has the empty namespace, which `exact: ""`,
    // `prefix: ""` and `suffix: ""` match (and `presence` does not). Its principal is not the
    // empty string but nothing: ztunnel compares principals only after stripping `spiffe://`
    // from the peer's id, so no principal entry, positive or negative, ever matches it.
    let ns = Some(c.src.map_or("", |i| i.namespace.as_str()));
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

/// Decides a connection to `dst`. `explain`, when given, receives every applicable policy; an
/// explanation is not a connection, so it logs nothing (no dry-run or decision lines).
///
/// Logs as ztunnel does (at debug; a dry-run match at info): `deny policy match`, `no allow
/// policies, allow`, `allow policy match` (with the ALLOW that matched), `no allow policies
/// matched`, and `dry-run: deny policy match` / `dry-run: allow policy match`.
pub fn decide(
    store: &Store,
    dst: &Workload,
    c: &Conn,
    mut explain: Option<&mut Vec<Considered>>,
) -> Decision {
    if let Some(why) = &dst.fail_closed {
        return Decision::DestinationFailedClosed(why.clone());
    }
    let log = explain.is_none();
    let mut deny: Option<Arc<Authorization>> = None;
    let mut allow_exists = false;
    let mut allowed_by: Option<Arc<Authorization>> = None;
    store.for_each_policy_of(dst, |p| {
        let matched = policy_matches(p, c);
        if let Some(e) = explain.as_deref_mut() {
            e.push(Considered { policy: p.key(), action: p.action, dry_run: p.dry_run, matched });
        }
        if p.dry_run {
            if matched && log {
                let what = match p.action {
                    Action::Deny => "dry-run: deny policy match",
                    Action::Allow => "dry-run: allow policy match",
                };
                tracing::info!(policy = %format_args!("{}/{}", p.namespace, p.name),
                    dst = %dst.uid, "{what}");
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
                if matched && allowed_by.is_none() {
                    allowed_by = Some(p.clone());
                }
            }
        }
    });
    let d = match (&deny, &allowed_by) {
        (Some(p), _) => Decision::ExplicitDeny(p.clone()),
        (None, Some(_)) => Decision::Allow,
        (None, None) if !allow_exists => Decision::Allow,
        (None, None) => Decision::NoAllowMatched,
    };
    if log {
        let key = |p: &Authorization| format!("{}/{}", p.namespace, p.name);
        match (&deny, &allowed_by) {
            (Some(p), _) => tracing::debug!(policy = %key(p), dst = %dst.uid, "deny policy match"),
            (None, Some(p)) => {
                tracing::debug!(policy = %key(p), dst = %dst.uid, "allow policy match")
            }
            (None, None) if !allow_exists => {
                tracing::debug!(dst = %dst.uid, "no allow policies, allow")
            }
            (None, None) => tracing::debug!(dst = %dst.uid, "no allow policies matched"),
        }
    }
    d
}

/// `/authz/check` and `mbtunnel check-policy`: the decision for a hypothetical connection from
/// `src` (a SPIFFE id: an mTLS peer, whose address `src_ip` must be given since `source_ips`
/// rules compare it; an IP alone: a plaintext peer) to `dst` (`ip:port` of a workload), with
/// every applicable policy and whether it matched. Logs nothing.
pub fn explain(
    state: &Store,
    src: Option<&str>,
    src_ip: Option<&str>,
    dst: Option<&str>,
) -> Result<serde_json::Value, String> {
    let usage = "usage: /authz/check?src=<spiffe://... or source ip>[&src_ip=<ip>]&dst=<ip:port> \
                 (src_ip is required with a SPIFFE id)";
    let src = src.ok_or(usage)?;
    let dst: std::net::SocketAddr =
        dst.ok_or(usage)?.parse().map_err(|_| format!("dst must be ip:port; {usage}"))?;
    let w = state
        .workload_by_ip(dst.ip())
        .ok_or_else(|| format!("{} is not a workload address in the mesh state", dst.ip()))?;
    let ip =
        |v: &str| v.parse::<IpAddr>().map_err(|_| format!("'{v}' is not an IP address; {usage}"));
    let (id, src_ip) = if src.starts_with("spiffe://") {
        let id: Identity = src.parse().map_err(|e| format!("src: {e}"))?;
        let Some(a) = src_ip else {
            return Err(format!(
                "a SPIFFE source needs its address too (src_ip): policies with source_ips \
                 compare it, and no address is assumed; {usage}"
            ));
        };
        (Some(id), ip(a)?)
    } else {
        let a = ip(src)?;
        if let Some(other) = src_ip.filter(|v| ip(v).ok() != Some(a)) {
            return Err(format!("src {src} and src_ip {other} disagree; give one address"));
        }
        (None, a)
    };
    let principal = id.as_ref().map(principal_of);
    let c = Conn {
        src: id.as_ref(),
        principal: principal.as_deref(),
        src_ip,
        dst_ip: dst.ip(),
        dst_port: dst.port(),
    };
    let mut considered = Vec::new();
    let d = decide(state, &w, &c, Some(&mut considered));
    Ok(serde_json::json!({
        "source": src,
        "source_ip": src_ip.to_string(),
        "source_identity_verified": id.is_some(),
        "destination": dst.to_string(),
        "destination_workload": format!("{}/{}", w.namespace, w.name),
        "local": state.local_workload_by_ip(dst.ip()).is_some(),
        "allowed": d.allowed(),
        "reason": d.reason(),
        "policies": considered,
    }))
}

#[cfg(test)]
mod tests;
