//! OpenSSL's own single-op figures, from the `openssl` binary when one is on the machine:
//! `openssl speed -seconds N -elapsed rsa2048 rsa3072 rsa4096 ecdsap256`, one process, started
//! from the (pinned) measuring thread so it inherits the pin. Its RSA sign is a full
//! `RSA_sign`-style operation with PKCS#1 padding and blinding (OpenSSL 3 runs the two CRT
//! halves together with AVX-512 IFMA where the CPU has it); its ECDSA sign includes nonce
//! generation.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::process::Command;

/// Environment variable naming the `openssl` binary (default: `openssl` on PATH).
pub const OPENSSL_ENV: &str = "MBTUNNEL_OPENSSL";

fn binary() -> String {
    std::env::var(OPENSSL_ENV).ok().filter(|s| !s.is_empty()).unwrap_or_else(|| "openssl".into())
}

/// `openssl version`, or `None` when there is no usable binary.
pub fn version() -> Option<String> {
    let o = Command::new(binary()).arg("version").output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
}

/// Key of a figure: `rsa2048`, `rsa3072`, `rsa4096`, `ecdsap256`.
pub type Algo = &'static str;

/// Runs `openssl speed` once for `algos` and returns sign/s per algorithm it printed.
pub fn speed(algos: &[Algo], seconds: u32) -> Result<HashMap<String, f64>, String> {
    let o = Command::new(binary())
        .arg("speed")
        .arg("-seconds")
        .arg(seconds.max(1).to_string())
        .arg("-elapsed")
        .args(algos)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", binary()))?;
    if !o.status.success() {
        return Err(format!("openssl speed failed: {}", String::from_utf8_lossy(&o.stderr).trim()));
    }
    Ok(parse(&String::from_utf8_lossy(&o.stdout)))
}

/// Parses the summary lines of `openssl speed` (3.x):
/// `rsa 2048 bits 0.000664s 0.000030s   1505.9  33516.0` and
/// ` 256 bits ecdsa (nistp256)   0.0000s   0.0001s  24591.1   8057.0` — sign/s is the
/// next-to-last column.
pub fn parse(out: &str) -> HashMap<String, f64> {
    let mut m = HashMap::new();
    for line in out.lines() {
        let t: Vec<&str> = line.split_whitespace().collect();
        if t.len() < 4 {
            continue;
        }
        let key = if t[0] == "rsa" && t.get(2) == Some(&"bits") {
            format!("rsa{}", t[1])
        } else if t.get(2) == Some(&"ecdsa") && t.get(3) == Some(&"(nistp256)") {
            "ecdsap256".to_string()
        } else {
            continue;
        };
        if let Some(v) = t[t.len() - 2].parse::<f64>().ok().filter(|v| *v > 0.0) {
            m.insert(key, v);
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_openssl_3_summary() {
        let out = "\
                  sign    verify    sign/s verify/s
rsa 2048 bits 0.000664s 0.000030s   1505.9  33516.0
rsa 4096 bits 0.004000s 0.000100s    250.0  10000.0
                              sign    verify    sign/s verify/s
 256 bits ecdsa (nistp256)   0.0000s   0.0001s  24591.1   8057.0
";
        let m = parse(out);
        assert_eq!(m.get("rsa2048"), Some(&1505.9));
        assert_eq!(m.get("rsa4096"), Some(&250.0));
        assert_eq!(m.get("ecdsap256"), Some(&24591.1));
        assert_eq!(m.len(), 3);
    }
}
