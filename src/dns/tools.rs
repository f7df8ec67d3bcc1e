//! Two small DNS programs for tests, the demo and the bench (`mbtunnel tool dns-server`,
//! `mbtunnel tool dig`): an authoritative server for a fixed set of A/AAAA records (the
//! "upstream" a test starts), and a one-query client.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The records a [`StaticServer`] holds: lower-case FQDN → addresses.
pub type Records = HashMap<String, Vec<IpAddr>>;

/// Parses `name=ip` pairs (the name with or without its trailing dot).
pub fn parse_records(pairs: &[String]) -> Result<Records, String> {
    let mut m = Records::new();
    for p in pairs {
        let (n, ip) = p.split_once('=').ok_or_else(|| format!("'{p}' is not name=ip"))?;
        let ip: IpAddr = ip.parse().map_err(|_| format!("'{ip}' is not an IP address"))?;
        m.entry(fqdn_key(n)).or_default().push(ip);
    }
    Ok(m)
}

fn fqdn_key(n: &str) -> String {
    let n = n.trim().to_lowercase();
    if n.ends_with('.') {
        n
    } else {
        format!("{n}.")
    }
}

/// An authoritative server over UDP and TCP for fixed records (with one TTL): A/AAAA of a known name
/// are answered, a known name without records of the type gets NOERROR, anything else
/// NXDOMAIN. Counts the queries it answered.
pub struct StaticServer {
    pub addr: SocketAddr,
    pub queries: Arc<AtomicU64>,
}

impl StaticServer {
    pub async fn start(
        listen: SocketAddr,
        records: Records,
        ttl: u32,
    ) -> std::io::Result<StaticServer> {
        let udp = tokio::net::UdpSocket::bind(listen).await?;
        let addr = udp.local_addr()?;
        let tcp = tokio::net::TcpListener::bind(addr).await?;
        let records = Arc::new(records);
        let queries = Arc::new(AtomicU64::new(0));
        let (r, q) = (records.clone(), queries.clone());
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            while let Ok((n, src)) = udp.recv_from(&mut buf).await {
                if let Some(out) = static_answer(&r, &buf[..n], ttl) {
                    q.fetch_add(1, Ordering::Relaxed);
                    let _ = udp.send_to(&out, src).await;
                }
            }
        });
        let (r, q) = (records, queries.clone());
        tokio::spawn(async move {
            while let Ok((mut s, _)) = tcp.accept().await {
                let (r, q) = (r.clone(), q.clone());
                tokio::spawn(async move {
                    let mut len = [0u8; 2];
                    while s.read_exact(&mut len).await.is_ok() {
                        let mut p = vec![0u8; usize::from(u16::from_be_bytes(len))];
                        if s.read_exact(&mut p).await.is_err() {
                            return;
                        }
                        let Some(out) = static_answer(&r, &p, ttl) else { return };
                        q.fetch_add(1, Ordering::Relaxed);
                        let mut framed = (out.len() as u16).to_be_bytes().to_vec();
                        framed.extend_from_slice(&out);
                        if s.write_all(&framed).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Ok(StaticServer { addr, queries })
    }
}

fn static_answer(records: &Records, packet: &[u8], ttl: u32) -> Option<Vec<u8>> {
    let req = Message::from_vec(packet).ok()?;
    let q = req.queries().first()?.clone();
    let mut m = Message::new();
    m.set_id(req.id())
        .set_message_type(MessageType::Response)
        .set_op_code(OpCode::Query)
        .set_authoritative(true)
        .set_recursion_desired(req.recursion_desired());
    m.add_query(q.clone());
    match records.get(&q.name().to_lowercase().to_utf8()) {
        None => {
            m.set_response_code(ResponseCode::NXDomain);
        }
        Some(ips) => {
            for ip in ips {
                let rdata = match (ip, q.query_type()) {
                    (IpAddr::V4(a), RecordType::A) => RData::A(A(*a)),
                    (IpAddr::V6(a), RecordType::AAAA) => RData::AAAA(AAAA(*a)),
                    _ => continue,
                };
                m.add_answer(Record::from_rdata(q.name().clone(), ttl, rdata));
            }
        }
    }
    m.to_vec().ok()
}

/// How [`query`] asks.
#[derive(Clone, Copy, Debug)]
pub struct Ask {
    pub tcp: bool,
    pub timeout: Duration,
    /// The source address (default: the kernel's choice).
    pub from: Option<IpAddr>,
}

impl Ask {
    pub fn udp() -> Ask {
        Ask { tcp: false, timeout: Duration::from_secs(5), from: None }
    }
    pub fn tcp(self, tcp: bool) -> Ask {
        Ask { tcp, ..self }
    }
    pub fn from(self, ip: IpAddr) -> Ask {
        Ask { from: Some(ip), ..self }
    }
}

/// Sends one query for `name`/`rtype` to `server` and returns the response.
pub async fn query(
    server: SocketAddr,
    name: &str,
    rtype: RecordType,
    ask: Ask,
) -> Result<Message, String> {
    let timeout = ask.timeout;
    let mut n = Name::from_utf8(name).map_err(|e| format!("'{name}': {e}"))?;
    if name.ends_with('.') {
        n.set_fqdn(true);
    }
    let mut m = Message::new();
    m.set_id(rand_id()).set_recursion_desired(true).add_query(Query::query(n, rtype));
    let out = m.to_vec().map_err(|e| e.to_string())?;
    let reply = tokio::time::timeout(timeout, exchange(server, &out, ask.tcp, ask.from))
        .await
        .map_err(|_| format!("no answer from {server} within {timeout:?}"))?
        .map_err(|e| format!("{server}: {e}"))?;
    let r = Message::from_vec(&reply).map_err(|e| format!("unparseable answer: {e}"))?;
    if r.id() != m.id() {
        return Err(format!("answer id {} for query {}", r.id(), m.id()));
    }
    Ok(r)
}

/// Sends raw bytes to `server` (from `from` when set) and returns the raw answer.
pub async fn exchange(
    server: SocketAddr,
    packet: &[u8],
    tcp: bool,
    from: Option<IpAddr>,
) -> std::io::Result<Vec<u8>> {
    let any: IpAddr = if server.is_ipv4() { [0u8; 4].into() } else { [0u16; 8].into() };
    let bind = SocketAddr::new(from.unwrap_or(any), 0);
    if tcp {
        let sock = if server.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        sock.bind(bind)?;
        let mut s = sock.connect(server).await?;
        let mut framed = (packet.len() as u16).to_be_bytes().to_vec();
        framed.extend_from_slice(packet);
        s.write_all(&framed).await?;
        let mut len = [0u8; 2];
        s.read_exact(&mut len).await?;
        let mut r = vec![0u8; usize::from(u16::from_be_bytes(len))];
        s.read_exact(&mut r).await?;
        Ok(r)
    } else {
        let s = tokio::net::UdpSocket::bind(bind).await?;
        s.connect(server).await?;
        s.send(packet).await?;
        let mut buf = vec![0u8; 65535];
        let n = s.recv(&mut buf).await?;
        buf.truncate(n);
        Ok(buf)
    }
}

fn rand_id() -> u16 {
    let mut b = [0u8; 2];
    getrandom::getrandom(&mut b).expect("random bytes");
    u16::from_be_bytes(b)
}

/// A response as one JSON object: code, flags and answers (`name`, `type`, `ttl`, `data`).
pub fn to_json(m: &Message) -> serde_json::Value {
    let answers: Vec<serde_json::Value> = m
        .answers()
        .iter()
        .map(|r| {
            serde_json::json!({
                "name": r.name().to_utf8(),
                "type": r.record_type().to_string(),
                "ttl": r.ttl(),
                "data": r.data().to_string(),
            })
        })
        .collect();
    serde_json::json!({
        "rcode": m.response_code().to_str(),
        "aa": m.authoritative(),
        "ra": m.recursion_available(),
        "tc": m.truncated(),
        "answers": answers,
    })
}
