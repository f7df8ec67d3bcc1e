//! Log lines a peer can cause once per connection, held to one per second per kind.
//!
//! A client that opens connections to 15008 and sends garbage, or an authenticated peer that
//! drops its connections before the HTTP/2 preface, would otherwise write a warning per
//! connection: tens of thousands of lines a second, the log pipeline's CPU and disk, and the one
//! line an operator needs buried under them. Each kind (a call site and its reason) logs its first
//! event at once and then at most one a second, with `suppressed` = the events of that kind left
//! out since its last line; the ones left out go to `debug`, so `RUST_LOG=debug` still shows
//! every event. The refusal and HTTP/2 error metrics count every event either way.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// At most one line per [`RateLog::EVERY`] per key; counts what it left out.
pub struct RateLog<K> {
    slots: Mutex<HashMap<K, Slot>>,
}

struct Slot {
    last: Instant,
    suppressed: u64,
}

impl<K: Hash + Eq> Default for RateLog<K> {
    fn default() -> Self {
        RateLog { slots: Mutex::new(HashMap::new()) }
    }
}

impl<K: Hash + Eq> RateLog<K> {
    pub const EVERY: Duration = Duration::from_secs(1);

    /// `Some(n)`: log this event now, standing for `n` earlier events of `key` that were not
    /// logged. `None`: leave it out (counted). Keys come from small fixed sets (call sites and
    /// metric reasons), so the map stays as small as they are.
    pub fn allow(&self, key: K, now: Instant) -> Option<u64> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        match slots.get_mut(&key) {
            Some(s) if now.saturating_duration_since(s.last) < Self::EVERY => {
                s.suppressed += 1;
                None
            }
            Some(s) => {
                s.last = now;
                Some(std::mem::take(&mut s.suppressed))
            }
            None => {
                slots.insert(key, Slot { last: now, suppressed: 0 });
                Some(0)
            }
        }
    }
}

/// `tracing::$level!` with a `suppressed` field when `$log` allows `$key` now, else
/// `tracing::debug!` with the same fields and message.
#[macro_export]
macro_rules! log_limited {
    ($log:expr, $key:expr, $level:ident, $($rest:tt)+) => {
        match $log.allow($key, std::time::Instant::now()) {
            Some(suppressed) => tracing::$level!(suppressed, $($rest)+),
            None => tracing::debug!($($rest)+),
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn each_key_speaks_once_a_second_and_counts_the_rest() {
        let log = RateLog::default();
        let t = Instant::now();
        assert_eq!(log.allow("a", t), Some(0));
        assert_eq!(log.allow("a", t + 10 * MS), None);
        assert_eq!(log.allow("b", t + 20 * MS), Some(0), "another key has its own second");
        assert_eq!(log.allow("a", t + 500 * MS), None);
        assert_eq!(log.allow("a", t + 1001 * MS), Some(2), "the two left out are counted");
        assert_eq!(log.allow("a", t + 1002 * MS), None);
        assert_eq!(log.allow("b", t + 1010 * MS), None, "b's second runs from its own line");
        assert_eq!(log.allow("b", t + 1020 * MS), Some(1));
        assert_eq!(log.allow("a", t + 2001 * MS), Some(1));
    }

    #[test]
    fn a_clock_that_goes_back_does_not_open_the_gate() {
        let log = RateLog::default();
        let t = Instant::now() + Duration::from_secs(5);
        assert_eq!(log.allow((), t), Some(0));
        assert_eq!(log.allow((), t - Duration::from_secs(3)), None);
    }
}
