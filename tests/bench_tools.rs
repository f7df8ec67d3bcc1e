//! The bench scripts' own arithmetic (`benches/lib/*.py`) on fixed inputs: the tables and
//! profile breakdowns in `benches/README.md` are only as right as it is.
//! - `perf_breakdown.py` files perf's symbols under the right kind of work (a substring rule once
//!   filed BoringSSL's AES-GCM decryption, `aes_gcm_dec_*`, under signatures) and reads
//!   `LABEL=FILE.perf@COST` arguments.
//! - `dataplane_report.py costs` turns one product run's raw outputs into each proxy's cost per
//!   unit of work, the figures the breakdowns are scaled by.
//!
//! Needs `python3` (`make test` installs it); without it the test fails rather than skips.

use std::path::{Path, PathBuf};
use std::process::Command;

fn lib_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/lib")
}

/// Runs `script` with benches/lib on the import path; panics with its output unless it exits 0.
fn python(script: &str, args: &[&str]) -> String {
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .env("PYTHONPATH", lib_dir())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap_or_else(|e| panic!("python3 (installed by `make test`): {e}"));
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "python3 failed:\n{text}");
    text
}

#[test]
fn perf_breakdown_files_symbols_by_kind_of_work() {
    let script = r#"
import perf_breakdown as pb
want = {
    "aes_gcm_dec_update_vaes_avx512": "symmetric",
    "aws_lc_0_33_0_sha512_block_data_order_nohw": "symmetric",
    "gcm_ghash_vpclmulqdq_avx512": "symmetric",
    "__ecp_nistz256_mul_montx": "signatures",
    "ec_GFp_nistp_recode_scalar_bits": "signatures",
    "EC_POINT_mul": "signatures",
    "bn_sqrx8x_internal": "signatures",
    "RSA_sign_pss_mgf1": "signatures",
    "mbtunnel::mb::rsa::sqr20": "signatures",
    "fiat_curve25519_adx_mul": "key exchange",
    "bssl::x25519_ge_scalarmult_base_adx": "key exchange",
    "Lcurve25519_x25519_scalarloop": "key exchange",
    "ge_p3_tobytes": "key exchange",
    "mlkem_encap": "key exchange",
    "_int_malloc": "allocator",
    "__memmove_avx512_unaligned_erms": "memory copies",
    "[k] finish_task_switch.isra.0": "kernel: scheduler",
    "[k] _copy_from_iter": "kernel: TCP/IP",
    "[k] tcp_sendmsg_locked": "kernel: TCP/IP",
    "h2::proto::connection::Connection<T,P,B>::poll": "the rest",
    "core::slice::sort::merge_sort": "the rest",
    "<core::fmt::Universal as Display>::fmt": "the rest",
}
bad = [(s, pb.kind_of(s), k) for s, k in want.items() if not pb.kind_of(s).startswith(k)]
assert not bad, "misfiled (symbol, got, want): %r" % bad
assert pb.parse("mb client=/x/wrk-client.perf@0.02055") == ("mb client", "/x/wrk-client.perf", 0.02055)
assert pb.parse("zt=/x/a@b.perf") == ("zt", "/x/a@b.perf", None)
print("ok")
"#;
    assert!(python(script, &[]).contains("ok"));
}

#[test]
fn dataplane_report_costs_per_proxy_and_unit() {
    let dir = std::env::temp_dir().join(format!("mbtunnel-bench-tools-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let put = |name: &str, text: &str| std::fs::write(dir.join(name), text).unwrap();
    let m = |client: f64, server: f64| {
        format!(
            r#"{{"wall": 5.0, "cpu_client": {client}, "cpu_server": {server}, "cpu_apps": 1.0,
               "cpu_loadgen": 1.0, "cpu_ksoftirqd": 0.0, "cpu_profilers": 0.0, "busy": 9.0,
               "steal": 0.0, "rss_client_kib": 13000, "rss_server_kib": 13000,
               "csw_client": 1, "csw_server": 1, "rc": 0, "foreign": 0.0}}"#
        )
    };
    // One stream: 4 GB received, 2.0 + 1.0 CPU-s.
    put("iperf1.json", &m(2.0, 1.0));
    put(
        "iperf1.out",
        r#"{"end": {"sum_received": {"bytes": 4000000000, "bits_per_second": 6.4e9}}}"#,
    );
    // wrk: 150,000 requests, 3.0 + 1.5 CPU-s.
    put("wrk.json", &m(3.0, 1.5));
    put(
        "wrk.out",
        "Running 5s test @ http://10.77.0.2/\n  2 threads and 16 connections\n\
         \x20 150000 requests in 5.00s, 170.00MB read\nRequests/sec:  30000.00\n\
         Transfer/sec:     34.00MB\n",
    );
    // Full handshakes: two s_time clients, 1,000 + 1,500 connections; server 0.9 CPU-s.
    put("hs.json", &m(0.0, 0.9));
    for (i, n) in [(1, 1000), (2, 1500)] {
        put(
            &format!("hs-{i}.out"),
            &format!("starting\n****\n\n{n} connections in 5.00 real seconds, 33 bytes read per connection\n"),
        );
    }
    let script = r#"
import sys, dataplane_report as r
got = {w: (u, round(c, 6), round(s, 6)) for w, u, c, s in r.costs(sys.argv[1])}
assert got == {
    "iperf1": ("CPU-s per GB", 0.5, 0.25),
    "wrk": ("CPU-s per 1000 requests", 0.02, 0.01),
    "hs": ("CPU-ms per handshake", 0.0, 0.36),
}, got
print("ok")
"#;
    let out = python(script, &[dir.to_str().unwrap()]);
    std::fs::remove_dir_all(&dir).ok();
    assert!(out.contains("ok"), "{out}");
}
