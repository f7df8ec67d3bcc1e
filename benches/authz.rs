//! Authorization decision cost: 1, 10, 100 and 1000 policies applying to one workload, for a
//! connection only the last policy allows (every policy is evaluated). The decision walks only
//! the policies that apply and allocates nothing (tests/authz_alloc.rs counts).

use std::collections::HashMap;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use mbtunnel::authz::{decide, principal_of, Conn};
use mbtunnel::identity::Identity;
use mbtunnel::state::policy::Authorization;
use mbtunnel::state::{Delta, Resource, Store, StoreConfig, Workload};

/// `n` ALLOW policies in the workload's namespace; policy i allows principal `.../sa/p{i}`.
/// Plus 1000 policies of another namespace, which must cost nothing.
pub fn store_with(n: usize) -> (Store, Workload) {
    let s = Store::new(StoreConfig {
        trust_domain: "cluster.local".into(),
        node_name: "n".into(),
        hbone_port: 15008,
        node_hbone: HashMap::new(),
        inpod: false,
        sync_timeout: None,
    });
    let mut ps = Vec::new();
    for (ns, count) in [("demo", n), ("elsewhere", 1000)] {
        for i in 0..count {
            let y = format!(
                "{{name: p{i}, namespace: {ns}, scope: NAMESPACE, action: ALLOW, rules: [{{clauses: \
                 [{{matches: [{{principals: [{{exact: cluster.local/ns/demo/sa/p{i}}}], \
                 destination_ports: [8080], source_ips: [10.0.0.0/8]}}]}}]}}]}}"
            );
            ps.push(Resource::Policy(serde_yaml::from_str::<Authorization>(&y).unwrap()));
        }
    }
    s.apply(Delta { upserts: ps, removes: vec![] });
    let w: Workload = serde_yaml::from_str(
        "{uid: d, name: echo, namespace: demo, service_account: echo, ips: [10.0.0.9], node: n}",
    )
    .unwrap();
    (s, w)
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("authz_decision");
    for n in [1usize, 10, 100, 1000] {
        let (s, w) = store_with(n);
        let id: Identity = format!("spiffe://cluster.local/ns/demo/sa/p{}", n - 1).parse().unwrap();
        let p = principal_of(&id);
        let conn = Conn {
            src: Some(&id),
            principal: Some(&p),
            src_ip: "10.1.2.3".parse().unwrap(),
            dst_ip: "10.0.0.9".parse().unwrap(),
            dst_port: 8080,
        };
        assert!(decide(&s, &w, &conn, None).allowed());
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| decide(&s, &w, std::hint::black_box(&conn), None).allowed())
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
