//! Pieces of a simulated cluster shared by the namespace tests: a fake istio-cni (ZDS server),
//! node proxies running inside node namespaces, an echo server and clients inside pods.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::netns::{runtime_in, Pod, Sim};
use mbtunnel::app::Running;
use mbtunnel::config::Config;
use mbtunnel::inpod::uds::{SeqPacket, SeqPacketListener};
use mbtunnel::inpod::zds::{
    ResponsePayload, WorkloadInfo, WorkloadRequest, WorkloadResponse, ZdsHello,
};
use mbtunnel::redirect::{self, Backend};
use prost::Message;

/// A fake istio-cni node agent: a ZDS server on a SEQPACKET socket.
pub struct Cni {
    pub rt: tokio::runtime::Runtime,
    listener: SeqPacketListener,
    conn: Option<SeqPacket>,
    path: PathBuf,
}

impl Cni {
    pub fn new(path: PathBuf) -> Cni {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let listener =
            rt.block_on(async { SeqPacketListener::bind(&path) }).expect("bind CNI socket");
        Cni { rt, listener, conn: None, path }
    }

    /// Waits for the proxy to connect and checks its hello.
    pub fn accept(&mut self) {
        let conn = self.rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), self.listener.accept()).await
        });
        let conn = conn.expect("proxy did not connect to the CNI").unwrap();
        let p = self.rt.block_on(conn.recv()).unwrap().expect("hello");
        let hello = ZdsHello::decode(&p.data[..]).expect("ZdsHello");
        assert_eq!(hello.version, 1, "ZdsHello V1");
        self.conn = Some(conn);
    }

    /// Sends raw bytes (+ fds) and returns the ack's error text ("" = ok).
    pub fn send_raw(&self, data: &[u8], fds: &[&OwnedFd]) -> String {
        let conn = self.conn.as_ref().expect("connected");
        let fds: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        self.rt.block_on(async {
            conn.send(data, &fds).await.expect("send");
            let p = tokio::time::timeout(Duration::from_secs(20), conn.recv())
                .await
                .expect("ack timed out")
                .unwrap()
                .expect("proxy closed the connection");
            match WorkloadResponse::decode(&p.data[..]).expect("WorkloadResponse").payload {
                Some(ResponsePayload::Ack(a)) => a.error,
                None => panic!("response without ack"),
            }
        })
    }

    pub fn send(&self, req: WorkloadRequest, fd: Option<&OwnedFd>) -> String {
        self.send_raw(&req.encode_to_vec(), &fd.into_iter().collect::<Vec<_>>())
    }

    /// What istio-cni does for a new pod: rules in its netns, then AddWorkload with the fd.
    pub fn enroll(&self, pod: &Pod, uid: &str, name: &str, sa: &str, backend: Backend) -> String {
        redirect::apply(backend, &pod.path(), true).expect("redirect rules");
        let info = WorkloadInfo {
            name: name.into(),
            namespace: "demo".into(),
            service_account: sa.into(),
        };
        self.send(WorkloadRequest::add(uid, Some(info)), Some(&pod.fd()))
    }

    pub fn disconnect(&mut self) {
        self.conn = None;
    }
}

impl Drop for Cni {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A node proxy running in its node's namespace.
pub struct Node {
    pub rt: tokio::runtime::Runtime,
    pub running: Option<Running>,
}

impl Node {
    pub fn start(sim: &Sim, n: u8, cfg: Config) -> Node {
        let rt = runtime_in(&sim.node_ns(n));
        // Spawned, so that app::start itself runs on a thread inside the node namespace.
        let running = rt
            .block_on(async { tokio::spawn(mbtunnel::app::start(cfg, None)).await })
            .unwrap()
            .expect("start node proxy");
        Node { rt, running: Some(running) }
    }
    pub fn r(&self) -> &Running {
        self.running.as_ref().unwrap()
    }
    pub fn metrics(&self) -> String {
        self.r().metrics_text()
    }
    pub fn pods(&self) -> Vec<String> {
        self.r().inpod.as_ref().unwrap().uids()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            self.rt.block_on(async { tokio::spawn(r.shutdown()).await.ok() });
        }
    }
}

/// An echo server inside a pod on port 8080 (one dual-stack socket); records who connected
/// (IPv4 peers as plain IPv4).
pub fn echo_in(pod: &Pod) -> Arc<Mutex<Vec<SocketAddr>>> {
    let peers = Arc::new(Mutex::new(Vec::new()));
    let l = pod.run(move || TcpListener::bind("[::]:8080")).expect("echo bind");
    let p = peers.clone();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let peer = s.peer_addr().unwrap();
            p.lock().unwrap().push(SocketAddr::new(peer.ip().to_canonical(), peer.port()));
            std::thread::spawn(move || {
                let mut r = s.try_clone().unwrap();
                let _ = std::io::copy(&mut r, &mut s);
                let _ = s.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    peers
}

/// Connects from inside `pod` to `dst` (a socket created in the pod, then used from here).
pub fn connect_from(pod: &Pod, dst: SocketAddr) -> std::io::Result<TcpStream> {
    let s = pod.run(move || TcpStream::connect_timeout(&dst, Duration::from_secs(5)))?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    Ok(s)
}

/// Sends `n` bytes, half-closes, checks they come back.
pub fn round_trip(mut s: TcpStream, n: usize) {
    let data = super::pattern(n, n as u32);
    let mut w = s.try_clone().unwrap();
    let d2 = data.clone();
    let t = std::thread::spawn(move || {
        w.write_all(&d2).unwrap();
        w.shutdown(std::net::Shutdown::Write).unwrap();
    });
    let mut back = Vec::new();
    s.read_to_end(&mut back).expect("read echo");
    t.join().unwrap();
    assert_eq!(back.len(), data.len());
    assert!(back == data, "echo differs");
}

pub fn wait(what: &str, f: impl Fn() -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

pub fn sa(addr: IpAddr, port: u16) -> SocketAddr {
    SocketAddr::new(addr, port)
}
