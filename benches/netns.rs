//! Outbound sockets for in-pod mode: what one costs a tokio worker when it is made in a pod's
//! network namespace. Three ways, 100 sockets per iteration from one task on the worker:
//! - `own`: `socket()` in the proxy's own namespace (the floor; not possible for a pod);
//! - `setns_here`: the worker enters the pod's namespace, makes the socket and returns
//!   (`Netns::tcp_socket`, what the proxy does);
//! - `pod_thread`: the socket is made by the pod's namespace thread and sent back
//!   (`Netns::run`, what the proxy did before).
//!
//! Root only (it creates a namespace): `taskset -c 1 cargo bench --locked --bench netns`
//! (one core, so the hand-off's second thread costs its CPU time, not an idle core's).

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use mbtunnel::net::netns::{self, Netns};
use socket2::{Domain, Protocol, Socket, Type};

const PER_ITER: u64 = 100;

/// One way to make the sockets: a task spawned on the worker.
type Way = fn(Arc<Netns>) -> tokio::task::JoinHandle<()>;

fn socket() -> std::io::Result<Socket> {
    let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP))?;
    s.set_nonblocking(true)?;
    Ok(s)
}

struct NsGuard(String);
impl Drop for NsGuard {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn bench(c: &mut Criterion) {
    let name = format!("mbt-bench-netns-{}", std::process::id());
    let ok = std::process::Command::new("ip")
        .args(["netns", "add", &name])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("netns bench needs root and `ip netns add`: not run");
        return;
    }
    let _guard = NsGuard(name.clone());
    let fd = netns::open(&std::path::Path::new("/var/run/netns").join(&name)).unwrap();
    let ns = Arc::new(Netns::enter(fd, &name).unwrap());
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let mut g = c.benchmark_group("pod_socket");
    g.throughput(Throughput::Elements(PER_ITER));
    let ways: [(&str, Way); 3] = [
        ("own", |_| {
            tokio::spawn(async {
                for _ in 0..PER_ITER {
                    drop(socket().unwrap());
                }
            })
        }),
        ("setns_here", |ns| {
            tokio::spawn(async move {
                for _ in 0..PER_ITER {
                    drop(ns.tcp_socket(false).unwrap());
                }
            })
        }),
        ("pod_thread", |ns| {
            tokio::spawn(async move {
                for _ in 0..PER_ITER {
                    drop(ns.run(socket).await.unwrap().unwrap());
                }
            })
        }),
    ];
    for (way, f) in ways {
        g.bench_function(way, |b| b.iter(|| rt.block_on(async { f(ns.clone()).await.unwrap() })));
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
