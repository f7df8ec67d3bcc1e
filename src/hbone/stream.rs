//! One HBONE `CONNECT` stream as a byte stream, driven on `h2` directly so that a tunnel can end
//! the way its TCP legs end: cleanly with END_STREAM (the TCP FIN), or with `RST_STREAM`
//! (`CONNECT_ERROR`, RFC 9113 §8.5: "the TCP connection was reset or otherwise abnormally
//! closed") when a leg was reset or cut. hyper's upgraded streams cannot reset: dropping one
//! sends END_STREAM, so a cut on one side reached the other side's application as a clean EOF.
//!
//! Flow control: received data is given back to the peer's window as soon as it is read, and a
//! write never hands h2 more than the send capacity the peer granted, so neither direction
//! buffers more than the h2 windows however slow the other side is.
#![forbid(unsafe_code)]

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use h2::{Reason, RecvStream, SendStream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Largest write handed to h2 at once (the capacity reserved for it).
const MAX_WRITE: usize = 256 * 1024;

/// The two halves of a `CONNECT` stream.
pub struct H2Stream {
    send: SendStream<Bytes>,
    recv: RecvStream,
    /// Received bytes not yet read.
    buf: Bytes,
    /// END_STREAM sent.
    shut: bool,
}

impl H2Stream {
    pub fn new(send: SendStream<Bytes>, recv: RecvStream) -> H2Stream {
        H2Stream { send, recv, buf: Bytes::new(), shut: false }
    }

    /// Ends the stream abnormally: the peer's application sees a reset, not an EOF.
    pub fn reset(&mut self) {
        self.send.send_reset(Reason::CONNECT_ERROR);
    }
}

/// What a peer's `RST_STREAM` (or a broken connection) means to the reader or writer: `NO_ERROR`
/// is a clean end (a peer that has finished may reset to stop our sending); every other code —
/// `CONNECT_ERROR`, `CANCEL` (the peer dropped the stream without ending it) — is a reset.
fn io_error(e: h2::Error) -> io::Error {
    match e.reason() {
        Some(Reason::NO_ERROR) => io::Error::new(io::ErrorKind::BrokenPipe, e),
        Some(_) => io::Error::new(io::ErrorKind::ConnectionReset, e),
        None if e.is_io() => e.into_io().unwrap_or_else(|| io::Error::other("h2 I/O error")),
        None => io::Error::other(e),
    }
}

impl H2Stream {
    /// The next received bytes as h2 delivered them (no copy); `None` at the peer's END_STREAM.
    pub fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Option<Bytes>>> {
        if !self.buf.is_empty() {
            return Poll::Ready(Ok(Some(std::mem::take(&mut self.buf))));
        }
        loop {
            match ready!(self.recv.poll_data(cx)) {
                None => return Poll::Ready(Ok(None)),
                Some(Ok(b)) => {
                    // The bytes are ours now: let the peer send as many again.
                    let _ = self.recv.flow_control().release_capacity(b.len());
                    if !b.is_empty() {
                        return Poll::Ready(Ok(Some(b)));
                    }
                }
                Some(Err(e)) if e.reason() == Some(Reason::NO_ERROR) => {
                    return Poll::Ready(Ok(None))
                }
                Some(Err(e)) => return Poll::Ready(Err(io_error(e))),
            }
        }
    }

    /// Sends the start of `chunk`, as much as the peer's window allows, without copying it, and
    /// advances `chunk` past it; returns that length.
    pub fn poll_send_chunk(
        &mut self,
        cx: &mut Context<'_>,
        chunk: &mut Bytes,
    ) -> Poll<io::Result<usize>> {
        if chunk.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let n = ready!(self.poll_send_capacity(cx, chunk.len()))?;
        self.send.send_data(chunk.split_to(n), false).map_err(io_error)?;
        Poll::Ready(Ok(n))
    }

    /// Waits until the peer's window lets us send, and returns how much of `want` we may send.
    fn poll_send_capacity(&mut self, cx: &mut Context<'_>, want: usize) -> Poll<io::Result<usize>> {
        if self.shut {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        // A peer reset ends writing at once, even while waiting for window.
        if let Poll::Ready(r) = self.send.poll_reset(cx) {
            return Poll::Ready(Err(match r {
                Ok(reason) => io_error(reason.into()),
                Err(e) => io_error(e),
            }));
        }
        let want = want.min(MAX_WRITE);
        while self.send.capacity() == 0 {
            self.send.reserve_capacity(want);
            match ready!(self.send.poll_capacity(cx)) {
                Some(Ok(_)) => {}
                Some(Err(e)) => return Poll::Ready(Err(io_error(e))),
                None => return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
            }
        }
        Poll::Ready(Ok(self.send.capacity().min(want)))
    }
}

impl AsyncRead for H2Stream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.buf.is_empty() {
            match ready!(self.poll_chunk(cx))? {
                Some(b) => self.buf = b,
                None => return Poll::Ready(Ok(())),
            }
        }
        let n = out.remaining().min(self.buf.len());
        out.put_slice(&self.buf[..n]);
        self.buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for H2Stream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let n = ready!(self.poll_send_capacity(cx, data.len()))?;
        self.send.send_data(Bytes::copy_from_slice(&data[..n]), false).map_err(io_error)?;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // h2's connection task writes what was handed to it.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.shut {
            self.shut = true;
            // Capacity reserved for a write that will not come goes back to the connection.
            self.send.reserve_capacity(0);
            self.send.send_data(Bytes::new(), true).map_err(io_error)?;
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A client and a server `H2Stream` joined by one h2 connection over an in-memory pipe.
    async fn pair() -> (H2Stream, H2Stream) {
        let (c, s) = tokio::io::duplex(64 * 1024);
        let server = tokio::spawn(async move {
            let mut conn = h2::server::handshake(s).await.unwrap();
            let (req, mut respond) = conn.accept().await.unwrap().unwrap();
            let send = respond.send_response(http::Response::new(()), false).unwrap();
            tokio::spawn(async move { while conn.accept().await.is_some() {} });
            H2Stream::new(send, req.into_body())
        });
        let (sender, conn) = h2::client::handshake(c).await.unwrap();
        tokio::spawn(conn);
        let mut sender = sender.ready().await.unwrap();
        let req = http::Request::builder()
            .method(http::Method::CONNECT)
            .uri("10.0.0.1:80")
            .body(())
            .unwrap();
        let (resp, send) = sender.send_request(req, false).unwrap();
        let resp = resp.await.unwrap();
        (H2Stream::new(send, resp.into_body()), server.await.unwrap())
    }

    #[tokio::test]
    async fn bytes_cross_both_ways_beyond_the_default_window_and_end_with_eof() {
        let (mut a, mut b) = pair().await;
        // More than h2's default 64 KiB windows: flow control must be given back as read.
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let d2 = data.clone();
        let w = tokio::spawn(async move {
            a.write_all(&d2).await.unwrap();
            a.shutdown().await.unwrap();
            let mut back = Vec::new();
            a.read_to_end(&mut back).await.unwrap();
            back
        });
        let mut got = Vec::new();
        b.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, data);
        b.write_all(b"done").await.unwrap();
        b.shutdown().await.unwrap();
        assert_eq!(w.await.unwrap(), b"done");
    }

    #[tokio::test]
    async fn chunks_cross_without_copies_beyond_the_window_and_end_with_none() {
        let (mut a, mut b) = pair().await;
        let data = Bytes::from((0..1_000_000u32).map(|i| (i * 13 % 241) as u8).collect::<Vec<_>>());
        let d2 = data.clone();
        let w = tokio::spawn(async move {
            let mut rest = d2;
            while !rest.is_empty() {
                let before = rest.len();
                let n = std::future::poll_fn(|cx| a.poll_send_chunk(cx, &mut rest)).await.unwrap();
                assert_eq!(before - n, rest.len(), "the chunk advances by what was sent");
            }
            a.shutdown().await.unwrap();
            a // kept until the reader is done: dropping it would reset the stream
        });
        let mut got = Vec::new();
        while let Some(c) = std::future::poll_fn(|cx| b.poll_chunk(cx)).await.unwrap() {
            assert!(!c.is_empty(), "no empty chunks");
            got.extend_from_slice(&c);
        }
        drop(w.await.unwrap());
        assert!(got == data, "bytes differ ({} of {})", got.len(), data.len());
    }

    #[tokio::test]
    async fn a_reset_reaches_the_peer_as_a_reset_not_an_eof() {
        let (mut a, mut b) = pair().await;
        a.write_all(b"partial").await.unwrap();
        let mut buf = [0u8; 7];
        b.read_exact(&mut buf).await.unwrap();
        a.reset();
        let e = b.read(&mut buf).await.expect_err("reset, not EOF");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}");
        // The writer on the reset side's peer fails too.
        let mut failed = false;
        for _ in 0..10 {
            if b.write_all(&[0u8; 1024]).await.is_err() {
                failed = true;
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(failed, "writes to a reset stream fail");
    }

    #[tokio::test]
    async fn dropping_a_stream_without_ending_it_is_a_reset() {
        let (a, mut b) = pair().await;
        drop(a);
        let mut buf = [0u8; 4];
        let e = b.read(&mut buf).await.expect_err("an abandoned stream is not a clean end");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}");
    }
}
