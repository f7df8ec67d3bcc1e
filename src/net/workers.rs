//! The threads that run connections: one single-threaded runtime each.
//!
//! A proxied connection is a few tasks that wake each other for every chunk moved: the relay,
//! the h2 connection it tunnels through, the TLS and TCP legs. On a work-stealing runtime those
//! tasks drift between workers, and every hop between them is a thread wake-up (measured on the
//! data-plane bench: ~25k context switches per 5 s stream on the client side against ztunnel's
//! ~4k). Here a connection is handed, once, to one worker thread, chosen in turn, and every task
//! it spawns (h2 connection, CONNECT streams) stays on that thread. Accept loops run on workers
//! too ([`Workers::spawn_listener`]; a connection handed to another worker costs one wake-up),
//! the control plane on the main thread's runtime. A tunnel on a
//! pooled HBONE connection that another worker opened moves to that worker ([`current`],
//! [`Workers::handle`]), so the relay and the h2 connection it uses share a thread too.
#![forbid(unsafe_code)]

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

thread_local! {
    static CURRENT: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// The index of the worker the calling thread is, if it is one.
pub fn current() -> Option<usize> {
    CURRENT.with(|c| c.get())
}

/// Worker runtimes, each on a thread of its own, used in turn.
pub struct Workers {
    handles: Vec<Handle>,
    next: AtomicUsize,
    /// Dropping a sender stops its worker.
    stops: Mutex<Vec<oneshot::Sender<()>>>,
}

/// ztunnel's runtime series over the worker runtimes, read at each scrape: `tokio_num_workers`,
/// `tokio_global_queue_depth`, `tokio_num_alive_tasks` (summed over the workers) and, per worker
/// (`worker="i"`), `tokio_worker_total_busy_duration_seconds_total`,
/// `tokio_worker_park_count_total`, `tokio_worker_park_unpark_count_total`. Each worker here is a
/// runtime of one thread, so worker `i` is runtime `i`'s only worker.
#[derive(Debug)]
pub struct RuntimeCollector(pub std::sync::Weak<Workers>);

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers").field("threads", &self.handles.len()).finish()
    }
}

impl prometheus_client::collector::Collector for RuntimeCollector {
    fn encode(
        &self,
        mut enc: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let Some(w) = self.0.upgrade() else { return Ok(()) };
        let ms: Vec<_> = w.handles.iter().map(|h| h.metrics()).collect();
        let sum = |f: &dyn Fn(&tokio::runtime::RuntimeMetrics) -> usize| {
            ms.iter().map(f).sum::<usize>() as i64
        };
        for (name, help, v) in [
            (
                "tokio_num_workers",
                "the number of worker threads used by the runtime",
                sum(&|m| m.num_workers()),
            ),
            (
                "tokio_global_queue_depth",
                "the number of tasks currently scheduled in the runtime's global queue",
                sum(&|m| m.global_queue_depth()),
            ),
            (
                "tokio_num_alive_tasks",
                "the number of alive tasks in the runtime",
                sum(&|m| m.num_alive_tasks()),
            ),
        ] {
            let g = ConstGauge::new(v);
            g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        type PerWorker = fn(&tokio::runtime::RuntimeMetrics) -> f64;
        let per_worker: [(&str, &str, PerWorker); 3] = [
            (
                "tokio_worker_total_busy_duration_seconds",
                "the amount of time worker threads have been busy",
                |m| m.worker_total_busy_duration(0).as_secs_f64(),
            ),
            (
                "tokio_worker_park_count",
                "the total number of times the given worker thread has parked",
                |m| m.worker_park_count(0) as f64,
            ),
            (
                "tokio_worker_park_unpark_count",
                "the total number of times the given worker thread has parked and unparked",
                |m| m.worker_park_unpark_count(0) as f64,
            ),
        ];
        for (name, help, f) in per_worker {
            let mut family = enc.encode_descriptor(
                name,
                help,
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for (i, m) in ms.iter().enumerate() {
                let worker = i.to_string();
                let labels = [("worker", worker.as_str())];
                let c = ConstCounter::new(f(m));
                c.encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

impl Workers {
    /// Starts `n` worker threads (`mbt-worker-N`); `n` = 0 starts none, and connections then run
    /// on the runtime that accepted them.
    pub fn start(n: usize) -> std::io::Result<Workers> {
        let (mut handles, mut stops) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for i in 0..n {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            handles.push(rt.handle().clone());
            let (stop, stopped) = oneshot::channel::<()>();
            stops.push(stop);
            std::thread::Builder::new().name(format!("mbt-worker-{i}")).spawn(move || {
                CURRENT.with(|c| c.set(Some(i)));
                let _ = rt.block_on(stopped);
                // Connections still open here were cut by the drain already; do not wait on
                // blocking work left behind.
                rt.shutdown_timeout(Duration::from_millis(100));
            })?;
        }
        Ok(Workers { handles, next: AtomicUsize::new(0), stops: Mutex::new(stops) })
    }

    /// Worker threads running.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Whether connections run where they were accepted (no worker threads).
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Worker `i`'s runtime.
    pub fn handle(&self, i: usize) -> Option<&Handle> {
        self.handles.get(i)
    }

    /// The next worker in turn, if there are workers, and whether it is the calling thread.
    pub fn pick(&self) -> Option<(usize, &Handle)> {
        if self.handles.is_empty() {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        Some((i, &self.handles[i]))
    }

    /// Runs `make(stream)` on the next worker. Without workers, or when the next worker is this
    /// thread, it runs here.
    pub fn spawn_conn<F, Fut>(&self, s: tokio::net::TcpStream, make: F)
    where
        F: FnOnce(tokio::net::TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let next = self.pick().map(|(i, _)| i);
        self.spawn_moved(next, s, move |s| async move {
            match s {
                Ok(s) => make(s).await,
                Err(e) => tracing::warn!(error = %e, "could not hand a connection to a worker"),
            }
        });
    }

    /// Runs `make` on worker `to`, with the socket moved from this runtime's I/O driver to that
    /// worker's; here, unmoved, when `to` is this thread or no worker. `make` gets the error
    /// instead of the socket when the move failed.
    pub fn spawn_moved<F, Fut>(
        &self,
        to: Option<usize>,
        s: tokio::net::TcpStream,
        make: F,
    ) -> tokio::task::JoinHandle<()>
    where
        F: FnOnce(std::io::Result<tokio::net::TcpStream>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let Some(rt) = to.filter(|i| Some(*i) != current()).and_then(|i| self.handles.get(i))
        else {
            return tokio::spawn(make(Ok(s)));
        };
        match s.into_std() {
            Ok(std) => rt.spawn(async move { make(tokio::net::TcpStream::from_std(std)).await }),
            Err(e) => tokio::spawn(make(Err(e))),
        }
    }

    /// Runs `serve(listener)` (an accept loop) on the next worker, so that accepting takes no
    /// thread of its own and a connection that stays on that worker needs no hand-off. Without
    /// workers it runs here.
    pub fn spawn_listener<F, Fut>(
        &self,
        name: &'static str,
        l: tokio::net::TcpListener,
        serve: F,
    ) -> tokio::task::JoinHandle<()>
    where
        F: FnOnce(tokio::net::TcpListener) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let Some((_, rt)) = self.pick() else {
            return tokio::spawn(serve(l));
        };
        match l.into_std() {
            Ok(std) => rt.spawn(async move {
                match tokio::net::TcpListener::from_std(std) {
                    Ok(l) => serve(l).await,
                    Err(e) => tracing::error!(listener = name, error = %e,
                        "listener could not move to a worker: not accepting"),
                }
            }),
            Err(e) => {
                tracing::error!(listener = name, error = %e,
                    "listener could not leave the main runtime: not accepting");
                tokio::spawn(async {})
            }
        }
    }

    /// Stops every worker thread; tasks still on them are dropped.
    pub fn stop(&self) {
        self.stops.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn connections_run_on_the_workers_in_turn_with_everything_they_spawn() {
        let workers = Workers::start(2).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for _ in 0..4 {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (s, _) = listener.accept().await.unwrap();
            let tx = tx.clone();
            workers.spawn_conn(s, move |mut s| async move {
                let here = std::thread::current().name().map(str::to_owned);
                assert_eq!(here, current().map(|i| format!("mbt-worker-{i}")));
                // A task the connection spawns runs on the same thread.
                let inner =
                    tokio::spawn(async { std::thread::current().name().map(str::to_owned) })
                        .await
                        .unwrap();
                let mut b = [0u8; 4];
                s.read_exact(&mut b).await.unwrap();
                // Reported before the echo: the test reads the echo before the next
                // connection, so the reports arrive in connection order.
                tx.send((here, inner)).unwrap();
                s.write_all(&b).await.unwrap();
            });
            c.write_all(b"ping").await.unwrap();
            let mut b = [0u8; 4];
            c.read_exact(&mut b).await.unwrap();
            assert_eq!(&b, b"ping");
        }
        let mut seen = Vec::new();
        for _ in 0..4 {
            let (here, inner) = rx.recv().await.unwrap();
            assert_eq!(here, inner, "a spawned task left its connection's worker");
            seen.push(here.unwrap());
        }
        assert_eq!(seen, ["mbt-worker-0", "mbt-worker-1", "mbt-worker-0", "mbt-worker-1"]);
    }

    #[tokio::test]
    async fn an_accept_loop_runs_on_a_worker_and_hands_connections_on_in_turn() {
        let workers = std::sync::Arc::new(Workers::start(2).unwrap());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let w = workers.clone();
        let _l = workers.spawn_listener("test", listener, move |l| async move {
            tx.send(("accept", current())).unwrap();
            loop {
                let (s, _) = l.accept().await.unwrap();
                let tx = tx.clone();
                w.spawn_conn(s, move |_s| async move {
                    tx.send(("conn", current())).unwrap();
                });
            }
        });
        assert_eq!(rx.recv().await.unwrap(), ("accept", Some(0)));
        let mut conns = Vec::new();
        for _ in 0..4 {
            conns.push(tokio::net::TcpStream::connect(addr).await.unwrap());
            conns.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        let mut on = [0; 2];
        for _ in 0..8 {
            let (what, w) = rx.recv().await.unwrap();
            assert_eq!(what, "conn");
            on[w.unwrap()] += 1;
        }
        assert_eq!(on, [4, 4], "connections not spread in turn");
    }

    #[tokio::test]
    async fn without_workers_connections_run_where_they_were_accepted() {
        let workers = Workers::start(0).unwrap();
        assert!(workers.is_empty());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut c = tokio::net::TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (s, _) = listener.accept().await.unwrap();
        let (tx, rx) = oneshot::channel();
        workers.spawn_conn(s, move |mut s| async move {
            s.write_all(b"ok").await.unwrap();
            tx.send(std::thread::current().name().map(str::to_owned)).unwrap();
        });
        let mut b = [0u8; 2];
        c.read_exact(&mut b).await.unwrap();
        assert_eq!(rx.await.unwrap(), std::thread::current().name().map(str::to_owned));
        assert_eq!(current(), None);
    }
}
