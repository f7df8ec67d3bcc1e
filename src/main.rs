//! The `mbtunnel` command.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand};
use mbtunnel::config::{env, Config, KeyAlgorithm, LogFormat};
use mbtunnel::redirect::Backend;
use tracing_subscriber::prelude::*;
use tracing_subscriber::{reload, EnvFilter};

#[derive(Parser)]
#[command(
    name = "mbtunnel",
    version,
    about = "Node-level mTLS (HBONE) proxy for ambient service meshes, \
with an AVX-512 IFMA multi-buffer signer"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// Implementations `mbtunnel speed --compare` can measure beside ours.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum CompareWith {
    /// Intel's crypto_mb (libcrypto_mb.so), and OpenSSL's `openssl speed` when present.
    CryptoMb,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a node proxy.
    Run(Box<RunArgs>),
    /// Print the version.
    Version,
    /// Show CPU features, the signer backend that would be chosen, and why.
    Doctor,
    /// Signatures per second: the IFMA multi-buffer backend against BoringSSL single-op, same run,
    /// one pinned core, interleaved rounds, medians; with the CPU named, its measured IFMA rate and
    /// each kernel's share of it. `--compare crypto-mb` adds Intel's crypto_mb (loaded at run time
    /// from MBTUNNEL_CRYPTO_MB_LIB, the pip prefixes or the loader's path; skipped with install
    /// instructions when absent) and `openssl speed` when an `openssl` binary is on PATH.
    Speed {
        /// Seconds of measurement per algorithm and contender (split over the rounds).
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
        /// Interleaved rounds; every figure is the median over them (at least 3 with --compare).
        #[arg(long, default_value_t = 5)]
        rounds: u32,
        /// CPU to pin the measuring thread to (default: the last one this process may use).
        #[arg(long)]
        cpu: Option<usize>,
        /// Compare with other implementations: `crypto-mb` (Intel's multi-buffer library, plus
        /// OpenSSL's `openssl speed` when the binary exists).
        #[arg(long, value_enum)]
        compare: Option<CompareWith>,
        /// Path of libcrypto_mb.so (or its folder); overrides MBTUNNEL_CRYPTO_MB_LIB.
        #[arg(long)]
        crypto_mb_lib: Option<PathBuf>,
        /// With --compare: leave out the OpenSSL column.
        #[arg(long)]
        no_openssl: bool,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Without --compare: also write the table as a chart (SVG) to this file, signatures per
        /// second of each backend per algorithm on a log axis, the ratio beside each pair.
        #[arg(long)]
        svg: Option<PathBuf>,
    },
    /// Benchmarks.
    #[command(subcommand)]
    Bench(Bench),
    /// Traffic capture: in-pod rules in a pod's namespace (iptables, nftables), or the eBPF
    /// redirect of a node proxy running with ebpf_enabled.
    #[command(subcommand)]
    Redirect(RedirectCmd),
    /// Explain the authorization decision for a hypothetical connection to a workload of the
    /// running proxy's mesh state: every applicable policy, whether it matched, the verdict
    /// (asks the proxy's admin API, `/authz/check`).
    CheckPolicy {
        /// The source: a SPIFFE id (an mTLS peer) or an IP address (a plaintext peer).
        #[arg(long)]
        src: String,
        /// The source's address; required when --src is a SPIFFE id (policies with source_ips
        /// compare it).
        #[arg(long)]
        src_ip: Option<std::net::IpAddr>,
        /// The destination, ip:port.
        #[arg(long)]
        dst: std::net::SocketAddr,
        /// The proxy's admin address.
        #[arg(long, default_value = "127.0.0.1:15000")]
        admin: std::net::SocketAddr,
    },
    /// Test helpers used by the demo and tests: an echo server, a client, and a stand-in CNI (cni).
    #[command(hide = true, subcommand)]
    Tool(Tool),
}

#[derive(clap::Args)]
struct RunArgs {
    /// YAML file with the node settings and the mesh (workloads, services, nodes).
    /// Unknown fields are errors. Without it, defaults apply.
    #[arg(long, short, env = env::CONFIG)]
    config: Option<PathBuf>,
    /// This node's name; the proxy serves workloads whose `node` matches. [env: NODE_NAME]
    #[arg(long)]
    node_name: Option<String>,
    /// SPIFFE trust domain (default cluster.local). [env: TRUST_DOMAIN]
    #[arg(long)]
    trust_domain: Option<String>,
    /// Directory holding the development CA root (ca-cert.pem, ca-key.pem); created on first
    /// use. Put an existing root there to share it. [env: MBTUNNEL_CA_DIR]
    #[arg(long)]
    ca_dir: Option<PathBuf>,
    /// Workload key algorithm: ecdsa-p256 (default), rsa-2048, rsa-3072, rsa-4096.
    /// [env: MBTUNNEL_KEY_ALGORITHM]
    #[arg(long)]
    key_algorithm: Option<KeyAlgorithm>,
    /// Signer backend: auto (IFMA when the CPU has it), ifma, scalar; model is a test backend
    /// (the IFMA kernels' portable model, slow, never for production).
    /// [env: MBTUNNEL_SIGNER_BACKEND]
    #[arg(long)]
    signer_backend: Option<String>,
    /// Signer threads (0 = half the CPU limit, at least one). [env: MBTUNNEL_SIGNER_THREADS]
    #[arg(long)]
    signer_threads: Option<usize>,
    /// Whole CPUs the proxy may use (0 = the detected CPU quota); the signer runs half as many
    /// threads, at least one. The DaemonSet passes `limits.cpu`. [env: MBTUNNEL_CPU_LIMIT]
    #[arg(long)]
    cpu_limit: Option<usize>,
    /// Threads running connections (0 = one per CPU of the CPU limit); each connection and the
    /// tasks it spawns stay on one of them. [env: MBTUNNEL_WORKER_THREADS]
    #[arg(long)]
    worker_threads: Option<usize>,
    /// Log format: text or json, lines in Istio's shape (ztunnel's LOG_FORMAT, plain or json, is
    /// read too). `istio_build`'s tag is ISTIO_META_ISTIO_VERSION. [env: MBTUNNEL_LOG_FORMAT]
    #[arg(long)]
    log_format: Option<String>,
    /// Log filter, e.g. info or mbtunnel=debug. [env: RUST_LOG]
    #[arg(long)]
    log_level: Option<String>,
    /// eBPF redirect mode: node-level capture by our tc classifiers, without NAT or iptables
    /// (needs CAP_BPF + CAP_NET_ADMIN and the node's network namespace; pods are attached with
    /// `mbtunnel redirect ebpf`). [env: MBTUNNEL_EBPF_ENABLED]
    #[arg(long)]
    ebpf: bool,
    /// eBPF mode: the node's interfaces toward other nodes, comma-separated, attached at start.
    /// [env: MBTUNNEL_EBPF_UPLINKS]
    #[arg(long, value_delimiter = ',')]
    ebpf_uplinks: Vec<String>,
    /// eBPF mode: fail open — nothing is pinned, so while no proxy runs pods talk directly.
    /// Default: fail closed (maps and links pinned under ebpf_pin_dir; enrolled pods' new
    /// connections are dropped until a proxy listens again). [env: MBTUNNEL_EBPF_FAIL_CLOSED=false]
    #[arg(long)]
    ebpf_fail_open: bool,
    /// In-pod mode: pods come from istio-cni over ZDS and their listeners open inside each
    /// pod's network namespace. [env: INPOD_ENABLED]
    #[arg(long)]
    inpod: bool,
    /// In-pod mode: the ZDS socket istio-cni serves (default /var/run/ztunnel/ztunnel.sock).
    /// [env: INPOD_UDS]
    #[arg(long)]
    inpod_socket: Option<std::path::PathBuf>,
    /// The DNS proxy: true or false (default: on in in-pod mode, off otherwise; also read as
    /// ISTIO_META_DNS_CAPTURE). It answers mesh hostnames and forwards the rest to
    /// MBTUNNEL_DNS_UPSTREAMS (ip:port,...; default the servers of /etc/resolv.conf); it listens
    /// on DNS_PROXY_ADDR or ISTIO_META_DNS_PROXY_ADDR (default 127.0.0.1:15053) in each pod's
    /// namespace (in-pod mode) or in the proxy's. Short names use CLUSTER_DOMAIN (default
    /// cluster.local); among services sharing a hostname, PREFERED_SERVICE_NAMESPACE's answers
    /// when the client's namespace has none. [env: DNS_CAPTURE]
    #[arg(long)]
    dns_capture: Option<bool>,
    /// istiod's xDS endpoint, e.g. https://istiod.istio-system.svc:15012. Set: workloads,
    /// services and authorization policies come over delta xDS (the file must list none).
    /// Extra gRPC metadata: XDS_HEADER_<name>=<value>. [env: XDS_ADDRESS]
    #[arg(long)]
    xds_address: Option<String>,
    /// istiod's CA endpoint (default: the xDS address). Set: certificates are requested with a
    /// CSR and the proxy holds no CA key. Extra gRPC metadata: CA_HEADER_<name>=<value>.
    /// [env: CA_ADDRESS]
    #[arg(long)]
    ca_address: Option<String>,
    /// Root certificate(s) that verify istiod's xDS server: a PEM file or inline PEM (default
    /// ./var/run/secrets/istio/root-cert.pem). [env: XDS_ROOT_CA]
    #[arg(long)]
    xds_root_ca: Option<String>,
    /// Root certificate(s) that verify istiod's CA server (default as --xds-root-ca).
    /// [env: CA_ROOT_CA]
    #[arg(long)]
    ca_root_ca: Option<String>,
    /// File holding the bearer token sent to istiod, re-read at every call (default
    /// ./var/run/secrets/tokens/istio-token). AUTH_TOKEN, as ztunnel reads it: a path when
    /// that file exists, else a fixed token. A token with an http:// xDS or CA address is
    /// refused at start-up (it would be sent in clear). [env: MBTUNNEL_AUTH_TOKEN_FILE]
    #[arg(long)]
    auth_token_file: Option<PathBuf>,
    /// Cluster id sent to istiod (default Kubernetes). [env: CLUSTER_ID]
    #[arg(long)]
    cluster_id: Option<String>,
    /// Certificate lifetime requested from the CA, e.g. 24h, 90m, 3600s (default 24h).
    /// [env: SECRET_TTL]
    #[arg(long)]
    secret_ttl: Option<String>,
    /// This proxy's pod name, namespace and IP, sent to istiod in the xDS node.
    /// [env: POD_NAME]
    #[arg(long)]
    pod_name: Option<String>,
    /// [env: POD_NAMESPACE]
    #[arg(long)]
    pod_namespace: Option<String>,
    /// [env: INSTANCE_IP]
    #[arg(long)]
    instance_ip: Option<std::net::IpAddr>,
    /// With istiod: how long a connection that arrives before the first xDS response of both
    /// types waits before it is refused, in milliseconds (default 5000).
    /// [env: MBTUNNEL_XDS_SYNC_TIMEOUT_MS]
    #[arg(long)]
    xds_sync_timeout_ms: Option<u64>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum RedirectAction {
    Apply,
    Remove,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum BenchMode {
    SignerIfma,
    SignerScalar,
    Inline,
}

impl BenchMode {
    fn mode(self) -> mbtunnel::bench::Mode {
        match self {
            BenchMode::SignerIfma => mbtunnel::bench::Mode::SignerIfma,
            BenchMode::SignerScalar => mbtunnel::bench::Mode::SignerScalar,
            BenchMode::Inline => mbtunnel::bench::Mode::Inline,
        }
    }
}

#[derive(Subcommand)]
enum RedirectCmd {
    /// Install or remove in-pod iptables rules in a pod's network namespace (what istio-cni
    /// does): outbound TCP → 15001, DNS → 15053, inbound → 15006 (15008 untouched), mark 0x539 skipped,
    /// connmark 0x111 + table 100 for replies.
    Iptables {
        /// apply or remove.
        action: RedirectAction,
        /// The namespace: /var/run/netns/NAME or /proc/PID/ns/net.
        #[arg(long)]
        netns: PathBuf,
        /// Leave DNS (port 53) alone; by default it is redirected to the DNS proxy on 15053,
        /// as istio-cni does with DNS capture on.
        #[arg(long)]
        no_dns_capture: bool,
    },
    /// The same rules as nftables (table inet mbtunnel).
    Nftables {
        /// apply or remove.
        action: RedirectAction,
        /// The namespace: /var/run/netns/NAME or /proc/PID/ns/net.
        #[arg(long)]
        netns: PathBuf,
        /// Leave DNS (port 53) alone; by default it is redirected to the DNS proxy on 15053,
        /// as istio-cni does with DNS capture on.
        #[arg(long)]
        no_dns_capture: bool,
    },
    /// eBPF redirect: attach the tc classifiers to interfaces and enrol pods, on the node proxy
    /// running here with ebpf_enabled (through its admin API; the proxy owns programs and maps).
    #[command(subcommand)]
    Ebpf(EbpfCmd),
}

#[derive(clap::Args)]
struct AdminArg {
    /// The proxy's admin address.
    #[arg(long, default_value = "127.0.0.1:15000")]
    admin: std::net::SocketAddr,
    /// The proxy's admin token (its `ebpf_token_file`, written at start, readable by root only);
    /// changes need it.
    #[arg(long, default_value = mbtunnel::redirect::ebpf::DEFAULT_TOKEN_FILE)]
    token_file: PathBuf,
}

impl AdminArg {
    fn admin(self) -> mbtunnel::redirect::control::Admin {
        mbtunnel::redirect::control::Admin { addr: self.admin, token_file: self.token_file }
    }
}

#[derive(Subcommand)]
enum EbpfCmd {
    /// Attach a classifier: `--pod-netns` attaches the pod's veth (host side) and enrols the
    /// pod's addresses; `--iface` attaches one interface with `--role` (pod, or uplink for the
    /// node's interface toward other nodes).
    Attach {
        /// The pod's namespace (/var/run/netns/NAME or /proc/PID/ns/net).
        #[arg(long, conflicts_with = "iface", required_unless_present = "iface")]
        pod_netns: Option<PathBuf>,
        /// An interface of this namespace.
        #[arg(long)]
        iface: Option<String>,
        /// What the interface is (with --iface).
        #[arg(long, default_value = "pod")]
        role: mbtunnel::redirect::ebpf::Role,
        #[command(flatten)]
        admin: AdminArg,
    },
    /// Detach: `--pod-netns` removes the pod's addresses and detaches its veth; `--iface`
    /// detaches one interface.
    Detach {
        #[arg(long, conflicts_with = "iface", required_unless_present = "iface")]
        pod_netns: Option<PathBuf>,
        #[arg(long)]
        iface: Option<String>,
        #[command(flatten)]
        admin: AdminArg,
    },
    /// Enrol pod addresses: their next connections are captured.
    Enrol {
        #[arg(long, required = true)]
        ip: Vec<std::net::IpAddr>,
        #[command(flatten)]
        admin: AdminArg,
    },
    /// Remove pod addresses: their next connections are not captured (open ones go on).
    Unenrol {
        #[arg(long, required = true)]
        ip: Vec<std::net::IpAddr>,
        #[command(flatten)]
        admin: AdminArg,
    },
    /// Interfaces, enrolled addresses and packet counters, as JSON.
    Status {
        #[command(flatten)]
        admin: AdminArg,
    },
}

fn rules(
    backend: Backend,
    action: RedirectAction,
    netns: &std::path::Path,
    dns: bool,
) -> anyhow::Result<()> {
    match action {
        RedirectAction::Apply => mbtunnel::redirect::apply(backend, netns, dns)?,
        RedirectAction::Remove => mbtunnel::redirect::remove(backend, netns)?,
    }
    Ok(())
}

fn ebpf_cmd(cmd: EbpfCmd) -> anyhow::Result<()> {
    use mbtunnel::redirect::control;
    let mut out = String::new();
    let add = matches!(cmd, EbpfCmd::Enrol { .. });
    match cmd {
        EbpfCmd::Attach { pod_netns: Some(ns), admin, .. } => {
            let (admin, pod) = (admin.admin(), control::pod_link(&ns)?);
            out += &admin.attach(&pod.host_iface, mbtunnel::redirect::ebpf::Role::Pod)?;
            for ip in pod.ips {
                out += &admin.enrol(ip, true)?;
            }
        }
        EbpfCmd::Attach { iface: Some(i), role, admin, .. } => {
            out += &admin.admin().attach(&i, role)?;
        }
        EbpfCmd::Detach { pod_netns: Some(ns), admin, .. } => {
            let (admin, pod) = (admin.admin(), control::pod_link(&ns)?);
            for ip in pod.ips {
                out += &admin.enrol(ip, false)?;
            }
            out += &admin.detach(&pod.host_iface)?;
        }
        EbpfCmd::Detach { iface: Some(i), admin, .. } => out += &admin.admin().detach(&i)?,
        EbpfCmd::Attach { .. } | EbpfCmd::Detach { .. } => {
            anyhow::bail!("give --pod-netns or --iface")
        }
        EbpfCmd::Enrol { ip, admin } | EbpfCmd::Unenrol { ip, admin } => {
            let admin = admin.admin();
            for a in ip {
                out += &admin.enrol(a, add)?;
            }
        }
        EbpfCmd::Status { admin } => out += &admin.admin().status()?,
    }
    print!("{out}");
    Ok(())
}

#[derive(Subcommand)]
enum Bench {
    /// Concurrent mTLS handshakes: signer on IFMA vs signer on scalar vs inline BoringSSL.
    Handshakes {
        /// Seconds per measured point.
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
        /// Concurrency levels, comma separated.
        #[arg(long, default_value = "1,8,64,256", value_delimiter = ',')]
        concurrency: Vec<usize>,
        /// Workload key algorithms, comma separated.
        #[arg(long, default_value = "rsa-2048,ecdsa-p256", value_delimiter = ',')]
        keys: Vec<KeyAlgorithm>,
        /// Signer threads per side (0 = the default: half the CPUs, at least one).
        #[arg(long, default_value_t = 0)]
        signer_threads: usize,
        /// Modes to run, comma separated: signer-ifma, signer-scalar, inline.
        #[arg(long, default_value = "signer-ifma,signer-scalar,inline", value_delimiter = ',')]
        modes: Vec<BenchMode>,
        /// Adaptive fill bound in microseconds for every key class (unset = the signer's
        /// per-class defaults; 0 = off).
        #[arg(long)]
        signer_fill_us: Option<u64>,
        /// Rounds per point, the modes taking turns; each figure is the median over the rounds.
        #[arg(long, default_value_t = 1)]
        repeat: usize,
        /// TLS 1.3 resumption on both sides, each client offering the session from its previous
        /// connection (as mbtunnel peers do); without it every handshake is full.
        #[arg(long)]
        resumption: bool,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum Tool {
    /// An authoritative DNS server (UDP and TCP) for fixed A/AAAA records; NXDOMAIN for other
    /// names. Prints its address as a JSON line.
    DnsServer {
        #[arg(long)]
        listen: SocketAddr,
        /// name=ip (repeatable).
        #[arg(long)]
        record: Vec<String>,
        /// TTL of the answers, seconds.
        #[arg(long, default_value_t = 60)]
        ttl: u32,
    },
    /// One DNS query; prints the answer as a JSON line (rcode, aa, tc, answers).
    Dig {
        #[arg(long)]
        server: SocketAddr,
        #[arg(long)]
        name: String,
        /// A, AAAA, TXT, ...
        #[arg(long, default_value = "A")]
        r#type: String,
        #[arg(long)]
        tcp: bool,
        /// Source address.
        #[arg(long)]
        bind: Option<std::net::IpAddr>,
    },
    /// Echo every byte back on each connection.
    Echo {
        #[arg(long)]
        listen: SocketAddr,
    },
    /// Send N pseudo-random bytes, read the echo, check it, print a JSON line.
    Send {
        #[arg(long)]
        connect: SocketAddr,
        #[arg(long)]
        bind: Option<IpAddr>,
        #[arg(long, default_value_t = 1 << 20)]
        bytes: usize,
    },
    /// A minimal stand-in for istio-cni's node agent: serves ZDS on `--socket`, installs the
    /// redirect rules in each pod's namespace, and enrols the pods (replayed on every reconnect,
    /// then SnapshotSent). Prints one JSON line per ack.
    Cni {
        #[arg(long)]
        socket: PathBuf,
        /// uid=NETNS_PATH[=namespace/name/service_account], e.g. client-1=/var/run/netns/pod-a
        /// (repeatable). The workload information is sent with the pod (ztunnel requires it).
        #[arg(long = "pod")]
        pods: Vec<mbtunnel::devtools::CniPod>,
        /// A file of pods, one per line in the `--pod` syntax.
        #[arg(long)]
        pods_file: Option<PathBuf>,
        #[arg(long, default_value = "iptables")]
        redirect: mbtunnel::redirect::Backend,
        /// One line per connection once every pod is acknowledged, instead of one per ack.
        #[arg(long)]
        quiet: bool,
    },
    /// A handshake storm: from each pod of `--pods-file` (the `tool cni` syntax), one connection
    /// to `--connect` from inside the pod's namespace, `--concurrency` at a time; prints one JSON
    /// line (connections, failures, connections per second, latency).
    Storm {
        #[arg(long)]
        pods_file: PathBuf,
        #[arg(long)]
        connect: SocketAddr,
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
        /// What each connection sends (`\r\n` for CRLF).
        #[arg(long, default_value = "GET / HTTP/1.0\\r\\n\\r\\n")]
        request: String,
        /// How the answer must start.
        #[arg(long, default_value = "HTTP/1.1 200")]
        expect: String,
    },
}

type FilterHandle = reload::Handle<EnvFilter, tracing_subscriber::Registry>;

/// Logging for `run`: events go to stderr in batches written by a thread of their own
/// ([`mbtunnel::logbuf`]); the guard writes what is left when `run` returns.
fn init_logging(
    format: LogFormat,
    level: &str,
) -> anyhow::Result<(FilterHandle, mbtunnel::logbuf::LogGuard)> {
    use mbtunnel::logbuf::BatchWriter;
    let filter =
        EnvFilter::try_new(level).with_context(|| format!("invalid log filter '{level}'"))?;
    let (filter, handle) = reload::Layer::new(filter);
    let (writer, guard) =
        BatchWriter::new(Box::new(std::io::stderr())).context("starting the log writer")?;
    // A panic's message goes straight to stderr: write the lines logged before it first.
    let w = writer.clone();
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        w.flush_now();
        previous(info)
    }));
    let reg = tracing_subscriber::registry().with(filter);
    // Istio's line shapes (mbtunnel::logfmt), so log pipelines built for ztunnel parse ours.
    match format {
        LogFormat::Json => reg
            .with(
                tracing_subscriber::fmt::layer()
                    .event_format(mbtunnel::logfmt::IstioJson)
                    .fmt_fields(mbtunnel::logfmt::json_span_fields())
                    .with_writer(writer),
            )
            .init(),
        LogFormat::Text => reg
            .with(
                tracing_subscriber::fmt::layer()
                    .event_format(mbtunnel::logfmt::IstioText)
                    .fmt_fields(mbtunnel::logfmt::IstioText)
                    .with_writer(writer),
            )
            .init(),
    }
    Ok((handle, guard))
}

fn load_config(a: &RunArgs) -> anyhow::Result<Config> {
    let mut cfg = match &a.config {
        Some(p) => Config::from_file(p)?,
        None => Config::default(),
    };
    cfg.apply_env(|k| std::env::var(k).ok())?;
    cfg.apply_header_env(std::env::vars());
    if let Some(v) = &a.xds_address {
        cfg.xds_address = Some(v.clone());
    }
    if let Some(v) = &a.ca_address {
        cfg.ca_address = Some(v.clone());
    }
    if a.inpod {
        cfg.inpod_enabled = true;
    }
    if let Some(v) = a.dns_capture {
        cfg.dns_capture = Some(v);
    }
    if let Some(v) = &a.inpod_socket {
        cfg.inpod_socket = v.clone();
    }
    if let Some(v) = &a.xds_root_ca {
        cfg.xds_root_ca = v.clone();
    }
    if let Some(v) = &a.ca_root_ca {
        cfg.ca_root_ca = v.clone();
    }
    if let Some(v) = &a.auth_token_file {
        cfg.auth_token_file = v.clone();
    }
    if let Some(v) = &a.cluster_id {
        cfg.cluster_id = v.clone();
    }
    if let Some(v) = &a.secret_ttl {
        cfg.cert_lifetime_secs = mbtunnel::config::parse_duration(v)
            .map_err(|e| anyhow::anyhow!("--secret-ttl: {e}"))?
            .as_secs();
    }
    if let Some(v) = &a.pod_name {
        cfg.pod_name = v.clone();
    }
    if let Some(v) = &a.pod_namespace {
        cfg.pod_namespace = v.clone();
    }
    if let Some(v) = a.xds_sync_timeout_ms {
        cfg.xds_sync_timeout_ms = v;
    }
    if let Some(v) = a.instance_ip {
        cfg.instance_ip = Some(v);
    }
    if let Some(v) = &a.node_name {
        cfg.node_name = v.clone();
    }
    if let Some(v) = &a.trust_domain {
        cfg.trust_domain = v.clone();
    }
    if let Some(v) = &a.ca_dir {
        cfg.ca_dir = v.clone();
    }
    if let Some(v) = a.key_algorithm {
        cfg.key_algorithm = v;
    }
    if let Some(v) = &a.signer_backend {
        cfg.signer_backend = v.clone();
    }
    if let Some(v) = a.signer_threads {
        cfg.signer_threads = v;
    }
    if let Some(v) = a.cpu_limit {
        cfg.cpu_limit = v;
    }
    if let Some(v) = a.worker_threads {
        cfg.worker_threads = v;
    }
    if let Some(v) = &a.log_format {
        cfg.log_format = v.parse().map_err(|e| anyhow::anyhow!("--log-format: {e}"))?;
    }
    if let Some(v) = a.log_level.clone().or_else(|| std::env::var(env::LOG).ok()) {
        cfg.log_level = v;
    }
    if a.ebpf {
        cfg.ebpf_enabled = true;
    }
    if !a.ebpf_uplinks.is_empty() {
        cfg.ebpf_uplinks = a.ebpf_uplinks.clone();
    }
    if a.ebpf_fail_open {
        cfg.ebpf_fail_closed = false;
    }
    cfg.validate()?;
    Ok(cfg)
}

async fn run(cfg: Config) -> anyhow::Result<()> {
    let (handle, _log) = init_logging(cfg.log_format, &cfg.log_level)?;
    tracing::info!(
        worker_threads = cfg.runtime_workers(),
        cpus = cfg.cpus(),
        "starting: connection worker threads and the CPUs they follow"
    );
    let ctl: mbtunnel::admin::LogControl = Arc::new(move |level: &str| {
        let f = EnvFilter::try_new(level).map_err(|e| e.to_string())?;
        handle.reload(f).map_err(|e| e.to_string())
    });
    let running = mbtunnel::app::start(cfg, Some(ctl)).await?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = tokio::signal::ctrl_c() => tracing::info!("interrupt received"),
    }
    running.shutdown().await;
    Ok(())
}

async fn tool(t: Tool) -> anyhow::Result<()> {
    use mbtunnel::devtools;
    match t {
        Tool::Echo { listen } => devtools::echo(listen).await,
        Tool::DnsServer { listen, record, ttl } => {
            use mbtunnel::dns::tools;
            let records = tools::parse_records(&record).map_err(anyhow::Error::msg)?;
            let s = tools::StaticServer::start(listen, records, ttl).await?;
            println!("{}", serde_json::json!({ "dns_server": s.addr.to_string() }));
            std::future::pending::<()>().await;
            Ok(())
        }
        Tool::Dig { server, name, r#type, tcp, bind } => {
            use mbtunnel::dns::tools;
            let rtype: hickory_proto::rr::RecordType =
                r#type.to_uppercase().parse().map_err(|e| anyhow::anyhow!("--type {type}: {e}"))?;
            let mut ask = tools::Ask::udp().tcp(tcp);
            if let Some(ip) = bind {
                ask = ask.from(ip);
            }
            let m = tools::query(server, &name, rtype, ask).await.map_err(anyhow::Error::msg)?;
            println!("{}", tools::to_json(&m));
            Ok(())
        }
        Tool::Cni { socket, mut pods, pods_file, redirect, quiet } => {
            if let Some(f) = pods_file {
                pods.extend(devtools::read_pods(&f)?);
            }
            devtools::fake_cni(socket, pods, redirect, quiet).await
        }
        Tool::Storm { pods_file, connect, concurrency, request, expect } => {
            let pods = devtools::read_pods(&pods_file)?;
            tokio::task::spawn_blocking(move || {
                devtools::storm(pods, connect, concurrency, &request, &expect)
            })
            .await?
        }
        Tool::Send { connect, bind, bytes } => devtools::send(connect, bind, bytes).await,
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Version => {
            println!("mbtunnel {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        Cmd::Doctor => {
            print!("{}", mbtunnel::speed::doctor());
            Ok(())
        }
        Cmd::Speed {
            seconds,
            rounds,
            cpu,
            compare: Some(CompareWith::CryptoMb),
            crypto_mb_lib,
            no_openssl,
            json,
            svg,
        } => {
            if svg.is_some() {
                anyhow::bail!("--svg charts the speed table; use it without --compare");
            }
            let opts = mbtunnel::speed::compare::CompareOptions {
                duration: std::time::Duration::from_secs_f64(seconds.max(0.05)),
                rounds,
                cpu,
                crypto_mb_lib,
                openssl: !no_openssl,
                ..Default::default()
            };
            let r = mbtunnel::speed::compare::run_compare(&opts);
            if json {
                println!("{}", r.to_json());
            } else {
                print!("{r}");
            }
            if r.has_errors() {
                anyhow::bail!("the comparison found errors (see the rows marked ERROR)");
            }
            Ok(())
        }
        Cmd::Speed { seconds, rounds, cpu, compare: None, json, svg, .. } => {
            let opts = mbtunnel::speed::SpeedOptions {
                rounds,
                cpu,
                ..mbtunnel::speed::SpeedOptions::with_seconds(seconds)
            };
            let r = mbtunnel::speed::run_speed(&opts);
            if json {
                println!("{}", r.to_json());
            } else {
                print!("{r}");
            }
            if let Some(path) = svg {
                std::fs::write(&path, mbtunnel::speed::chart::svg(&r))
                    .with_context(|| format!("cannot write the chart to {}", path.display()))?;
                eprintln!("chart written to {}", path.display());
            }
            Ok(())
        }
        Cmd::Bench(Bench::Handshakes {
            seconds,
            concurrency,
            keys,
            signer_threads,
            modes,
            signer_fill_us,
            repeat,
            resumption,
            json,
        }) => {
            let opts = mbtunnel::bench::BenchOptions {
                duration: std::time::Duration::from_secs_f64(seconds),
                concurrency,
                keys,
                modes: modes.into_iter().map(BenchMode::mode).collect(),
                signer_threads,
                fill_wait: signer_fill_us.map(std::time::Duration::from_micros),
                repeat,
                resumption,
            };
            let r = mbtunnel::bench::run(&opts)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                print!("{r}");
            }
            Ok(())
        }
        Cmd::Redirect(RedirectCmd::Ebpf(cmd)) => ebpf_cmd(cmd),
        Cmd::CheckPolicy { src, src_ip, dst, admin } => {
            if src.starts_with("spiffe://") && src_ip.is_none() {
                anyhow::bail!(
                    "check-policy: a SPIFFE --src needs --src-ip, the peer's address (policies \
                     with source_ips compare it; none is assumed)"
                );
            }
            let a = mbtunnel::redirect::control::Admin { addr: admin, token_file: PathBuf::new() };
            print!("{}", a.check_policy(&src, src_ip, &dst.to_string())?);
            Ok(())
        }
        Cmd::Redirect(RedirectCmd::Iptables { action, netns, no_dns_capture }) => {
            rules(Backend::Iptables, action, &netns, !no_dns_capture)
        }
        Cmd::Redirect(RedirectCmd::Nftables { action, netns, no_dns_capture }) => {
            rules(Backend::Nftables, action, &netns, !no_dns_capture)
        }
        Cmd::Run(a) => {
            mbtunnel::net::sys::tune_allocator();
            let cfg = load_config(&a)?;
            // Listeners and connections run on worker threads of their own (`net::Workers`);
            // this runtime runs the control plane.
            tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(run(cfg))
        }
        Cmd::Tool(t) => tokio::runtime::Runtime::new()?.block_on(tool(t)),
    }
}
