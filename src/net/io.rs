//! A read and write buffer under TLS, so the record layer costs one system call per many records
//! instead of two reads per record and one write per record.
//!
//! BoringSSL reads a record in two exact reads (its 5-byte header, then the body) and hands each
//! sealed record to the transport as its own write; h2 writes a DATA frame's 9-byte header and its
//! payload as two TLS writes. Over a plain socket that is ~5 system calls per 64 KiB moved each
//! way. Here reads fill up to [`BUF`] bytes at once and BoringSSL's small reads are served from
//! memory; writes collect until the TLS layer flushes (h2 flushes after each batch of frames,
//! BoringSSL after each handshake flight and alert) or [`BUF`] bytes are waiting.
//!
//! Memory: a buffer is allocated when first needed and freed whenever it is empty and the
//! socket has nothing more to give (a read that would block) or has taken everything (a flush),
//! so an idle pooled connection or a handshake waiting on its peer holds neither buffer.
//!
//! A socket write that fails (reset, broken pipe) ends the writing side: what was waiting is
//! dropped and every later write, flush or shutdown fails with the same kind of error at once.
//! Without that, a peer that resets after its handshake cost two more failing `sendto`s per
//! connection: h2's SETTINGS again, then the TLS `close_notify` behind it.
#![forbid(unsafe_code)]

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::net::gate::Gate;

/// Size of each buffer: four full TLS records.
pub const BUF: usize = 64 * 1024;

/// A byte stream with a read buffer and a write buffer of [`BUF`] bytes each.
pub struct Buffered<S> {
    inner: S,
    /// Read ahead, not yet consumed (filled without zeroing first: a fill is one `recv` into
    /// spare capacity, not a 64 KiB `memset` and then the `recv`).
    rbuf: BytesMut,
    wbuf: Vec<u8>,
    /// Bytes of `wbuf` already written.
    wpos: usize,
    /// The kind of error a socket write returned: writing is over.
    wfailed: Option<io::ErrorKind>,
    /// During a TLS handshake: the turn at the CPU its reads take and its waits give back.
    gate: Option<Box<Gate>>,
}

impl<S> Buffered<S> {
    pub fn new(inner: S) -> Buffered<S> {
        Buffered {
            inner,
            rbuf: BytesMut::new(),
            wbuf: Vec::new(),
            wpos: 0,
            wfailed: None,
            gate: None,
        }
    }

    /// Reads hand bytes on only once `gate` grants a turn; a read or write that has to wait
    /// on the peer gives the turn back (see [`crate::net::gate`]).
    pub fn set_gate(&mut self, gate: Gate) {
        self.gate = Some(Box::new(gate));
    }

    pub fn gate(&self) -> Option<&Gate> {
        self.gate.as_deref()
    }

    /// The handshake is over: reads and writes no longer take turns.
    pub fn end_gate(&mut self) {
        self.gate = None;
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Bytes held in memory: (read ahead not yet consumed, written but not yet sent).
    pub fn buffered(&self) -> (usize, usize) {
        (self.rbuf.len(), self.wbuf.len() - self.wpos)
    }

    /// Whether either buffer holds an allocation (for the memory tests).
    pub fn holds_memory(&self) -> bool {
        self.rbuf.capacity() != 0 || self.wbuf.capacity() != 0
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for Buffered<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (read_ahead, unsent) = self.buffered();
        f.debug_struct("Buffered")
            .field("inner", &self.inner)
            .field("read_ahead", &read_ahead)
            .field("unsent", &unsent)
            .finish()
    }
}

impl<S: AsyncWrite + Unpin> Buffered<S> {
    /// Writes out what the write buffer holds; frees it once empty.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check_writable()?;
        while self.wpos < self.wbuf.len() {
            let r = match Pin::new(&mut self.inner).poll_write(cx, &self.wbuf[self.wpos..]) {
                Poll::Ready(r) => r,
                Poll::Pending => {
                    // The peer is not taking what we sent: its turn, not ours.
                    if let Some(g) = &mut self.gate {
                        g.peer_waits();
                    }
                    return Poll::Pending;
                }
            };
            match r {
                Ok(0) => {
                    return Poll::Ready(Err(self.write_failed(io::ErrorKind::WriteZero.into())))
                }
                Ok(n) => self.wpos += n,
                Err(e) => return Poll::Ready(Err(self.write_failed(e))),
            }
        }
        self.wbuf = Vec::new();
        self.wpos = 0;
        Poll::Ready(Ok(()))
    }

    /// The error of the write that failed before, if one did.
    fn check_writable(&self) -> io::Result<()> {
        match self.wfailed {
            Some(kind) => Err(io::Error::new(kind, "an earlier write on this connection failed")),
            None => Ok(()),
        }
    }

    /// Ends the writing side after `e`: drops what waits and remembers the kind of error.
    fn write_failed(&mut self, e: io::Error) -> io::Error {
        self.wfailed = Some(e.kind());
        self.wbuf = Vec::new();
        self.wpos = 0;
        e
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Buffered<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if me.rbuf.is_empty() {
            // Empty. A read as large as the buffer gains nothing from it (but a gated read
            // needs the bytes in hand before it asks for a turn).
            if out.remaining() >= BUF && me.gate.is_none() {
                me.rbuf = BytesMut::new();
                return Pin::new(&mut me.inner).poll_read(cx, out);
            }
            // Consumed to the end: `reserve` takes the same allocation back from the start.
            me.rbuf.reserve(BUF);
            match tokio_util::io::poll_read_buf(Pin::new(&mut me.inner), cx, &mut me.rbuf) {
                Poll::Ready(Ok(0)) => {
                    me.rbuf = BytesMut::new();
                    return Poll::Ready(Ok(())); // EOF
                }
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => {
                    me.rbuf = BytesMut::new();
                    return Poll::Ready(Err(e));
                }
                Poll::Pending => {
                    // Nothing to read: hold no memory, and no turn, while waiting.
                    me.rbuf = BytesMut::new();
                    if let Some(g) = &mut me.gate {
                        g.peer_waits();
                    }
                    return Poll::Pending;
                }
            }
        }
        if let Some(g) = &mut me.gate {
            ready!(g.poll_turn(cx));
        }
        let n = out.remaining().min(me.rbuf.len());
        out.put_slice(&me.rbuf[..n]);
        me.rbuf.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Buffered<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        if me.wbuf.len() + data.len() > BUF {
            ready!(me.poll_drain(cx))?;
        }
        me.check_writable()?;
        if data.len() >= BUF {
            // Nothing waits in front of it: no need to copy.
            return match ready!(Pin::new(&mut me.inner).poll_write(cx, data)) {
                Err(e) => Poll::Ready(Err(me.write_failed(e))),
                ok => Poll::Ready(ok),
            };
        }
        if me.wbuf.capacity() == 0 {
            me.wbuf = Vec::with_capacity(BUF);
        }
        me.wbuf.extend_from_slice(data);
        Poll::Ready(Ok(data.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        ready!(me.poll_drain(cx))?;
        Pin::new(&mut me.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        ready!(me.poll_drain(cx))?;
        Pin::new(&mut me.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn small_writes_wait_for_a_flush_and_small_reads_come_from_one_fill() {
        let (a, mut b) = tokio::io::duplex(4 * BUF);
        let mut a = Buffered::new(a);
        a.write_all(b"hello").await.unwrap();
        a.write_all(b" world").await.unwrap();
        assert_eq!(a.buffered(), (0, 11), "nothing sent before the flush");
        let mut probe = [0u8; 1];
        let early = tokio::time::timeout(std::time::Duration::from_millis(50), b.read(&mut probe));
        assert!(early.await.is_err(), "the peer sees nothing before the flush");
        a.flush().await.unwrap();
        assert!(!a.holds_memory(), "an empty write buffer is freed");
        let mut got = [0u8; 11];
        b.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello world");

        // The peer sends 3 pieces; the buffered side reads them in 5-byte steps.
        b.write_all(b"0123456789abcdef").await.unwrap();
        let mut five = [0u8; 5];
        a.read_exact(&mut five).await.unwrap();
        assert_eq!(&five, b"01234");
        assert_eq!(a.buffered().0, 11, "the rest was read ahead in the same fill");
        let mut rest = [0u8; 11];
        a.read_exact(&mut rest).await.unwrap();
        assert_eq!(&rest, b"56789abcdef");
    }

    #[tokio::test]
    async fn large_and_mixed_transfers_arrive_intact_and_idle_holds_no_buffer() {
        let (a, b) = tokio::io::duplex(8 * 1024);
        let (mut a, mut b) = (Buffered::new(a), Buffered::new(b));
        let data: Vec<u8> = (0..(3 * BUF + 777) as u32).map(|i| (i * 31 % 253) as u8).collect();
        let d2 = data.clone();
        let w = tokio::spawn(async move {
            // Small, medium, buffer-sized and larger writes, flushed now and then.
            let sizes = [1usize, 9, 16384, BUF, 100, BUF + 5, 3];
            let mut off = 0;
            let mut i = 0;
            while off < d2.len() {
                let n = sizes[i % sizes.len()].min(d2.len() - off);
                a.write_all(&d2[off..off + n]).await.unwrap();
                if i % 3 == 0 {
                    a.flush().await.unwrap();
                }
                off += n;
                i += 1;
            }
            a.shutdown().await.unwrap();
            assert!(!a.holds_memory());
        });
        let mut got = Vec::new();
        let mut chunk = vec![0u8; 5000];
        loop {
            let n = b.read(&mut chunk).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&chunk[..n]);
        }
        w.await.unwrap();
        assert_eq!(got.len(), data.len());
        assert!(got == data, "bytes differ");
        assert!(!b.holds_memory(), "a reader at EOF holds no buffer");
    }

    /// Counts the writes that reach it; fails every one after the first `ok`.
    struct Breaks {
        ok: usize,
        calls: usize,
    }

    impl AsyncWrite for Breaks {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            data: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.calls += 1;
            if self.calls > self.ok {
                return Poll::Ready(Err(io::ErrorKind::ConnectionReset.into()));
            }
            Poll::Ready(Ok(data.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn a_failed_write_ends_writing_without_more_system_calls() {
        let mut a = Buffered::new(Breaks { ok: 1, calls: 0 });
        a.write_all(b"flight").await.unwrap();
        a.flush().await.unwrap();
        a.write_all(b"settings").await.unwrap();
        let e = a.flush().await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
        assert_eq!(a.get_ref().calls, 2);
        assert!(!a.holds_memory(), "what waited is dropped");
        // The close_notify and anything after it: the same error, and no write reaches the socket.
        let e = a.write_all(b"alert").await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
        assert_eq!(a.flush().await.unwrap_err().kind(), io::ErrorKind::ConnectionReset);
        assert_eq!(a.shutdown().await.unwrap_err().kind(), io::ErrorKind::ConnectionReset);
        assert_eq!(a.write(&[0u8; BUF]).await.unwrap_err().kind(), io::ErrorKind::ConnectionReset);
        assert_eq!(a.get_ref().calls, 2, "no write after the failed one");

        // A large write straight to the socket ends writing the same way.
        let mut b = Buffered::new(Breaks { ok: 0, calls: 0 });
        assert!(b.write(&[0u8; BUF]).await.is_err());
        assert!(b.write_all(b"x").await.is_err());
        assert_eq!(b.get_ref().calls, 1);
    }

    #[tokio::test]
    async fn a_reader_waiting_for_data_holds_no_buffer() {
        let (a, mut b) = tokio::io::duplex(1024);
        let mut a = Buffered::new(a);
        b.write_all(b"x").await.unwrap();
        let mut one = [0u8; 1];
        a.read_exact(&mut one).await.unwrap();
        let mut more = [0u8; 1];
        let pending = tokio::time::timeout(std::time::Duration::from_millis(20), a.read(&mut more));
        assert!(pending.await.is_err());
        assert!(!a.holds_memory(), "waiting with an empty buffer frees it");
    }
}
