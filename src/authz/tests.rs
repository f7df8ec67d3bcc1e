//! The semantic table: each row a policy set, a destination workload, a connection and the
//! expected decision, written from Istio's documented rules (see the module comment).

use std::collections::HashMap;

use super::*;
use crate::state::{Delta, Resource, StoreConfig};

const CLIENT: &str = "spiffe://cluster.local/ns/demo/sa/client";
const OTHER: &str = "spiffe://cluster.local/ns/other/sa/robot";

fn store(policies: &str) -> Store {
    let s = Store::new(StoreConfig {
        trust_domain: "cluster.local".into(),
        node_name: "n".into(),
        hbone_port: 15008,
        node_hbone: HashMap::new(),
        inpod: false,
        sync_timeout: None,
    });
    let ps: Vec<Authorization> = serde_yaml::from_str(policies).expect(policies);
    s.apply(Delta { upserts: ps.into_iter().map(Resource::Policy).collect(), removes: vec![] });
    s
}

fn dst(listed: &[&str]) -> Workload {
    let mut w: Workload = serde_yaml::from_str(
        "{uid: d, name: echo, namespace: demo, service_account: echo, ips: [10.0.0.9], node: n}",
    )
    .unwrap();
    w.authorization_policies = listed.iter().map(|s| s.to_string()).collect();
    w
}

/// `src`: a SPIFFE id or "-" for plaintext; `to`: "ip:port".
fn check(policies: &str, listed: &[&str], src: &str, src_ip: &str, to: &str) -> String {
    let s = store(policies);
    let id: Option<Identity> = (src != "-").then(|| src.parse().unwrap());
    let principal = id.as_ref().map(principal_of);
    let to: std::net::SocketAddr = to.parse().unwrap();
    let c = Conn {
        src: id.as_ref(),
        principal: principal.as_deref(),
        src_ip: src_ip.parse().unwrap(),
        dst_ip: to.ip(),
        dst_port: to.port(),
    };
    match decide(&s, &dst(listed), &c, None) {
        Decision::Allow => "allow".into(),
        Decision::ExplicitDeny(p) => format!("deny {}", p.key()),
        Decision::NoAllowMatched => "no-allow".into(),
        Decision::DestinationFailedClosed(_) => "failed-closed".into(),
    }
}

const TO: &str = "10.0.0.9:8080";
const FROM: &str = "10.1.2.3";

fn allow(rules: &str) -> String {
    format!("[{{name: a, namespace: demo, scope: NAMESPACE, action: ALLOW, rules: {rules}}}]")
}
fn deny(rules: &str) -> String {
    format!("[{{name: d, namespace: demo, scope: NAMESPACE, action: DENY, rules: {rules}}}]")
}
fn one(m: &str) -> String {
    format!("[{{clauses: [{{matches: [{m}]}}]}}]")
}

/// (policies, policies the workload lists, source, source ip, destination, expected, what).
type Row<'a> = (String, Vec<&'a str>, &'a str, &'a str, &'a str, &'a str, &'a str);

#[test]
fn semantic_table() {
    let rows: Vec<Row> = vec![
        // (policies, listed, src, src_ip, dst, expected, what)
        ("[]".into(), vec![], CLIENT, FROM, TO, "allow", "no policy: allow"),
        ("[]".into(), vec![], "-", FROM, TO, "allow", "no policy: plaintext allowed too"),
        (allow("[]"), vec![], CLIENT, FROM, TO, "no-allow", "ALLOW without rules exists, matches nothing"),
        (deny("[]"), vec![], CLIENT, FROM, TO, "allow", "DENY without rules matches nothing"),
        (deny("[{}]"), vec![], CLIENT, FROM, TO, "deny demo/d", "a rule without clauses matches everything"),
        (deny("[{clauses: [{}]}]"), vec![], CLIENT, FROM, TO, "deny demo/d", "a clause without matches matches everything"),
        (deny("[{clauses: [{matches: [{}]}]}]"), vec![], CLIENT, FROM, TO, "allow", "a clause of only empty matches matches nothing"),
        (deny("[{clauses: [{matches: [{}, {destination_ports: [8080]}]}]}]"), vec![], CLIENT, FROM, TO, "deny demo/d", "empty matches are skipped, the others count"),
        (deny("[{clauses: [{matches: [{destination_ports: [8080]}]}, {matches: [{destination_ports: [9090]}]}]}]"), vec![], CLIENT, FROM, TO, "allow", "a rule needs all its clauses"),
        (deny("[{clauses: [{matches: [{destination_ports: [9090]}]}]}, {clauses: [{matches: [{destination_ports: [8080]}]}]}]"), vec![], CLIENT, FROM, TO, "deny demo/d", "a policy needs any rule"),
        (deny("[{clauses: [{matches: [{destination_ports: [8080], source_ips: [10.9.0.0/16]}]}]}]"), vec![], CLIENT, FROM, TO, "allow", "a match needs all its fields"),
        // principals
        (allow(&one("{principals: [{exact: cluster.local/ns/demo/sa/client}]}")), vec![], CLIENT, FROM, TO, "allow", "principal exact"),
        (allow(&one("{principals: [{exact: cluster.local/ns/demo/sa/client}]}")), vec![], OTHER, FROM, TO, "no-allow", "principal exact, other peer"),
        (allow(&one("{principals: [{exact: spiffe://cluster.local/ns/demo/sa/client}]}")), vec![], CLIENT, FROM, TO, "no-allow", "principals are written without spiffe://"),
        (allow(&one("{principals: [{prefix: cluster.local/ns/demo/}]}")), vec![], CLIENT, FROM, TO, "allow", "principal prefix"),
        (allow(&one("{principals: [{suffix: /sa/robot}]}")), vec![], OTHER, FROM, TO, "allow", "principal suffix"),
        (allow(&one("{principals: [presence]}")), vec![], CLIENT, FROM, TO, "allow", "principal presence"),
        (allow(&one("{principals: [presence]}")), vec![], "-", FROM, TO, "no-allow", "no identity: positives never match"),
        (allow(&one("{not_principals: [{exact: cluster.local/ns/demo/sa/client}]}")), vec![], CLIENT, FROM, TO, "no-allow", "not_principals excludes"),
        (allow(&one("{not_principals: [{exact: cluster.local/ns/demo/sa/client}]}")), vec![], OTHER, FROM, TO, "allow", "not_principals lets others"),
        (deny(&one("{not_principals: [presence]}")), vec![], "-", FROM, TO, "deny demo/d", "STRICT: plaintext denied (negatives match no identity)"),
        (deny(&one("{not_principals: [presence]}")), vec![], CLIENT, FROM, TO, "allow", "STRICT: mTLS allowed"),
        // namespaces
        (allow(&one("{namespaces: [{exact: demo}]}")), vec![], CLIENT, FROM, TO, "allow", "namespace"),
        (allow(&one("{namespaces: [{exact: demo}]}")), vec![], OTHER, FROM, TO, "no-allow", "namespace, other"),
        (allow(&one("{namespaces: [{exact: demo}]}")), vec![], "-", FROM, TO, "no-allow", "namespace, no identity"),
        (deny(&one("{not_namespaces: [{exact: demo}]}")), vec![], OTHER, FROM, TO, "deny demo/d", "not_namespaces"),
        (deny(&one("{not_namespaces: [{exact: demo}]}")), vec![], CLIENT, FROM, TO, "allow", "not_namespaces, own namespace"),
        (deny(&one("{not_namespaces: [{exact: demo}]}")), vec![], "-", FROM, TO, "deny demo/d", "not_namespaces, no identity"),
        // service accounts
        (allow(&one("{service_accounts: [{namespace: demo, service_account: client}]}")), vec![], CLIENT, FROM, TO, "allow", "service account"),
        (allow(&one("{service_accounts: [{namespace: other, service_account: client}]}")), vec![], CLIENT, FROM, TO, "no-allow", "service account in another namespace"),
        (allow(&one("{not_service_accounts: [{namespace: demo, service_account: client}]}")), vec![], CLIENT, FROM, TO, "no-allow", "not_service_accounts"),
        (allow(&one("{not_service_accounts: [{namespace: demo, service_account: client}]}")), vec![], "-", FROM, TO, "allow", "not_service_accounts, no identity"),
        // addresses and ports
        (allow(&one("{source_ips: [10.1.0.0/16]}")), vec![], "-", FROM, TO, "allow", "source CIDR"),
        (allow(&one("{source_ips: [10.1.2.3]}")), vec![], "-", FROM, TO, "allow", "source address without length"),
        (allow(&one("{source_ips: [10.2.0.0/16]}")), vec![], "-", FROM, TO, "no-allow", "source CIDR, outside"),
        (allow(&one("{source_ips: [0.0.0.0/0]}")), vec![], "-", "fd00::1", TO, "no-allow", "an IPv4 block never holds IPv6"),
        (allow(&one("{source_ips: ['fd00::/8']}")), vec![], "-", "fd00::1", TO, "allow", "IPv6 CIDR"),
        (allow(&one("{not_source_ips: [10.1.0.0/16]}")), vec![], "-", FROM, TO, "no-allow", "not_source_ips"),
        (allow(&one("{destination_ips: [10.0.0.9/32]}")), vec![], "-", FROM, TO, "allow", "destination address"),
        (allow(&one("{not_destination_ips: [10.0.0.0/8]}")), vec![], "-", FROM, TO, "no-allow", "not_destination_ips"),
        (allow(&one("{destination_ports: [80, 8080]}")), vec![], "-", FROM, TO, "allow", "destination port"),
        (allow(&one("{destination_ports: [80]}")), vec![], "-", FROM, TO, "no-allow", "destination port, other"),
        (allow(&one("{not_destination_ports: [8080]}")), vec![], "-", FROM, TO, "no-allow", "not_destination_ports"),
        // scopes
        ("[{name: g, namespace: istio-system, scope: GLOBAL, action: DENY, rules: [{}]}]".into(), vec![], CLIENT, FROM, TO, "deny istio-system/g", "GLOBAL ignores its own namespace"),
        ("[{name: n, namespace: other, scope: NAMESPACE, action: DENY, rules: [{}]}]".into(), vec![], CLIENT, FROM, TO, "allow", "NAMESPACE of another namespace"),
        ("[{name: w, namespace: demo, scope: WORKLOAD_SELECTOR, action: DENY, rules: [{}]}]".into(), vec![], CLIENT, FROM, TO, "allow", "WORKLOAD_SELECTOR not listed"),
        ("[{name: w, namespace: other, scope: WORKLOAD_SELECTOR, action: DENY, rules: [{}]}]".into(), vec!["other/w"], CLIENT, FROM, TO, "deny other/w", "WORKLOAD_SELECTOR listed, from another namespace"),
        ("[]".into(), vec!["demo/missing"], CLIENT, FROM, TO, "allow", "an unknown listed policy is skipped"),
        // dry run, precedence
        ("[{name: d, namespace: demo, scope: NAMESPACE, action: DENY, dry_run: true, rules: [{}]}]".into(), vec![], CLIENT, FROM, TO, "allow", "dry-run DENY not enforced"),
        ("[{name: a, namespace: demo, scope: NAMESPACE, action: ALLOW, dry_run: true, rules: []}]".into(), vec![], CLIENT, FROM, TO, "allow", "dry-run ALLOW does not count as existing"),
        (format!("[{{name: a, namespace: demo, scope: NAMESPACE, action: ALLOW, rules: [{{}}]}}, {{name: d, namespace: demo, scope: NAMESPACE, action: DENY, rules: {}}}]", one("{principals: [{exact: cluster.local/ns/demo/sa/client}]}")), vec![], CLIENT, FROM, TO, "deny demo/d", "DENY beats ALLOW"),
        (format!("[{{name: a1, namespace: demo, scope: NAMESPACE, action: ALLOW, rules: {}}}, {{name: a2, namespace: demo, scope: NAMESPACE, action: ALLOW, rules: {}}}]", one("{destination_ports: [1]}"), one("{destination_ports: [8080]}")), vec![], CLIENT, FROM, TO, "allow", "any ALLOW that matches"),
    ];
    let mut failures = Vec::new();
    for (p, listed, src, ip, to, want, what) in &rows {
        let got = check(p, listed, src, ip, to);
        if got != *want {
            failures.push(format!("{what}: got {got}, want {want}\n  policies: {p}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} rows:\n{}",
        failures.len(),
        rows.len(),
        failures.join("\n")
    );
}

#[test]
fn explanation_names_every_applicable_policy() {
    let s = store(&format!(
        "[{{name: a, namespace: demo, scope: NAMESPACE, action: ALLOW, rules: {}}}, \
          {{name: g, namespace: x, scope: GLOBAL, action: DENY, dry_run: true, rules: [{{}}]}}]",
        one("{principals: [presence]}")
    ));
    let id: Identity = CLIENT.parse().unwrap();
    let p = principal_of(&id);
    let c = Conn {
        src: Some(&id),
        principal: Some(&p),
        src_ip: FROM.parse().unwrap(),
        dst_ip: "10.0.0.9".parse().unwrap(),
        dst_port: 80,
    };
    let mut e = Vec::new();
    assert!(decide(&s, &dst(&[]), &c, Some(&mut e)).allowed());
    let names: Vec<_> = e.iter().map(|c| (c.policy.as_str(), c.matched, c.dry_run)).collect();
    // ztunnel's order: the destination's namespace, then GLOBAL.
    assert_eq!(names, vec![("demo/a", true, false), ("x/g", true, true)]);
}

// Issue 30 item 10: the last differences from ztunnel's `assert_rbac` / `rbac.rs`, one test each.

#[test]
fn a_listed_policy_applies_whatever_its_scope() {
    let p = "[{name: n, namespace: other, scope: NAMESPACE, action: DENY, rules: [{}]}]";
    assert_eq!(check(p, &["other/n"], CLIENT, FROM, TO), "deny other/n", "listed NAMESPACE policy");
    assert_eq!(check(p, &[], CLIENT, FROM, TO), "allow", "not listed: another namespace's");
    // Listed and also applying through its scope: counted once (explanations list it once).
    let s = store("[{name: d, namespace: demo, scope: NAMESPACE, action: DENY, rules: []}]");
    let (id, pr) = peer(CLIENT);
    let mut e = Vec::new();
    decide(&s, &dst(&["demo/d"]), &conn(&id, &pr, FROM), Some(&mut e));
    assert_eq!(e.len(), 1, "{e:?}");
}

#[test]
fn a_peer_without_identity_has_the_empty_namespace() {
    for m in [
        "{namespaces: [{exact: ''}]}",
        "{namespaces: [{prefix: ''}]}",
        "{namespaces: [{suffix: ''}]}",
    ] {
        assert_eq!(check(&allow(&one(m)), &[], "-", FROM, TO), "allow", "{m}");
    }
    assert_eq!(check(&allow(&one("{namespaces: [presence]}")), &[], "-", FROM, TO), "no-allow");
    assert_eq!(
        check(&deny(&one("{not_namespaces: [{exact: ''}]}")), &[], "-", FROM, TO),
        "allow",
        "the empty namespace is excluded by not_namespaces ''"
    );
    // ztunnel compares principals after stripping spiffe:// from the peer's id: a peer without
    // one matches no principal entry, not even an empty one.
    assert_eq!(check(&allow(&one("{principals: [{exact: ''}]}")), &[], "-", FROM, TO), "no-allow");
    assert_eq!(check(&allow(&one("{principals: [{prefix: ''}]}")), &[], "-", FROM, TO), "no-allow");
}

#[test]
fn namespace_policies_are_consulted_before_global_ones() {
    let p = "[{name: g, namespace: istio-system, scope: GLOBAL, action: DENY, rules: [{}]}, \
             {name: z, namespace: demo, scope: NAMESPACE, action: DENY, rules: [{}]}]";
    assert_eq!(check(p, &[], CLIENT, FROM, TO), "deny demo/z", "the DENY ztunnel names");
}

fn peer(src: &str) -> (Identity, String) {
    let id: Identity = src.parse().unwrap();
    let p = principal_of(&id);
    (id, p)
}

fn conn<'a>(id: &'a Identity, principal: &'a str, src_ip: &str) -> Conn<'a> {
    Conn {
        src: Some(id),
        principal: Some(principal),
        src_ip: src_ip.parse().unwrap(),
        dst_ip: "10.0.0.9".parse().unwrap(),
        dst_port: 8080,
    }
}

/// What `f` logs, at debug and above.
fn logs(f: impl FnOnce()) -> String {
    #[derive(Clone, Default)]
    struct Buf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let w = buf.clone();
    let sub = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || w.clone())
        .finish();
    tracing::subscriber::with_default(sub, || {
        // A callsite first reached on another test's thread, where no subscriber was set, may
        // have cached "never" against a dispatcher list that changed meanwhile (tests run in
        // parallel): ask every callsite again now that this thread has its subscriber.
        tracing::callsite::rebuild_interest_cache();
        f()
    });
    let out = buf.0.lock().unwrap().clone();
    String::from_utf8(out).unwrap()
}

#[test]
fn decisions_log_as_ztunnel_does() {
    let (id, pr) = peer(CLIENT);
    let c = conn(&id, &pr, FROM);
    let none = store("[]");
    let l = logs(|| assert!(decide(&none, &dst(&[]), &c, None).allowed()));
    assert!(l.contains("no allow policies, allow"), "{l}");
    let two = store(&format!(
        "[{{name: a1, namespace: demo, scope: NAMESPACE, action: ALLOW, rules: {}}}, \
          {{name: a2, namespace: demo, scope: NAMESPACE, action: ALLOW, rules: [{{}}]}}]",
        one("{destination_ports: [1]}")
    ));
    let l = logs(|| assert!(decide(&two, &dst(&[]), &c, None).allowed()));
    assert!(l.contains("allow policy match") && l.contains("policy=demo/a2"), "{l}");
    assert!(!l.contains("demo/a1"), "{l}");
    let miss = store(&allow(&one("{destination_ports: [1]}")));
    let mut d = None;
    let l = logs(|| d = Some(decide(&miss, &dst(&[]), &c, None)));
    assert!(l.contains("no allow policies matched"), "{l}");
    assert_eq!(d.unwrap().reason(), "allow policies exist, but none allowed");
    let denied = store(&deny("[{}]"));
    let l = logs(|| assert!(!decide(&denied, &dst(&[]), &c, None).allowed()));
    assert!(l.contains("deny policy match") && l.contains("policy=demo/d"), "{l}");
}

#[test]
fn explaining_a_decision_writes_no_match_lines() {
    let s = store(
        "[{name: g, namespace: demo, scope: NAMESPACE, action: DENY, dry_run: true, rules: [{}]}]",
    );
    let (id, pr) = peer(CLIENT);
    let c = conn(&id, &pr, FROM);
    let l = logs(|| {
        decide(&s, &dst(&[]), &c, None);
    });
    assert!(l.contains("dry-run: deny policy match"), "a connection logs its dry-run match: {l}");
    let mut e = Vec::new();
    let l = logs(|| {
        decide(&s, &dst(&[]), &c, Some(&mut e));
    });
    assert!(l.is_empty(), "an explanation is not a connection: {l}");
    assert!(e[0].matched && e[0].dry_run);
}

#[test]
fn explaining_an_mtls_source_uses_its_address() {
    let s = store(&allow(&one("{source_ips: [10.1.0.0/16]}")));
    let w =
        "{uid: d, name: echo, namespace: demo, service_account: echo, ips: [10.0.0.9], node: n}";
    s.apply(Delta {
        upserts: vec![Resource::Workload(serde_yaml::from_str(w).unwrap())],
        removes: vec![],
    });
    let v = explain(&s, Some(CLIENT), Some(FROM), Some(TO)).unwrap();
    assert_eq!((v["allowed"].as_bool(), v["source_ip"].as_str()), (Some(true), Some(FROM)), "{v}");
    let v = explain(&s, Some(CLIENT), Some("10.2.0.1"), Some(TO)).unwrap();
    assert_eq!(v["allowed"], false, "{v}");
    let e = explain(&s, Some(CLIENT), None, Some(TO)).unwrap_err();
    assert!(e.contains("src_ip"), "no address is assumed for a SPIFFE source: {e}");
    let v = explain(&s, Some(FROM), None, Some(TO)).unwrap();
    assert_eq!(
        (v["allowed"].as_bool(), v["source_identity_verified"].as_bool()),
        (Some(true), Some(false))
    );
}
