//! Wiring: builds the state, CA, signer, TLS, pool and listeners from a [`Config`], serves the
//! HTTP endpoints, and drains on shutdown.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use http::StatusCode;
use prometheus_client::registry::Registry;
use serde_json::json;

use crate::admin::{self, text, LogControl};
use crate::config::Config;
use crate::grpc::{Endpoints, TokenSource};
use crate::hbone::Pool;
use crate::identity::ca::DevCa;
use crate::identity::istio::IstioCa;
use crate::identity::source::{CertSource, DevCaSource};
use crate::identity::store::{humantime, CertStore};
use crate::inpod::InPod;
use crate::metrics::Metrics;
use crate::proxy::{self, socket, Ctx, Drain};
use crate::redirect::ebpf::{EbpfRedirect, Listeners, RedirectMetrics, Role};
use crate::signer::{Signer, SignerConfig};
use crate::state::{local_resources, replace_delta, State};
use crate::tls::TlsProvider;
use crate::xds::{NodeInfo, XdsMetrics};

/// Addresses actually bound (ports may be 0 in the config).
#[derive(Clone, Copy, Debug)]
pub struct Bound {
    pub outbound: SocketAddr,
    pub inbound: SocketAddr,
    pub inbound_plaintext: SocketAddr,
    pub metrics: SocketAddr,
    pub readiness: SocketAddr,
    pub admin: SocketAddr,
}

/// A running node proxy.
pub struct Running {
    pub bound: Bound,
    pub signer: Signer,
    pub ctx: Arc<Ctx>,
    pub store: Arc<CertStore>,
    /// In-pod mode: the pods enrolled by the CNI.
    pub inpod: Option<Arc<InPod>>,
    /// eBPF redirect mode: the loaded classifiers (detached when the last reference drops).
    pub ebpf: Option<Arc<EbpfRedirect>>,
    /// The xDS client, when a control plane is configured.
    pub xds: Option<Arc<crate::xds::Client>>,
    registry: Arc<Registry>,
    /// Certificates held for every local workload (at least once).
    certs_ready: tokio::sync::watch::Receiver<bool>,
    /// One xDS response of each type applied (true without a control plane).
    xds_ready: tokio::sync::watch::Receiver<bool>,
    /// False in in-pod mode until the CNI's first snapshot is applied; true otherwise.
    zds_ready: Arc<AtomicBool>,
    drain_timeout: Duration,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

fn bind(
    name: &str,
    addr: SocketAddr,
    transparent: bool,
) -> anyhow::Result<tokio::net::TcpListener> {
    socket::listen(addr, transparent).with_context(|| format!("cannot listen for {name} on {addr}"))
}

/// Starts a node proxy. Returns once listeners are bound; readiness turns true when the
/// certificates of every local workload are issued.
pub async fn start(cfg: Config, log: Option<LogControl>) -> anyhow::Result<Running> {
    let backend = crate::mb::init_backend(Some(&cfg.signer_backend))
        .map_err(|e| anyhow::anyhow!("signer_backend: {e}"))?;
    tracing::info!(backend = %backend.backend, cpu_features = %backend.features, reason = %backend.reason,
        "signer backend chosen");
    let state = Arc::new(State::new(cfg.store_config()));
    if cfg.xds_address.is_none() {
        state.apply(replace_delta(
            &state,
            local_resources(&cfg.workloads, &cfg.services, &cfg.policies),
        ));
    }
    let source: Arc<dyn CertSource> = match cfg.effective_ca_address() {
        Some(addr) => {
            let roots = crate::grpc::load_roots(&cfg.ca_root_ca)
                .map_err(|e| anyhow::anyhow!("CA_ROOT_CA: {e}"))?;
            let ep = Endpoints {
                address: addr.to_string(),
                roots_pem: roots,
                token: token_source(&cfg),
                cluster_id: cfg.cluster_id.clone(),
                headers: cfg.ca_headers.clone(),
            };
            Arc::new(
                IstioCa::new(ep, cfg.key_algorithm, Duration::from_secs(cfg.cert_lifetime_secs))
                    .map_err(|e| anyhow::anyhow!("CA_ADDRESS: {e}"))?,
            )
        }
        None => {
            let ca_dir = cfg.ca_dir.clone();
            let td = cfg.trust_domain.clone();
            let ca = tokio::task::spawn_blocking(move || DevCa::load_or_create(&ca_dir, &td))
                .await?
                .context("development CA")?;
            Arc::new(DevCaSource::new(
                ca,
                cfg.key_algorithm,
                Duration::from_secs(cfg.cert_lifetime_secs),
            ))
        }
    };
    tracing::info!(source = %source.describe(), holds_ca_key = source.holds_ca_key(),
        "workload certificates come from here");
    let store = Arc::new(CertStore::with_source(source));
    let mut registry = Registry::default();
    let metrics = Arc::new(Metrics::new(&mut registry));
    let redirect_mode = match (cfg.ebpf_enabled, cfg.inpod_enabled) {
        (true, _) => "ebpf",
        (_, true) => "inpod",
        _ => "external",
    };
    let redirect_metrics = RedirectMetrics::register(&mut registry, redirect_mode);
    let xds = match &cfg.xds_address {
        Some(addr) => {
            let roots = crate::grpc::load_roots(&cfg.xds_root_ca)
                .map_err(|e| anyhow::anyhow!("XDS_ROOT_CA: {e}"))?;
            let ep = Endpoints {
                address: addr.clone(),
                roots_pem: roots,
                token: token_source(&cfg),
                cluster_id: cfg.cluster_id.clone(),
                headers: cfg.xds_headers.clone(),
            };
            let node = NodeInfo {
                pod_name: cfg.pod_name.clone(),
                pod_namespace: cfg.pod_namespace.clone(),
                instance_ip: cfg.instance_ip.map(|i| i.to_string()).unwrap_or_default(),
                node_name: cfg.node_name.clone(),
                cluster_id: cfg.cluster_id.clone(),
            };
            let m = XdsMetrics::register(&mut registry);
            Some(Arc::new(crate::xds::Client::new(ep, node, state.clone(), m)))
        }
        None => None,
    };
    // The eBPF redirect hands connections to the listeners without NAT: they must accept
    // non-local destinations and answer from them.
    let transparent = cfg.transparent || cfg.ebpf_enabled;
    let signer = Signer::start(SignerConfig {
        threads: cfg.signer_threads,
        cpus: cfg.cpu_limit,
        max_wait: Duration::from_micros(cfg.signer_max_wait_us),
        queue_limit: cfg.signer_queue_limit,
        scalar_below: cfg.signer_scalar_below,
        backend: backend.backend,
        fill_wait: cfg.signer_fill_wait_us.map(Duration::from_micros),
    });
    signer.metrics().register(&mut registry, backend);
    tracing::info!(
        threads = signer.config().thread_count(),
        max_wait_us = cfg.signer_max_wait_us,
        queue_limit = cfg.signer_queue_limit,
        scalar_below = ?cfg.signer_scalar_below,
        fill_wait_us = ?cfg.signer_fill_wait_us,
        "signer started"
    );
    let tls = Arc::new(TlsProvider::new(
        store.clone(),
        signer.clone(),
        cfg.trust_domain.clone(),
        metrics.clone(),
    ));
    let pool = Arc::new(Pool::new(tls.clone(), metrics.clone(), cfg.socket_mark, transparent));

    let out_l = bind("outbound", cfg.outbound_addr, transparent)?;
    let in_l = bind("inbound HBONE", cfg.inbound_addr, transparent)?;
    let pt_l = bind("inbound plaintext", cfg.inbound_plaintext_addr, transparent)?;
    let ebpf = if cfg.ebpf_enabled {
        for (name, l) in
            [("outbound", &out_l), ("inbound HBONE", &in_l), ("inbound plaintext", &pt_l)]
        {
            if !socket::is_transparent(l) {
                anyhow::bail!(
                    "eBPF redirect: the {name} listener could not be made IP_TRANSPARENT \
                     (needs CAP_NET_ADMIN); without it redirected connections cannot be answered"
                );
            }
        }
        let e = EbpfRedirect::load(
            Listeners { outbound: &out_l, hbone: &in_l, plaintext: &pt_l },
            cfg.hbone_port,
            redirect_metrics.clone(),
        )?;
        for u in &cfg.ebpf_uplinks {
            e.attach(u, Role::Uplink)?;
        }
        Some(Arc::new(e))
    } else {
        None
    };
    let ebpf_token = match &ebpf {
        Some(_) => Some(Arc::new(
            crate::redirect::ebpf::write_token(&cfg.ebpf_token_file).with_context(|| {
                format!(
                    "eBPF redirect: cannot write the admin token to {}",
                    cfg.ebpf_token_file.display()
                )
            })?,
        )),
        None => None,
    };
    let metrics_l = bind("metrics", cfg.metrics_addr, false)?;
    let ready_l = bind("readiness", cfg.readiness_addr, false)?;
    let admin_l = bind("admin", cfg.admin_addr, false)?;
    let bound = Bound {
        outbound: out_l.local_addr()?,
        inbound: in_l.local_addr()?,
        inbound_plaintext: pt_l.local_addr()?,
        metrics: metrics_l.local_addr()?,
        readiness: ready_l.local_addr()?,
        admin: admin_l.local_addr()?,
    };
    let drain = Drain::default();
    let ctx = Arc::new(Ctx {
        state: state.clone(),
        tls,
        pool,
        metrics,
        drain: drain.clone(),
        mark: cfg.socket_mark,
        transparent,
        own_addrs: vec![bound.outbound, bound.inbound, bound.inbound_plaintext],
    });
    if ebpf.is_some() {
        // HBONE to a pod of this node stays in the process: dialled, it would leave the node's
        // namespace toward the pod, where no classifier sees it and nothing listens on 15008.
        let weak = Arc::downgrade(&ctx);
        ctx.pool.set_local_connector(Box::new(move |dst, src| {
            let ctx = weak.upgrade()?;
            ctx.state.local_workload_by_ip(dst.ip())?;
            let (client, server) = tokio::io::duplex(256 * 1024);
            tokio::spawn(proxy::inbound::serve_hbone(ctx, server, src, dst, None));
            Some(client)
        }));
    }
    let inpod_metrics =
        cfg.inpod_enabled.then(|| crate::inpod::InPodMetrics::register(&mut registry));
    let registry = Arc::new(registry);
    let mut tasks = Vec::new();

    let c = ctx.clone();
    tasks.push(tokio::spawn(proxy::accept_loop("outbound", out_l, drain.clone(), move |s, p| {
        proxy::outbound::handle(c.clone(), s, p, None, None)
    })));
    let c = ctx.clone();
    tasks.push(tokio::spawn(proxy::accept_loop("inbound", in_l, drain.clone(), move |s, p| {
        proxy::inbound::handle_hbone(c.clone(), s, p, None)
    })));
    let c = ctx.clone();
    tasks.push(tokio::spawn(proxy::accept_loop(
        "inbound_plaintext",
        pt_l,
        drain.clone(),
        move |s, p| proxy::inbound::handle_plaintext(c.clone(), s, p, None),
    )));

    let xds_ready = match &xds {
        Some(x) => {
            tracing::info!(address = %cfg.xds_address.as_deref().unwrap_or_default(),
                "mesh state from the control plane over delta xDS; not ready until both types arrive");
            tasks.push(tokio::spawn(x.clone().run()));
            x.ready()
        }
        None => {
            if let (Some(path), true) = (&cfg.config_file, cfg.watch_file) {
                tasks.push(tokio::spawn(watch_file(path.clone(), state.clone())));
            }
            tokio::sync::watch::channel(true).1
        }
    };
    // Certificates for the local workloads as they come and go; ready once all are held.
    let (certs_ready_tx, certs_ready) = tokio::sync::watch::channel(false);
    {
        let tls = ctx.tls.clone();
        tasks.push(tokio::spawn(crate::identity::manager::run(
            state.clone(),
            store.clone(),
            xds_ready.clone(),
            certs_ready_tx,
            Arc::new(move |id| tls.forget(id)),
        )));
    }
    tasks.push(tokio::spawn(store.clone().run_renewal()));
    let zds_ready = Arc::new(AtomicBool::new(!cfg.inpod_enabled));
    let inpod = inpod_metrics.map(|m| Arc::new(InPod::new(ctx.clone(), store.clone(), m)));
    if let Some(pods) = &inpod {
        tracing::info!(socket = %cfg.inpod_socket.display(), "in-pod mode: pods come from the CNI over ZDS; not ready until its first snapshot");
        tasks.push(tokio::spawn(crate::inpod::run_client(
            pods.clone(),
            cfg.inpod_socket.clone(),
            zds_ready.clone(),
            drain.clone(),
        )));
    }

    let reg = registry.clone();
    let scrape_ebpf = ebpf.clone();
    tasks.push(tokio::spawn(admin::serve(metrics_l, drain.clone(), move |req| {
        let reg = reg.clone();
        let ebpf = scrape_ebpf.clone();
        async move {
            match req.uri().path() {
                "/metrics" | "/stats/prometheus" => {
                    if let Some(e) = &ebpf {
                        e.refresh_metrics();
                    }
                    let mut s = String::new();
                    match prometheus_client::encoding::text::encode(&mut s, &reg) {
                        Ok(()) => {
                            let mut r = text(StatusCode::OK, s);
                            r.headers_mut().insert(
                                http::header::CONTENT_TYPE,
                                http::HeaderValue::from_static(
                                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                                ),
                            );
                            r
                        }
                        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
                    }
                }
                _ => text(StatusCode::NOT_FOUND, "try /metrics\n"),
            }
        }
    })));
    let (cr, xr) = (certs_ready.clone(), xds_ready.clone());
    let zr = zds_ready.clone();
    let dr = drain.clone();
    tasks.push(tokio::spawn(admin::serve(ready_l, drain.clone(), move |req| {
        let ready = *cr.borrow() && *xr.borrow() && zr.load(Ordering::Acquire) && !dr.is_draining();
        async move {
            match req.uri().path() {
                "/healthz/ready" if ready => text(StatusCode::OK, "ready\n"),
                "/healthz/ready" => text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n"),
                _ => text(StatusCode::NOT_FOUND, "try /healthz/ready\n"),
            }
        }
    })));
    let dump_cfg = Arc::new(cfg.clone());
    let dump_store = store.clone();
    let dump_ctx = ctx.clone();
    let dump_signer = signer.clone();
    let dump_inpod = inpod.clone();
    let dump_xds = xds.clone();
    let admin_ebpf = ebpf.clone();
    let admin_token = ebpf_token.clone();
    tasks.push(tokio::spawn(admin::serve(admin_l, drain.clone(), move |req| {
        let cfg = dump_cfg.clone();
        let store = dump_store.clone();
        let ctx = dump_ctx.clone();
        let signer = dump_signer.clone();
        let inpod = dump_inpod.clone();
        let xds = dump_xds.clone();
        let ebpf = admin_ebpf.clone();
        let token = admin_token.clone();
        let log = log.clone();
        async move {
            let path = req.uri().path();
            if path == "/redirect/ebpf" || path.starts_with("/redirect/ebpf/") {
                // Attaching runs netlink and bpf syscalls: off the async workers.
                let (method, path, query) =
                    (req.method().clone(), path.to_string(), req.uri().query().map(String::from));
                let presented = req
                    .headers()
                    .get(crate::redirect::ebpf::TOKEN_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .map(String::from);
                return tokio::task::spawn_blocking(move || {
                    admin::ebpf_endpoint(
                        ebpf.as_deref(),
                        &method,
                        &path,
                        query.as_deref(),
                        presented.as_deref(),
                        token.as_deref().map(String::as_str),
                    )
                })
                .await
                .unwrap_or_else(|e| text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()));
            }
            match path {
                "/config_dump" => {
                    let mut v = config_dump(&cfg, &store, &ctx, &signer);
                    if let Some(p) = &inpod {
                        v["inpod_pods"] = json!(p.uids());
                    }
                    if let Some(e) = &ebpf {
                        v["redirect"] = e.status();
                    }
                    if let Some(x) = &xds {
                        v["xds"] = json!(x.status());
                    }
                    let mut r =
                        text(StatusCode::OK, serde_json::to_string_pretty(&v).unwrap_or_default());
                    r.headers_mut().insert(
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static("application/json"),
                    );
                    r
                }
                "/logging" => match (admin::level_param(req.uri().query()), &log) {
                    (Some(level), Some(ctl)) => match ctl(&level) {
                        Ok(()) => {
                            tracing::info!(%level, "log level changed");
                            text(StatusCode::OK, format!("log level set to {level}\n"))
                        }
                        Err(e) => {
                            text(StatusCode::BAD_REQUEST, format!("invalid level '{level}': {e}\n"))
                        }
                    },
                    (None, _) => text(
                        StatusCode::BAD_REQUEST,
                        "usage: /logging?level=<filter, e.g. debug or mbtunnel=trace>\n",
                    ),
                    (_, None) => {
                        text(StatusCode::NOT_IMPLEMENTED, "log level control not available\n")
                    }
                },
                _ => text(
                    StatusCode::NOT_FOUND,
                    "endpoints: /config_dump /logging?level=... /redirect/ebpf\n",
                ),
            }
        }
    })));
    tracing::info!(outbound = %bound.outbound, inbound = %bound.inbound, plaintext = %bound.inbound_plaintext,
        metrics = %bound.metrics, readiness = %bound.readiness, admin = %bound.admin, node = %cfg.node_name,
        "listening");
    Ok(Running {
        bound,
        signer,
        ctx,
        store,
        inpod,
        ebpf,
        xds,
        registry,
        certs_ready,
        xds_ready,
        zds_ready,
        drain_timeout: Duration::from_secs(cfg.drain_timeout_secs),
        tasks,
    })
}

fn config_dump(cfg: &Config, store: &CertStore, ctx: &Ctx, signer: &Signer) -> serde_json::Value {
    let b = crate::mb::backend_choice();
    let certs: Vec<_> = store
        .snapshot()
        .iter()
        .map(|c| {
            json!({
                "identity": c.identity.to_string(),
                "serial": c.serial,
                "algorithm": c.algorithm,
                "not_before": humantime(c.not_before),
                "not_after": humantime(c.not_after),
                "issued_at": humantime(c.issued_at),
                "renew_at": humantime(c.refresh_at()),
                "intermediates": c.chain_der.len(),
            })
        })
        .collect();
    let roots: Vec<String> = store
        .snapshot()
        .first()
        .map(|b| {
            b.roots_der
                .iter()
                .filter_map(|d| boring::x509::X509::from_der(d).ok()?.to_pem().ok())
                .filter_map(|p| String::from_utf8(p).ok())
                .collect()
        })
        .unwrap_or_default();
    json!({
        "config": cfg,
        "local_workloads": ctx.state.local_workloads().iter().map(|w| w.uid.clone()).collect::<Vec<_>>(),
        "state": ctx.state.dump(),
        "certificate_source": store.source().describe(),
        "holds_ca_key": store.source().holds_ca_key(),
        "certificates": certs,
        "root_certificates": roots,
        "signer": {
            "backend": b.backend.to_string(),
            "cpu_features": b.features.to_string(),
            "reason": b.reason,
            "state": signer.dump(),
        },
        "hbone_pool_connections": ctx.pool.len(),
        "active_connections": ctx.drain.active(),
        "draining": ctx.drain.is_draining(),
    })
}

fn token_source(cfg: &Config) -> TokenSource {
    match &cfg.auth_token {
        Some(t) => TokenSource::Static(t.clone()),
        None => TokenSource::File(cfg.auth_token_file.clone()),
    }
}

/// Local mode: re-reads the config file when it changes and applies its workloads, services and
/// policies. An invalid file is reported and the state held stays.
async fn watch_file(path: std::path::PathBuf, state: Arc<State>) {
    let stamp =
        |p: &std::path::Path| std::fs::metadata(p).ok().map(|m| (m.modified().ok(), m.len()));
    let mut last = stamp(&path);
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = stamp(&path);
        if now == last {
            continue;
        }
        last = now;
        let p = path.clone();
        let parsed = tokio::task::spawn_blocking(move || Config::from_file(&p)).await;
        match parsed {
            Ok(Ok(c)) => {
                let before = state.counts();
                state.apply(replace_delta(
                    &state,
                    local_resources(&c.workloads, &c.services, &c.policies),
                ));
                let after = state.counts();
                tracing::info!(file = %path.display(), workloads = after.workloads, services = after.services,
                    policies = after.policies, was = ?before,
                    "config file changed: mesh state reloaded (other settings apply at restart)");
            }
            Ok(Err(e)) => tracing::error!(error = %e,
                "config file changed but is invalid: keeping the mesh state held"),
            Err(e) => tracing::error!(error = %e, "config reload task failed"),
        }
    }
}

impl Running {
    pub fn is_ready(&self) -> bool {
        *self.certs_ready.borrow()
            && *self.xds_ready.borrow()
            && self.zds_ready.load(Ordering::Acquire)
    }

    /// Waits until ready (or `timeout`).
    pub async fn wait_ready(&self, timeout: Duration) -> bool {
        let end = tokio::time::Instant::now() + timeout;
        while tokio::time::Instant::now() < end {
            if self.is_ready() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// The metrics in Prometheus text format.
    pub fn metrics_text(&self) -> String {
        if let Some(e) = &self.ebpf {
            e.refresh_metrics();
        }
        let mut s = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut s, &self.registry);
        s
    }

    /// Stops accepting, sends GOAWAY on HBONE connections, waits for in-flight connections up to
    /// the drain deadline. Returns how many were still open.
    pub async fn shutdown(self) -> usize {
        tracing::info!(active = self.ctx.drain.active(), "draining");
        self.ctx.drain.start();
        let left = self.ctx.drain.wait_idle(self.drain_timeout).await;
        if left > 0 {
            tracing::warn!(left, "drain deadline reached; closing remaining connections");
        } else {
            tracing::info!("drained");
        }
        for t in self.tasks {
            t.abort();
        }
        left
    }
}
