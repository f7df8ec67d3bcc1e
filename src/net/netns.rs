//! Network namespaces as the proxy uses them. A socket belongs to the namespace it was created
//! in, whatever thread uses it later, so a pod's sockets are created inside its namespace and
//! then driven by the ordinary tokio runtime. Two ways in:
//! - a thread per pod that has entered its namespace and runs jobs there ([`Netns::run`]):
//!   listeners, the redirect setup, anything slow or that may block;
//! - the calling thread, for the length of one short synchronous call ([`Netns::run_here`]):
//!   outbound sockets, one per connection a pod opens. Two `setns` calls on the worker cost less
//!   than handing each connect's `socket()` to the pod's thread and waking the worker again.
#![forbid(unsafe_code)]

use std::cell::OnceCell;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::mpsc;

use socket2::{Domain, Protocol, Socket, Type};

use super::sys;

type Job = Box<dyn FnOnce() + Send>;

/// A network namespace with a thread living in it.
pub struct Netns {
    name: String,
    id: NetnsId,
    fd: OwnedFd,
    jobs: std::sync::Mutex<mpsc::Sender<Job>>,
}

/// Identity of a namespace: device and inode of its nsfs file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NetnsId {
    pub dev: u64,
    pub ino: u64,
}

impl std::fmt::Display for NetnsId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "net:[{}]", self.ino)
    }
}

/// The namespace identity of `fd`.
pub fn netns_id(fd: BorrowedFd<'_>) -> io::Result<NetnsId> {
    let f = File::from(fd.try_clone_to_owned()?);
    let m = f.metadata()?;
    Ok(NetnsId { dev: m.dev(), ino: m.ino() })
}

/// Opens a namespace file (`/var/run/netns/NAME`, `/proc/PID/ns/net`).
pub fn open(path: &Path) -> io::Result<OwnedFd> {
    Ok(File::open(path)?.into())
}

/// Moves the calling thread into `ns` (for runtimes whose threads must all live in a namespace,
/// e.g. `tokio::runtime::Builder::on_thread_start`).
pub fn enter_current_thread(ns: BorrowedFd<'_>) -> io::Result<()> {
    sys::setns_net(ns)
}

impl Netns {
    /// Starts a thread in the namespace `fd`; fails if it cannot enter.
    pub fn enter(fd: OwnedFd, name: &str) -> io::Result<Netns> {
        let id = netns_id(fd.as_fd())?;
        let thread_fd = fd.try_clone()?;
        let (tx, rx) = mpsc::channel::<Job>();
        let (ok_tx, ok_rx) = mpsc::channel();
        std::thread::Builder::new().name(format!("netns-{}", short(name))).spawn(move || {
            let r = sys::setns_net(thread_fd.as_fd());
            drop(thread_fd);
            let entered = r.is_ok();
            let _ = ok_tx.send(r);
            if entered {
                // Runs until every sender is gone (the pod was removed).
                while let Ok(job) = rx.recv() {
                    job();
                }
            }
        })?;
        ok_rx.recv().map_err(|_| io::Error::other("netns thread died"))??;
        Ok(Netns { name: name.into(), id, fd, jobs: std::sync::Mutex::new(tx) })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn id(&self) -> NetnsId {
        self.id
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Runs `f` on the namespace's thread.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> io::Result<T> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit(Box::new(move || {
            let _ = tx.send(f());
        }))?;
        rx.await.map_err(|_| self.gone())
    }

    /// Runs `f` on the namespace's thread, blocking the caller (not for async contexts).
    pub fn run_blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> io::Result<T> {
        let (tx, rx) = mpsc::channel();
        self.submit(Box::new(move || {
            let _ = tx.send(f());
        }))?;
        rx.recv().map_err(|_| self.gone())
    }

    /// Hands a job to the namespace's thread.
    fn submit(&self, job: Job) -> io::Result<()> {
        self.jobs.lock().unwrap().send(job).map_err(|_| self.gone())
    }

    fn gone(&self) -> io::Error {
        io::Error::other(format!("netns thread of {} is gone", self.name))
    }

    /// Runs `f` on the calling thread inside this namespace, then moves the thread back to its
    /// own namespace (the one it was in when it first came here). For short synchronous work
    /// only: nothing else runs on the thread meanwhile, so `f` must not block or yield. Should
    /// the way back fail (it cannot unless the kernel runs out of memory), the process aborts
    /// rather than let a worker create this node's sockets inside a pod.
    pub fn run_here<T>(&self, f: impl FnOnce() -> T) -> io::Result<T> {
        HOME.with(|home| {
            let home = match home.get() {
                Some(fd) => fd,
                None => {
                    let fd = open(Path::new("/proc/thread-self/ns/net"))?;
                    home.get_or_init(|| fd)
                }
            };
            sys::setns_net(self.fd.as_fd())?;
            let back = GoHome(home.as_fd());
            let out = f();
            drop(back);
            Ok(out)
        })
    }

    /// A non-blocking TCP socket in this namespace, created on the calling thread.
    pub fn tcp_socket(&self, v6: bool) -> io::Result<Socket> {
        self.run_here(|| {
            let s = Socket::new(
                if v6 { Domain::IPV6 } else { Domain::IPV4 },
                Type::STREAM,
                Some(Protocol::TCP),
            )?;
            s.set_nonblocking(true)?;
            Ok(s)
        })?
    }
}

thread_local! {
    /// The namespace this thread returns to after [`Netns::run_here`]: the one it was in when it
    /// first ran one (a runtime may have put its threads in a namespace when they started).
    static HOME: OnceCell<OwnedFd> = const { OnceCell::new() };
}

/// Moves the thread back to its namespace when dropped, also when the work in between panicked.
struct GoHome<'a>(BorrowedFd<'a>);

impl Drop for GoHome<'_> {
    fn drop(&mut self) {
        if let Err(e) = sys::setns_net(self.0) {
            tracing::error!(error = %e, "cannot return a thread to its network namespace; aborting");
            std::process::abort();
        }
    }
}

impl std::fmt::Debug for Netns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Netns({} {})", self.name, self.id)
    }
}

fn short(s: &str) -> String {
    s.chars().take(8).collect()
}
