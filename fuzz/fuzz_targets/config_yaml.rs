//! The local YAML config: any text either parses into a `Config` that passes `validate`, or is
//! refused with an error naming the file. A config that parses must survive being written back
//! out (as the admin config dump does) and read again unchanged.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use mbtunnel::config::Config;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let path = Path::new("fuzz.yaml");
    match Config::from_yaml(text, path) {
        Ok(cfg) => {
            cfg.validate().expect("a parsed config validates");
            let dumped = serde_yaml::to_string(&cfg).expect("a config serializes");
            let again = Config::from_yaml(&dumped, path)
                .unwrap_or_else(|e| panic!("serialized config does not parse: {e}\n{dumped}"));
            assert_eq!(cfg, again, "config changed in a YAML round trip:\n{dumped}");
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(!msg.is_empty());
        }
    }
});
