//! An accept loop that runs out of file descriptors backs off and counts its errors instead of
//! spinning (issue 15, row 4). Alone in its test binary: it lowers the process's fd limit.
//! Loopback block: 127.0.80.x.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{ip, metric, temp_dir};

fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").unwrap().count() as u64
}

fn set_nofile(soft: u64) -> u64 {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit on a live, properly sized struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        let old = r.rlim_cur;
        r.rlim_cur = soft;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &r), 0);
        old
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_backs_off_and_counts_when_out_of_descriptors() {
    let ca = temp_dir("ca80");
    let b = mbtunnel::app::start(common::config(80, "node-b", &ca, "echo", "ecdsa-p256"), None)
        .await
        .expect("start B");
    assert!(b.wait_ready(Duration::from_secs(30)).await);
    let hbone = SocketAddr::new(ip(80, 3), 15008);
    // Sockets made first, connected after the limit is lowered: the proxy's accept then has no
    // descriptor to give the connections, while ours already exist.
    let socks: Vec<socket2::Socket> = (0..64)
        .map(|_| socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap())
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let old = set_nofile(open_fds() + 2);
    for s in &socks {
        s.connect(&hbone.into()).unwrap();
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let errors =
        metric(&b.metrics_text(), "mbtunnel_accept_errors_total", &["listener=\"inbound\""])
            .unwrap_or(0.0);
    set_nofile(old);
    // Counted, and backing off: 5 ms doubling to 1 s gives about ten errors in two seconds; a
    // loop that retried at once would have counted hundreds of thousands.
    assert!(errors >= 1.0, "accept errors were counted");
    assert!(errors < 1000.0, "the accept loop backs off: {errors} errors in 2 s");
    // With descriptors back, the queued connections are accepted.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    drop(socks);
    b.shutdown().await;
}
