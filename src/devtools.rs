//! Developer tools behind the hidden `mbtunnel tool` command, used by the demo scripts and
//! namespace tests: an echo server, a client that checks its echo, and a minimal stand-in for
//! istio-cni's node agent.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Echoes every byte back on each connection; prints one JSON line per connection.
pub async fn echo(listen: SocketAddr) -> anyhow::Result<()> {
    let l =
        tokio::net::TcpListener::bind(listen).await.with_context(|| format!("bind {listen}"))?;
    loop {
        let (mut s, peer) = l.accept().await?;
        tokio::spawn(async move {
            let (mut r, mut w) = s.split();
            let n = tokio::io::copy(&mut r, &mut w).await.unwrap_or(0);
            let _ = w.shutdown().await;
            println!("{{\"echo_peer\":\"{peer}\",\"bytes\":{n}}}");
        });
    }
}

/// Sends `bytes` pseudo-random bytes, reads the echo, checks it, prints a JSON line.
pub async fn send(connect: SocketAddr, bind: Option<IpAddr>, bytes: usize) -> anyhow::Result<()> {
    let sock = if connect.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    if let Some(ip) = bind {
        sock.bind(SocketAddr::new(ip, 0)).with_context(|| format!("bind {ip}"))?;
    }
    let start = std::time::Instant::now();
    let s = sock.connect(connect).await.with_context(|| format!("connect {connect}"))?;
    let data: Vec<u8> = (0..bytes).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    let (mut r, mut w) = s.into_split();
    let d2 = data.clone();
    let writer = tokio::spawn(async move {
        w.write_all(&d2).await?;
        w.shutdown().await
    });
    let mut back = Vec::with_capacity(bytes);
    r.read_to_end(&mut back).await?;
    writer.await??;
    let ok = back == data;
    println!(
        "{{\"sent\":{},\"received\":{},\"intact\":{},\"ms\":{}}}",
        data.len(),
        back.len(),
        ok,
        start.elapsed().as_millis()
    );
    anyhow::ensure!(ok, "echo mismatch: sent {} bytes, got {} back", data.len(), back.len());
    Ok(())
}

/// A pod as the CNI stand-in enrols it: its uid, its network namespace, and optionally the
/// workload information istio-cni sends with it (ztunnel requires it; mbtunnel finds the
/// workload by uid without it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CniPod {
    pub uid: String,
    pub netns: PathBuf,
    /// (namespace, name, service account).
    pub info: Option<(String, String, String)>,
}

impl std::str::FromStr for CniPod {
    type Err = String;

    /// `uid=NETNS_PATH` or `uid=NETNS_PATH=namespace/name/service_account`.
    fn from_str(s: &str) -> Result<CniPod, String> {
        let bad = || format!("'{s}' is not uid=/path/to/netns[=namespace/name/service_account]");
        let mut parts = s.splitn(3, '=');
        let (uid, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        if uid.is_empty() || path.is_empty() {
            return Err(bad());
        }
        let info = match parts.next() {
            None => None,
            Some(i) => match i.split('/').collect::<Vec<_>>()[..] {
                [ns, name, sa] if !ns.is_empty() && !name.is_empty() && !sa.is_empty() => {
                    Some((ns.into(), name.into(), sa.into()))
                }
                _ => return Err(bad()),
            },
        };
        Ok(CniPod { uid: uid.into(), netns: path.into(), info })
    }
}

/// Pods from a file: one `uid=NETNS_PATH[=namespace/name/service_account]` per line (blank lines
/// and `#` comments skipped).
pub fn read_pods(path: &std::path::Path) -> anyhow::Result<Vec<CniPod>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.parse::<CniPod>().map_err(anyhow::Error::msg))
        .collect()
}

/// A minimal stand-in for istio-cni's node agent: serves ZDS on `socket`, installs the redirect
/// rules in each pod's namespace, and enrols the pods (replayed on every reconnect, then
/// SnapshotSent). Prints one JSON line per ack, or with `quiet` one line once every pod of a
/// connection has been acknowledged.
pub async fn fake_cni(
    socket: PathBuf,
    pods: Vec<CniPod>,
    backend: crate::redirect::Backend,
    quiet: bool,
) -> anyhow::Result<()> {
    use crate::inpod::uds::SeqPacketListener;
    use crate::inpod::zds::{ResponsePayload, WorkloadInfo, WorkloadRequest, WorkloadResponse};
    use prost::Message;
    for pod in &pods {
        crate::redirect::apply(backend, &pod.netns, true)
            .with_context(|| format!("redirect rules for pod {}", pod.uid))?;
    }
    let l =
        SeqPacketListener::bind(&socket).with_context(|| format!("bind {}", socket.display()))?;
    loop {
        let conn = l.accept().await?;
        let _hello = conn.recv().await?;
        let mut reqs: Vec<(String, WorkloadRequest, Option<std::os::fd::OwnedFd>)> = Vec::new();
        for pod in &pods {
            let fd = crate::net::netns::open(&pod.netns)
                .with_context(|| format!("open {}", pod.netns.display()))?;
            let info = pod.info.as_ref().map(|(namespace, name, sa)| WorkloadInfo {
                name: name.clone(),
                namespace: namespace.clone(),
                service_account: sa.clone(),
            });
            reqs.push((format!("add {}", pod.uid), WorkloadRequest::add(&pod.uid, info), Some(fd)));
        }
        reqs.push(("snapshot".into(), WorkloadRequest::snapshot_sent(), None));
        let (mut acked, mut failed) = (0usize, 0usize);
        for (what, req, fd) in reqs {
            let fds: Vec<_> = fd.as_ref().map(std::os::fd::AsFd::as_fd).into_iter().collect();
            conn.send(&req.encode_to_vec(), &fds).await?;
            let Some(p) = conn.recv().await? else { break };
            let err = match WorkloadResponse::decode(&p.data[..]).map(|r| r.payload) {
                Ok(Some(ResponsePayload::Ack(a))) => a.error,
                _ => "malformed response".into(),
            };
            if err.is_empty() {
                acked += 1;
            } else {
                failed += 1;
            }
            if !quiet || !err.is_empty() {
                println!("{}", serde_json::json!({"request": what, "error": err}));
            }
        }
        if quiet {
            println!("{}", serde_json::json!({"acked": acked, "failed": failed}));
        }
        // Hold the connection until the proxy goes; then wait for it to come back.
        while conn.recv().await?.is_some() {}
    }
}

/// What one storm connection saw.
struct StormResult {
    ok: bool,
    millis: f64,
}

/// A handshake storm from many pods: `concurrency` threads take the pods in turn; each enters a
/// pod's network namespace, opens one TCP connection to `connect` (captured there and carried by
/// the node proxy over HBONE under the pod's identity), sends `request`, reads the answer to its
/// end, and requires it to start with `expect`. Prints one JSON line: connections, failures,
/// wall seconds, connections per second, p50/p99 latency. Fails when any connection failed.
pub fn storm(
    pods: Vec<CniPod>,
    connect: SocketAddr,
    concurrency: usize,
    request: &str,
    expect: &str,
) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    anyhow::ensure!(!pods.is_empty(), "no pods");
    // Open every namespace first, so the storm measures connections, not file opens.
    let mut fds = Vec::with_capacity(pods.len());
    for p in &pods {
        fds.push(
            crate::net::netns::open(&p.netns)
                .with_context(|| format!("open {}", p.netns.display()))?,
        );
    }
    let fds = Arc::new(fds);
    let next = Arc::new(AtomicUsize::new(0));
    let results = Arc::new(Mutex::new(Vec::with_capacity(pods.len())));
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let request = Arc::new(request.replace("\\r\\n", "\r\n").into_bytes());
    let expect = Arc::new(expect.as_bytes().to_vec());
    let start = std::time::Instant::now();
    let threads: Vec<_> = (0..concurrency.clamp(1, pods.len()))
        .map(|_| {
            let (fds, next, results, errors) =
                (fds.clone(), next.clone(), results.clone(), errors.clone());
            let (request, expect) = (request.clone(), expect.clone());
            std::thread::spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(fd) = fds.get(i) else { return };
                let t0 = std::time::Instant::now();
                let r = (|| -> std::io::Result<()> {
                    use std::os::fd::AsFd;
                    crate::net::netns::enter_current_thread(fd.as_fd())?;
                    let mut s = std::net::TcpStream::connect_timeout(
                        &connect,
                        std::time::Duration::from_secs(15),
                    )?;
                    s.set_read_timeout(Some(std::time::Duration::from_secs(15)))?;
                    s.write_all(&request)?;
                    let mut answer = Vec::new();
                    s.read_to_end(&mut answer)?;
                    if !answer.starts_with(&expect) {
                        return Err(std::io::Error::other(format!(
                            "answer of {} bytes does not start with the expected bytes",
                            answer.len()
                        )));
                    }
                    Ok(())
                })();
                if let Err(e) = &r {
                    errors.lock().unwrap().push(format!("pod {i}: {e}"));
                }
                let millis = t0.elapsed().as_secs_f64() * 1000.0;
                results.lock().unwrap().push(StormResult { ok: r.is_ok(), millis });
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
    let wall = start.elapsed().as_secs_f64();
    let results = std::mem::take(&mut *results.lock().unwrap());
    let mut ms: Vec<f64> = results.iter().filter(|r| r.ok).map(|r| r.millis).collect();
    ms.sort_by(f64::total_cmp);
    let pct = |q: f64| ms.get(((ms.len() as f64 - 1.0) * q).round() as usize).copied();
    let ok = ms.len();
    let failed = results.len() - ok;
    let errors = errors.lock().unwrap();
    println!(
        "{}",
        serde_json::json!({
            "connections": results.len(), "ok": ok, "failed": failed, "wall_s": wall,
            "conn_per_s": ok as f64 / wall, "p50_ms": pct(0.5), "p99_ms": pct(0.99),
            "concurrency": concurrency, "first_errors": errors.iter().take(5).collect::<Vec<_>>(),
        })
    );
    anyhow::ensure!(failed == 0, "{failed} of {} connections failed", results.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_parse_with_and_without_workload_info() {
        let p: CniPod = "c-1=/var/run/netns/p1".parse().unwrap();
        assert_eq!((p.uid.as_str(), p.info), ("c-1", None));
        let p: CniPod = "c-2=/var/run/netns/p2=default/client-2/sa-2".parse().unwrap();
        assert_eq!(p.netns, PathBuf::from("/var/run/netns/p2"));
        assert_eq!(p.info, Some(("default".into(), "client-2".into(), "sa-2".into())));
        for bad in ["", "c", "=/x", "c=", "c=/x=default/name", "c=/x=a//b"] {
            assert!(bad.parse::<CniPod>().is_err(), "{bad}");
        }
    }
}
