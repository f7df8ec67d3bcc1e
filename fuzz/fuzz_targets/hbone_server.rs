//! The HBONE server on raw bytes, as they arrive after TLS: the client preface, then any HTTP/2
//! frames. Each request that h2 lets through (with the server's own settings and bounds) meets the proxy's own checks
//! (`check_connect`, as the inbound path runs them) on a node whose only local workload is
//! 10.0.0.2, reached at 10.0.0.2:15008, in a pod (so the proxy's ports are loops).
//! Invariants: nothing panics or hangs; a request is accepted only if it is a CONNECT to
//! 10.0.0.2 on a port other than the proxy's; every refusal's status is the one its reason maps
//! to.
#![no_main]

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use libfuzzer_sys::fuzz_target;
use mbtunnel::hbone::{check_connect, server_builder};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const PROXY_PORTS: [u16; 3] = [15001, 15006, 15008];

fn answer<B>(req: &Request<B>) -> StatusCode {
    let local: IpAddr = [10, 0, 0, 2].into();
    let reached = SocketAddr::new(local, 15008);
    let r = check_connect(req, reached, &PROXY_PORTS, |ip| (ip == local).then_some(()));
    match r {
        Ok((target, ())) => {
            assert_eq!(req.method(), Method::CONNECT);
            assert_eq!(target.ip(), local);
            assert!(!PROXY_PORTS.contains(&target.port()));
            StatusCode::OK
        }
        Err(e) => {
            assert!(!e.reason().is_empty());
            e.status()
        }
    }
}

thread_local! {
    static RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        // Timers (keepalive pings, timeouts) fire as soon as the runtime is idle.
        .start_paused(true)
        .build()
        .unwrap();
}

fuzz_target!(|data: &[u8]| {
    RT.with(|rt| {
        rt.block_on(async {
            let (mut client, server) = tokio::io::duplex(64 * 1024);
            let conn = async move {
                let Ok(mut conn) = server_builder().handshake::<_, Bytes>(server).await else {
                    return;
                };
                while let Some(Ok((req, mut respond))) = conn.accept().await {
                    let mut r = Response::new(());
                    *r.status_mut() = answer(&req);
                    let ok = r.status() == StatusCode::OK;
                    // An accepted stream stays open (as a tunnel would); a refusal ends it.
                    let _ = respond.send_response(r, !ok);
                }
            };
            let input = [PREFACE, data].concat();
            let peer = async move {
                let _ = client.write_all(&input).await;
                let _ = client.shutdown().await;
                // Read whatever the server answers, so it never blocks on a full pipe.
                let mut sink = [0u8; 4096];
                while let Ok(n) = client.read(&mut sink).await {
                    if n == 0 {
                        break;
                    }
                }
            };
            let both = async {
                let (_, ()) = tokio::join!(conn, peer);
            };
            // Paused time: a connection that would wait for pings ends here, not after 20 s.
            let _ = tokio::time::timeout(Duration::from_secs(60), both).await;
        })
    })
});
