//! Key-share prediction: a client sends one key share, for the group the destination chose last.
//!
//! By default a BoringSSL client whose first group is post-quantum sends two key shares, one
//! post-quantum (X25519MLKEM768) and one classical (X25519), so that a server without the hybrid
//! needs no second round trip. Every handshake then makes an X25519 key pair that a mesh peer
//! (mbtunnel or ztunnel, both of which pick the hybrid) throws away: the handshake-storm profile
//! (benches/README.md) put it at 3.8 % of the client proxy's CPU per new HBONE connection.
//!
//! A node proxy talks to the same few thousand peer addresses again and again, so it remembers
//! which group each destination chose in its last completed handshake and hints it to BoringSSL
//! (`SSL_set1_server_supported_groups_hint`, the mechanism of
//! draft-ietf-tls-key-share-prediction): the next ClientHello carries that one share. The
//! supported_groups list is unchanged, so a wrong guess (the address now serves a proxy that
//! prefers another group) costs a HelloRetryRequest round trip, never a failure or a weaker
//! group than the server would pick; the next handshake learns the new choice. Only a handshake
//! that completed, with the peer's certificate checked, teaches a prediction.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;

use boring::ssl::SslRef;
use foreign_types::ForeignTypeRef;

/// Destinations remembered at most; past it the table starts over (a node proxy talks to a few
/// thousand peer proxies at most; the cost of forgetting is one handshake with two shares).
const MAX_DESTINATIONS: usize = 16_384;

/// The group each destination chose in its last completed handshake.
#[derive(Debug, Default)]
pub struct Predictions {
    chosen: Mutex<HashMap<SocketAddr, u16>>,
}

impl Predictions {
    /// The group `dest` chose last, if any.
    pub fn get(&self, dest: SocketAddr) -> Option<u16> {
        self.chosen.lock().unwrap().get(&dest).copied()
    }

    /// Before a client handshake to `dest`: send only the share of the group it chose last.
    pub fn hint(&self, ssl: &mut SslRef, dest: SocketAddr) {
        let Some(group) = self.get(dest) else { return };
        // SAFETY: `ssl` is a live client SSL that has not started its handshake; BoringSSL
        // copies the one-element list before returning. A group the context does not support
        // is ignored by BoringSSL (it then sends its default shares), so the result needs no
        // handling beyond a log line.
        let ok =
            unsafe { boring_sys::SSL_set1_server_supported_groups_hint(ssl.as_ptr(), &group, 1) };
        if ok != 1 {
            tracing::debug!(%dest, group, "key-share hint refused");
        }
    }

    /// After a completed client handshake to `dest`: remember the group it chose.
    pub fn learn(&self, dest: SocketAddr, ssl: &SslRef) {
        if let Some(group) = ssl.curve() {
            self.remember(dest, group);
        }
    }

    fn remember(&self, dest: SocketAddr, group: u16) {
        let mut m = self.chosen.lock().unwrap();
        if m.get(&dest) == Some(&group) {
            return;
        }
        if m.len() >= MAX_DESTINATIONS {
            m.clear();
        }
        m.insert(dest, group);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_choice_wins_and_a_full_table_starts_over() {
        let p = Predictions::default();
        let a: SocketAddr = "10.0.0.1:15008".parse().unwrap();
        p.remember(a, 0x11ec);
        p.remember(a, 23);
        assert_eq!(p.get(a), Some(23));
        for i in 1..MAX_DESTINATIONS as u32 {
            p.remember(SocketAddr::from((std::net::Ipv4Addr::from(i), 1)), 29);
        }
        assert_eq!(p.chosen.lock().unwrap().len(), MAX_DESTINATIONS);
        let b: SocketAddr = "10.0.0.2:15008".parse().unwrap();
        p.remember(b, 0x11ec);
        assert_eq!(p.chosen.lock().unwrap().len(), 1);
        assert_eq!((p.get(a), p.get(b)), (None, Some(0x11ec)));
    }
}
