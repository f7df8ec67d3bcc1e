//! Statistics for the dudect-style timing reports in the tests: Welch's t between two classes of
//! inputs, optionally after cropping the slow tail, as dudect does, because preemption on a
//! shared machine produces outliers that swamp the means. The verdict printed is computed from
//! the statistic ([`verdict`]); with `MBTUNNEL_DUDECT_ASSERT=1` a report also asserts
//! |t| < [`T_THRESHOLD`] ([`conclude`]).
#![forbid(unsafe_code)]

/// dudect's threshold: |t| at or above it means the two classes' timings differ.
pub const T_THRESHOLD: f64 = 4.5;

/// Environment variable: when `1`, [`conclude`] asserts |t| < [`T_THRESHOLD`].
pub const ASSERT_ENV: &str = "MBTUNNEL_DUDECT_ASSERT";

/// Welch's t statistic between two samples (|t| above ~4.5 suggests a timing difference).
pub fn welch_t(a: &[f64], b: &[f64]) -> f64 {
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    let var = |x: &[f64], m: f64| {
        x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / (x.len().max(2) - 1) as f64
    };
    let (ma, mb) = (mean(a), mean(b));
    (ma - mb) / (var(a, ma) / a.len() as f64 + var(b, mb) / b.len() as f64).sqrt()
}

/// The verdict the number supports: "leak suspected" when |t| ≥ 4.5, "no evidence of leak at
/// N samples" below, "inconclusive" when t is not a number (an empty class, zero variance).
pub fn verdict(t: f64, samples: usize) -> String {
    if !t.is_finite() {
        format!("inconclusive: t = {t} at {samples} samples (empty class or zero variance)")
    } else if t.abs() >= T_THRESHOLD {
        format!("leak suspected: |t| = {:.2} >= {T_THRESHOLD} at {samples} samples", t.abs())
    } else {
        format!("no evidence of leak at {samples} samples (|t| = {:.2} < {T_THRESHOLD})", t.abs())
    }
}

/// Prints `label`'s statistic and [`verdict`]; under `MBTUNNEL_DUDECT_ASSERT=1` also asserts
/// |t| < 4.5 (an inconclusive t fails too). Returns the verdict.
pub fn conclude(label: &str, t: f64, samples: usize) -> String {
    let v = verdict(t, samples);
    println!("{label}: t = {t:+.2}: {v}");
    if std::env::var(ASSERT_ENV).as_deref() == Ok("1") {
        assert!(t.abs() < T_THRESHOLD, "{label}: {v}");
    }
    v
}

/// Prints, for each percentile cut, the two classes' means and Welch's t over the observations
/// (`(class 0 or 1, nanoseconds)`) at or below that percentile; then concludes (see
/// [`conclude`]) on the largest |t| over the cuts, as dudect does. Returns that t.
pub fn report_cropped(label: &str, obs: &[(usize, f64)], percentiles: &[usize]) -> f64 {
    let mut sorted: Vec<f64> = obs.iter().map(|o| o.1).collect();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let mut ts = Vec::new();
    for &pct in percentiles {
        let cut = sorted[(sorted.len() * pct / 100).min(sorted.len() - 1)];
        let class = |c: usize| -> Vec<f64> {
            obs.iter().filter(|o| o.0 == c && o.1 <= cut).map(|o| o.1).collect()
        };
        let (a, b) = (class(0), class(1));
        let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
        let t = welch_t(&a, &b);
        println!(
            "{label} (samples <= p{pct}): fixed mean {:.0} ns (n={}), random mean {:.0} ns \
             (n={}), Welch t = {t:.2}",
            mean(&a),
            a.len(),
            mean(&b),
            b.len(),
        );
        ts.push(t);
    }
    // A non-finite t (an empty class) wins, so that an inconclusive cut is never hidden.
    let worst = ts
        .iter()
        .copied()
        .find(|t| !t.is_finite())
        .or_else(|| ts.iter().copied().max_by(|a, b| a.abs().total_cmp(&b.abs())))
        .unwrap_or(f64::NAN);
    conclude(&format!("{label} (largest |t| over the cuts)"), worst, obs.len());
    worst
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdict_follows_the_number() {
        assert!(verdict(4.5, 1000).starts_with("leak suspected"), "{}", verdict(4.5, 1000));
        assert!(verdict(-7.0, 1000).starts_with("leak suspected"));
        let v = verdict(-1.2, 20_000);
        assert!(v.starts_with("no evidence of leak at 20000 samples"), "{v}");
        assert!(verdict(f64::NAN, 10).starts_with("inconclusive"));
    }

    #[test]
    fn welch_t_separates_shifted_samples_and_not_equal_ones() {
        let a: Vec<f64> = (0..1000).map(|i| (i % 17) as f64).collect();
        let b: Vec<f64> = (0..1000).map(|i| (i % 17) as f64 + 3.0).collect();
        assert!(welch_t(&a, &b).abs() > 10.0);
        let c: Vec<f64> = (0..1000).map(|i| ((i + 5) % 17) as f64).collect();
        assert!(welch_t(&a, &c).abs() < T_THRESHOLD);
    }

    #[test]
    fn report_concludes_on_the_largest_t() {
        // Class 1 is slower by a constant: every cut sees it.
        let obs: Vec<(usize, f64)> =
            (0..2000).map(|i| (i % 2, 100.0 + (i % 13) as f64 + 20.0 * (i % 2) as f64)).collect();
        assert!(report_cropped("shifted", &obs, &[50, 100]).abs() >= T_THRESHOLD);
        let same: Vec<(usize, f64)> =
            (0..2000).map(|i| (i % 2, 100.0 + (i / 2 % 13) as f64)).collect();
        assert!(report_cropped("same", &same, &[50, 100]).abs() < T_THRESHOLD);
    }
}
