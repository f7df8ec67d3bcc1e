//! TLS 1.3 session resumption between mbtunnel peers (`tls_resumption`, on by default).
//!
//! What keeps it as safe as a full handshake:
//! - Only PSK with (EC)DHE: BoringSSL sends tickets only to clients that offer `psk_dhe_ke` and
//!   never resumes without a fresh key exchange, so forward secrecy holds. No 0-RTT data.
//! - Ticket keys are BoringSSL's own random per-context keys; mbtunnel rebuilds its contexts every
//!   [`TICKET_KEY_ROTATION`], so no ticket key lives longer than that, and a new certificate (a
//!   new context) ends every ticket issued under the old one.
//! - A ticket's lifetime is at most [`MAX_TICKET_LIFETIME`] and at most the remaining lifetime of
//!   the client certificate that authenticated the session (set while verifying it,
//!   [`cap_lifetime`]); the client keeps a session no longer than the ticket's lifetime, the
//!   server certificate's remaining lifetime and its own certificate's.
//! - A resumed session's peer identity is checked again, exactly as after a full handshake:
//!   the client requires the expected destination identity, the server its trust domain (and
//!   authorization runs on the identity as for every connection).
//! - The client offers a session only to the address and expected identity it came from, and
//!   uses each ticket once.
//!
//! - Tickets go only to mbtunnel peers: a client with resumption on offers the ALPN token
//!   [`TICKETS_ALPN`] after `h2` (servers select `h2`; the token only says "this client keeps
//!   tickets", as Istio's `istio-peer-exchange` token marks mesh peers), and the server turns
//!   tickets off for any connection whose ClientHello lacks it. ztunnel and other clients, which
//!   never resume with us, cost no ticket (about 1 KB on the wire, a session serialization and
//!   an encryption per connection).
//!
//! ztunnel's client never offers a session (its server does send tickets, which our client
//! keeps and offers back; it resumes only if that server accepts them), so interoperability is
//! unchanged: a ztunnel server selects `h2` and ignores the token, a ztunnel client gets no
//! tickets from us.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use boring::asn1::Asn1Time;
use boring::ex_data::Index;
use boring::ssl::{ExtensionType, Ssl, SslContextBuilder, SslOptions, SslRef, SslSession};
use boring::x509::X509Ref;

use crate::identity::Identity;

/// Contexts (and with them BoringSSL's ticket keys) are rebuilt at least this often.
pub const TICKET_KEY_ROTATION: Duration = Duration::from_secs(3600);
/// The longest a ticket is valid.
pub const MAX_TICKET_LIFETIME: Duration = Duration::from_secs(3600);
/// Sessions the client keeps per destination (BoringSSL's server sends two per connection).
const PER_DESTINATION: usize = 2;
/// Destinations the client keeps sessions for, per local certificate.
const MAX_DESTINATIONS: usize = 4096;

/// The ALPN token an mbtunnel client with resumption on offers after `h2`.
pub const TICKETS_ALPN: &[u8] = b"mbtunnel-tickets";

/// A client's ALPN list (wire format): `h2`, then [`TICKETS_ALPN`] when it keeps tickets.
pub fn client_alpn(keeps_tickets: bool) -> Vec<u8> {
    let mut v = b"\x02h2".to_vec();
    if keeps_tickets {
        v.push(TICKETS_ALPN.len() as u8);
        v.extend_from_slice(TICKETS_ALPN);
    }
    v
}

/// Whether a ClientHello's ALPN extension body (a 2-byte length, then length-prefixed names)
/// names [`TICKETS_ALPN`].
pub fn offers_tickets(ext: &[u8]) -> bool {
    let Some(mut list) = ext.get(2..) else { return false };
    while let Some((&n, rest)) = list.split_first() {
        let Some(name) = rest.get(..usize::from(n)) else { return false };
        if name == TICKETS_ALPN {
            return true;
        }
        list = &rest[usize::from(n)..];
    }
    false
}

/// Where a client session may be offered: the expected server identity at one address.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SessionKey {
    pub expected: Identity,
    pub addr: SocketAddr,
}

/// The per-connection slot telling the new-session callback which key a ticket belongs to.
fn key_index() -> Index<Ssl, SessionKey> {
    static INDEX: OnceLock<Index<Ssl, SessionKey>> = OnceLock::new();
    *INDEX.get_or_init(|| Ssl::new_ex_index().expect("SSL ex_data index"))
}

/// Server side: tickets on, one per connection, each valid at most [`MAX_TICKET_LIFETIME`],
/// stateless (no session cache), bound to `sid_ctx`.
pub fn server_context(
    b: &mut SslContextBuilder,
    sid_ctx: &[u8],
) -> Result<(), boring::error::ErrorStack> {
    b.set_session_id_context(sid_ctx)?;
    // SAFETY: `b` owns a valid SSL_CTX; the calls store integers in it.
    unsafe {
        boring_sys::SSL_CTX_set_session_psk_dhe_timeout(
            b.as_ptr(),
            MAX_TICKET_LIFETIME.as_secs() as u32,
        );
        // One ticket per connection (BoringSSL sends two): a client uses each ticket once and
        // gets a new one with every connection, and each ticket costs an encryption.
        boring_sys::SSL_CTX_set_num_tickets(b.as_ptr(), 1);
    }
    // Tickets only for clients that say they keep them (mbtunnel peers).
    b.set_select_certificate_callback(|mut hello| {
        let alpn = hello.get_extension(ExtensionType::APPLICATION_LAYER_PROTOCOL_NEGOTIATION);
        if !alpn.is_some_and(offers_tickets) {
            hello.ssl_mut().set_options(SslOptions::NO_TICKET);
        }
        Ok(())
    });
    Ok(())
}

/// Lowers the lifetime of the session being negotiated on `ssl` (and of the tickets it will be
/// sent in) to `remaining`, if that is shorter. Called while verifying the peer's certificate.
pub fn cap_lifetime(ssl: &SslRef, remaining: Duration) {
    let Some(session) = ssl.session() else { return };
    let secs = remaining.as_secs().min(u64::from(u32::MAX)) as u32;
    if secs < session.timeout() {
        // SAFETY: during a full handshake `SSL_get_session` is the handshake's own new session,
        // which no other connection holds yet; setting its timeouts writes two integers.
        unsafe {
            boring_sys::SSL_SESSION_set_timeout(
                foreign_types::ForeignTypeRef::as_ptr(session),
                secs,
            );
        }
    }
}

/// Marks `ssl` as a connection to `key`, so tickets it receives are kept under `key`.
pub fn tag(ssl: &mut SslRef, key: SessionKey) {
    ssl.set_ex_data(key_index(), key);
}

/// The key a connection was tagged with.
pub fn key_of(ssl: &SslRef) -> Option<&SessionKey> {
    ssl.ex_data(key_index())
}

/// Offers `session` on `ssl`.
///
/// `session` must come from the same context as `ssl`: the cache holding it lives in that
/// context's [`super::Contexts`].
pub fn offer(ssl: &mut SslRef, session: &SslSession) -> Result<(), boring::error::ErrorStack> {
    // SAFETY: the session was created by a connection of the same SSL_CTX (see above), which is
    // what `SSL_set_session` requires.
    unsafe { ssl.set_session(session) }
}

struct Cached {
    session: SslSession,
    expires: Instant,
    /// The lifetime the server gave the ticket.
    ticket_lifetime: Duration,
}

/// Client sessions of one local certificate, by destination; each is used once.
#[derive(Default)]
pub struct ClientSessions {
    map: Mutex<HashMap<SessionKey, Vec<Cached>>>,
}

impl ClientSessions {
    /// A live session for `key`, removed from the cache.
    pub fn take(&self, key: &SessionKey) -> Option<SslSession> {
        let mut map = self.map.lock().unwrap();
        let list = map.get_mut(key)?;
        let now = Instant::now();
        list.retain(|c| c.expires > now);
        let c = list.pop();
        if list.is_empty() {
            map.remove(key);
        }
        c.map(|c| c.session)
    }

    /// Keeps `session` for `key` until `valid_for` from now.
    pub fn put(&self, key: SessionKey, session: SslSession, valid_for: Duration) {
        if valid_for.is_zero() {
            return;
        }
        let now = Instant::now();
        let mut map = self.map.lock().unwrap();
        if map.len() >= MAX_DESTINATIONS && !map.contains_key(&key) {
            map.retain(|_, l| l.iter().any(|c| c.expires > now));
            if map.len() >= MAX_DESTINATIONS {
                // Still full of live sessions: forget one destination (the next connection
                // there does a full handshake).
                let victim = map.keys().next().cloned();
                victim.map(|k| map.remove(&k));
            }
        }
        let list = map.entry(key).or_default();
        list.retain(|c| c.expires > now);
        if list.len() >= PER_DESTINATION {
            list.remove(0);
        }
        let ticket_lifetime = Duration::from_secs(u64::from(session.timeout()));
        list.push(Cached { session, expires: now + valid_for, ticket_lifetime });
    }

    /// Sessions kept now (tests, config dump).
    pub fn len(&self) -> usize {
        self.map.lock().unwrap().values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The longest lifetime a server gave a ticket kept now (tests).
    pub fn longest_ticket_lifetime(&self) -> Option<Duration> {
        let map = self.map.lock().unwrap();
        map.values().flatten().map(|c| c.ticket_lifetime).max()
    }
}

/// Time left until `not_after` (zero when past).
pub fn remaining(not_after: SystemTime) -> Duration {
    not_after.duration_since(SystemTime::now()).unwrap_or_default()
}

/// Time left on a certificate: zero when it has expired, is not valid yet, or its times cannot
/// be read. Read from BoringSSL's parse (no re-encoding, no second parser on the handshake path).
pub fn remaining_of(cert: &X509Ref) -> Duration {
    let Ok(now_asn1) = Asn1Time::days_from_now(0) else { return Duration::ZERO };
    let now = SystemTime::now();
    match super::verify::validity(cert, &now_asn1, now) {
        Some((from, until)) if from <= now => until.duration_since(now).unwrap_or_default(),
        _ => Duration::ZERO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tickets_token_is_found_anywhere_in_a_well_formed_alpn_list_only() {
        let ext = |names: &[&[u8]]| {
            let mut list = Vec::new();
            for n in names {
                list.push(n.len() as u8);
                list.extend_from_slice(n);
            }
            let mut e = (list.len() as u16).to_be_bytes().to_vec();
            e.extend(list);
            e
        };
        assert!(offers_tickets(&ext(&[b"h2", TICKETS_ALPN])));
        assert!(offers_tickets(&ext(&[TICKETS_ALPN, b"h2"])));
        assert!(!offers_tickets(&ext(&[b"h2"])));
        assert!(!offers_tickets(&ext(&[b"h2", b"mbtunnel-ticket"])));
        assert!(!offers_tickets(&[]));
        // Truncated: a name whose length runs past the end.
        let mut cut = ext(&[b"h2", TICKETS_ALPN]);
        cut.pop();
        assert!(!offers_tickets(&cut));
        assert_eq!(&client_alpn(true)[3..], &ext(&[TICKETS_ALPN])[2..]);
    }
}
