//! Statistics for the dudect-style timing reports in the tests (they report, never assert):
//! Welch's t between two classes of inputs, optionally after cropping the slow tail, as dudect
//! does, because preemption on a shared machine produces outliers that swamp the means.
#![forbid(unsafe_code)]

/// Welch's t statistic between two samples (|t| above ~4.5 suggests a timing difference).
pub fn welch_t(a: &[f64], b: &[f64]) -> f64 {
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    let var = |x: &[f64], m: f64| {
        x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / (x.len().max(2) - 1) as f64
    };
    let (ma, mb) = (mean(a), mean(b));
    (ma - mb) / (var(a, ma) / a.len() as f64 + var(b, mb) / b.len() as f64).sqrt()
}

/// Prints, for each percentile cut, the two classes' means and Welch's t over the observations
/// (`(class 0 or 1, nanoseconds)`) at or below that percentile.
pub fn report_cropped(label: &str, obs: &[(usize, f64)], percentiles: &[usize]) {
    let mut sorted: Vec<f64> = obs.iter().map(|o| o.1).collect();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap());
    for &pct in percentiles {
        let cut = sorted[(sorted.len() * pct / 100).min(sorted.len() - 1)];
        let class = |c: usize| -> Vec<f64> {
            obs.iter().filter(|o| o.0 == c && o.1 <= cut).map(|o| o.1).collect()
        };
        let (a, b) = (class(0), class(1));
        let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
        println!(
            "{label} (samples <= p{pct}): fixed mean {:.0} ns (n={}), random mean {:.0} ns \
             (n={}), Welch t = {:.2}",
            mean(&a),
            a.len(),
            mean(&b),
            b.len(),
            welch_t(&a, &b)
        );
    }
}
