//! `mbtunnel speed --svg FILE`: the speed table as a picture. One group per algorithm: a bar for
//! the multi-buffer backend's signatures per second and one for BoringSSL single-op, on a log
//! axis (RSA-4096 and P-256 differ by ~300×), each labelled with its rate, the ratio beside the
//! pair. The CPU and the run's settings are the title, so a chart is never read without them.
#![forbid(unsafe_code)]

use std::fmt::Write;

use super::SpeedReport;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The SVG document.
pub fn svg(r: &SpeedReport) -> String {
    let rates: Vec<f64> = r
        .rows
        .iter()
        .flat_map(|row| [row.ifma_ops_per_s, Some(row.scalar_ops_per_s)])
        .flatten()
        .filter(|v| *v > 0.0)
        .collect();
    // Decades that hold every rate.
    let lo = rates.iter().cloned().fold(f64::INFINITY, f64::min).max(1.0).log10().floor();
    let hi = rates.iter().cloned().fold(1.0, f64::max).log10().ceil().max(lo + 1.0);
    let (left, width, bar, top) = (200.0, 520.0, 14.0, 64.0);
    let group = 2.0 * bar + 18.0;
    let height = top + group * r.rows.len() as f64 + 36.0;
    let x = |v: f64| left + (v.max(1.0).log10() - lo) / (hi - lo) * width;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{height}" font-family="sans-serif" font-size="12">"#,
        w = left + width + 120.0
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="10" y="20" font-size="14" font-weight="bold">Signatures per second on one core: {} (green) vs BoringSSL single-op (grey)</text>"#,
        esc(&r.backend)
    );
    let _ = writeln!(
        s,
        r#"<text x="10" y="40">{}; {:.2} s per measurement, median of {} interleaved rounds</text>"#,
        esc(&r.cpu),
        r.seconds_per_measurement,
        r.rounds
    );
    for d in lo as i32..=hi as i32 {
        let v = 10f64.powi(d);
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" y1="{1}" x2="{0:.1}" y2="{2}" stroke="#ddd"/><text x="{0:.1}" y="{3}" text-anchor="middle">{4}</text>"##,
            x(v),
            top - 8.0,
            height - 30.0,
            height - 14.0,
            fmt_rate(v)
        );
    }
    for (i, row) in r.rows.iter().enumerate() {
        let y = top + group * i as f64;
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            left - 8.0,
            y + bar + 4.0,
            esc(&row.algorithm)
        );
        let bars = [(row.ifma_ops_per_s, "#2e7d32"), (Some(row.scalar_ops_per_s), "#9e9e9e")];
        for (j, (v, colour)) in bars.iter().enumerate() {
            let Some(v) = v else { continue };
            let yy = y + j as f64 * bar;
            let _ = writeln!(
                s,
                r#"<rect x="{left}" y="{yy:.1}" width="{:.1}" height="{}" fill="{colour}"/><text x="{:.1}" y="{:.1}">{}/s</text>"#,
                (x(*v) - left).max(1.0),
                bar - 2.0,
                x(*v) + 4.0,
                yy + bar - 4.0,
                fmt_rate(*v)
            );
        }
        if let Some(q) = row.ratio {
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" font-weight="bold">{q:.2}×</text>"#,
                left + width + 60.0,
                y + bar + 4.0
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

/// 1234567 → "1.23M", 5833 → "5.8k", 781 → "781".
fn fmt_rate(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.3}M", v / 1e6)
    } else if v >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::speed::SpeedRow;

    #[test]
    fn every_row_has_its_bars_rates_and_ratio() {
        let row = |alg: &str, ifma: Option<f64>, scalar: f64| SpeedRow {
            algorithm: alg.into(),
            ifma_ops_per_s: ifma,
            scalar_ops_per_s: scalar,
            ratio: ifma.map(|i| i / scalar),
            batch_latency_us: None,
            ifma_per_batch: None,
            ifma_share_of_peak: None,
            crossover_batch: None,
        };
        let r = SpeedReport {
            cpu: "Test CPU <x>".into(),
            pinned_cpu: Some(1),
            ifma_peak_per_s: None,
            backend: "ifma".into(),
            backend_reason: String::new(),
            cpu_features: String::new(),
            seconds_per_measurement: 2.0,
            rounds: 5,
            rows: vec![row("RSA-2048", Some(5833.0), 1418.0), row("P-256", None, 55861.0)],
        };
        let s = svg(&r);
        assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"));
        assert!(s.contains("Test CPU &lt;x&gt;"), "{s}");
        // Two bars for RSA, one for P-256 (no IFMA figure), plus the background.
        assert_eq!(s.matches("<rect").count(), 4, "{s}");
        assert!(s.contains("5.8k/s") && s.contains("1.4k/s") && s.contains("56k/s"), "{s}");
        assert!(s.contains("4.11×"), "{s}");
        assert_eq!(fmt_rate(272_660.0), "273k");
        assert_eq!(fmt_rate(781.0), "781");
    }
}
