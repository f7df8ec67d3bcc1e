//! DNS answers per second, over UDP on loopback, one query in flight, each a full round trip
//! from a client socket: the upstream resolver this run starts (`dns::tools::StaticServer`, an
//! authoritative server of fixed records — the baseline), the proxy answering a mesh name from
//! the mesh state, and the proxy forwarding an outside name to that upstream (after the first,
//! hickory's cache answers it: what a pod asking the same outside name again gets). Also the
//! proxy's answer alone, in-process, without sockets (`answer/*`).
//! `taskset -c 1 cargo bench --locked --bench dns` (one core: client, proxy and upstream share it).

use std::net::SocketAddr;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use hickory_proto::op::{Message, Query};
use hickory_proto::rr::{Name, RecordType};
use mbtunnel::dns::tools::{parse_records, StaticServer};
use mbtunnel::dns::{server, Clients, Dns, DnsConfig, DnsMetrics, Transport, Upstream};
use mbtunnel::proxy::drain::Drain;
use mbtunnel::state::store_of_yaml;

const MESH: &str = r#"
workloads:
- {uid: c, name: client, namespace: demo, ips: [127.0.0.1], node: a}
- {uid: e1, name: echo-1, namespace: demo, ips: [10.0.2.2], node: b}
services:
- {name: echo, namespace: demo, vips: [10.96.0.20], ports: [{port: 80}], workloads: [e1]}
"#;

fn query(name: &str) -> Vec<u8> {
    let mut m = Message::new();
    m.set_id(7)
        .set_recursion_desired(true)
        .add_query(Query::query(Name::from_utf8(name).unwrap(), RecordType::A));
    m.to_vec().unwrap()
}

fn bench(c: &mut Criterion) {
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let records = parse_records(&["outside.example.org=203.0.113.7".into()]).unwrap();
    let up =
        rt.block_on(StaticServer::start("127.0.0.1:0".parse().unwrap(), records, 300)).unwrap();
    let state = Arc::new(store_of_yaml("a", MESH).unwrap());
    let cfg = DnsConfig { upstreams: vec![up.addr], ..DnsConfig::default() };
    let mut reg = prometheus_client::registry::Registry::default();
    let upstream = Arc::new(Upstream::new(&cfg.upstreams));
    let dns =
        Arc::new(Dns::new(&cfg, state.clone(), upstream, DnsMetrics::register(&mut reg)).unwrap());
    let drain = Drain::default();
    let listen: SocketAddr = "127.0.0.1:0".parse().unwrap();
    // Bind first to learn a free port, then serve there.
    let port = std::net::UdpSocket::bind(listen).unwrap().local_addr().unwrap().port();
    let proxy = SocketAddr::new(listen.ip(), port);
    let _tasks = rt
        .block_on(async {
            tokio::spawn({
                let (dns, drain) = (dns.clone(), drain.clone());
                async move { server::listen(&dns, None, proxy, Clients::Node, &drain).await }
            })
            .await
        })
        .unwrap()
        .unwrap();
    let client = rt.block_on(async {
        let s = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        s
    });
    let mut buf = vec![0u8; 4096];
    let mut g = c.benchmark_group("dns_udp");
    g.throughput(Throughput::Elements(1));
    let rows = [
        ("upstream_direct", up.addr, "outside.example.org."),
        ("proxy_mesh_name", proxy, "echo.demo.svc.cluster.local."),
        ("proxy_forwarded_cached", proxy, "outside.example.org."),
    ];
    for (row, server, name) in rows {
        let q = query(name);
        g.bench_function(row, |b| {
            b.iter(|| {
                rt.block_on(async {
                    client.send_to(&q, server).await.unwrap();
                    let (n, _) = client.recv_from(&mut buf).await.unwrap();
                    assert!(n > 12);
                })
            })
        });
    }
    g.finish();
    let client_wl = state.workload_by_uid("c").unwrap();
    let mut g = c.benchmark_group("dns_answer");
    g.throughput(Throughput::Elements(1));
    for (row, name) in [("mesh_name", "echo.demo.svc.cluster.local."), ("short_name", "echo.")] {
        let q = query(name);
        g.bench_function(row, |b| {
            b.iter(|| rt.block_on(dns.answer(Some(&client_wl), &q, Transport::Udp)).unwrap())
        });
    }
    g.finish();
    drain.start();
}

criterion_group!(benches, bench);
criterion_main!(benches);
