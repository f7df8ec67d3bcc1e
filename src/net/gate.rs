//! Turns at the CPU for TLS handshakes, held only while a handshake has bytes to work on.
//!
//! A handshake alternates between work on this host (parsing a flight, key exchange, a signature,
//! verifying the peer's chain) and waits on the network (the peer's next flight). A permit held
//! across the whole handshake lets any peer that sends a partial ClientHello and then nothing
//! hold one of a fixed number of turns until its deadline: a few hundred such connections stop
//! every new handshake on the node. A [`Gate`] instead takes its permit when bytes have arrived
//! for the handshake to work on and gives it back whenever the handshake must wait for its peer
//! (a read that would block, or a write the peer does not take), so permits are only ever held
//! by work that is running, or queued to run, here. Waiters are served in arrival order.
//!
//! The gate also tells whose turn it is: [`Gate::peer_turn`] is set while the handshake waits
//! on its peer, and cleared as soon as it has something to do — what the pending-handshake
//! budget reads to evict connections that are waiting on the network rather than on us.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::PollSemaphore;

/// One handshake's access to a shared [`Semaphore`] of CPU turns.
pub struct Gate {
    sem: PollSemaphore,
    permit: Option<OwnedSemaphorePermit>,
    /// Set while the handshake waits on its peer (shared with whoever budgets pending ones).
    peer_turn: Arc<AtomicBool>,
}

impl Gate {
    pub fn new(sem: Arc<Semaphore>, peer_turn: Arc<AtomicBool>) -> Gate {
        Gate { sem: PollSemaphore::new(sem), permit: None, peer_turn }
    }

    /// Bytes are here to work on: resolves once this handshake holds a turn. A closed semaphore
    /// (never closed by the proxy) lets the work run rather than hang it.
    pub fn poll_turn(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.peer_turn.store(false, Ordering::Relaxed);
        if self.permit.is_none() {
            self.permit = std::task::ready!(self.sem.poll_acquire(cx));
        }
        Poll::Ready(())
    }

    /// The handshake waits on its peer: give the turn back.
    pub fn peer_waits(&mut self) {
        self.permit = None;
        self.peer_turn.store(true, Ordering::Relaxed);
    }

    /// Whether a turn is held now (tests).
    pub fn holds_turn(&self) -> bool {
        self.permit.is_some()
    }

    /// The flag [`Gate::peer_waits`] sets.
    pub fn peer_turn(&self) -> &Arc<AtomicBool> {
        &self.peer_turn
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::io::Buffered;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A read that has to wait for the peer gives its turn back; bytes arriving take it again,
    /// in arrival order behind whoever already waits for one.
    #[tokio::test]
    async fn a_turn_is_held_only_while_bytes_are_being_worked_on() {
        let sem = Arc::new(Semaphore::new(1));
        let (a, mut peer) = tokio::io::duplex(1024);
        let mut s = Buffered::new(a);
        s.set_gate(Gate::new(sem.clone(), Arc::default()));
        peer.write_all(b"hello").await.unwrap();
        let mut b = [0u8; 5];
        s.read_exact(&mut b).await.unwrap();
        assert!(s.gate().unwrap().holds_turn());
        assert_eq!(sem.available_permits(), 0);
        // Nothing more to read: the turn goes back while the read waits on the peer.
        let waiting = tokio::time::timeout(std::time::Duration::from_millis(50), s.read(&mut b));
        assert!(waiting.await.is_err(), "nothing was sent");
        assert_eq!(sem.available_permits(), 1, "a wait on the peer holds no turn");
        assert!(s.gate().unwrap().peer_turn().load(Ordering::Relaxed));
        // Someone else holds the only turn: bytes that arrive wait for it, unread.
        let other = sem.clone().acquire_owned().await.unwrap();
        peer.write_all(b"x").await.unwrap();
        let blocked = tokio::time::timeout(std::time::Duration::from_millis(50), s.read(&mut b));
        assert!(blocked.await.is_err(), "read without a turn");
        assert!(!s.gate().unwrap().peer_turn().load(Ordering::Relaxed), "our turn, queued");
        drop(other);
        assert_eq!(s.read(&mut b).await.unwrap(), 1);
        assert_eq!(b[0], b'x');
        // The handshake is over: the gate leaves and its turn with it.
        s.end_gate();
        assert_eq!(sem.available_permits(), 1);
    }
}
