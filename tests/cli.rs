//! The binary as a user meets it: help, version, config errors, SIGTERM.

use std::process::{Command, Stdio};
use std::time::Duration;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mbtunnel"))
}

#[test]
fn version_and_help() {
    let out = bin().arg("version").output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("mbtunnel "));
    let help = String::from_utf8(bin().args(["run", "--help"]).output().unwrap().stdout).unwrap();
    for opt in [
        "--config",
        "--node-name",
        "--key-algorithm",
        "--signer-backend",
        "--log-format",
        "MBTUNNEL_CONFIG",
    ] {
        assert!(help.contains(opt), "help lacks {opt}:\n{help}");
    }
}

/// The README's list of environment variables and `run --help` name the same ones, both ways.
#[test]
fn run_help_names_every_environment_variable_the_readme_lists() {
    let help = String::from_utf8(bin().args(["run", "--help"]).output().unwrap().stdout).unwrap();
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let list = readme
        .split_once("which override the file. Environment:")
        .and_then(|(_, rest)| rest.split_once("\n\n"))
        .map(|(list, _)| list)
        .expect("README's environment paragraph");
    // `XDS_HEADER_<k>` in the README, `XDS_HEADER_<name>` in the help: compare up to the `<`.
    let listed: Vec<&str> = list
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|n| n.chars().next().is_some_and(|c| c.is_ascii_uppercase()))
        .map(|n| n.split('<').next().unwrap())
        .collect();
    assert!(listed.len() > 20, "{listed:?}");
    for name in &listed {
        assert!(help.contains(name), "run --help does not name {name}:\n{help}");
    }
    for tag in help.split("[env: ").skip(1) {
        let name = tag.split([']', '=']).next().unwrap();
        assert!(listed.contains(&name), "README's environment list lacks {name}");
    }
}

#[test]
fn config_errors_name_the_file_and_field() {
    let out = bin().args(["run", "--config", "/nonexistent/x.yaml"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/x.yaml"), "{err}");
    let f = std::env::temp_dir().join(format!("mbt-cli-{}.yaml", std::process::id()));
    std::fs::write(&f, "node_name: a\nlisten_everywhere: true\n").unwrap();
    let out = bin().arg("run").arg("--config").arg(&f).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("listen_everywhere"), "{err}");
    let _ = std::fs::remove_file(f);
}

fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else { return String::new() };
    let _ = write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// An empty directory of this test process's own, and the path of a config file in it.
fn fresh_dir(tag: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("mbt-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("n.yaml");
    (dir, cfg)
}

fn admin_get(path: &str) -> String {
    http_get("127.0.21.1:15000", path)
}

#[test]
fn sigterm_drains_and_exits_zero() {
    let (dir, cfg) = fresh_dir("run");
    std::fs::write(
        &cfg,
        format!(
            "node_name: n\nca_dir: {}/ca\noutbound_addr: 127.0.21.1:0\ninbound_addr: 127.0.21.1:0\n\
             inbound_plaintext_addr: 127.0.21.1:0\nmetrics_addr: 127.0.21.1:0\nreadiness_addr: 127.0.21.1:0\n\
             admin_addr: 127.0.21.1:15000\nlog_format: json\n",
            dir.display()
        ),
    )
    .unwrap();
    let mut child =
        bin().arg("run").arg("--config").arg(&cfg).stderr(Stdio::piped()).spawn().unwrap();
    // The admin endpoint changes the log level at run time.
    let mut answer = String::new();
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(50));
        answer = admin_get("/logging?level=debug");
        if !answer.is_empty() {
            break;
        }
    }
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.contains("log level set to debug"),
        "{answer}"
    );
    let bad = admin_get("/logging?level=%5Bbad");
    assert!(bad.starts_with("HTTP/1.1 400"), "{bad}");
    let dump = admin_get("/config_dump");
    assert!(dump.contains("\"signer\"") && dump.contains("\"queue_limit\""), "{dump}");
    Command::new("kill").arg("-TERM").arg(child.id().to_string()).status().unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "exit status {status:?}");
    let mut log = String::new();
    use std::io::Read;
    child.stderr.take().unwrap().read_to_string(&mut log).unwrap();
    assert!(log.contains("SIGTERM received") && log.contains("drained"), "{log}");
    assert!(log.contains("log level changed"), "{log}");
    assert!(log.lines().any(|l| l.starts_with('{')), "json log format: {log}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Garbage on the HBONE port: every connection is refused and counted, but the log speaks for
/// each reason at most once a second (with `suppressed`), not once per connection.
#[test]
fn peer_caused_refusals_are_counted_each_and_logged_once_a_second() {
    use std::io::{BufRead, Read, Write};
    let (dir, cfg) = fresh_dir("flood");
    // The inbound listener is on the workload's own address: a direct connection reaches it.
    std::fs::write(
        &cfg,
        format!(
            "node_name: n\nca_dir: {}/ca\noutbound_addr: 127.0.22.2:0\ninbound_addr: 127.0.22.2:15008\n\
             inbound_plaintext_addr: 127.0.22.2:0\nmetrics_addr: 127.0.22.2:15020\n\
             readiness_addr: 127.0.22.2:15021\nadmin_addr: 127.0.22.2:0\nworkloads:\n\
             - {{uid: a, name: a, namespace: demo, service_account: a, ips: [127.0.22.2], node: n}}\n",
            dir.display()
        ),
    )
    .unwrap();
    let mut child = bin()
        .arg("run")
        .arg("--config")
        .arg(&cfg)
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        std::io::BufReader::new(stderr).lines().map_while(Result::ok).collect::<Vec<_>>()
    });
    let mut ready = false;
    for _ in 0..200 {
        std::thread::sleep(Duration::from_millis(50));
        if http_get("127.0.22.2:15021", "/healthz/ready").starts_with("HTTP/1.1 200") {
            ready = true;
            break;
        }
    }
    assert!(ready, "the proxy did not become ready");
    const N: usize = 40;
    let start = std::time::Instant::now();
    for _ in 0..N {
        let mut s = std::net::TcpStream::connect("127.0.22.2:15008").unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        // Until the proxy has refused it (alert, then close).
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
    // The client sees the close before the proxy has counted the refusal: wait for the count.
    let refused_now = || {
        let metrics = http_get("127.0.22.2:15020", "/metrics");
        let n: u64 = metrics
            .lines()
            .filter(|l| l.starts_with("mbtunnel_connections_refused_total{reason=\"tls_"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .map(|v| v as u64)
            .sum();
        (n, metrics)
    };
    let (mut refused, mut metrics) = refused_now();
    for _ in 0..100 {
        if refused >= N as u64 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
        (refused, metrics) = refused_now();
    }
    let elapsed = start.elapsed();
    Command::new("kill").arg("-TERM").arg(child.id().to_string()).status().unwrap();
    assert!(child.wait().unwrap().success());
    let log = reader.join().unwrap();
    assert_eq!(refused, N as u64, "every refusal counted:\n{metrics}");
    let lines: Vec<_> =
        log.iter().filter(|l| l.contains("refused: TLS handshake with peer failed")).collect();
    // The first one at once, then at most one a second per reason (a single reason here).
    assert!(!lines.is_empty(), "no refusal logged:\n{}", log.join("\n"));
    assert!(
        lines.len() as u64 <= 1 + elapsed.as_secs(),
        "{} lines for {N} refusals in {elapsed:?}:\n{}",
        lines.len(),
        log.join("\n")
    );
    assert!(lines[0].contains("suppressed=0"), "{}", lines[0]);
    let _ = std::fs::remove_dir_all(dir);
}

/// The bearer token and header values given in the environment appear nowhere the proxy shows
/// or writes: not in `/config_dump` (which names them `<redacted>` and keeps header names), not
/// in the log, even at debug level.
#[test]
fn config_dump_and_log_never_show_the_token_or_header_values() {
    let (dir, cfg) = fresh_dir("secrets");
    std::fs::write(
        &cfg,
        format!(
            "node_name: n\nca_dir: {}/ca\noutbound_addr: 127.0.23.1:0\ninbound_addr: 127.0.23.1:0\n\
             inbound_plaintext_addr: 127.0.23.1:0\nmetrics_addr: 127.0.23.1:0\nreadiness_addr: 127.0.23.1:0\n\
             admin_addr: 127.0.23.1:15000\n",
            dir.display()
        ),
    )
    .unwrap();
    const TOKEN: &str = "tok-c1f7e9a2d4";
    const XDS_VALUE: &str = "xhv-5b8e03";
    const CA_VALUE: &str = "chv-e61d94";
    let mut child = bin()
        .arg("run")
        .arg("--config")
        .arg(&cfg)
        .env("RUST_LOG", "debug")
        .env("AUTH_TOKEN", TOKEN)
        .env("XDS_HEADER_X-Tenant", XDS_VALUE)
        .env("CA_HEADER_X-Api-Key", CA_VALUE)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut dump = String::new();
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(50));
        dump = http_get("127.0.23.1:15000", "/config_dump");
        if !dump.is_empty() {
            break;
        }
    }
    Command::new("kill").arg("-TERM").arg(child.id().to_string()).status().unwrap();
    assert!(child.wait().unwrap().success());
    let mut log = String::new();
    use std::io::Read;
    child.stderr.take().unwrap().read_to_string(&mut log).unwrap();
    assert!(dump.starts_with("HTTP/1.1 200") && dump.contains("\"auth_token\""), "{dump}");
    assert!(dump.contains("\"x-tenant\": \"<redacted>\""), "{dump}");
    assert!(dump.contains("\"x-api-key\": \"<redacted>\""), "{dump}");
    assert!(dump.contains("\"auth_token\": \"<redacted>\""), "{dump}");
    for secret in [TOKEN, XDS_VALUE, CA_VALUE] {
        assert!(!dump.contains(secret), "{secret} in the dump:\n{dump}");
        assert!(!log.contains(secret), "{secret} in the log:\n{log}");
    }
    assert!(log.contains("drained"), "{log}");
    let _ = std::fs::remove_dir_all(dir);
}

/// The portable model is a test backend: `doctor` names it when it is forced, says it is a test
/// backend and warns; `auto` never picks it.
#[test]
fn doctor_names_a_forced_model_backend_and_warns() {
    let out = bin().arg("doctor").env("MBTUNNEL_SIGNER_BACKEND", "model").output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("signer backend: model"), "{text}");
    assert!(text.contains("TEST backend") && text.contains("never"), "{text}");
    let out = bin().arg("doctor").env("MBTUNNEL_SIGNER_BACKEND", "auto").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!text.contains("signer backend: model"), "auto chose the model:\n{text}");
}
