//! Log lines in Istio's shape, so a pipeline that parses ztunnel's logs parses ours.
//!
//! Plain (`MBTUNNEL_LOG_FORMAT=text`, the default):
//! `<RFC 3339 time>\t<level>\t<target>[:<span>{<fields>}]…\t<message>\tk=v k=v …` — the level in
//! lower case, the crate prefix dropped from the target, string values quoted (Rust's `Debug`),
//! displayed values (`%addr`) and numbers bare.
//!
//! JSON (`MBTUNNEL_LOG_FORMAT=json`): one object per line with `level`, `time`, `scope` (the
//! target), `message`, the event's fields under their own names, and each enclosing span's fields
//! as an object under the span's name.
#![forbid(unsafe_code)]

use std::fmt;

use serde::ser::{SerializeMap, Serializer as _};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// The crate's own prefix, dropped from plain targets (`mbtunnel::proxy::inbound` → `proxy::inbound`).
const CRATE_PREFIX: &str = "mbtunnel::";

/// Plain lines, Istio's tab-separated shape.
#[derive(Clone, Copy, Debug, Default)]
pub struct IstioText;

/// JSON lines, Istio's keys.
#[derive(Clone, Copy, Debug, Default)]
pub struct IstioJson;

/// Writes `message` first (then a tab), the other fields as space-separated `k=v`.
struct TextFields<'w> {
    w: Writer<'w>,
    first: bool,
    res: fmt::Result,
}

impl Visit for TextFields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.record_debug(field, &value)
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if self.res.is_err() {
            return;
        }
        let name = field.name();
        self.res = if name == "message" {
            write!(self.w, "{value:?}\t")
        } else if name.starts_with("log.") {
            Ok(())
        } else {
            let sep = if std::mem::take(&mut self.first) { "" } else { " " };
            write!(self.w, "{sep}{name}={value:?}")
        };
    }
}

impl<'w> FormatFields<'w> for IstioText {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        w: Writer<'w>,
        fields: R,
    ) -> fmt::Result {
        let mut v = TextFields { w, first: true, res: Ok(()) };
        fields.record(&mut v);
        v.res
    }
}

impl<S, N> FormatEvent<S, N> for IstioText
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut w: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        SystemTime.format_time(&mut w)?;
        let meta = event.metadata();
        let level = meta.level().as_str().to_ascii_lowercase();
        let target = meta.target();
        write!(w, "\t{level}\t{}", target.strip_prefix(CRATE_PREFIX).unwrap_or(target))?;
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                write!(w, ":{}", span.metadata().name())?;
                let ext = span.extensions();
                if let Some(f) = ext.get::<FormattedFields<N>>().filter(|f| !f.is_empty()) {
                    write!(w, "{{{f}}}")?;
                }
            }
        }
        if event.fields().next().is_some() {
            w.write_char('\t')?;
        }
        ctx.format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

/// Serializes each field of an event into a JSON map under its own name.
struct JsonEntries<M: SerializeMap> {
    map: M,
    res: Result<(), M::Error>,
}

impl<M: SerializeMap> Visit for JsonEntries<M> {
    fn record_bool(&mut self, f: &Field, v: bool) {
        if self.res.is_ok() {
            self.res = self.map.serialize_entry(f.name(), &v);
        }
    }
    fn record_u64(&mut self, f: &Field, v: u64) {
        if self.res.is_ok() {
            self.res = self.map.serialize_entry(f.name(), &v);
        }
    }
    fn record_i64(&mut self, f: &Field, v: i64) {
        if self.res.is_ok() {
            self.res = self.map.serialize_entry(f.name(), &v);
        }
    }
    fn record_f64(&mut self, f: &Field, v: f64) {
        if self.res.is_ok() {
            self.res = self.map.serialize_entry(f.name(), &v);
        }
    }
    fn record_str(&mut self, f: &Field, v: &str) {
        if self.res.is_ok() {
            self.res = self.map.serialize_entry(f.name(), v);
        }
    }
    fn record_debug(&mut self, f: &Field, v: &dyn fmt::Debug) {
        if self.res.is_ok() {
            self.res = self.map.serialize_entry(f.name(), &format_args!("{v:?}"));
        }
    }
}

/// `fmt::Write` as `io::Write`, for serde_json.
struct Utf8Sink<'a, 'w>(&'a mut Writer<'w>);

impl std::io::Write for Utf8Sink<'_, '_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let s = std::str::from_utf8(buf).map_err(std::io::Error::other)?;
        self.0.write_str(s).map_err(std::io::Error::other)?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<S, N> FormatEvent<S, N> for IstioJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut w: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let mut time = String::with_capacity(32);
        SystemTime.format_time(&mut Writer::new(&mut time))?;
        let mut line = || -> Result<(), serde_json::Error> {
            let mut ser = serde_json::Serializer::new(Utf8Sink(&mut w));
            let mut map = ser.serialize_map(None)?;
            map.serialize_entry("level", &meta.level().as_str().to_ascii_lowercase())?;
            map.serialize_entry("time", &time)?;
            map.serialize_entry("scope", meta.target())?;
            let mut v = JsonEntries { map, res: Ok(()) };
            event.record(&mut v);
            v.res?;
            let mut map = v.map;
            if let Some(scope) = ctx.event_scope() {
                for span in scope.from_root() {
                    let ext = span.extensions();
                    if let Some(f) = ext.get::<FormattedFields<N>>() {
                        let fields: serde_json::Value = if f.is_empty() {
                            serde_json::Value::Object(Default::default())
                        } else {
                            serde_json::from_str(f).map_err(serde::ser::Error::custom)?
                        };
                        map.serialize_entry(span.metadata().name(), &fields)?;
                    }
                }
            }
            map.end()
        };
        line().map_err(|_| fmt::Error)?;
        writeln!(w)
    }
}

/// Span fields for [`IstioJson`]: a JSON object, so each span nests as one.
pub fn json_span_fields() -> JsonFields {
    JsonFields::new()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::prelude::*;

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn emit(json: bool) -> String {
        let buf = Buf::default();
        let b = buf.clone();
        let make = move || b.clone();
        let sub = tracing_subscriber::registry();
        let _g = if json {
            tracing::subscriber::set_default(
                sub.with(
                    tracing_subscriber::fmt::layer()
                        .event_format(IstioJson)
                        .fmt_fields(json_span_fields())
                        .with_writer(make),
                ),
            )
        } else {
            tracing::subscriber::set_default(
                sub.with(
                    tracing_subscriber::fmt::layer()
                        .event_format(IstioText)
                        .fmt_fields(IstioText)
                        .with_writer(make),
                ),
            )
        };
        // As in authz's tests: callsites cached on other test threads are asked again.
        tracing::callsite::rebuild_interest_cache();
        let addr: std::net::SocketAddr = "10.0.0.1:40000".parse().unwrap();
        tracing::event!(target: "access", parent: None, tracing::Level::INFO, src.addr = %addr,
            src.workload = "client", bytes_sent = 5u64, duration = "3ms", "connection complete");
        let span = tracing::info_span!("outbound", id = 7u64);
        span.in_scope(|| tracing::warn!(target: "mbtunnel::proxy::outbound", "refused"));
        let out = buf.0.lock().unwrap().clone();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn plain_lines_have_istios_fields_in_order() {
        let out = emit(false);
        let lines: Vec<&str> = out.lines().collect();
        let f: Vec<&str> = lines[0].split('\t').collect();
        assert_eq!(f.len(), 5, "{out}");
        assert!(f[0].ends_with('Z') && f[0].contains('T'), "{}", f[0]);
        assert_eq!(
            &f[1..],
            [
                "info",
                "access",
                "connection complete",
                r#"src.addr=10.0.0.1:40000 src.workload="client" bytes_sent=5 duration="3ms""#
            ]
        );
        let g: Vec<&str> = lines[1].split('\t').collect();
        // The message always ends with a tab, fields or not (as ztunnel's lines do).
        assert_eq!(&g[1..], ["warn", "proxy::outbound:outbound{id=7}", "refused", ""], "{out}");
    }

    #[test]
    fn json_lines_have_istios_keys() {
        let out = emit(true);
        let lines: Vec<serde_json::Value> =
            out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        let a = &lines[0];
        assert_eq!(a["level"], "info");
        assert_eq!(a["scope"], "access");
        assert_eq!(a["message"], "connection complete");
        assert_eq!(a["src.addr"], "10.0.0.1:40000");
        assert_eq!(a["src.workload"], "client");
        assert_eq!(a["bytes_sent"], 5);
        assert_eq!(a["duration"], "3ms");
        assert!(a["time"].as_str().unwrap().ends_with('Z'));
        let b = &lines[1];
        assert_eq!(b["scope"], "mbtunnel::proxy::outbound");
        assert_eq!(b["outbound"]["id"], 7);
    }
}
