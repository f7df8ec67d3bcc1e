//! Wiring: builds the state, CA, signer, TLS, pool and listeners from a [`Config`], serves the
//! HTTP endpoints, and drains on shutdown.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use prometheus_client::registry::Registry;

use crate::admin::{self, LogControl};
use crate::config::Config;
use crate::grpc::{Endpoints, TokenSource};
use crate::hbone::Pool;
use crate::identity::ca::DevCa;
use crate::identity::istio::IstioCa;
use crate::identity::source::{CertSource, DevCaSource};
use crate::identity::store::CertStore;
use crate::inpod::InPod;
use crate::metrics::Metrics;
use crate::net::socket;
use crate::proxy::{self, Ctx, Drain};
use crate::redirect::ebpf::{EbpfRedirect, Listeners, PinMode, RedirectMetrics, Role};
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
            let ep = endpoints(&cfg, addr, &cfg.ca_root_ca, "CA_ROOT_CA", &cfg.ca_headers)?;
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
            let ep = endpoints(&cfg, addr, &cfg.xds_root_ca, "XDS_ROOT_CA", &cfg.xds_headers)?;
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
    let limits = cfg.limits();
    tracing::info!(?limits, "connection limits");
    let tls = Arc::new(
        TlsProvider::new(store.clone(), signer.clone(), cfg.trust_domain.clone(), metrics.clone())
            .with_limits(&limits)
            .with_resumption(cfg.tls_resumption)
            .with_verify_cache(cfg.tls_verify_cache)
            .with_ciphers(&cfg.tls_ciphers)
            .with_groups(&cfg.tls_groups),
    );
    let pool = Arc::new(Pool::new(
        tls.clone(),
        metrics.clone(),
        cfg.socket_mark,
        transparent,
        limits.clone(),
    ));
    pool.start_idle_timer();

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
            cfg.socket_mark,
            redirect_metrics.clone(),
            if cfg.ebpf_fail_closed {
                PinMode::FailClosed(cfg.ebpf_pin_dir.clone())
            } else {
                PinMode::FailOpen(cfg.ebpf_pin_dir.clone())
            },
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
    let mut tasks_early = Vec::new();
    let dns_cfg = cfg.dns();
    let upstream = Arc::new(crate::dns::Upstream::new(&dns_cfg.upstreams));
    let dns = if dns_cfg.enabled {
        let m = crate::dns::DnsMetrics::register(&mut registry);
        let d = crate::dns::Dns::new(&dns_cfg, state.clone(), upstream.clone(), m)
            .map_err(|e| anyhow::anyhow!("DNS proxy: {e}"))?;
        Some(Arc::new(d))
    } else {
        None
    };
    let workers = Arc::new(
        crate::net::Workers::start(cfg.runtime_workers()).context("starting the worker threads")?,
    );
    let ctx = Arc::new(Ctx {
        state: state.clone(),
        tls,
        pool,
        drain: drain.clone(),
        mark: cfg.socket_mark,
        transparent,
        own_addrs: vec![bound.outbound, bound.inbound, bound.inbound_plaintext],
        conns: Arc::default(),
        pending: proxy::PendingHandshakes::new(
            limits.max_pending_handshakes,
            limits.max_pending_handshakes_per_source,
            metrics.clone(),
        ),
        metrics,
        limits,
        workers,
        peer_logs: Default::default(),
        dns: dns.clone(),
        upstream,
    });
    if let (Some(d), false) = (&dns, cfg.inpod_enabled) {
        // Node mode: one DNS proxy in the proxy's namespace; the client is the local workload
        // with the query's source address. (In-pod mode opens one in each pod.)
        tasks_early.extend(
            crate::dns::server::listen(d, None, dns_cfg.addr, crate::dns::Clients::Node, &drain)
                .await
                .with_context(|| format!("DNS proxy: cannot listen on {}", dns_cfg.addr))?,
        );
        tracing::info!(addr = %dns_cfg.addr, "DNS proxy listening (UDP and TCP)");
    }
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
    let trim_metrics = crate::memtrim::TrimMetrics::register(&mut registry);
    crate::metrics::register_build(
        &mut registry,
        std::env::var(crate::config::env::ISTIO_VERSION).ok(),
    );
    registry.register_collector(Box::new(crate::identity::store::CertCollector(Arc::downgrade(
        &store,
    ))));
    registry.register_collector(Box::new(crate::net::workers::RuntimeCollector(Arc::downgrade(
        &ctx.workers,
    ))));
    let admin_refused = prometheus_client::metrics::counter::Counter::default();
    registry.sub_registry_with_prefix("mbtunnel").register(
        "admin_refused",
        "Admin requests refused: a state-changing request from a non-loopback peer",
        admin_refused.clone(),
    );
    let registry = Arc::new(registry);
    let mut tasks = tasks_early;

    let c = ctx.clone();
    tasks.push(proxy::spawn_accept_loop(
        "outbound",
        out_l,
        drain.clone(),
        ctx.metrics.clone(),
        ctx.workers.clone(),
        move |s, p| proxy::outbound::handle(c.clone(), s, p, None, None),
    ));
    let c = ctx.clone();
    tasks.push(proxy::spawn_accept_loop(
        "inbound",
        in_l,
        drain.clone(),
        ctx.metrics.clone(),
        ctx.workers.clone(),
        move |s, p| proxy::inbound::handle_hbone(c.clone(), s, p, None),
    ));
    let c = ctx.clone();
    tasks.push(proxy::spawn_accept_loop(
        "inbound_plaintext",
        pt_l,
        drain.clone(),
        ctx.metrics.clone(),
        ctx.workers.clone(),
        move |s, p| proxy::inbound::handle_plaintext(c.clone(), s, p, None),
    ));

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
        let (tls, warm) = (ctx.tls.clone(), ctx.tls.clone());
        // Contexts for new certificates are built on a blocking thread, not on a worker during
        // the identity's first handshake; one build pass at a time, on the latest list.
        let (held_tx, mut held_rx) = tokio::sync::watch::channel(Vec::new());
        tasks.push(tokio::spawn(async move {
            while held_rx.changed().await.is_ok() {
                let ids = held_rx.borrow_and_update().clone();
                let warm = warm.clone();
                let _ = tokio::task::spawn_blocking(move || warm.warm(&ids)).await;
            }
        }));
        tasks.push(tokio::spawn(crate::identity::manager::run(
            state.clone(),
            store.clone(),
            xds_ready.clone(),
            certs_ready_tx,
            Arc::new(move |id| tls.forget(id)),
            Arc::new(move |ids| {
                held_tx.send_replace(ids);
            }),
        )));
    }
    tasks.push(tokio::spawn(store.clone().run_renewal()));
    tasks.push(tokio::spawn(crate::memtrim::run(trim_metrics)));
    tasks.push(tokio::spawn(proxy::run_recheck(ctx.clone())));
    let zds_ready = Arc::new(AtomicBool::new(!cfg.inpod_enabled));
    let inpod = inpod_metrics.map(|m| Arc::new(InPod::new(ctx.clone(), store.clone(), m)));
    if let Some(pods) = &inpod {
        tasks.push(tokio::spawn(pods.clone().watch_pending()));
        tracing::info!(socket = %cfg.inpod_socket.display(), "in-pod mode: pods come from the CNI over ZDS; not ready until its first snapshot");
        tasks.push(tokio::spawn(crate::inpod::run_client(
            pods.clone(),
            cfg.inpod_socket.clone(),
            zds_ready.clone(),
            drain.clone(),
        )));
    }

    let endpoint = |name, listener| admin::Endpoint {
        name,
        listener,
        drain: drain.clone(),
        accept_errors: ctx.metrics.accept_error_counter(name),
    };
    tasks.push(tokio::spawn(admin::serve_metrics(
        endpoint("metrics", metrics_l),
        registry.clone(),
        ebpf.clone(),
    )));
    let (cr, xr) = (certs_ready.clone(), xds_ready.clone());
    let zr = zds_ready.clone();
    let dr = drain.clone();
    tasks.push(tokio::spawn(admin::serve_readiness(
        endpoint("readiness", ready_l),
        Arc::new(move || {
            *cr.borrow() && *xr.borrow() && zr.load(Ordering::Acquire) && !dr.is_draining()
        }),
    )));
    let admin_state = Arc::new(admin::AdminState {
        refused: admin_refused,
        cfg: Arc::new(cfg.clone()),
        store: store.clone(),
        ctx: ctx.clone(),
        signer: signer.clone(),
        inpod: inpod.clone(),
        xds: xds.clone(),
        ebpf: ebpf.clone(),
        ebpf_token: ebpf_token.clone(),
        log,
    });
    tasks.push(tokio::spawn(admin::serve_admin(endpoint("admin", admin_l), admin_state)));
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

/// One control-plane endpoint from the settings: its roots (named `what` in errors), the token,
/// the cluster id and extra metadata.
fn endpoints(
    cfg: &Config,
    address: &str,
    roots: &str,
    what: &str,
    headers: &std::collections::BTreeMap<String, crate::config::Secret>,
) -> anyhow::Result<Endpoints> {
    if let Some(e) = cfg.plaintext_token_error() {
        anyhow::bail!(e);
    }
    let roots_pem = crate::grpc::load_roots(roots).map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
    Ok(Endpoints {
        address: address.to_string(),
        roots_pem,
        token: token_source(cfg, address),
        cluster_id: cfg.cluster_id.clone(),
        headers: headers.clone(),
    })
}

/// The token `address`'s calls carry: the fixed one, else the token file (re-read at every
/// call). A plaintext address carries none: start-up refused a token with one
/// ([`Config::plaintext_token_error`]), and a token file that appears later is not sent in clear.
fn token_source(cfg: &Config, address: &str) -> TokenSource {
    if crate::config::is_plaintext(address) {
        tracing::warn!(%address, "control plane over plaintext: no token is sent (local development only)");
        return TokenSource::None;
    }
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
    /// the drain deadline. Returns how many proxied connections were still open then (they are
    /// cut), or, when every one had ended, how many HBONE connections had not closed in time.
    ///
    /// Every HBONE connection, inbound and pooled, ends with GOAWAY then TLS close_notify before
    /// its socket closes, and the drain waits for that too: inbound ones once their streams have
    /// finished, pooled ones (let go by the pool) once their last tunnel has.
    pub async fn shutdown(self) -> usize {
        let drain = &self.ctx.drain;
        tracing::info!(
            active = drain.active(),
            hbone_inbound = drain.hbone_open(),
            hbone_pooled = self.ctx.pool.open_connections(),
            "draining"
        );
        let end = tokio::time::Instant::now() + self.drain_timeout;
        drain.start();
        self.ctx.pool.drain();
        let mut left = drain.wait_idle(self.drain_timeout).await;
        if left == 0 {
            // The HBONE connections carrying cut streams are not counted twice: only when every
            // proxied connection ended do the HBONE connections' own closes count.
            left += drain.wait_hbone_closed(end).await;
            left += self.ctx.pool.wait_closed(end).await;
        }
        if left > 0 {
            tracing::warn!(left, "drain deadline reached; resetting remaining connections");
            // Reset, not FIN: an application must be able to tell a cut from a complete answer.
            // HBONE connections still end with close_notify once their streams are cut.
            drain.cut_all();
            drain.wait_idle(Duration::from_secs(1)).await;
            let end = tokio::time::Instant::now() + Duration::from_secs(1);
            drain.wait_hbone_closed(end).await;
            self.ctx.pool.wait_closed(end).await;
        } else {
            tracing::info!("drained");
        }
        for t in self.tasks {
            t.abort();
        }
        self.ctx.workers.stop();
        left
    }
}
