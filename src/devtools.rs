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

/// A minimal stand-in for istio-cni's node agent: serves ZDS on `socket`, installs the redirect
/// rules in each pod's namespace, and enrols the pods (replayed on every reconnect, then
/// SnapshotSent). Prints one JSON line per ack.
pub async fn fake_cni(
    socket: PathBuf,
    pods: Vec<(String, PathBuf)>,
    backend: crate::redirect::Backend,
) -> anyhow::Result<()> {
    use crate::inpod::uds::SeqPacketListener;
    use crate::inpod::zds::{ResponsePayload, WorkloadRequest, WorkloadResponse};
    use prost::Message;
    for (uid, path) in &pods {
        crate::redirect::apply(backend, path, true)
            .with_context(|| format!("redirect rules for pod {uid}"))?;
    }
    let l =
        SeqPacketListener::bind(&socket).with_context(|| format!("bind {}", socket.display()))?;
    loop {
        let conn = l.accept().await?;
        let _hello = conn.recv().await?;
        let mut reqs: Vec<(String, WorkloadRequest, Option<std::os::fd::OwnedFd>)> = Vec::new();
        for (uid, path) in &pods {
            let fd = crate::net::netns::open(path)
                .with_context(|| format!("open {}", path.display()))?;
            reqs.push((format!("add {uid}"), WorkloadRequest::add(uid, None), Some(fd)));
        }
        reqs.push(("snapshot".into(), WorkloadRequest::snapshot_sent(), None));
        for (what, req, fd) in reqs {
            let fds: Vec<_> = fd.as_ref().map(std::os::fd::AsFd::as_fd).into_iter().collect();
            conn.send(&req.encode_to_vec(), &fds).await?;
            let Some(p) = conn.recv().await? else { break };
            let err = match WorkloadResponse::decode(&p.data[..]).map(|r| r.payload) {
                Ok(Some(ResponsePayload::Ack(a))) => a.error,
                _ => "malformed response".into(),
            };
            println!("{}", serde_json::json!({"request": what, "error": err}));
        }
        // Hold the connection until the proxy goes; then wait for it to come back.
        while conn.recv().await?.is_some() {}
    }
}
