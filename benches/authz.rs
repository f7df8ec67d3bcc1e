//! Authorization decision cost: 1, 10, 100 and 1000 policies applying to one workload, for a
//! connection only the last policy allows (every policy is evaluated). The decision walks only
//! the policies that apply and allocates nothing (tests/authz_alloc.rs counts).
//!
//! `authz_recheck` (issue 30 item 7): 10,000 open inbound connections tracked for the live
//! re-check, over 100 local workloads. `accept/*` is what a new connection does with the
//! registry and the policies (register, decide, deregister), with no pushes, and with 100
//! pushes/s applied by another thread (each followed by what the re-check task does: re-check
//! every open connection if the authorization epoch moved) — of other nodes' workloads, the
//! mesh's usual churn, or of a local workload, which re-checks all 10,000 each time.
//! `push/*` is the cost of handling one push: apply plus the re-check it causes.
//! `cargo bench --locked --bench authz -- authz_recheck`

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use mbtunnel::authz::{decide, principal_of, Conn};
use mbtunnel::identity::Identity;
use mbtunnel::proxy::ConnRegistry;
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

const OPEN: usize = 10_000;
const LOCAL: usize = 100;

fn workload(uid: &str, ip: &str, node: &str, sa: &str) -> Workload {
    serde_yaml::from_str(&format!(
        "{{uid: {uid}, name: {uid}, namespace: demo, service_account: {sa}, ips: [{ip}], node: {node}}}"
    ))
    .unwrap()
}

/// 100 ALLOW policies (as `store_with`), 100 local workloads and 1,000 of other nodes.
fn mesh() -> Arc<Store> {
    let (s, _) = store_with(100);
    let mut up = Vec::new();
    for i in 0..LOCAL {
        up.push(Resource::Workload(workload(
            &format!("l{i}"),
            &format!("10.0.1.{i}"),
            "n",
            "echo",
        )));
    }
    for i in 0..1000 {
        let ip = format!("10.2.{}.{}", i / 250, i % 250);
        up.push(Resource::Workload(workload(&format!("r{i}"), &ip, "other", "echo")));
    }
    s.apply(Delta { upserts: up, removes: vec![] });
    Arc::new(s)
}

/// What one push is: a changed workload, remote or local.
#[derive(Clone, Copy)]
enum Push {
    Remote,
    Local,
}

/// Applies push number `n` of kind `k` and does what the re-check task does after it.
fn push(
    s: &Store,
    reg: &ConnRegistry,
    rx: &mut tokio::sync::watch::Receiver<u64>,
    k: Push,
    n: u64,
) {
    let w = match k {
        Push::Remote => workload(&format!("r{}", n % 1000), "10.2.9.9", "other", &format!("sa{n}")),
        Push::Local => workload("l0", "10.0.1.0", "n", &format!("sa{}", n % 2)),
    };
    s.apply(Delta { upserts: vec![Resource::Workload(w)], removes: vec![] });
    if rx.has_changed().unwrap_or(false) {
        rx.borrow_and_update();
        reg.recheck(s);
    }
}

fn recheck(c: &mut Criterion) {
    let s = mesh();
    let reg = Arc::new(ConnRegistry::default());
    let ids: Vec<Identity> = (0..100)
        .map(|i| format!("spiffe://cluster.local/ns/demo/sa/p{i}").parse().unwrap())
        .collect();
    let _open: Vec<_> = (0..OPEN)
        .map(|i| {
            let dst = format!("10.0.1.{}:8080", i % LOCAL).parse().unwrap();
            reg.register(
                &format!("l{}", i % LOCAL),
                Some(&ids[i % 100]),
                "10.1.0.1".parse().unwrap(),
                dst,
            )
        })
        .collect();
    let mut g = c.benchmark_group("authz_recheck");
    let id = &ids[99];
    let p = principal_of(id);
    let w = s.workload_by_uid("l7").unwrap();
    let accept = |reg: &Arc<ConnRegistry>| {
        let dst = "10.0.1.7:8080".parse().unwrap();
        let t = reg.register("l7", Some(id), "10.1.2.3".parse().unwrap(), dst);
        let conn = Conn {
            src: Some(id),
            principal: Some(&p),
            src_ip: "10.1.2.3".parse().unwrap(),
            dst_ip: dst.ip(),
            dst_port: 8080,
        };
        let ok = decide(&s, &w, &conn, None).allowed();
        drop(t);
        ok
    };
    assert!(accept(&reg));
    g.bench_function("accept/no_pushes", |b| b.iter(|| accept(&reg)));
    for (name, kind) in [("remote", Push::Remote), ("local", Push::Local)] {
        let stop = Arc::new(AtomicBool::new(false));
        let pusher = {
            let (s, reg, stop) = (s.clone(), reg.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rx = s.subscribe_authz();
                rx.borrow_and_update();
                let mut n = 0u64;
                let start = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    push(&s, &reg, &mut rx, kind, n);
                    // 100 pushes a second, on schedule.
                    let next = start + Duration::from_millis(10 * n);
                    std::thread::sleep(next.saturating_duration_since(Instant::now()));
                }
                n
            })
        };
        g.bench_function(format!("accept/100_pushes_per_s_{name}"), |b| b.iter(|| accept(&reg)));
        stop.store(true, Ordering::Relaxed);
        pusher.join().unwrap();
    }
    for (name, kind) in [("remote", Push::Remote), ("local", Push::Local)] {
        let mut rx = s.subscribe_authz();
        rx.borrow_and_update();
        let mut n = 0u64;
        g.bench_function(format!("push/{name}_workload"), |b| {
            b.iter(|| {
                n += 1;
                push(&s, &reg, &mut rx, kind, n)
            })
        });
    }
    g.finish();
    assert_eq!(reg.len(), OPEN, "every open connection still tracked");
}

criterion_group!(benches, bench, recheck);
criterion_main!(benches);
