//! SPIFFE ids out of a peer certificate (what the TLS verify callbacks run on every handshake,
//! on bytes the peer chose): arbitrary DER must give an error or a list of valid ids, never a
//! panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mbtunnel::identity::Identity;

fuzz_target!(|data: &[u8]| {
    if let Ok(ids) = mbtunnel::tls::spiffe_ids_of(data) {
        for id in ids {
            let s = id.to_string();
            assert_eq!(s.parse::<Identity>().as_ref(), Ok(&id), "extracted id does not re-parse");
        }
    }
});
