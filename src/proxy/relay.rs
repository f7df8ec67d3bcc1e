//! Moving bytes between the two legs of a proxied connection: chunked copy both ways with
//! half-close, the early stop, and the abnormal end (reset) that a cut connection must show.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What one proxied connection moved: `ab` from the first side to the second, `ba` back, counted
/// as the bytes are written, so a connection that fails half-way reports what it moved.
#[derive(Debug)]
pub struct Copied {
    pub ab: u64,
    pub ba: u64,
    pub result: Result<(), String>,
}

/// One direction of a copy: the chunk in flight, what was written, and how large the next read
/// may be.
struct Half {
    /// Where reads from a TCP leg land; each chunk is split off and handed on without a copy.
    buf: bytes::BytesMut,
    /// Read and not yet written.
    chunk: bytes::Bytes,
    /// Size of the next read: follows the traffic ([`next_read_size`]).
    want: usize,
    written: u64,
    eof: bool,
    unflushed: bool,
    done: bool,
}

/// First and smallest read of a connection.
const MIN_READ: usize = 16 * 1024;
/// Largest read: one chunk handed to the other leg at once (an h2 DATA frame on HBONE).
const MAX_READ: usize = 256 * 1024;

/// The size of the read after one that asked for `want` bytes and got `got`: twice as large
/// after a read that filled it (more is waiting), half as large (not below [`MIN_READ`]) after
/// one that filled less than a quarter of it, so a connection that goes back to small messages
/// after a burst goes back to small buffers too. Each read allocates what it asks for, and a
/// chunk keeps its allocation until the other leg has written it.
fn next_read_size(want: usize, got: usize) -> usize {
    if got >= want {
        (want * 2).min(MAX_READ)
    } else if got < want / 4 {
        (want / 2).max(MIN_READ)
    } else {
        want
    }
}

impl Half {
    fn new() -> Half {
        Half {
            buf: bytes::BytesMut::new(),
            chunk: bytes::Bytes::new(),
            want: MIN_READ,
            written: 0,
            eof: false,
            unflushed: false,
            done: false,
        }
    }

    /// Moves bytes from `r` to `w` until `r` ends (then shuts `w` down), an error, or pending.
    fn poll_copy<R: Leg + ?Sized, W: Leg + ?Sized>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        r: &mut R,
        w: &mut W,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::{ready, Poll};
        loop {
            if self.chunk.is_empty() && !self.eof {
                match r.poll_read_chunk(cx, &mut self.buf, self.want) {
                    Poll::Ready(Ok(Some(c))) => {
                        self.want = next_read_size(self.want, c.len());
                        self.chunk = c;
                    }
                    Poll::Ready(Ok(None)) => self.eof = true,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {
                        // Nothing more to read now: hold no buffer while idle, and push out
                        // what was written.
                        self.buf = bytes::BytesMut::new();
                        if self.unflushed {
                            ready!(std::pin::Pin::new(&mut *w).poll_flush(cx))?;
                            self.unflushed = false;
                        }
                        return Poll::Pending;
                    }
                }
            }
            while !self.chunk.is_empty() {
                let n = ready!(w.poll_write_chunk(cx, &mut self.chunk))?;
                if n == 0 {
                    return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
                }
                self.written += n as u64;
                self.unflushed = true;
            }
            if self.eof {
                ready!(std::pin::Pin::new(&mut *w).poll_flush(cx))?;
                ready!(std::pin::Pin::new(&mut *w).poll_shutdown(cx))?;
                return Poll::Ready(Ok(()));
            }
        }
    }
}

/// Copies both ways until both sides closed (a side that ends has the other's write side shut
/// down: half-close), an error, or `stop` resolves with a reason. Bytes moved are reported in
/// every case. The caller resets its TCP sockets when the result is an error, so the peers see a
/// reset rather than a clean end they would take for success.
pub async fn copy_both<A, B>(
    a: &mut A,
    b: &mut B,
    stop: impl std::future::Future<Output = String>,
) -> Copied
where
    A: Leg + ?Sized,
    B: Leg + ?Sized,
{
    use std::task::Poll;
    let (mut ab, mut ba) = (Half::new(), Half::new());
    let mut stop = std::pin::pin!(stop);
    let stop_wake = Arc::new(StopWake::default());
    let mut stop_polled = false;
    let result = std::future::poll_fn(|cx| {
        // Most wake-ups are bytes to move: `stop` (drain and revocation watches, a lock each to
        // poll) is polled first, then only when it woke the task itself.
        stop_wake.task.register(cx.waker());
        if !stop_polled || stop_wake.woken.swap(false, Ordering::AcqRel) {
            stop_polled = true;
            let waker = futures::task::waker_ref(&stop_wake);
            if let Poll::Ready(reason) =
                stop.as_mut().poll(&mut std::task::Context::from_waker(&waker))
            {
                return Poll::Ready(Err(reason));
            }
        }
        if !ab.done {
            match ab.poll_copy(cx, &mut *a, &mut *b) {
                Poll::Ready(Ok(())) => ab.done = true,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.to_string())),
                Poll::Pending => {}
            }
        }
        if !ba.done {
            match ba.poll_copy(cx, &mut *b, &mut *a) {
                Poll::Ready(Ok(())) => ba.done = true,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.to_string())),
                Poll::Pending => {}
            }
        }
        if ab.done && ba.done {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    })
    .await;
    Copied { ab: ab.written, ba: ba.written, result }
}

/// The waker `copy_both` gives its `stop` future: it records that `stop` woke, then wakes the
/// task.
#[derive(Default)]
struct StopWake {
    woken: AtomicBool,
    task: futures::task::AtomicWaker,
}

impl futures::task::ArcWake for StopWake {
    fn wake_by_ref(this: &Arc<Self>) {
        this.woken.store(true, Ordering::Release);
        this.task.wake();
    }
}

/// Resets a TCP connection when it is dropped (`SO_LINGER` 0: RST instead of FIN), so that a
/// cut connection is never mistaken for a complete one.
pub fn reset_on_close(s: &tokio::net::TcpStream) {
    let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
}

/// One side of a relayed connection, which can be ended abnormally so that its far end learns
/// the connection was cut rather than finished: RST instead of FIN on TCP,
/// `RST_STREAM(CONNECT_ERROR)` instead of END_STREAM on an HBONE stream.
///
/// Bytes move between legs as [`Bytes`](bytes::Bytes) chunks, so an HBONE leg hands h2's
/// received frames to the socket, and the socket's reads to h2, without copying them. The
/// provided methods serve any byte stream.
pub trait Leg: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin {
    fn abort(&mut self);

    /// The next bytes this leg received, read into `buf` (at most `want` of them) unless the
    /// leg already holds them; `None` when the peer has finished.
    fn poll_read_chunk(
        &mut self,
        cx: &mut std::task::Context<'_>,
        buf: &mut bytes::BytesMut,
        want: usize,
    ) -> std::task::Poll<std::io::Result<Option<bytes::Bytes>>> {
        read_chunk(self, cx, buf, want)
    }

    /// Writes the start of `chunk` and advances it past what was written; returns that length.
    fn poll_write_chunk(
        &mut self,
        cx: &mut std::task::Context<'_>,
        chunk: &mut bytes::Bytes,
    ) -> std::task::Poll<std::io::Result<usize>> {
        let n = std::task::ready!(std::pin::Pin::new(self).poll_write(cx, chunk))?;
        bytes::Buf::advance(chunk, n);
        std::task::Poll::Ready(Ok(n))
    }
}

/// Reads into `buf` (at most `want` bytes) and splits what was read off as a chunk.
fn read_chunk<R: tokio::io::AsyncRead + Unpin + ?Sized>(
    r: &mut R,
    cx: &mut std::task::Context<'_>,
    buf: &mut bytes::BytesMut,
    want: usize,
) -> std::task::Poll<std::io::Result<Option<bytes::Bytes>>> {
    use std::task::ready;
    buf.clear();
    buf.reserve(want);
    // Read no more than `want` even when the buffer kept a larger capacity.
    let mut limited = bytes::BufMut::limit(&mut *buf, want);
    let n = ready!(tokio_util::io::poll_read_buf(std::pin::Pin::new(r), cx, &mut limited))?;
    std::task::Poll::Ready(Ok((n > 0).then(|| buf.split().freeze())))
}

impl Leg for tokio::net::TcpStream {
    fn abort(&mut self) {
        reset_on_close(self);
    }

    /// A read that drained the socket cleared its readiness, so a request/response connection
    /// asks here, and allocates a read buffer only when bytes (or the end) are waiting.
    fn poll_read_chunk(
        &mut self,
        cx: &mut std::task::Context<'_>,
        buf: &mut bytes::BytesMut,
        want: usize,
    ) -> std::task::Poll<std::io::Result<Option<bytes::Bytes>>> {
        std::task::ready!(self.poll_read_ready(cx))?;
        read_chunk(self, cx, buf, want)
    }
}

impl Leg for crate::hbone::Tunnel {
    fn abort(&mut self) {
        self.reset();
    }

    fn poll_read_chunk(
        &mut self,
        cx: &mut std::task::Context<'_>,
        _: &mut bytes::BytesMut,
        _: usize,
    ) -> std::task::Poll<std::io::Result<Option<bytes::Bytes>>> {
        self.stream().poll_chunk(cx)
    }

    fn poll_write_chunk(
        &mut self,
        cx: &mut std::task::Context<'_>,
        chunk: &mut bytes::Bytes,
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.stream().poll_send_chunk(cx, chunk)
    }
}

impl Leg for crate::hbone::H2Stream {
    fn abort(&mut self) {
        self.reset();
    }

    fn poll_read_chunk(
        &mut self,
        cx: &mut std::task::Context<'_>,
        _: &mut bytes::BytesMut,
        _: usize,
    ) -> std::task::Poll<std::io::Result<Option<bytes::Bytes>>> {
        self.poll_chunk(cx)
    }

    fn poll_write_chunk(
        &mut self,
        cx: &mut std::task::Context<'_>,
        chunk: &mut bytes::Bytes,
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.poll_send_chunk(cx, chunk)
    }
}

/// [`copy_both`], then, when the connection did not end cleanly on both sides (a leg failed or
/// `stop` cut it), aborts both legs: a reset on one side arrives as a reset on the other.
pub async fn relay<A: Leg, B: Leg>(a: &mut A, b: &mut B, stop: Stop<'_>) -> Copied {
    let c = copy_both(a, b, stop).await;
    if c.result.is_err() {
        a.abort();
        b.abort();
    }
    c
}

/// What ends a relay early, with the reason. Boxed: a future passed by value is stored again
/// at each level of `async fn` it goes down, and a relay task's future is copied whole when it
/// is spawned and when it completes.
pub type Stop<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = String> + Send + 'a>>;

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn tcp_pair(
        l: &tokio::net::TcpListener,
    ) -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        let c = tokio::net::TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        (c, l.accept().await.unwrap().0)
    }

    /// Reads grow while they fill, up to the largest, and come back down to the smallest once
    /// the traffic is small again (a burst does not leave 256 KiB reads behind).
    #[test]
    fn read_size_follows_the_traffic() {
        let mut want = MIN_READ;
        for _ in 0..10 {
            want = next_read_size(want, want);
        }
        assert_eq!(want, MAX_READ);
        // A read that filled a third of it keeps the size.
        assert_eq!(next_read_size(want, want / 3), MAX_READ);
        let mut steps = 0;
        while want > MIN_READ {
            want = next_read_size(want, 1024);
            steps += 1;
        }
        assert_eq!((want, steps), (MIN_READ, 4));
        assert_eq!(next_read_size(MIN_READ, 10), MIN_READ);
    }

    /// `copy_both` polls its stop future only when that future woke it: a stop that fires
    /// after many wake-ups by bytes must still end the relay, with its reason and the bytes
    /// moved until then.
    #[tokio::test]
    async fn a_stop_that_fires_mid_relay_ends_it_with_its_reason_and_the_bytes_moved() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (mut app, mut a) = tcp_pair(&l).await;
        let (mut b, mut server) = tcp_pair(&l).await;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let relay = tokio::spawn(async move {
            copy_both(&mut a, &mut b, async {
                let _ = rx.await;
                "stopped".to_string()
            })
            .await
        });
        for i in 0..20u8 {
            app.write_all(&[i]).await.unwrap();
            let mut got = [0u8; 1];
            server.read_exact(&mut got).await.unwrap();
            assert_eq!(got[0], i);
            server.write_all(&[i, i]).await.unwrap();
            let mut back = [0u8; 2];
            app.read_exact(&mut back).await.unwrap();
        }
        tx.send(()).unwrap();
        let c = tokio::time::timeout(Duration::from_secs(10), relay)
            .await
            .expect("the relay did not see its stop")
            .unwrap();
        assert_eq!(c.result, Err("stopped".to_string()));
        assert_eq!((c.ab, c.ba), (20, 40));
    }
}
