//! Operating mbtunnel as ztunnel is operated: two `mbtunnel run` processes on loopback (the
//! demo's topology) fed the mesh of `tests/fixtures/ztunnel-metrics/mesh.yaml`, compared with what
//! a real ztunnel printed for the same connections (scripts/record-ztunnel-metrics.sh):
//! - the access line of an inbound connection has ztunnel's fields, in ztunnel's order, with the
//!   same values where they do not depend on addresses or time, in the plain and JSON formats;
//! - every metric family ztunnel exports is exported with the same type;
//! - readiness answers as ztunnel's (500 while not ready, 405 to anything but GET);
//! - `/config_dump` has ztunnel's shape: the same top-level keys, and for each kind of object
//!   (workload, service, endpoint, policy, certificate, version, local config) the same keys,
//!   so `istioctl ztunnel-config` reads it.
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/ztunnel-metrics")
}

fn http(addr: &str, method: &str, path: &str) -> String {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else { return String::new() };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(s, "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// The fixture's mesh, in mbtunnel's file form, on loopback: the client pod at 127.0.63.2 (node
/// A), the server pod at 127.0.63.3 (node B), the service's VIP where node A's outbound listens.
const MESH: &str = r#"trust_domain: cluster.local
key_algorithm: ecdsa-p256
workloads:
  - {uid: zclient-uid, name: client-7d4f, namespace: demo, service_account: client, ips: [127.0.63.2],
     node: node-a, workload_name: client, canonical_name: client-app, canonical_revision: v1,
     cluster_id: cluster1, locality: {region: region-a, zone: zone-a1}}
  - {uid: zserver-uid, name: server-5c9b, namespace: demo, service_account: server, ips: [127.0.63.3],
     node: node-b, workload_name: server, cluster_id: cluster1}
  - {uid: zintruder-uid, name: intruder-1, namespace: demo, service_account: intruder,
     ips: [127.0.63.5], node: node-a}
services:
  - {name: server, namespace: demo, hostname: server.demo.svc.cluster.local, vips: [127.0.63.50],
     ports: [{port: 8080, target_port: 8080}], workloads: [zserver-uid]}
policies:
  - {name: deny-intruder, namespace: demo, scope: NAMESPACE, action: DENY,
     rules: [{clauses: [{matches: [{source_ips: [127.0.63.5/32]}]}]}]}
  - {name: deny-8081, namespace: demo, scope: NAMESPACE, action: DENY,
     rules: [{clauses: [{matches: [{destination_ports: [8081]}]}]}]}
"#;

struct Proc(Child, PathBuf);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.1).unwrap_or_default()
    }
}

fn start(dir: &Path, node: &str, me: u8, outbound: &str, mesh: &str, format: &str) -> Proc {
    let cfg = dir.join(format!("{node}.yaml"));
    std::fs::write(
        &cfg,
        format!(
            "node_name: {node}\nca_dir: {ca}\n{mesh}outbound_addr: {outbound}\n\
             inbound_addr: 127.0.63.{me}:15008\ninbound_plaintext_addr: 127.0.63.{me}:15006\n\
             metrics_addr: 127.0.63.{me}:15020\nreadiness_addr: 127.0.63.{me}:15021\n\
             admin_addr: 127.0.63.{me}:15000\n",
            ca = dir.join("ca").display()
        ),
    )
    .unwrap();
    let log = dir.join(format!("{node}.log"));
    let child = Command::new(env!("CARGO_BIN_EXE_mbtunnel"))
        .args(["run", "--config"])
        .arg(&cfg)
        .env("RUST_LOG", "info")
        .env("LOG_FORMAT", format)
        .env_remove("MBTUNNEL_LOG_FORMAT")
        .stderr(std::fs::File::create(&log).unwrap())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    Proc(child, log)
}

fn wait_ready(addr: &str) -> bool {
    (0..200).any(|_| {
        std::thread::sleep(Duration::from_millis(50));
        http(addr, "GET", "/healthz/ready").starts_with("HTTP/1.1 200")
    })
}

/// An echo server on `addr`: answers each connection with what it read, then closes.
fn echo(addr: &str) {
    let l = std::net::TcpListener::bind(addr).unwrap();
    std::thread::spawn(move || {
        for mut s in l.incoming().flatten() {
            std::thread::spawn(move || {
                let mut b = vec![0u8; 64 * 1024];
                while let Ok(n) = s.read(&mut b) {
                    if n == 0 || s.write_all(&b[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
}

fn connect_from(bind: &str, to: &str) -> std::io::Result<std::net::TcpStream> {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    sock.bind(&bind.parse::<std::net::SocketAddr>().unwrap().into())?;
    sock.connect(&to.parse::<std::net::SocketAddr>().unwrap().into())?;
    Ok(sock.into())
}

/// Sends `n` bytes from `bind` to `to` and reads them back.
fn round_trip(bind: &str, to: &str, n: usize) {
    let mut s = connect_from(bind, to).unwrap();
    s.write_all(&vec![7u8; n]).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut back = Vec::new();
    s.read_to_end(&mut back).unwrap();
    assert_eq!(back.len(), n);
}

/// `k=v` pairs of a plain access line (the part after the message), in order.
fn plain_fields(line: &str) -> Vec<(String, String)> {
    let cols: Vec<&str> = line.split('\t').collect();
    let kv = cols.last().unwrap();
    let mut out = Vec::new();
    let mut rest = *kv;
    while !rest.is_empty() {
        let (k, after) = rest.split_once('=').unwrap();
        let (v, next) = if let Some(q) = after.strip_prefix('"') {
            let end = q.find('"').unwrap();
            (format!("\"{}\"", &q[..end]), q[end + 1..].trim_start())
        } else {
            let end = after.find(' ').unwrap_or(after.len());
            (after[..end].to_string(), after[end..].trim_start())
        };
        out.push((k.to_string(), v));
        rest = next;
    }
    out
}

/// The fields whose values do not depend on addresses, ports or time.
const STABLE: &[&str] = &[
    "src.workload",
    "src.namespace",
    "src.identity",
    "src.cluster",
    "dst.workload",
    "dst.namespace",
    "dst.identity",
    "dst.cluster",
    "direction",
    "bytes_sent",
    "bytes_recv",
];

/// The tests here share the pair's addresses: one runs at a time.
static ONE_PAIR: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn run_pair(format: &str) -> (Proc, Proc, PathBuf) {
    let dir = std::env::temp_dir().join(format!("mbt-operate-{format}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let a = start(&dir, "node-a", 2, "127.0.63.50:8080", MESH, format);
    let b = start(&dir, "node-b", 3, "127.0.63.3:15001", MESH, format);
    assert!(wait_ready("127.0.63.2:15021"), "node A not ready: {}", a.log());
    assert!(wait_ready("127.0.63.3:15021"), "node B not ready: {}", b.log());
    (a, b, dir)
}

fn access_lines(p: &Proc, want: usize) -> Vec<String> {
    let mut lines = Vec::new();
    for _ in 0..100 {
        lines = p.log().lines().filter(|l| l.contains("access")).map(String::from).collect();
        if lines.len() >= want {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    lines
}

#[test]
fn access_lines_metric_families_and_readiness_are_ztunnels() {
    let _one = ONE_PAIR.lock().unwrap_or_else(|e| e.into_inner());
    echo("127.0.63.3:8080");
    let want_plain = std::fs::read_to_string(fixtures().join("access.log")).unwrap();
    let want_json = std::fs::read_to_string(fixtures().join("access.json")).unwrap();
    let zt_ok: Vec<(String, String)> = plain_fields(want_plain.lines().next().unwrap());

    // Plain format.
    let (a, b, dir) = run_pair("plain");
    round_trip("127.0.63.2:0", "127.0.63.50:8080", 1000);
    let lines = access_lines(&b, 1);
    assert_eq!(lines.len(), 1, "node B's access lines: {}", b.log());
    let cols: Vec<&str> = lines[0].split('\t').collect();
    assert_eq!(&cols[1..4], ["info", "access", "connection complete"], "{}", lines[0]);
    let got = plain_fields(&lines[0]);
    let names = |v: &[(String, String)]| v.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>();
    // ztunnel's fields, in its order; we add dst.service (the destination side knows it here).
    let mut got_names = names(&got);
    got_names.retain(|k| k != "dst.service");
    assert_eq!(got_names, names(&zt_ok), "mbtunnel: {}\nztunnel: {}", lines[0], want_plain);
    for k in STABLE {
        let v = |f: &[(String, String)]| f.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(v(&got), v(&zt_ok), "{k}: {}", lines[0]);
    }
    let value = |k: &str| got.iter().find(|(n, _)| n == k).unwrap().1.clone();
    assert_eq!(value("dst.hbone_addr"), "127.0.63.3:8080");
    assert_eq!(value("dst.addr"), "127.0.63.3:15008");
    assert!(value("duration").ends_with("ms\""), "{}", lines[0]);
    // The source side's line: outbound, the same names.
    let out = access_lines(&a, 1);
    assert!(out.iter().any(|l| l.contains("direction=\"outbound\"")), "{out:?}");

    // A connection the server's policy denies: ztunnel's failure series appear.
    if let Ok(mut s) = connect_from("127.0.63.5:0", "127.0.63.50:8080") {
        let _ = s.write_all(b"denied");
        let mut b = Vec::new();
        let _ = s.read_to_end(&mut b);
        assert!(b.is_empty(), "the denied connection was answered");
    }
    assert!(
        (0..100).any(|_| {
            std::thread::sleep(Duration::from_millis(50));
            http("127.0.63.2:15020", "GET", "/metrics")
                .contains("istio_tcp_connections_failed_total{reporter=\"source\"")
        }),
        "no failed connection counted"
    );
    // Every family ztunnel exports, with its type.
    let zt_full = std::fs::read_to_string(fixtures().join("source-full.prom")).unwrap();
    let ours = http("127.0.63.2:15020", "GET", "/metrics");
    for t in zt_full.lines().filter(|l| l.starts_with("# TYPE ")) {
        assert!(ours.lines().any(|l| l == t), "missing `{t}` in mbtunnel's exposition:\n{ours}");
    }
    assert!(
        ours.contains("istio_tcp_sockets_open{reporter=\"source\"} 0"),
        "the client's socket is closed: {ours}"
    );
    assert!(ours.contains("istio_build{component=\"ztunnel\",tag=\"unknown\"} 1"), "{ours}");
    // What the heap trims gave back (glibc builds).
    for family in ["mbtunnel_memory_trims", "mbtunnel_memory_released_bytes"] {
        assert!(ours.contains(&format!("# TYPE {family} counter")), "no {family}: {ours}");
    }
    drop((a, b));
    let _ = std::fs::remove_dir_all(&dir);

    // JSON format: the same keys as ztunnel's JSON line (time aside), in the same order.
    let (a, b, dir) = run_pair("json");
    round_trip("127.0.63.2:0", "127.0.63.50:8080", 1000);
    let lines = access_lines(&b, 1);
    assert_eq!(lines.len(), 1, "{}", b.log());
    let keys = |l: &str| -> Vec<String> {
        let v: serde_json::Map<String, serde_json::Value> = serde_json::from_str(l).unwrap();
        v.keys().filter(|k| *k != "time" && *k != "dst.service").cloned().collect()
    };
    // serde_json's map keeps keys sorted; compare as sets of names, then the values.
    let zt_line = want_json.lines().next().unwrap();
    assert_eq!(keys(&lines[0]), keys(zt_line), "mbtunnel: {}\nztunnel: {zt_line}", lines[0]);
    let ours: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
    let zt: serde_json::Value = serde_json::from_str(zt_line).unwrap();
    for k in STABLE.iter().chain(&["level", "scope", "message"]) {
        assert_eq!(ours[k], zt[k], "{k}: {}", lines[0]);
    }
    assert!(ours["time"].as_str().is_some_and(|t| t.ends_with('Z')), "{}", lines[0]);
    drop((a, b));

    // Readiness as ztunnel's: a proxy waiting for a control plane that never answers is not
    // ready (500); a POST is refused (405). Its root: the dev CA's of the pair above.
    let root = dir.join("ca").join("ca-cert.pem");
    let cp = format!(
        "xds_address: https://127.0.63.99:1\nxds_root_ca: {r}\nca_root_ca: {r}\n",
        r = root.display()
    );
    let c = start(&dir, "node-c", 4, "127.0.63.4:15001", &cp, "plain");
    let mut answer = String::new();
    for _ in 0..100 {
        answer = http("127.0.63.4:15021", "GET", "/healthz/ready");
        if !answer.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(answer.starts_with("HTTP/1.1 500"), "{answer}\n{}", c.log());
    let post = http("127.0.63.4:15021", "POST", "/healthz/ready");
    assert!(post.starts_with("HTTP/1.1 405"), "{post}");
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The keys of a JSON object, sorted.
fn keys(v: &serde_json::Value) -> Vec<String> {
    let mut k: Vec<String> = v.as_object().map(|m| m.keys().cloned().collect()).unwrap_or_default();
    k.sort();
    k
}

fn by<'a>(list: &'a serde_json::Value, key: &str, value: &str) -> &'a serde_json::Value {
    list.as_array()
        .and_then(|l| l.iter().find(|x| x[key] == value))
        .unwrap_or_else(|| panic!("no {key}={value} in {list:#}"))
}

#[test]
fn config_dump_has_ztunnels_shape() {
    let zt: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("config_dump.json")).unwrap(),
    )
    .unwrap();
    let _one = ONE_PAIR.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b, dir) = run_pair("plain");
    let answer = http("127.0.63.2:15000", "GET", "/config_dump");
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200") && head.contains("application/json"), "{head}");
    // Chunked or not: the JSON object is between the first '{' and the last '}'.
    let body = &body[body.find('{').unwrap()..=body.rfind('}').unwrap()];
    let ours: serde_json::Value = serde_json::from_str(body).unwrap();
    assert!(!body.contains("PRIVATE KEY"), "a key in the dump");

    // Top level: ztunnel's keys, plus one for mbtunnel's own.
    let mut want = keys(&zt);
    want.push("mbtunnel".into());
    want.sort();
    assert_eq!(keys(&ours), want);

    // Workloads: the client's keys and the values that do not depend on the topology.
    let (w, zw) =
        (by(&ours["workloads"], "uid", "zclient-uid"), by(&zt["workloads"], "uid", "zclient-uid"));
    assert_eq!(keys(w), keys(zw), "ours: {w:#}\nztunnel: {zw:#}");
    for k in [
        "canonicalName",
        "canonicalRevision",
        "capacity",
        "clusterId",
        "locality",
        "name",
        "namespace",
        "networkMode",
        "protocol",
        "serviceAccount",
        "status",
        "trustDomain",
        "workloadName",
        "workloadType",
    ] {
        assert_eq!(w[k], zw[k], "workload {k}");
    }
    // The server backs a service: from xDS ztunnel lists it under `services` (its local-file
    // mode, which recorded the fixture, does not); the rest is the same.
    let (w, zw) =
        (by(&ours["workloads"], "uid", "zserver-uid"), by(&zt["workloads"], "uid", "zserver-uid"));
    let mut k = keys(w);
    assert_eq!(w["services"], serde_json::json!(["demo/server.demo.svc.cluster.local"]));
    k.retain(|k| k != "services");
    assert_eq!(k, keys(zw), "ours: {w:#}\nztunnel: {zw:#}");

    // Services and their endpoints.
    let (s, zs) = (&ours["services"][0], &zt["services"][0]);
    assert_eq!(keys(s), keys(zs), "ours: {s:#}\nztunnel: {zs:#}");
    for k in ["name", "namespace", "hostname", "canonical", "visibility", "subjectAltNames"] {
        assert_eq!(s[k], zs[k], "service {k}");
    }
    assert_eq!(s["vips"], serde_json::json!(["/127.0.63.50"]));
    assert_eq!(s["ports"], serde_json::json!({"8080": 8080}));
    let (e, ze) = (&s["endpoints"]["zserver-uid"], &zs["endpoints"]["zserver-uid"]);
    assert_eq!(keys(e), keys(ze), "ours: {e:#}\nztunnel: {ze:#}");
    assert_eq!((&e["workloadUid"], &e["status"]), (&ze["workloadUid"], &ze["status"]));
    assert_eq!(ours["stagedServices"], zt["stagedServices"]);

    // The policy both were given, value for value.
    assert_eq!(
        by(&ours["policies"], "name", "deny-8081"),
        by(&zt["policies"], "name", "deny-8081")
    );

    // Certificates: ztunnel's keys and value forms (base64 of the PEM, decimal serial, RFC 3339
    // to the second).
    let c = by(&ours["certificates"], "identity", "spiffe://cluster.local/ns/demo/sa/client");
    let zc = &zt["certificates"][0];
    assert_eq!(keys(c), keys(zc));
    assert_eq!(c["state"], "Available");
    for (list, zlist) in [("certChain", "certChain"), ("rootCerts", "rootCerts")] {
        let (x, zx) = (&c[list][0], &zc[zlist][0]);
        assert_eq!(keys(x), keys(zx), "{list}");
        let pem = boring::base64::decode_block(x["pem"].as_str().unwrap()).unwrap();
        assert!(String::from_utf8(pem).unwrap().starts_with("-----BEGIN CERTIFICATE-----"));
        let serial = x["serialNumber"].as_str().unwrap();
        assert!(!serial.is_empty() && serial.bytes().all(|b| b.is_ascii_digit()), "{serial}");
        for t in ["validFrom", "expirationTime"] {
            let t = x[t].as_str().unwrap();
            assert!(t.len() == 20 && t.ends_with('Z') && &t[10..11] == "T", "{t}");
        }
    }

    // Build info and the local file's view.
    assert_eq!(keys(&ours["version"]), keys(&zt["version"]));
    assert_eq!(keys(&ours["staticConfig"]), keys(&zt["staticConfig"]));
    let sw = by(&ours["staticConfig"]["workloads"], "uid", "zclient-uid");
    let zsw = by(&zt["staticConfig"]["workloads"], "uid", "zclient-uid");
    assert_eq!(keys(sw), keys(zsw), "ours: {sw:#}\nztunnel: {zsw:#}");
    // `config`: only ztunnel's keys (the settings the two share); mbtunnel's own are elsewhere.
    let zkeys = keys(&zt["config"]);
    for k in keys(&ours["config"]) {
        assert!(zkeys.contains(&k), "config.{k} is not a key of ztunnel's config");
    }
    assert_eq!(ours["config"]["adminAddr"], serde_json::json!({"SocketAddr": "127.0.63.2:15000"}));
    assert!(ours["mbtunnel"]["signer"]["backend"].is_string());
    drop((a, b));
    let _ = std::fs::remove_dir_all(&dir);
}
