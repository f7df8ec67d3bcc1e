//! The DNS proxy's answers, as a table of queries against one mesh state and one upstream (a
//! [`StaticServer`] on loopback): what is answered locally and how, what is forwarded, and
//! what bad packets get.

use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RecordType};

use super::tools::{parse_records, StaticServer};
use super::*;
use crate::state::{local_resources, Delta};

const MESH: &str = r#"
workloads:
- {uid: c, name: client, namespace: demo, canonical_name: client, canonical_revision: v1,
   ips: [10.0.1.2], node: a}
- {uid: e1, name: echo-1, namespace: demo, ips: [10.0.2.2, "fd00::2"], node: b}
- {uid: d1, name: db-1, namespace: demo, ips: [10.0.2.5], node: b}
- {uid: d2, name: db-2, namespace: demo, ips: [10.0.2.6, "fd00::6"], node: b}
- {uid: o, name: other-client, namespace: other, ips: [10.0.1.3], node: a}
services:
- {name: echo, namespace: demo, vips: [10.96.0.20, "fd00:96::20"], ports: [{port: 80}], workloads: [e1]}
- {name: db, namespace: demo, ports: [{port: 5432}], workloads: [d1, d2]}
- {name: v4only, namespace: demo, vips: [10.96.0.21, "fd00:96::21"], ports: [{port: 80}],
   ip_families: IPV4_ONLY}
- {name: api, namespace: demo, hostname: api.example.com, vips: [240.240.0.1], ports: [{port: 443}]}
- {name: wild, namespace: demo, hostname: "*.wild.example", vips: [240.240.0.2], ports: [{port: 443}]}
- {name: dnsonly, namespace: demo, hostname: dns.example.com, ports: [{port: 443}]}
- {name: shared, namespace: demo, hostname: shared.example.com, vips: [240.240.0.3], ports: [{port: 80}]}
- {name: shared, namespace: other, hostname: shared.example.com, vips: [240.240.0.4], ports: [{port: 80}]}
- {name: echo, namespace: other, vips: [10.96.0.30], ports: [{port: 80}]}
"#;

fn store() -> Arc<Store> {
    Arc::new(crate::state::store_of_yaml("a", MESH).unwrap())
}

async fn proxy() -> (Dns, Arc<Store>, StaticServer) {
    let up = StaticServer::start(
        "127.0.0.1:0".parse().unwrap(),
        parse_records(&[
            "outside.example.org=203.0.113.7".into(),
            "outside.example.org=2001:db8::7".into(),
            "echo.demo.svc.cluster.local.example.org=203.0.113.99".into(),
        ])
        .unwrap(),
        60,
    )
    .await
    .unwrap();
    let state = store();
    let cfg = DnsConfig { upstreams: vec![up.addr], ..DnsConfig::default() };
    let mut reg = Registry::default();
    let dns = Dns::new(
        &cfg,
        state.clone(),
        Arc::new(Upstream::new(&cfg.upstreams)),
        DnsMetrics::register(&mut reg),
    )
    .unwrap();
    (dns, state, up)
}

fn query(name: &str, rtype: RecordType) -> Vec<u8> {
    let mut m = Message::new();
    m.set_id(0x4242)
        .set_recursion_desired(true)
        .add_query(Query::query(Name::from_utf8(name).unwrap(), rtype));
    m.to_vec().unwrap()
}

async fn ask(dns: &Dns, client: Option<&Workload>, name: &str, rtype: RecordType) -> Message {
    let out = dns.answer(client, &query(name, rtype), Transport::Udp).await.unwrap();
    Message::from_vec(&out).unwrap()
}

/// Answer records as `type data` strings, CNAMEs first, addresses sorted.
fn records(m: &Message) -> Vec<String> {
    let mut cnames: Vec<String> = Vec::new();
    let mut addrs: Vec<String> = Vec::new();
    for r in m.answers() {
        let s = format!("{} {} {}", r.name(), r.record_type(), r.data());
        if r.record_type() == RecordType::CNAME {
            cnames.push(s);
        } else {
            addrs.push(s);
        }
    }
    addrs.sort();
    cnames.extend(addrs);
    cnames
}

#[tokio::test]
async fn answers_table() {
    let (dns, state, up) = proxy().await;
    let client = state.workload_by_uid("c").unwrap();
    let other = state.workload_by_uid("o").unwrap();
    use RecordType::{A, AAAA};
    struct Case {
        who: &'static str,
        name: &'static str,
        rtype: RecordType,
        code: ResponseCode,
        aa: bool,
        want: &'static [&'static str],
    }
    let ok = ResponseCode::NoError;
    let cases = [
        // A service by its full name, its short names and with the trailing dot.
        Case { who: "c", name: "echo.demo.svc.cluster.local.", rtype: A, code: ok, aa: true,
            want: &["echo.demo.svc.cluster.local. A 10.96.0.20"] },
        Case { who: "c", name: "echo.demo.svc.cluster.local.", rtype: AAAA, code: ok, aa: true,
            want: &["echo.demo.svc.cluster.local. AAAA fd00:96::20"] },
        Case { who: "c", name: "echo.", rtype: A, code: ok, aa: true,
            want: &["echo. A 10.96.0.20"] },
        Case { who: "c", name: "echo.demo.", rtype: A, code: ok, aa: true,
            want: &["echo.demo. A 10.96.0.20"] },
        Case { who: "c", name: "echo.demo.svc.", rtype: A, code: ok, aa: true,
            want: &["echo.demo.svc. A 10.96.0.20"] },
        // The same short name means the client's own namespace's service.
        Case { who: "o", name: "echo.", rtype: A, code: ok, aa: true,
            want: &["echo. A 10.96.0.30"] },
        // A name with a search domain appended by the pod's resolver ("echo.demo" + "svc.cluster.local"
        // would be the full name itself; "echo" + "demo.svc.cluster.local" too): a search domain
        // appended to a full name is taken off, with a CNAME to the name it found.
        Case { who: "c", name: "echo.demo.svc.cluster.local.demo.svc.cluster.local.", rtype: A,
            code: ok, aa: true,
            want: &[
                "echo.demo.svc.cluster.local.demo.svc.cluster.local. CNAME echo.demo.svc.cluster.local.",
                "echo.demo.svc.cluster.local. A 10.96.0.20",
            ] },
        // Headless: the endpoints' addresses of the family, one per endpoint.
        Case { who: "c", name: "db.demo.svc.cluster.local.", rtype: A, code: ok, aa: true,
            want: &["db.demo.svc.cluster.local. A 10.0.2.5", "db.demo.svc.cluster.local. A 10.0.2.6"] },
        Case { who: "c", name: "db.demo.svc.cluster.local.", rtype: AAAA, code: ok, aa: true,
            want: &["db.demo.svc.cluster.local. AAAA fd00::6"] },
        // ip_families IPV4_ONLY: no AAAA, authoritative NOERROR.
        Case { who: "c", name: "v4only.demo.svc.cluster.local.", rtype: AAAA, code: ok, aa: true,
            want: &[] },
        Case { who: "c", name: "v4only.demo.svc.cluster.local.", rtype: A, code: ok, aa: true,
            want: &["v4only.demo.svc.cluster.local. A 10.96.0.21"] },
        // ServiceEntry hosts with auto-allocated addresses, exact and wildcard; no AAAA.
        Case { who: "c", name: "api.example.com.", rtype: A, code: ok, aa: true,
            want: &["api.example.com. A 240.240.0.1"] },
        Case { who: "c", name: "api.example.com.", rtype: AAAA, code: ok, aa: true, want: &[] },
        Case { who: "c", name: "foo.wild.example.", rtype: A, code: ok, aa: true,
            want: &["foo.wild.example. A 240.240.0.2"] },
        // A wildcard found after a search domain came off: no CNAME (ztunnel's rule).
        Case { who: "c", name: "foo.wild.example.demo.svc.cluster.local.", rtype: A, code: ok,
            aa: true, want: &["foo.wild.example.demo.svc.cluster.local. A 240.240.0.2"] },
        // The client's namespace's service among those sharing a hostname.
        Case { who: "c", name: "shared.example.com.", rtype: A, code: ok, aa: true,
            want: &["shared.example.com. A 240.240.0.3"] },
        Case { who: "o", name: "shared.example.com.", rtype: A, code: ok, aa: true,
            want: &["shared.example.com. A 240.240.0.4"] },
        // A ServiceEntry host without addresses (DNS resolution) is not answered here: forwarded,
        // and the upstream does not know it.
        Case { who: "c", name: "dns.example.com.", rtype: A, code: ResponseCode::NXDomain,
            aa: false, want: &[] },
        // Outside names: forwarded, answers as the upstream gave them, not authoritative.
        Case { who: "c", name: "outside.example.org.", rtype: A, code: ok, aa: false,
            want: &["outside.example.org. A 203.0.113.7"] },
        Case { who: "c", name: "outside.example.org.", rtype: AAAA, code: ok, aa: false,
            want: &["outside.example.org. AAAA 2001:db8::7"] },
        Case { who: "c", name: "nowhere.example.org.", rtype: A, code: ResponseCode::NXDomain,
            aa: false, want: &[] },
        // Other types are always forwarded (the upstream has no TXT: NOERROR, empty).
        Case { who: "c", name: "outside.example.org.", rtype: RecordType::TXT, code: ok,
            aa: false, want: &[] },
        // Not a workload of this proxy: SERVFAIL.
        Case { who: "-", name: "echo.demo.svc.cluster.local.", rtype: A,
            code: ResponseCode::ServFail, aa: false, want: &[] },
    ];
    for c in &cases {
        let who = match c.who {
            "c" => Some(&*client),
            "o" => Some(&*other),
            _ => None,
        };
        let m = ask(&dns, who, c.name, c.rtype).await;
        let what = format!("{} {} {}", c.who, c.name, c.rtype);
        assert_eq!(m.id(), 0x4242, "{what}");
        assert_eq!(m.message_type(), MessageType::Response, "{what}");
        assert_eq!(m.response_code(), c.code, "{what}");
        assert_eq!(m.authoritative(), c.aa, "{what}");
        assert!(m.recursion_available() && m.recursion_desired(), "{what}");
        assert_eq!(m.queries().len(), 1, "{what}");
        assert_eq!(records(&m), c.want, "{what}");
        for r in m.answers().iter().filter(|_| c.aa) {
            assert_eq!(r.ttl(), TTL_SECS, "{what}");
        }
    }
    assert!(up.queries.load(std::sync::atomic::Ordering::Relaxed) >= 5);
    // Every query counted once, by type, protocol and source; forwards and their failures.
    let m = &dns.metrics;
    let l = |t: &str, who: Option<&Workload>| labels(t.parse().unwrap(), Transport::Udp, who);
    assert_eq!(m.requests.get_or_create(&l("A", Some(&client))).get(), 14);
    // The unknown source's one and the other namespace's two (it has no canonical name).
    assert_eq!(m.requests.get_or_create(&l("A", None)).get(), 3);
    assert_eq!(m.upstream_requests.get_or_create(&l("A", Some(&client))).get(), 3);
    assert_eq!(m.upstream_failures.get_or_create(&l("A", Some(&client))).get(), 2);
    assert_eq!(l("A", Some(&client)).source_canonical_service, "client");
    assert_eq!(l("A", Some(&other)).source_canonical_service, "unknown");
}

#[tokio::test]
async fn bad_packets_get_formerr_and_never_a_crash() {
    let (dns, state, _up) = proxy().await;
    let client = state.workload_by_uid("c").unwrap();
    let good = query("echo.demo.svc.cluster.local.", RecordType::A);
    // Shorter than a header: nothing to answer.
    for n in 0..12 {
        assert!(dns.answer(Some(&client), &good[..n], Transport::Udp).await.is_none(), "{n}");
    }
    // A header with a question cut short: FORMERR with the query's id.
    for n in 12..good.len() - 1 {
        let out = dns.answer(Some(&client), &good[..n], Transport::Udp).await.unwrap();
        let m = Message::from_vec(&out).unwrap();
        assert_eq!((m.id(), m.response_code()), (0x4242, ResponseCode::FormErr), "{n}");
    }
    // A response sent as a query, two questions, no question: FORMERR.
    let mut resp = Message::from_vec(&good).unwrap();
    resp.set_message_type(MessageType::Response);
    let mut two = Message::from_vec(&good).unwrap();
    two.add_query(Query::query(Name::from_utf8("db.").unwrap(), RecordType::A));
    let mut none = Message::new();
    none.set_id(7);
    for m in [resp, two, none] {
        let out = dns.answer(Some(&client), &m.to_vec().unwrap(), Transport::Tcp).await.unwrap();
        assert_eq!(Message::from_vec(&out).unwrap().response_code(), ResponseCode::FormErr);
    }
    // Another opcode: NOTIMP.
    let mut notify = Message::from_vec(&good).unwrap();
    notify.set_op_code(OpCode::Notify);
    let out = dns.answer(Some(&client), &notify.to_vec().unwrap(), Transport::Udp).await.unwrap();
    assert_eq!(Message::from_vec(&out).unwrap().response_code(), ResponseCode::NotImp);
    // Random bytes after a valid header: an answer or nothing, never a panic.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for _ in 0..2000 {
        let mut p = good.clone();
        for _ in 0..4 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let i = (x as usize) % p.len();
            p[i] = (x >> 32) as u8;
        }
        let _ = dns.answer(Some(&client), &p, Transport::Udp).await;
    }
    assert!(dns.metrics.malformed.get() >= 12 + 3);
}

#[tokio::test]
async fn large_udp_answers_are_truncated_and_edns_is_answered() {
    let (dns, state, _up) = proxy().await;
    // A headless service with many endpoints: more than 512 bytes of A records.
    let mut ws = Vec::new();
    let mut svc: Service =
        serde_yaml::from_str("{name: big, namespace: demo, ports: [{port: 80}]}").unwrap();
    for i in 0..60u8 {
        let w: Workload = serde_yaml::from_str(&format!(
            "{{uid: big{i}, name: big-{i}, namespace: demo, ips: [10.9.0.{i}], node: b}}"
        ))
        .unwrap();
        svc.workloads.push(w.uid.clone());
        ws.push(w);
    }
    state.apply(Delta { upserts: local_resources(&ws, &[svc], &[]), removes: vec![] });
    let client = state.workload_by_uid("c").unwrap();
    let q = query("big.demo.svc.cluster.local.", RecordType::A);
    let udp =
        Message::from_vec(&dns.answer(Some(&client), &q, Transport::Udp).await.unwrap()).unwrap();
    assert!(udp.truncated() && udp.answers().is_empty());
    let tcp =
        Message::from_vec(&dns.answer(Some(&client), &q, Transport::Tcp).await.unwrap()).unwrap();
    assert!(!tcp.truncated());
    assert_eq!(tcp.answers().len(), 60);
    // With EDNS and a 4096-byte buffer it fits over UDP, and EDNS is answered.
    let mut m = Message::from_vec(&q).unwrap();
    let mut e = Edns::new();
    e.set_max_payload(4096);
    m.set_edns(e);
    let out = dns.answer(Some(&client), &m.to_vec().unwrap(), Transport::Udp).await.unwrap();
    let r = Message::from_vec(&out).unwrap();
    assert!(!r.truncated());
    assert_eq!(r.answers().len(), 60);
    assert_eq!(r.extensions().as_ref().map(|e| e.max_payload()), Some(4096));
}
