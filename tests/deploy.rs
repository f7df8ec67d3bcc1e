//! The shipping artifacts checked against the code they ship, so that neither drifts:
//! - `Dockerfile`: the build stage installs through `scripts/deps.sh` (or exactly its list), the
//!   runtime stage carries only the binary on the same Debian release, `EXPOSE` lists the default
//!   listener ports.
//! - `deploy/`: the ConfigMap parses with the proxy's own parser and, started in-process, serves
//!   the probe and scrape paths the DaemonSet uses; container ports, probes, scrape annotations,
//!   the termination grace period, the control-plane env and mounts (istiod's root, the
//!   istio-ca token) and the signer thread env follow the config; the ConfigMap plus the
//!   DaemonSet's env run against a control plane of our own and become ready.
//! - `Cargo.toml`: a plain build resolves the crates it shares with the dev-dependencies with the
//!   same features as the tests, so `make test` and `make demo` compile them once.
//!
//! Kubernetes schema validation and the env-name check against `mbtunnel run --help` are in
//! `scripts/validate-deploy.sh` (`make validate-deploy`); here env names are checked against
//! `mbtunnel::config::env`.

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use mbtunnel::config::{env, Config};
use serde::Deserialize;
use serde_yaml::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Ports a pod must expose: every listener that is not bound to loopback.
fn exposed_ports(c: &Config) -> BTreeSet<u16> {
    [
        c.outbound_addr,
        c.inbound_addr,
        c.inbound_plaintext_addr,
        c.metrics_addr,
        c.readiness_addr,
        c.admin_addr,
    ]
    .iter()
    .filter(|a| !a.ip().is_loopback())
    .map(|a| a.port())
    .collect()
}

// ---------------------------------------------------------------------------------------------
// Dockerfile

/// One Dockerfile instruction: keyword (upper case) and its arguments, continuations joined.
fn instructions(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let t = line.trim();
        if cur.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        if let Some(body) = t.strip_suffix('\\') {
            cur.push_str(body);
            cur.push(' ');
            continue;
        }
        cur.push_str(t);
        let (kw, args) = cur.split_once(char::is_whitespace).unwrap_or((&cur, ""));
        out.push((kw.to_ascii_uppercase(), args.trim().to_string()));
        cur.clear();
    }
    out
}

/// Instructions grouped by stage (a stage starts at each FROM).
fn stages(text: &str) -> Vec<Vec<(String, String)>> {
    let mut out: Vec<Vec<(String, String)>> = Vec::new();
    for (kw, args) in instructions(text) {
        if kw == "FROM" {
            out.push(Vec::new());
        }
        if let Some(s) = out.last_mut() {
            s.push((kw, args));
        }
    }
    out
}

fn deps_list() -> BTreeSet<String> {
    let out = Command::new(root().join("scripts/deps.sh")).arg("--list").output().unwrap();
    assert!(out.status.success(), "scripts/deps.sh --list failed");
    String::from_utf8(out.stdout).unwrap().split_whitespace().map(String::from).collect()
}

/// Package names of every `apt-get install` in a RUN line.
fn apt_installs(run: &str) -> Vec<BTreeSet<String>> {
    run.split("&&")
        .filter_map(|cmd| {
            let words: Vec<&str> = cmd.split_whitespace().collect();
            let i = words.iter().position(|w| *w == "install")?;
            words[..i].iter().any(|w| w.ends_with("apt-get") || *w == "apt").then(|| {
                words[i + 1..]
                    .iter()
                    .filter(|w| !w.starts_with('-'))
                    .map(|w| w.to_string())
                    .collect()
            })
        })
        .collect()
}

/// The Debian release a base image is built on (`rust:1.95-bookworm`, `debian:bookworm-slim`).
fn debian_release(image: &str) -> Option<&'static str> {
    ["bookworm", "trixie", "bullseye"].into_iter().find(|r| image.contains(r))
}

#[test]
fn dockerfile_build_stage_uses_the_dependency_script() {
    let st = stages(&read("Dockerfile"));
    assert!(st.len() >= 2, "multi-stage build expected");
    let build = &st[0];
    let runs: Vec<&str> =
        build.iter().filter(|(k, _)| k == "RUN").map(|(_, a)| a.as_str()).collect();
    let via_script = runs.iter().any(|r| r.contains("scripts/deps.sh"));
    let inline: Vec<_> = runs.iter().flat_map(|r| apt_installs(r)).collect();
    assert!(via_script || !inline.is_empty(), "build stage installs no system packages");
    if via_script {
        assert!(
            build.iter().any(|(k, a)| k == "COPY" && a.contains("scripts/deps.sh")),
            "build stage runs scripts/deps.sh without copying it in"
        );
    }
    for pkgs in inline {
        assert_eq!(pkgs, deps_list(), "an inline apt list must equal scripts/deps.sh --list");
    }
    // The image ships the `dist` profile (release + LTO), the one the data-plane bench measures.
    assert!(
        runs.iter().any(|r| r.contains("cargo build --profile dist --locked")
            && r.contains("cp target/dist/mbtunnel /usr/local/bin/mbtunnel")),
        "build stage must build the dist binary from the lockfile and ship that binary"
    );
    let cargo =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")).unwrap();
    let dist = cargo.split("[profile.dist]").nth(1).expect("Cargo.toml defines [profile.dist]");
    let dist = dist.split("\n[").next().unwrap();
    assert!(
        dist.contains("inherits = \"release\"") && dist.contains("lto = \"fat\""),
        "[profile.dist] is release with fat LTO:{dist}"
    );
}

#[test]
fn dockerfile_runtime_stage_is_minimal_and_runs_the_binary() {
    let st = stages(&read("Dockerfile"));
    let (build, run) = (&st[0], st.last().unwrap());
    let from = |s: &[(String, String)]| s[0].1.split_whitespace().next().unwrap().to_string();
    let (build_img, run_img) = (from(build), from(run));
    assert!(
        run_img.contains("-slim") || run_img.contains("distroless"),
        "runtime base {run_img} is not slim or distroless"
    );
    // Same Debian release: the binary links glibc dynamically.
    assert_eq!(
        debian_release(&build_img),
        debian_release(&run_img),
        "build ({build_img}) and runtime ({run_img}) must share a Debian release"
    );
    assert!(debian_release(&run_img).is_some(), "runtime base names no Debian release");
    for (k, a) in run {
        assert!(
            !(k == "RUN" && (a.contains("cargo") || a.contains("rustc") || a.contains("gcc"))),
            "runtime stage must carry no toolchain: {k} {a}"
        );
    }
    let get = |kw: &str| run.iter().rev().find(|(k, _)| k == kw).map(|(_, a)| a.clone());
    let entry = get("ENTRYPOINT").expect("ENTRYPOINT");
    assert!(entry.starts_with('[') && entry.contains("mbtunnel"), "ENTRYPOINT {entry}");
    assert_eq!(get("CMD").as_deref(), Some(r#"["run"]"#));
}

/// BoringSSL's C++ runtime is linked statically (`.cargo/config.toml`): a shared libstdc++
/// costs each proxy ~0.5 MiB of resident memory (benches/README.md). This binary links
/// BoringSSL's libssl as the proxy does, so it has the same dependencies.
#[test]
fn the_cxx_runtime_is_not_a_shared_library() {
    let ctx = boring::ssl::SslContext::builder(boring::ssl::SslMethod::tls()).unwrap().build();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    assert!(maps.contains("libc.so") || maps.contains("libc-"), "no libc in /proc/self/maps");
    let shared: Vec<&str> = maps.lines().filter(|l| l.contains("libstdc++")).collect();
    assert!(shared.is_empty(), "libstdc++ is mapped as a shared library: {shared:?}");
    drop(ctx);
}

/// Each crate of the product's dependency graph with its features, as `cargo tree` resolves it
/// with `edges` (one line per crate and feature set: `name vX.Y.Z [f1,f2]`).
fn resolved(edges: &str) -> BTreeSet<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["tree", "--locked", "--prefix", "none", "-f", "{p} [{f}]", "-e", edges])
        .current_dir(root())
        .output()
        .expect("cargo tree runs");
    assert!(out.status.success(), "cargo tree: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| l.trim_end_matches(" (*)").to_string())
        .filter(|l| !l.is_empty())
        .collect()
}

/// `make test` builds the tests, then the binary the demo runs; `make demo` after it builds the
/// binary again. Both reuse the tests' build only if the dev-dependencies turn on no feature of
/// a crate the product shares with them (Cargo.toml names those features for the product).
#[test]
fn a_plain_build_resolves_shared_crates_as_the_tests_do() {
    let plain = resolved("no-dev");
    let tests = resolved("all");
    assert!(plain.iter().any(|l| l.starts_with("tokio v")), "no tokio in {plain:?}");
    let differ: Vec<&String> = plain.difference(&tests).collect();
    assert!(
        differ.is_empty(),
        "crates a plain build resolves with other features than the test build (add the test \
         build's features to [dependencies]): {differ:?}"
    );
}

#[test]
fn dockerfile_exposes_the_default_listener_ports() {
    let st = stages(&read("Dockerfile"));
    let exposed: BTreeSet<u16> = st
        .last()
        .unwrap()
        .iter()
        .filter(|(k, _)| k == "EXPOSE")
        .flat_map(|(_, a)| {
            a.split_whitespace().map(|p| p.trim_end_matches("/tcp").parse().unwrap())
        })
        .collect();
    assert_eq!(exposed, exposed_ports(&Config::default()));
}

// ---------------------------------------------------------------------------------------------
// deploy/

fn docs(rel: &str) -> Vec<Value> {
    let text = read(rel);
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{rel}: {e}")))
        .filter(|v| !v.is_null())
        .collect()
}

fn kind_of<'a>(rel: &str, kind: &str, all: &'a [Value]) -> &'a Value {
    all.iter().find(|d| d["kind"] == kind).unwrap_or_else(|| panic!("{rel}: no {kind}"))
}

fn str_of(v: &Value) -> &str {
    v.as_str().unwrap_or_else(|| panic!("not a string: {v:?}"))
}

fn configmap_text() -> String {
    let all = docs("deploy/configmap.yaml");
    str_of(&kind_of("configmap", "ConfigMap", &all)["data"]["config.yaml"]).to_string()
}

fn configmap_config() -> Config {
    Config::from_yaml(&configmap_text(), Path::new("deploy/configmap.yaml config.yaml"))
        .unwrap_or_else(|e| panic!("{e}"))
}

fn daemonset() -> Value {
    let all = docs("deploy/daemonset.yaml");
    kind_of("daemonset", "DaemonSet", &all).clone()
}

fn container(ds: &Value) -> &Value {
    let cs = ds["spec"]["template"]["spec"]["containers"].as_sequence().unwrap();
    cs.iter().find(|c| c["name"] == "mbtunnel").expect("container mbtunnel")
}

fn env_of<'a>(c: &'a Value, name: &str) -> Option<&'a Value> {
    c["env"].as_sequence()?.iter().find(|e| e["name"] == name)
}

#[test]
fn configmap_parses_with_the_proxys_parser_and_env() {
    let mut cfg = configmap_config();
    // The DaemonSet's literal env values must be accepted as the binary would apply them.
    let ds = daemonset();
    let c = container(&ds);
    let literal = |k: &str| env_of(c, k).and_then(|e| e["value"].as_str()).map(String::from);
    cfg.apply_env(|k| literal(k).or_else(|| (k == "NODE_NAME").then(|| "node-2".into())))
        .unwrap_or_else(|e| panic!("DaemonSet env rejected: {e}"));
    // The image's EXPOSE (the defaults) must be what the deployed config listens on.
    assert_eq!(exposed_ports(&cfg), exposed_ports(&Config::default()));
    // The config file the binary is pointed at is the ConfigMap's key, mounted.
    let path = literal(env::CONFIG).expect("MBTUNNEL_CONFIG set");
    let mount = c["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "config")
        .expect("config volume mounted");
    assert_eq!(Path::new(&path), Path::new(str_of(&mount["mountPath"])).join("config.yaml"));
}

#[test]
fn daemonset_ports_probes_and_scrape_follow_the_config() {
    let cfg = configmap_config();
    let ds = daemonset();
    let c = container(&ds);
    let ports: BTreeSet<u16> = c["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| p["containerPort"].as_u64().unwrap() as u16)
        .collect();
    assert_eq!(ports, exposed_ports(&cfg), "containerPorts");
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        let g = &c[probe]["httpGet"];
        assert_eq!(g["port"].as_u64(), Some(cfg.readiness_addr.port() as u64), "{probe} port");
        assert_eq!(g["path"], "/healthz/ready", "{probe} path");
    }
    let ann = &ds["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(ann["prometheus.io/scrape"], "true");
    assert_eq!(ann["prometheus.io/port"], cfg.metrics_addr.port().to_string().as_str());
    assert_eq!(ann["prometheus.io/path"], "/metrics");
}

#[test]
fn termination_grace_covers_the_drain() {
    let drain = configmap_config().drain_timeout_secs;
    let grace = daemonset()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        .as_u64()
        .expect("terminationGracePeriodSeconds");
    assert!(
        (drain + 5..=drain + 30).contains(&grace),
        "terminationGracePeriodSeconds {grace} must be drain_timeout_secs {drain} + 5..30"
    );
}

#[test]
fn rollout_is_node_by_node() {
    let ds = daemonset();
    let s = &ds["spec"]["updateStrategy"];
    assert_eq!(s["type"], "RollingUpdate");
    assert!(!s["rollingUpdate"]["maxUnavailable"].is_null(), "maxUnavailable set");
    assert_eq!(s["rollingUpdate"]["maxSurge"].as_u64(), Some(0), "never two proxies per node");
}

#[test]
fn signer_threads_follow_the_cpu_limit() {
    let ds = daemonset();
    let c = container(&ds);
    assert!(!c["resources"]["limits"]["cpu"].is_null(), "a CPU limit is set");
    let e = env_of(c, "MBTUNNEL_CPU_LIMIT").expect("MBTUNNEL_CPU_LIMIT");
    assert!(env_of(c, "MBTUNNEL_SIGNER_THREADS").is_none(), "threads follow the limit, not a pin");
    let r = &e["valueFrom"]["resourceFieldRef"];
    assert_eq!(r["resource"], "limits.cpu");
    assert_eq!(r["containerName"], "mbtunnel");
    assert_eq!(r["divisor"], "1", "whole CPUs, rounded up");
    // What the kubelet puts there (the limit in whole CPUs) is what the config reads.
    let limit = c["resources"]["limits"]["cpu"].as_str().expect("CPU limit in whole CPUs");
    let mut cfg = configmap_config();
    cfg.apply_env(|k| (k == env::CPU_LIMIT).then(|| limit.to_string())).unwrap();
    assert_eq!(cfg.cpu_limit.to_string(), limit);
    assert_eq!(cfg.signer_threads, 0, "the signer sizes itself from the limit");
    let signer = mbtunnel::signer::SignerConfig {
        threads: cfg.signer_threads,
        cpus: cfg.cpu_limit,
        ..Default::default()
    };
    let cpus: usize = limit.parse().unwrap();
    assert_eq!(signer.thread_count(), mbtunnel::signer::default_threads(cpus));
    assert_eq!(signer.thread_count(), (cpus / 2).max(1));
}

#[test]
fn daemonset_env_names_are_the_binarys() {
    let known = [
        env::CONFIG,
        env::NODE_NAME,
        env::TRUST_DOMAIN,
        env::CA_DIR,
        env::KEY_ALGORITHM,
        env::SIGNER_BACKEND,
        env::LOG_FORMAT,
        env::SIGNER_THREADS,
        env::CPU_LIMIT,
        env::LOG,
        env::XDS_ADDRESS,
        env::CA_ADDRESS,
        env::XDS_ROOT_CA,
        env::CA_ROOT_CA,
        env::AUTH_TOKEN_FILE,
        env::CLUSTER_ID,
        env::SECRET_TTL,
        env::POD_NAME,
        env::POD_NAMESPACE,
        env::INSTANCE_IP,
        env::INPOD_ENABLED,
        env::INPOD_UDS,
        env::WORKER_THREADS,
        env::EBPF_ENABLED,
        env::EBPF_UPLINKS,
        env::EBPF_FAIL_CLOSED,
        env::DNS_CAPTURE,
        env::META_DNS_CAPTURE,
        env::DNS_PROXY_ADDR,
        env::META_DNS_PROXY_ADDR,
        env::DNS_UPSTREAMS,
        env::CLUSTER_DOMAIN,
    ];
    let ds = daemonset();
    for e in container(&ds)["env"].as_sequence().unwrap() {
        let name = str_of(&e["name"]);
        assert!(known.contains(&name), "{name} is not in mbtunnel::config::env");
    }
}

/// The mount holding a container path.
fn mount_of<'a>(c: &'a Value, path: &str) -> Option<&'a Value> {
    c["volumeMounts"]
        .as_sequence()?
        .iter()
        .find(|m| Path::new(path).starts_with(str_of(&m["mountPath"])))
}

fn volume<'a>(ds: &'a Value, name: &str) -> &'a Value {
    ds["spec"]["template"]["spec"]["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("volume {name}"))
}

#[test]
fn istiod_mode_mounts_the_root_and_an_istio_ca_token_and_no_ca_key() {
    let ds = daemonset();
    let c = container(&ds);
    let literal = |k: &str| env_of(c, k).and_then(|e| e["value"].as_str()).map(String::from);
    let mut cfg = configmap_config();
    cfg.apply_env(literal).unwrap();
    let xds = cfg.xds_address.clone().unwrap();
    assert!(xds.starts_with("https://istiod.istio-system.svc:15012"), "{xds}");
    assert!(cfg.inpod_enabled, "pods are captured by istio-cni (in-pod mode)");
    assert!(cfg.workloads.is_empty() && cfg.services.is_empty(), "the mesh comes from istiod");
    // The root istiod publishes in every namespace, mounted where XDS_ROOT_CA / CA_ROOT_CA point.
    for root in [&cfg.xds_root_ca, &cfg.ca_root_ca] {
        let m = mount_of(c, root).unwrap_or_else(|| panic!("{root} is not mounted"));
        let v = volume(&ds, str_of(&m["name"]));
        assert_eq!(v["configMap"]["name"], "istio-ca-root-cert");
        assert!(root.ends_with("/root-cert.pem"), "{root}: the ConfigMap's key is root-cert.pem");
    }
    // The token file: a projected service-account token for istiod's CA audience.
    let tok = cfg.auth_token_file.to_str().unwrap();
    let m = mount_of(c, tok).unwrap_or_else(|| panic!("{tok} is not mounted"));
    let v = volume(&ds, str_of(&m["name"]));
    let src = &v["projected"]["sources"][0]["serviceAccountToken"];
    assert_eq!(src["audience"], "istio-ca");
    assert_eq!(Path::new(str_of(&m["mountPath"])).join(str_of(&src["path"])), Path::new(tok));
    // No CA key: no Secret volume at all, and nothing mounted where a dev CA would look.
    let vols = ds["spec"]["template"]["spec"]["volumes"].as_sequence().unwrap();
    assert!(vols.iter().all(|v| v["secret"].is_null()), "a Secret is mounted");
    assert!(mount_of(c, cfg.ca_dir.to_str().unwrap()).is_none(), "something is mounted at ca_dir");
}

#[test]
fn kustomization_lists_every_manifest() {
    let k = &docs("deploy/kustomization.yaml")[0];
    let listed: BTreeSet<String> =
        k["resources"].as_sequence().unwrap().iter().map(|r| str_of(r).to_string()).collect();
    let on_disk: BTreeSet<String> = std::fs::read_dir(root().join("deploy"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    assert_eq!(listed, on_disk);
}

async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.unwrap();
    let status = buf.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, buf)
}

/// The ConfigMap's config with the DaemonSet's env, as node-2 on loopback, pointed at a control
/// plane of our own (the token and root written to a temp dir in place of the DaemonSet's
/// mounts): it becomes ready and serves the probe, scrape and dump paths, with echo's certificate
/// from the control plane's CA and no CA directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configmap_and_daemonset_env_run_against_a_control_plane() {
    use common::cp::{self, ControlPlane};
    let dir = std::env::temp_dir().join(format!("mbt-deploy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cp = ControlPlane::start().await;
    cp.upsert(
        mbtunnel::xds::ADDRESS_TYPE,
        vec![cp::workload("e1", "echo", "echo", "10.244.2.20".parse().unwrap(), "node-2", &[])],
    );
    std::fs::write(dir.join("root-cert.pem"), &cp.root_pem).unwrap();
    std::fs::write(dir.join("istio-token"), format!("{}\n", cp::TOKEN)).unwrap();
    let ds = daemonset();
    let c = container(&ds);
    let literal = |k: &str| env_of(c, k).and_then(|e| e["value"].as_str()).map(String::from);
    let mut cfg = configmap_config();
    cfg.apply_env(literal).unwrap();
    // What the kubelet would provide, redirected to the test's files and control plane.
    cfg.xds_address = Some(cp.url());
    cfg.xds_root_ca = dir.join("root-cert.pem").display().to_string();
    cfg.ca_root_ca = cfg.xds_root_ca.clone();
    cfg.auth_token_file = dir.join("istio-token");
    cfg.node_name = "node-2".into();
    cfg.inpod_enabled = false; // no CNI here
    cfg.ca_dir = dir.join("never");
    let lo: SocketAddr = "127.0.61.1:0".parse().unwrap();
    cfg.outbound_addr = lo;
    cfg.inbound_addr = lo;
    cfg.inbound_plaintext_addr = lo;
    cfg.metrics_addr = lo;
    cfg.readiness_addr = lo;
    cfg.admin_addr = lo;
    let running = mbtunnel::app::start(cfg, None).await.expect("start");
    assert!(running.wait_ready(Duration::from_secs(20)).await, "not ready in 20 s");
    let (code, body) = http_get(running.bound.readiness, "/healthz/ready").await;
    assert_eq!(code, 200, "{body}");
    let (code, body) = http_get(running.bound.metrics, "/metrics").await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("mbtunnel_signer_backend_info"), "{body}");
    assert!(body.contains("mbtunnel_xds_connection_state 1"), "{body}");
    let (code, body) = http_get(running.bound.admin, "/config_dump").await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"holds_ca_key\": false") && body.contains("istiod CA"), "{body}");
    let id = "spiffe://cluster.local/ns/demo/sa/echo".parse().unwrap();
    assert!(running.store.current(&id).is_some(), "node-2 holds echo's certificate");
    assert!(!dir.join("never").exists(), "no CA directory in istiod mode");
    running.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}
