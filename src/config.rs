//! The one `Config` struct: built once from a YAML file and environment variables, printed in the
//! admin config dump. Unknown fields are errors that name the field; a missing or malformed file
//! names the file and what is wrong.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::identity::Identity;
use crate::state::StoreConfig;

/// Environment variable names, in one place.
pub mod env {
    pub const CONFIG: &str = "MBTUNNEL_CONFIG";
    pub const NODE_NAME: &str = "NODE_NAME";
    pub const TRUST_DOMAIN: &str = "TRUST_DOMAIN";
    pub const CA_DIR: &str = "MBTUNNEL_CA_DIR";
    pub const KEY_ALGORITHM: &str = "MBTUNNEL_KEY_ALGORITHM";
    /// Read by the multi-buffer core itself too (`mb::BACKEND_ENV`; a test keeps them equal).
    pub const SIGNER_BACKEND: &str = "MBTUNNEL_SIGNER_BACKEND";
    pub const LOG_FORMAT: &str = "MBTUNNEL_LOG_FORMAT";
    /// ztunnel's name for the log format (`plain` or `json`); `MBTUNNEL_LOG_FORMAT` wins.
    pub const ISTIO_LOG_FORMAT: &str = "LOG_FORMAT";
    pub const SIGNER_THREADS: &str = "MBTUNNEL_SIGNER_THREADS";
    /// Whole CPUs the proxy may use (the DaemonSet passes `limits.cpu`); sizes the signer.
    pub const CPU_LIMIT: &str = "MBTUNNEL_CPU_LIMIT";
    /// Proxy (tokio) worker threads; the name ztunnel's is modelled on (`ZTUNNEL_WORKER_THREADS`).
    pub const WORKER_THREADS: &str = "MBTUNNEL_WORKER_THREADS";
    pub const LOG: &str = "RUST_LOG";
    /// `true`/`false`: in-pod mode (the names ztunnel uses).
    pub const INPOD_ENABLED: &str = "INPOD_ENABLED";
    pub const INPOD_UDS: &str = "INPOD_UDS";
    pub const EBPF_ENABLED: &str = "MBTUNNEL_EBPF_ENABLED";
    /// Comma-separated interface names.
    pub const EBPF_UPLINKS: &str = "MBTUNNEL_EBPF_UPLINKS";
    pub const EBPF_FAIL_CLOSED: &str = "MBTUNNEL_EBPF_FAIL_CLOSED";
    // The control plane, with ztunnel's names.
    pub const XDS_ADDRESS: &str = "XDS_ADDRESS";
    pub const CA_ADDRESS: &str = "CA_ADDRESS";
    pub const XDS_ROOT_CA: &str = "XDS_ROOT_CA";
    pub const CA_ROOT_CA: &str = "CA_ROOT_CA";
    /// The bearer token itself (otherwise it is read from the token file at every call).
    pub const AUTH_TOKEN: &str = "AUTH_TOKEN";
    pub const AUTH_TOKEN_FILE: &str = "MBTUNNEL_AUTH_TOKEN_FILE";
    pub const CLUSTER_ID: &str = "CLUSTER_ID";
    /// How long a connection waits for the first xDS sync, milliseconds.
    pub const XDS_SYNC_TIMEOUT_MS: &str = "MBTUNNEL_XDS_SYNC_TIMEOUT_MS";
    /// Certificate lifetime requested from the CA, e.g. `24h`, `90m`, `3600s`.
    pub const SECRET_TTL: &str = "SECRET_TTL";
    pub const POD_NAME: &str = "POD_NAME";
    pub const POD_NAMESPACE: &str = "POD_NAMESPACE";
    pub const INSTANCE_IP: &str = "INSTANCE_IP";
    /// Prefixes: `XDS_HEADER_<k>=v` / `CA_HEADER_<k>=v` add metadata `k: v` to those calls.
    /// DNS proxy on or off (`ISTIO_META_DNS_CAPTURE` is read too, as ztunnel reads proxy
    /// metadata). Default: on in in-pod mode, off otherwise.
    pub const DNS_CAPTURE: &str = "DNS_CAPTURE";
    pub const META_DNS_CAPTURE: &str = "ISTIO_META_DNS_CAPTURE";
    /// Where the DNS proxy listens (default 127.0.0.1:15053); `ISTIO_META_DNS_PROXY_ADDR` too.
    pub const DNS_PROXY_ADDR: &str = "DNS_PROXY_ADDR";
    pub const META_DNS_PROXY_ADDR: &str = "ISTIO_META_DNS_PROXY_ADDR";
    /// Upstream resolvers, `ip:port,...` (default: /etc/resolv.conf's).
    pub const DNS_UPSTREAMS: &str = "MBTUNNEL_DNS_UPSTREAMS";
    pub const CLUSTER_DOMAIN: &str = "CLUSTER_DOMAIN";
    /// The Istio version `istio_build`'s `tag` reports (istiod's injection sets it).
    pub const ISTIO_VERSION: &str = "ISTIO_META_ISTIO_VERSION";
    /// ztunnel's spelling.
    pub const PREFERED_SERVICE_NAMESPACE: &str = "PREFERED_SERVICE_NAMESPACE";
    pub const XDS_HEADER_PREFIX: &str = "XDS_HEADER_";
    pub const CA_HEADER_PREFIX: &str = "CA_HEADER_";
}

/// Lanes of a multi-buffer batch (`mb::LANES`; a test keeps them equal). `config` imports
/// neither the crypto core nor the redirect code.
pub const BATCH_LANES: usize = 8;
/// Where eBPF mode writes its admin token by default (`redirect::ebpf::DEFAULT_TOKEN_FILE`).
pub const DEFAULT_EBPF_TOKEN_FILE: &str = "/var/run/mbtunnel/ebpf-admin.token";
/// Where eBPF mode pins its maps and links (fail-closed mode).
pub const DEFAULT_EBPF_PIN_DIR: &str = "/sys/fs/bpf/mbtunnel";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("invalid config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid config: {0}")]
    Invalid(String),
}

pub use crate::identity::KeyAlgorithm;

/// What a dump, a log line or a `Debug` print shows in place of a secret.
pub const REDACTED: &str = "<redacted>";

/// A secret setting (a bearer token, a header value): read from the file or the environment like
/// any string, but serialised (the admin config dump) and printed (`Debug`, so every log line)
/// as [`REDACTED`]. Only [`Secret::expose`] gives the value, for the one place that sends it.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(v: impl Into<String>) -> Secret {
        Secret(v.into())
    }
    /// The value itself: only for putting it on the wire.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(REDACTED)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// The one parser for the log format, whichever way it is given (file, env, flag).
impl std::str::FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            // `plain` is ztunnel's word for it.
            "text" | "plain" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            _ => Err(format!("'{s}' is not text (plain) or json")),
        }
    }
}

pub use crate::state::policy::Authorization;
pub use crate::state::{Protocol, Service, ServicePort, Workload};

/// Where the node's HBONE inbound can be reached when it is not `<workload ip>:hbone_port`
/// (several nodes on one machine).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Node {
    pub name: String,
    pub hbone_addr: SocketAddr,
}

/// Node proxy configuration plus the local view of the mesh.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// This node's name; the proxy serves the workloads whose `node` equals it.
    pub node_name: String,
    pub trust_domain: String,
    /// Directory of the development CA (ca-cert.pem, ca-key.pem); created on first use.
    pub ca_dir: PathBuf,
    pub key_algorithm: KeyAlgorithm,
    pub cert_lifetime_secs: u64,
    pub outbound_addr: SocketAddr,
    pub inbound_addr: SocketAddr,
    pub inbound_plaintext_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub readiness_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// Port dialed on a destination for HBONE.
    pub hbone_port: u16,
    /// Try `IP_TRANSPARENT` so applications see the original source address.
    pub transparent: bool,
    /// `SO_MARK` on sockets the proxy opens, so redirect rules skip them (0 = none).
    pub socket_mark: u32,
    pub drain_timeout_secs: u64,
    /// TCP connect timeout toward peers and applications, milliseconds.
    pub connect_timeout_ms: u64,
    /// TLS handshake timeout (either side), milliseconds.
    pub handshake_timeout_ms: u64,
    /// Inbound HBONE connections still in their TLS handshake, all listeners together; over
    /// it, the oldest one waiting on its peer from the heaviest source is dropped.
    pub max_pending_handshakes: usize,
    /// The same, from one source address; over it, that source's oldest waiting one is dropped.
    pub max_pending_handshakes_per_source: usize,
    /// TLS handshakes computing at once, per side; 0 = 32 per CPU of `cpu_limit`.
    pub max_concurrent_handshakes: usize,
    /// A pooled HBONE connection with no stream for this long is closed, seconds.
    pub pool_idle_timeout_secs: u64,
    /// Streams per pooled HBONE connection before the pool opens another (at most 100, the
    /// stream limit HBONE servers announce).
    pub pool_max_streams: usize,
    /// TLS 1.3 session resumption between mbtunnel peers (PSK with ECDHE, tickets at most an
    /// hour and never past the authenticating certificate; see `tls::resume`).
    pub tls_resumption: bool,
    /// Remember peer certificate chains that verified, so the same chain presented again skips
    /// its signature checks; the peer's proof of its key, validity times and identity are still
    /// checked on every handshake (see `tls::verify`).
    pub tls_verify_cache: bool,
    /// TLS key-exchange groups offered (client) and accepted (server), in preference order.
    /// Empty: BoringSSL's defaults: X25519MLKEM768 (the post-quantum hybrid), X25519, P-256,
    /// P-384. Two ztunnels (tls-aws-lc, defaults) agree on X25519; `[X25519]` here makes the same
    /// trade (about a fifth less CPU per new connection, no post-quantum protection).
    pub tls_groups: Vec<String>,
    /// TLS 1.3 cipher suites in strict preference order, offered (client) and picked (server).
    /// Default: TLS_AES_128_GCM_SHA256, TLS_AES_256_GCM_SHA384, TLS_CHACHA20_POLY1305_SHA256
    /// (see `tls::suites` for why); empty: BoringSSL's defaults, where a server follows the
    /// client's preference.
    pub tls_ciphers: Vec<String>,
    pub log_format: LogFormat,
    pub log_level: String,
    /// `auto`, `ifma` or `scalar`.
    pub signer_backend: String,
    /// Signer threads; 0 = half of `cpu_limit` (at least one).
    pub signer_threads: usize,
    /// Whole CPUs the proxy may use; 0 = the process's CPU quota as detected.
    pub cpu_limit: usize,
    /// Worker threads that run the proxy's connections (each a single-threaded runtime that keeps
    /// a connection's tasks together); 0 = `cpu_limit` (or the detected quota).
    pub worker_threads: usize,
    /// How long an idle signer thread may wait for a fuller batch, in microseconds (0 = never).
    pub signer_max_wait_us: u64,
    /// Requests allowed to wait in the signer; beyond it handshakes fail fast.
    pub signer_queue_limit: usize,
    /// Batches of at most this many requests use BoringSSL single-op (faster for so few).
    /// Unset: the measured per-class defaults (2 for RSA, 1 for ECDSA P-256).
    pub signer_scalar_below: Option<usize>,
    /// Adaptive fill bound in microseconds: under load, how long a forming batch of two or more
    /// may be held open for more lanes while requests keep arriving. Unset: six 8-lane passes of
    /// the class as measured at start-up for RSA (8/25/60 ms until measured), off for ECDSA
    /// P-256; 0 = off.
    pub signer_fill_wait_us: Option<u64>,
    /// In-pod mode: take pods from istio-cni over ZDS and open their listeners inside each pod's
    /// network namespace. The served workloads are then the enrolled pods (by uid), not those
    /// whose `node` is `node_name`.
    pub inpod_enabled: bool,
    /// The CNI's ZDS socket (Unix SOCK_SEQPACKET).
    pub inpod_socket: PathBuf,
    /// eBPF redirect mode: load our tc classifiers, which hand enrolled pods' connections to this
    /// proxy's listeners without NAT (listeners become `IP_TRANSPARENT`). Pods' veths are
    /// attached and pods enrolled at run time (`mbtunnel redirect ebpf ...`, admin API).
    pub ebpf_enabled: bool,
    /// eBPF mode: interfaces toward other nodes, attached (role uplink) at start-up.
    pub ebpf_uplinks: Vec<String>,
    /// eBPF mode: where the proxy writes (mode 0600) the token that changing the redirect
    /// through the admin API requires; `mbtunnel redirect ebpf` reads it.
    pub ebpf_token_file: PathBuf,
    /// eBPF mode: fail closed. The maps are pinned under `ebpf_pin_dir` and each classifier is
    /// attached with a pinned link, so they outlive the process: while no proxy listens (exit,
    /// crash, restart) an enrolled pod's new connections are dropped and counted (`no_listener`)
    /// instead of leaving unencrypted and unchecked; the next proxy takes the pinned state over.
    /// False: everything is detached when the proxy exits and pods talk directly until it
    /// returns (fail open); a start in this mode also removes state a fail-closed proxy pinned.
    pub ebpf_fail_closed: bool,
    /// eBPF mode: the directory on a BPF filesystem (bpffs) for the pinned maps and links.
    pub ebpf_pin_dir: PathBuf,
    /// istiod's xDS endpoint (`https://host:15012`). Set: workloads, services and policies come
    /// over delta xDS and the file must not list any.
    pub xds_address: Option<String>,
    /// xDS mode: a connection that arrives before the first complete response of both types
    /// (Address and Authorization) waits at most this long, then is refused (`xds_not_synced`);
    /// milliseconds. Never decided against an empty or partial policy set.
    pub xds_sync_timeout_ms: u64,
    /// istiod's CA endpoint; unset with `xds_address` set: the same address. Set: certificates
    /// come from that CA and the proxy holds no CA key.
    pub ca_address: Option<String>,
    /// Root certificate(s) that verify the xDS server: a PEM file path or inline PEM.
    pub xds_root_ca: String,
    /// Root certificate(s) that verify the CA server: a PEM file path or inline PEM.
    pub ca_root_ca: String,
    /// The projected service-account token sent as `authorization: Bearer` (read per call).
    pub auth_token_file: PathBuf,
    /// A fixed token instead of the file (`AUTH_TOKEN` when it does not name a file). Shown
    /// as `<redacted>` in the config dump and in logs.
    pub auth_token: Option<Secret>,
    pub cluster_id: String,
    pub pod_name: String,
    pub pod_namespace: String,
    pub instance_ip: Option<IpAddr>,
    /// Extra gRPC metadata on xDS calls (names shown, values `<redacted>`).
    pub xds_headers: BTreeMap<String, Secret>,
    /// Extra gRPC metadata on CA calls (names shown, values `<redacted>`).
    pub ca_headers: BTreeMap<String, Secret>,
    /// Local mode: re-read the config file's workloads, services and policies when it changes.
    pub watch_file: bool,
    /// The DNS proxy (see `crate::dns`): unset means on in in-pod mode, off otherwise.
    pub dns_capture: Option<bool>,
    /// Where the DNS proxy listens, UDP and TCP: in each pod's namespace (in-pod mode), or in
    /// the proxy's own.
    pub dns_proxy_addr: SocketAddr,
    /// Resolvers for names the mesh does not answer and for hostname workloads; empty: the
    /// node's (`/etc/resolv.conf`).
    pub dns_upstreams: Vec<SocketAddr>,
    pub cluster_domain: String,
    /// Among services sharing a hostname in several namespaces, the namespace whose service
    /// answers when the client's own namespace has none.
    pub preferred_service_namespace: Option<String>,
    /// The file this configuration was read from (set by the loader, not written in it).
    #[serde(skip)]
    pub config_file: Option<PathBuf>,
    pub nodes: Vec<Node>,
    pub workloads: Vec<Workload>,
    pub services: Vec<Service>,
    pub policies: Vec<Authorization>,
}

impl Default for Config {
    fn default() -> Self {
        let any = |p| SocketAddr::from(([0, 0, 0, 0], p));
        Config {
            node_name: "local".into(),
            trust_domain: "cluster.local".into(),
            ca_dir: PathBuf::from("/var/lib/mbtunnel/ca"),
            key_algorithm: KeyAlgorithm::EcdsaP256,
            cert_lifetime_secs: 24 * 3600,
            outbound_addr: any(15001),
            inbound_addr: any(15008),
            inbound_plaintext_addr: any(15006),
            metrics_addr: any(15020),
            readiness_addr: any(15021),
            admin_addr: SocketAddr::from(([127, 0, 0, 1], 15000)),
            hbone_port: 15008,
            transparent: true,
            socket_mark: 0x539,
            drain_timeout_secs: 5,
            connect_timeout_ms: 10_000,
            handshake_timeout_ms: 10_000,
            xds_sync_timeout_ms: 5_000,
            max_pending_handshakes: 4096,
            max_pending_handshakes_per_source: 512,
            max_concurrent_handshakes: 0,
            pool_idle_timeout_secs: 300,
            pool_max_streams: 100,
            tls_resumption: true,
            tls_verify_cache: true,
            tls_groups: Vec::new(),
            tls_ciphers: crate::tls::suites::default_order(),
            log_format: LogFormat::Text,
            log_level: "info".into(),
            signer_backend: "auto".into(),
            signer_threads: 0,
            cpu_limit: 0,
            worker_threads: 0,
            signer_max_wait_us: 0,
            signer_queue_limit: 4096,
            signer_scalar_below: None,
            signer_fill_wait_us: None,
            inpod_enabled: false,
            inpod_socket: PathBuf::from("/var/run/ztunnel/ztunnel.sock"),
            ebpf_enabled: false,
            ebpf_uplinks: Vec::new(),
            ebpf_token_file: PathBuf::from(DEFAULT_EBPF_TOKEN_FILE),
            ebpf_fail_closed: true,
            ebpf_pin_dir: PathBuf::from(DEFAULT_EBPF_PIN_DIR),
            xds_address: None,
            ca_address: None,
            xds_root_ca: "./var/run/secrets/istio/root-cert.pem".into(),
            ca_root_ca: "./var/run/secrets/istio/root-cert.pem".into(),
            auth_token_file: PathBuf::from("./var/run/secrets/tokens/istio-token"),
            auth_token: None,
            cluster_id: "Kubernetes".into(),
            pod_name: String::new(),
            pod_namespace: String::new(),
            instance_ip: None,
            xds_headers: BTreeMap::new(),
            ca_headers: BTreeMap::new(),
            watch_file: true,
            dns_capture: None,
            dns_proxy_addr: SocketAddr::from(([127, 0, 0, 1], crate::dns::DNS_PORT)),
            dns_upstreams: Vec::new(),
            cluster_domain: "cluster.local".into(),
            preferred_service_namespace: None,
            config_file: None,
            nodes: Vec::new(),
            workloads: Vec::new(),
            services: Vec::new(),
            policies: Vec::new(),
        }
    }
}

impl Config {
    /// The DNS proxy's settings; `enabled` resolves the default (on in in-pod mode).
    pub fn dns(&self) -> crate::dns::DnsConfig {
        crate::dns::DnsConfig {
            enabled: self.dns_capture.unwrap_or(self.inpod_enabled),
            addr: self.dns_proxy_addr,
            upstreams: self.dns_upstreams.clone(),
            cluster_domain: self.cluster_domain.clone(),
            preferred_namespace: self.preferred_service_namespace.clone(),
            ipv6: true,
        }
    }

    /// Parses YAML text; `path` names the source in errors.
    pub fn from_yaml(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let cfg: Config = serde_yaml::from_str(text)
            .map_err(|e| ConfigError::Parse { path: path.into(), message: e.to_string() })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads and parses a YAML file.
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read { path: path.into(), source })?;
        let mut c = Config::from_yaml(&text, path)?;
        c.config_file = Some(path.to_path_buf());
        Ok(c)
    }

    /// Applies environment overrides (see [`env`]) through `get`.
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        if let Some(v) = get(env::NODE_NAME) {
            self.node_name = v;
        }
        if let Some(v) = get(env::TRUST_DOMAIN) {
            self.trust_domain = v;
        }
        if let Some(v) = get(env::CA_DIR) {
            self.ca_dir = v.into();
        }
        if let Some(v) = get(env::KEY_ALGORITHM) {
            self.key_algorithm = v
                .parse()
                .map_err(|e| ConfigError::Invalid(format!("{}: {e}", env::KEY_ALGORITHM)))?;
        }
        if let Some(v) = get(env::SIGNER_BACKEND) {
            self.signer_backend = v;
        }
        let count = |name: &str, v: String, what: &str| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| ConfigError::Invalid(format!("{name}: '{v}' is not {what}")))
        };
        if let Some(v) = get(env::SIGNER_THREADS) {
            self.signer_threads = count(env::SIGNER_THREADS, v, "a thread count")?;
        }
        if let Some(v) = get(env::CPU_LIMIT) {
            self.cpu_limit = count(env::CPU_LIMIT, v, "a whole number of CPUs")?;
        }
        if let Some(v) = get(env::WORKER_THREADS) {
            self.worker_threads = count(env::WORKER_THREADS, v, "a thread count")?;
        }
        let flag = |name: &str, v: String| match v.trim() {
            "true" | "1" => Ok(true),
            "false" | "0" | "" => Ok(false),
            _ => Err(ConfigError::Invalid(format!("{name}: '{v}' is not true or false"))),
        };
        if let Some(v) = get(env::INPOD_ENABLED) {
            self.inpod_enabled = flag(env::INPOD_ENABLED, v)?;
        }
        if let Some(v) = get(env::EBPF_ENABLED) {
            self.ebpf_enabled = flag(env::EBPF_ENABLED, v)?;
        }
        if let Some(v) = get(env::EBPF_FAIL_CLOSED) {
            self.ebpf_fail_closed = flag(env::EBPF_FAIL_CLOSED, v)?;
        }
        if let Some(v) = get(env::EBPF_UPLINKS) {
            self.ebpf_uplinks =
                v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect();
        }
        for name in [env::META_DNS_CAPTURE, env::DNS_CAPTURE] {
            if let Some(v) = get(name) {
                self.dns_capture = Some(flag(name, v.to_lowercase())?);
            }
        }
        for name in [env::META_DNS_PROXY_ADDR, env::DNS_PROXY_ADDR] {
            if let Some(v) = get(name).filter(|v| !v.trim().is_empty()) {
                self.dns_proxy_addr = v.trim().parse().map_err(|_| {
                    ConfigError::Invalid(format!("{name}: '{v}' is not an ip:port address"))
                })?;
            }
        }
        if let Some(v) = get(env::DNS_UPSTREAMS) {
            self.dns_upstreams = v
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| {
                    s.parse().map_err(|_| {
                        ConfigError::Invalid(format!(
                            "{}: '{s}' is not an ip:port address",
                            env::DNS_UPSTREAMS
                        ))
                    })
                })
                .collect::<Result<_, _>>()?;
        }
        if let Some(v) = get(env::CLUSTER_DOMAIN).filter(|v| !v.trim().is_empty()) {
            self.cluster_domain = v.trim().to_string();
        }
        if let Some(v) = get(env::PREFERED_SERVICE_NAMESPACE) {
            self.preferred_service_namespace = Some(v).filter(|v| !v.trim().is_empty());
        }
        if let Some(v) = get(env::INPOD_UDS) {
            self.inpod_socket = v.into();
        }
        let nonempty = |v: String| Some(v).filter(|v| !v.trim().is_empty());
        if let Some(v) = get(env::XDS_ADDRESS).and_then(nonempty) {
            self.xds_address = Some(v);
        }
        if let Some(v) = get(env::CA_ADDRESS).and_then(nonempty) {
            self.ca_address = Some(v);
        }
        if let Some(v) = get(env::XDS_ROOT_CA).and_then(nonempty) {
            self.xds_root_ca = v;
        }
        if let Some(v) = get(env::CA_ROOT_CA).and_then(nonempty) {
            self.ca_root_ca = v;
        }
        // As ztunnel reads it: a path when that file exists (re-read at every call, since
        // projected tokens rotate), else the token itself.
        if let Some(v) = get(env::AUTH_TOKEN).and_then(nonempty) {
            if Path::new(&v).exists() {
                self.auth_token_file = v.into();
                self.auth_token = None;
            } else {
                self.auth_token = Some(Secret(v));
            }
        }
        if let Some(v) = get(env::AUTH_TOKEN_FILE).and_then(nonempty) {
            self.auth_token_file = v.into();
        }
        if let Some(v) = get(env::CLUSTER_ID).and_then(nonempty) {
            self.cluster_id = v;
        }
        if let Some(v) = get(env::XDS_SYNC_TIMEOUT_MS).and_then(nonempty) {
            self.xds_sync_timeout_ms = v.trim().parse().map_err(|_| {
                ConfigError::Invalid(format!(
                    "{}: '{v}' is not a number of milliseconds",
                    env::XDS_SYNC_TIMEOUT_MS
                ))
            })?;
        }
        if let Some(v) = get(env::SECRET_TTL).and_then(nonempty) {
            self.cert_lifetime_secs = parse_duration(&v)
                .map_err(|e| ConfigError::Invalid(format!("{}: {e}", env::SECRET_TTL)))?
                .as_secs();
        }
        if let Some(v) = get(env::POD_NAME) {
            self.pod_name = v;
        }
        if let Some(v) = get(env::POD_NAMESPACE) {
            self.pod_namespace = v;
        }
        if let Some(v) = get(env::INSTANCE_IP).and_then(nonempty) {
            // Several IPs may be given comma-separated; the first names the node.
            let first = v.split(',').next().unwrap_or_default().trim();
            self.instance_ip = Some(first.parse().map_err(|_| {
                ConfigError::Invalid(format!("{}: '{v}' is not an IP address", env::INSTANCE_IP))
            })?);
        }
        for name in [env::ISTIO_LOG_FORMAT, env::LOG_FORMAT] {
            if let Some(v) = get(name) {
                self.log_format =
                    v.parse().map_err(|e| ConfigError::Invalid(format!("{name}: {e}")))?;
            }
        }
        self.validate()
    }

    /// Applies `XDS_HEADER_<k>` / `CA_HEADER_<k>` variables from `vars`.
    pub fn apply_header_env(&mut self, vars: impl Iterator<Item = (String, String)>) {
        for (k, v) in vars {
            if let Some(h) = k.strip_prefix(env::XDS_HEADER_PREFIX) {
                self.xds_headers.insert(h.to_ascii_lowercase(), Secret(v));
            } else if let Some(h) = k.strip_prefix(env::CA_HEADER_PREFIX) {
                self.ca_headers.insert(h.to_ascii_lowercase(), Secret(v));
            }
        }
    }

    /// The CA endpoint in use: `ca_address`, else `xds_address`.
    pub fn effective_ca_address(&self) -> Option<&str> {
        self.ca_address.as_deref().or(self.xds_address.as_deref())
    }

    /// A bearer token is configured: the fixed one, or a token file that exists.
    pub fn has_token(&self) -> bool {
        self.auth_token.is_some() || self.auth_token_file.exists()
    }

    /// Why the settings would send the bearer token in clear: a control-plane address is
    /// plaintext (`http://`) while a token is configured. Plaintext without a token is allowed
    /// (local development); the calls then carry no `authorization`.
    pub fn plaintext_token_error(&self) -> Option<String> {
        let ca = self.ca_address.as_ref().map(|a| ("ca_address", a));
        let xds = self.xds_address.as_ref().map(|a| ("xds_address", a));
        let (name, addr) = xds.into_iter().chain(ca).find(|(_, a)| is_plaintext(a))?;
        if !self.has_token() {
            return None;
        }
        let token = match &self.auth_token {
            Some(_) => "the fixed token (AUTH_TOKEN)".to_string(),
            None => format!("the token in {}", self.auth_token_file.display()),
        };
        Some(format!(
            "{name} '{addr}' is plaintext (http://) and {token} would be sent in clear: use \
             https://, or remove the token for a local control plane without authentication"
        ))
    }

    /// What the mesh-state store needs from the configuration.
    pub fn store_config(&self) -> StoreConfig {
        StoreConfig {
            trust_domain: self.trust_domain.clone(),
            node_name: self.node_name.clone(),
            hbone_port: self.hbone_port,
            node_hbone: self.nodes.iter().map(|n| (n.name.clone(), n.hbone_addr)).collect(),
            inpod: self.inpod_enabled,
            sync_timeout: self
                .xds_address
                .is_some()
                .then(|| Duration::from_millis(self.xds_sync_timeout_ms)),
        }
    }

    /// Whole CPUs the proxy may use: `cpu_limit`, else the detected quota.
    pub fn cpus(&self) -> usize {
        match self.cpu_limit {
            0 => std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            n => n,
        }
    }

    /// Connection worker threads: `worker_threads`, else one per CPU of [`cpus`].
    ///
    /// [`cpus`]: Config::cpus
    pub fn runtime_workers(&self) -> usize {
        match self.worker_threads {
            0 => self.cpus(),
            n => n,
        }
    }

    /// The connection-path limits this configuration sets.
    pub fn limits(&self) -> crate::net::Limits {
        let cpus = self.cpus();
        crate::net::Limits {
            dial_timeout: Duration::from_millis(self.connect_timeout_ms),
            handshake_timeout: Duration::from_millis(self.handshake_timeout_ms),
            max_pending_handshakes: self.max_pending_handshakes,
            max_pending_handshakes_per_source: self.max_pending_handshakes_per_source,
            max_concurrent_handshakes: match self.max_concurrent_handshakes {
                0 => 32 * cpus.max(1),
                n => n,
            },
            pool_idle_timeout: Duration::from_secs(self.pool_idle_timeout_secs),
            pool_max_streams: self.pool_max_streams,
        }
    }

    /// Cross-field checks.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.node_name.is_empty() {
            return bad("node_name is empty".into());
        }
        if self.trust_domain.is_empty()
            || format!("spiffe://{}/ns/a/sa/b", self.trust_domain).parse::<Identity>().is_err()
        {
            return bad(format!(
                "trust_domain '{}' is not a valid SPIFFE trust domain",
                self.trust_domain
            ));
        }
        if self.cert_lifetime_secs < 60 {
            return bad(format!(
                "cert_lifetime_secs {} is below the minimum of 60",
                self.cert_lifetime_secs
            ));
        }
        if self.inpod_enabled && self.inpod_socket.as_os_str().is_empty() {
            return bad("inpod_socket is empty".into());
        }
        if self.ebpf_enabled && self.inpod_enabled {
            return bad("ebpf_enabled and inpod_enabled are two redirect modes: choose one".into());
        }
        if let Err(e) = crate::dns::names::Domains::new(&self.cluster_domain) {
            return bad(e);
        }
        if !self.ebpf_enabled && !self.ebpf_uplinks.is_empty() {
            return bad("ebpf_uplinks is set but ebpf_enabled is false".into());
        }
        for (name, v) in [
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("handshake_timeout_ms", self.handshake_timeout_ms),
            ("xds_sync_timeout_ms", self.xds_sync_timeout_ms),
            ("pool_idle_timeout_secs", self.pool_idle_timeout_secs),
            ("max_pending_handshakes", self.max_pending_handshakes as u64),
            ("max_pending_handshakes_per_source", self.max_pending_handshakes_per_source as u64),
        ] {
            if v == 0 {
                return bad(format!("{name} must be at least 1"));
            }
        }
        if !(1..=100).contains(&self.pool_max_streams) {
            return bad(format!(
                "pool_max_streams {} is outside 1..=100 (HBONE servers allow 100 streams)",
                self.pool_max_streams
            ));
        }
        if let Err(e) = crate::tls::suites::ids(&self.tls_ciphers) {
            return bad(format!("tls_ciphers: {e}"));
        }
        if let Some(g) = self.tls_groups.iter().find(|g| !crate::tls::GROUPS.contains(&g.as_str()))
        {
            return bad(format!(
                "tls_groups: unknown group '{g}' (known: {})",
                crate::tls::GROUPS.join(", ")
            ));
        }
        if self.signer_queue_limit == 0 {
            return bad("signer_queue_limit must be at least 1".into());
        }
        if let Some(k) = self.signer_scalar_below.filter(|k| *k > BATCH_LANES) {
            return bad(format!("signer_scalar_below {k} exceeds the batch size 8"));
        }
        if self.xds_address.is_some()
            && !(self.workloads.is_empty() && self.services.is_empty() && self.policies.is_empty())
        {
            return bad(
                "xds_address is set: workloads, services and policies come from the \
                 control plane, so the file must not list any (remove them, or unset xds_address)"
                    .into(),
            );
        }
        for (name, v) in [("xds_address", &self.xds_address), ("ca_address", &self.ca_address)] {
            if let Some(a) = v {
                if !(a.starts_with("https://") || a.starts_with("http://")) {
                    return bad(format!(
                        "{name} '{a}' must be a URL such as https://istiod.istio-system.svc:15012"
                    ));
                }
            }
        }
        if let Some(e) = self.plaintext_token_error() {
            return bad(e);
        }
        let mut uids = std::collections::HashSet::new();
        let mut ips = BTreeMap::new();
        for w in &self.workloads {
            if !uids.insert(&w.uid) {
                return bad(format!("workload uid '{}' appears twice", w.uid));
            }
            w.validate(&self.trust_domain).map_err(ConfigError::Invalid)?;
            for ip in &w.ips {
                if let Some(other) = ips.insert(*ip, &w.uid) {
                    return bad(format!("ip {ip} belongs to workloads '{other}' and '{}'", w.uid));
                }
            }
        }
        let mut pols = std::collections::HashSet::new();
        for p in &self.policies {
            if !pols.insert(p.key()) {
                return bad(format!("policy '{}' appears twice", p.key()));
            }
        }
        for s in &self.services {
            for uid in &s.workloads {
                if !uids.contains(uid) {
                    return bad(format!(
                        "service '{}/{}' names unknown workload '{uid}'",
                        s.namespace, s.name
                    ));
                }
            }
            if s.ports.is_empty() {
                return bad(format!("service '{}/{}' has no ports", s.namespace, s.name));
            }
        }
        Ok(())
    }
}

/// A control-plane address without TLS.
pub fn is_plaintext(address: &str) -> bool {
    address.get(..7).is_some_and(|s| s.eq_ignore_ascii_case("http://"))
}

/// Parses a duration as Go and Istio write them: `24h`, `90m`, `1h30m`, `3600s`, or a bare
/// number of seconds.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let t = s.trim();
    if let Ok(n) = t.parse::<u64>() {
        return Ok(std::time::Duration::from_secs(n));
    }
    let mut total = 0u64;
    let mut num = String::new();
    for c in t.chars() {
        if c.is_ascii_digit() {
            num.push(c);
            continue;
        }
        let unit = match c {
            'h' => 3600,
            'm' => 60,
            's' => 1,
            _ => return Err(format!("'{s}' is not a duration such as 24h, 90m or 3600s")),
        };
        let n: u64 = num.parse().map_err(|_| format!("'{s}' is not a duration such as 24h"))?;
        total = total.saturating_add(n.saturating_mul(unit));
        num.clear();
    }
    if !num.is_empty() || total == 0 {
        return Err(format!("'{s}' is not a positive duration such as 24h, 90m or 3600s"));
    }
    Ok(std::time::Duration::from_secs(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_mirrored_from_other_modules_agree() {
        assert_eq!(env::SIGNER_BACKEND, crate::mb::BACKEND_ENV);
        assert_eq!(BATCH_LANES, crate::mb::LANES);
        assert_eq!(DEFAULT_EBPF_TOKEN_FILE, crate::redirect::ebpf::DEFAULT_TOKEN_FILE);
    }

    #[test]
    fn secrets_are_redacted_in_serialisation_and_debug() {
        let mut c = Config::default();
        c.apply_env(|k| (k == env::AUTH_TOKEN).then(|| "tok-8f3a1c".to_string())).unwrap();
        c.apply_header_env(
            [
                ("XDS_HEADER_X-Tenant".to_string(), "hv-x-51d2".to_string()),
                ("CA_HEADER_X-Key".to_string(), "hv-c-77e0".to_string()),
            ]
            .into_iter(),
        );
        assert_eq!(c.auth_token.as_ref().map(Secret::expose), Some("tok-8f3a1c"));
        let json = serde_json::to_string(&c).unwrap();
        let debug = format!("{c:?}");
        for shown in [&json, &debug] {
            for secret in ["tok-8f3a1c", "hv-x-51d2", "hv-c-77e0"] {
                assert!(!shown.contains(secret), "{secret} shown: {shown}");
            }
            assert!(shown.contains("x-tenant") && shown.contains("x-key"), "names stay: {shown}");
            assert!(shown.contains(REDACTED), "{shown}");
        }
        // The file form still reads a token as written.
        let c = Config::from_yaml(
            "auth_token: abc
xds_headers: {k: v}
",
            Path::new("t.yaml"),
        );
        let c = c.unwrap();
        assert_eq!((c.auth_token.unwrap().expose(), c.xds_headers["k"].expose()), ("abc", "v"));
    }

    fn temp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("mbtunnel-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn auth_token_naming_an_existing_file_is_read_from_it_at_every_call() {
        let dir = temp_dir("token-file");
        let path = dir.join("istio-token");
        std::fs::write(&path, "jwt-first").unwrap();
        let mut c = Config::default();
        let p = path.to_str().unwrap().to_string();
        c.apply_env(|k| (k == env::AUTH_TOKEN).then(|| p.clone())).unwrap();
        assert!(c.auth_token.is_none(), "the path is not the token");
        assert_eq!(c.auth_token_file, path);
        let ep = |c: &Config| crate::grpc::TokenSource::File(c.auth_token_file.clone());
        assert_eq!(ep(&c).read().unwrap().as_deref(), Some("jwt-first"));
        // Projected tokens rotate: the next call reads the new one.
        std::fs::write(&path, "jwt-second").unwrap();
        assert_eq!(ep(&c).read().unwrap().as_deref(), Some("jwt-second"));
        // As ztunnel: an empty token file is an error, not a call without a token.
        std::fs::write(&path, "").unwrap();
        assert!(ep(&c).read().unwrap_err().contains("empty"));
        // A value that names no file is the token itself.
        let missing = dir.join("absent").to_str().unwrap().to_string();
        let mut c = Config::default();
        c.apply_env(|k| (k == env::AUTH_TOKEN).then(|| missing.clone())).unwrap();
        assert_eq!(c.auth_token.as_ref().map(Secret::expose), Some(missing.as_str()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_token_with_a_plaintext_control_plane_is_refused() {
        let dir = temp_dir("token-plaintext");
        let file = dir.join("istio-token");
        let base = || Config { auth_token_file: dir.join("not-mounted"), ..Config::default() };
        // Plaintext without a token: local development, allowed.
        let c = Config { xds_address: Some("http://127.0.0.1:15010".into()), ..base() };
        assert_eq!(c.plaintext_token_error(), None);
        c.validate().unwrap();
        // A fixed token over plaintext, for xDS or for the CA alone.
        for (xds, ca) in [
            (Some("http://127.0.0.1:15010"), None),
            (Some("https://istiod:15012"), Some("http://127.0.0.1:15010")),
            (None, Some("http://127.0.0.1:15010")),
        ] {
            let c = Config {
                xds_address: xds.map(String::from),
                ca_address: ca.map(String::from),
                auth_token: Some(Secret::new("tok-5e1d")),
                ..base()
            };
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("plaintext") && e.contains("AUTH_TOKEN"), "{e}");
            assert!(!e.contains("tok-5e1d"), "the token is not shown: {e}");
        }
        // A token file that exists counts as a token too.
        std::fs::write(&file, "jwt").unwrap();
        let c = Config {
            xds_address: Some("http://127.0.0.1:15010".into()),
            auth_token_file: file.clone(),
            ..Config::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains(&file.display().to_string()), "{e}");
        // TLS with a token is the normal case.
        let c = Config { xds_address: Some("https://istiod:15012".into()), ..c };
        c.validate().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn control_plane_settings_from_env() {
        let mut c = Config::default();
        c.apply_env(|k| match k {
            env::XDS_ADDRESS => Some("https://istiod.istio-system.svc:15012".into()),
            env::SECRET_TTL => Some("1h30m".into()),
            env::INSTANCE_IP => Some("10.0.0.7,fd00::7".into()),
            env::CLUSTER_ID => Some("c1".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(c.effective_ca_address(), Some("https://istiod.istio-system.svc:15012"));
        assert_eq!(c.cert_lifetime_secs, 5400);
        assert_eq!(c.instance_ip, Some("10.0.0.7".parse().unwrap()));
        assert_eq!(c.cluster_id, "c1");
        c.apply_header_env([("XDS_HEADER_X-Tenant".to_string(), "t1".to_string())].into_iter());
        assert_eq!(c.xds_headers["x-tenant"].expose(), "t1");
        let e = c.apply_env(|k| (k == env::SECRET_TTL).then(|| "soon".into())).unwrap_err();
        assert!(e.to_string().contains("SECRET_TTL"), "{e}");
        let e = Config::from_yaml(
            "xds_address: https://x:15012\nworkloads: [{uid: a, name: a, ips: [1.1.1.1], node: n}]\n",
            Path::new("t.yaml"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("must not list"), "{e}");
        let e = Config::from_yaml("xds_address: istiod:15012\n", Path::new("t.yaml")).unwrap_err();
        assert!(e.to_string().contains("URL"), "{e}");
    }

    const GOOD: &str = r#"
node_name: node-a
trust_domain: cluster.local
key_algorithm: rsa-2048
workloads:
  - uid: a1
    name: client
    namespace: demo
    service_account: client
    ips: [127.0.0.2]
    node: node-a
  - uid: b1
    name: echo
    ips: ["10.0.0.3"]
    node: node-b
    protocol: TCP
services:
  - name: echo
    hostname: echo.default.svc.cluster.local
    vips: [10.96.0.10]
    ports: [{port: 80, target_port: 8080}]
    workloads: [b1]
nodes:
  - name: node-b
    hbone_addr: 127.0.0.3:15008
"#;

    #[test]
    fn parses_good_file() {
        let c = Config::from_yaml(GOOD, Path::new("good.yaml")).unwrap();
        assert_eq!(c.node_name, "node-a");
        assert_eq!(c.key_algorithm, KeyAlgorithm::Rsa2048);
        assert_eq!(c.workloads.len(), 2);
        assert_eq!(c.workloads[1].namespace, "default");
        assert_eq!(c.workloads[1].protocol, Protocol::Tcp);
        assert_eq!(c.services[0].ports[0].target_port, Some(8080));
        assert_eq!(c.outbound_addr.port(), 15001, "defaults fill the rest");
        assert_eq!(
            c.workloads[0].identity(&c.trust_domain).to_string(),
            "spiffe://cluster.local/ns/demo/sa/client"
        );
    }

    #[test]
    fn unknown_field_is_named() {
        let e = Config::from_yaml("node_name: a\nnode_nmae: b\n", Path::new("x.yaml")).unwrap_err();
        let s = e.to_string();
        assert!(s.contains("x.yaml") && s.contains("node_nmae"), "{s}");
        let e = Config::from_yaml(
            "workloads: [{uid: a, name: a, ips: [1.2.3.4], node: n, colour: red}]\n",
            Path::new("y.yaml"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("colour") && e.contains("y.yaml"), "{e}");
    }

    #[test]
    fn tls_groups_are_checked_by_name() {
        let c =
            Config::from_yaml("node_name: a\ntls_groups: [X25519, P-256]\n", Path::new("g.yaml"))
                .unwrap();
        assert_eq!(c.tls_groups, ["X25519", "P-256"]);
        assert!(c.tls_resumption, "resumption is on by default");
        assert!(c.tls_verify_cache, "the chain cache is on by default");
        assert_eq!(c.tls_ciphers[0], "TLS_AES_128_GCM_SHA256", "AES-128 first by default");
        let e = Config::from_yaml(
            "node_name: a\ntls_ciphers: [TLS_RSA_WITH_RC4]\n",
            Path::new("c.yaml"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("TLS_RSA_WITH_RC4") && e.contains("TLS_AES_256_GCM_SHA384"), "{e}");
        let e = Config::from_yaml("node_name: a\ntls_groups: [X448]\n", Path::new("g.yaml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("X448") && e.contains("X25519MLKEM768"), "{e}");
    }

    #[test]
    fn missing_file_and_bad_yaml_name_the_file() {
        let e = Config::from_file(Path::new("/nonexistent/mbt.yaml")).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/mbt.yaml") && e.contains("cannot read"), "{e}");
        let e = Config::from_yaml("workloads: [", Path::new("bad.yaml")).unwrap_err().to_string();
        assert!(e.contains("bad.yaml") && e.contains("invalid config file"), "{e}");
    }

    #[test]
    fn bad_values() {
        for (yaml, want) in [
            ("key_algorithm: rsa-1024\n", "rsa-1024"),
            ("trust_domain: 'Bad Domain'\n", "trust_domain"),
            ("workloads: [{uid: a, name: a, ips: [], node: n}]\n", "no ips"),
            ("workloads: [{uid: a, name: a, ips: [1.1.1.1], node: n}, {uid: a, name: b, ips: [1.1.1.2], node: n}]\n", "twice"),
            ("workloads: [{uid: a, name: a, ips: [1.1.1.1], node: n}, {uid: b, name: b, ips: [1.1.1.1], node: n}]\n", "1.1.1.1"),
            ("services: [{name: s, ports: [{port: 1}], workloads: [zz]}]\n", "zz"),
            ("outbound_addr: not-an-addr\n", "outbound_addr"),
        ] {
            let e = Config::from_yaml(yaml, Path::new("t.yaml")).unwrap_err().to_string();
            assert!(e.contains(want), "{yaml}: {e}");
        }
    }

    #[test]
    fn env_overrides() {
        let mut c = Config::default();
        c.apply_env(|k| match k {
            env::NODE_NAME => Some("n9".into()),
            env::KEY_ALGORITHM => Some("rsa-4096".into()),
            env::LOG_FORMAT => Some("json".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(
            (c.node_name.as_str(), c.key_algorithm, c.log_format),
            ("n9", KeyAlgorithm::Rsa4096, LogFormat::Json)
        );
        let e = c.apply_env(|k| (k == env::LOG_FORMAT).then(|| "xml".into())).unwrap_err();
        assert!(e.to_string().contains("xml"));
        let mut c = Config::default();
        assert!(!c.inpod_enabled);
        c.apply_env(|k| match k {
            env::INPOD_ENABLED => Some("true".into()),
            env::INPOD_UDS => Some("/tmp/zds.sock".into()),
            _ => None,
        })
        .unwrap();
        assert!(c.inpod_enabled && c.inpod_socket == Path::new("/tmp/zds.sock"));
        let e = c.apply_env(|k| (k == env::INPOD_ENABLED).then(|| "maybe".into())).unwrap_err();
        assert!(e.to_string().contains("INPOD_ENABLED"), "{e}");
    }

    #[test]
    fn ebpf_mode_from_env_and_its_checks() {
        let mut c = Config::default();
        c.apply_env(|k| match k {
            env::EBPF_ENABLED => Some("1".into()),
            env::EBPF_UPLINKS => Some("eth0, ens5".into()),
            _ => None,
        })
        .unwrap();
        assert!(c.ebpf_enabled);
        assert_eq!(c.ebpf_uplinks, ["eth0", "ens5"]);
        let e = c.apply_env(|k| (k == env::INPOD_ENABLED).then(|| "true".into())).unwrap_err();
        assert!(e.to_string().contains("choose one"), "{e}");
        let e = Config::from_yaml("ebpf_uplinks: [eth0]\n", Path::new("t.yaml")).unwrap_err();
        assert!(e.to_string().contains("ebpf_enabled is false"), "{e}");
    }
}

#[cfg(test)]
mod signer_settings_tests {
    use super::*;

    #[test]
    fn signer_sizing_and_fill_settings_parse_from_file_and_env() {
        let text =
            "signer_threads: 0\ncpu_limit: 4\nsigner_max_wait_us: 0\nsigner_fill_wait_us: 0\n";
        let mut cfg = Config::from_yaml(text, Path::new("t.yaml")).unwrap();
        assert_eq!((cfg.cpu_limit, cfg.signer_fill_wait_us), (4, Some(0)));
        cfg.apply_env(|k| (k == env::CPU_LIMIT).then(|| " 2 ".to_string())).unwrap();
        assert_eq!(cfg.cpu_limit, 2);
        let e = cfg.apply_env(|k| (k == env::CPU_LIMIT).then(|| "1500m".to_string()));
        assert!(e.unwrap_err().to_string().contains(env::CPU_LIMIT));
        let unset = Config::from_yaml("node_name: n\n", Path::new("t.yaml")).unwrap();
        assert_eq!((unset.cpu_limit, unset.signer_fill_wait_us), (0, None));
    }

    #[test]
    fn worker_threads_follow_the_cpu_limit_unless_set() {
        let mut cfg = Config::from_yaml("cpu_limit: 3\n", Path::new("t.yaml")).unwrap();
        assert_eq!(cfg.runtime_workers(), 3, "0 = one per CPU of cpu_limit");
        cfg.apply_env(|k| (k == env::WORKER_THREADS).then(|| "1".to_string())).unwrap();
        assert_eq!(cfg.runtime_workers(), 1);
        let set = Config::from_yaml("cpu_limit: 3\nworker_threads: 2\n", Path::new("t.yaml"));
        assert_eq!(set.unwrap().runtime_workers(), 2);
        let e = cfg.apply_env(|k| (k == env::WORKER_THREADS).then(|| "two".to_string()));
        assert!(e.unwrap_err().to_string().contains(env::WORKER_THREADS));
        let detected = Config::from_yaml("node_name: n\n", Path::new("t.yaml")).unwrap();
        let quota = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        assert_eq!(detected.runtime_workers(), quota);
    }
}
