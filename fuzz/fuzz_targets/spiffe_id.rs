//! SPIFFE id parsing. Whatever parses prints back as exactly the input (the id has one spelling),
//! and a printed id never parses as a different id: the config validation and the certificate
//! checks both rely on `Identity::new(td, ns, sa).to_string().parse()` being unambiguous.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mbtunnel::identity::Identity;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };

    // The whole input as an id.
    if let Ok(id) = text.parse::<Identity>() {
        assert_eq!(id.to_string(), text, "Display does not round-trip");
        let json = serde_json::to_string(&id).expect("an id serializes");
        let back: Identity = serde_json::from_str(&json).expect("a serialized id deserializes");
        assert_eq!(back, id, "serde round trip changed the id");
    }

    // The input split into three parts, assembled by `Identity::new` and printed.
    let mut parts = text.splitn(3, '\u{0}');
    let (td, ns, sa) =
        (parts.next().unwrap_or(""), parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let built = Identity::new(td, ns, sa);
    if let Ok(parsed) = built.to_string().parse::<Identity>() {
        assert_eq!(parsed, built, "a printed id parsed as a different id");
    }
});
