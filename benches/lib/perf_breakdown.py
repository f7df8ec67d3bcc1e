#!/usr/bin/env python3
"""Where a proxy's CPU went, by kind of work, from `perf record` files.

  perf_breakdown.py LABEL=FILE.perf[@COST] [LABEL=FILE.perf[@COST] ...]

With @COST (the process's measured CPU per unit of work in the same run, e.g. ms per 1000
requests) each share is also given as that cost times the share, and a last pair of rows splits
the cost into kernel and user space: what a profile says a product could at best save.

Reads each profile's self time per symbol (`perf report --no-children --sort dso,sym`) and sums
it into a few kinds of work, the same rules for every product (ztunnel's rustls/aws-lc symbols
and mbtunnel's BoringSSL ones both name their primitives), and prints a markdown table: one
column per profile, shares of its samples in percent. Used for the handshake-storm profiles in
benches/README.md (`PERF=1 KEEP=1 README_WRITE=0 benches/hsstorm.sh`) and the data-plane ones
(`PERF=1 benches/dataplane.sh`; `benches/lib/dataplane_report.py costs RUN_DIR` gives the
@COST of each proxy).
"""
import re
import subprocess
import sys

# (kind, pattern on "dso symbol"), first match wins; kernel symbols are marked "[k]" by perf.
KINDS = [
    ("kernel: scheduler, futex, wake-ups",
     re.compile(r"\[k\].*(futex|schedule|switch|wake|ttwu|enqueue|dequeue|pick_next|select_task|"
                r"update_curr|update_load|native_queued_spin|irqentry_exit|ipi|_raw_spin_unlock_irq)")),
    ("kernel: TCP/IP, sockets, epoll, other syscalls", re.compile(r"\[k\]")),
    ("key exchange (X25519, ML-KEM)",
     re.compile(r"(?i)(x25519|curve25519|fe4_|\bfe_|(?<![a-z])ge_|mlkem|ml_kem|keccak|kyber|scalar_ntt|"
                r"matrix_expand|encrypt_cpa|centered_binomial|sha3|shake)")),
    ("signatures, certificates (ECDSA, RSA, X.509)",
     # (?<![a-z]): whole words, so that e.g. aes_gcm_dec_update or "universal" do not match.
     re.compile(r"(?i)(ecdsa|p256|nistz256|(?<![a-z])ecp_|(?<![a-z])ec_|(?<![a-z])bn_|bignum|"
                r"(?<![a-z])rsa|mont|mb::|ifma|x509|asn1|der::|"
                r"cbs_|cbb_|webpki|beeu|scalar_mul|point_)")),
    ("symmetric crypto, hashes, key schedule",
     re.compile(r"(?i)(aes|gcm|ghash|sha1|sha256|sha512|sha2|hkdf|hmac|chacha|poly1305)")),
    ("allocator", re.compile(r"(?i)(malloc|\bfree\b|cfree|_int_free|_int_malloc|unlink_chunk|realloc|"
                             r"calloc|alloc::|je_|jemalloc|sdallocx|mallocx|tcache|arena_)")),
    ("memory copies", re.compile(r"(?i)(memmove|memcpy|memset|memcmp)")),
]
OTHER = "the rest: runtime, HTTP/2, TLS state machine, proxy logic"


def kind_of(text):
    """The kind of work of one perf report entry: "[k] symbol" for kernel symbols, else the
    symbol."""
    return next((k for k, rx in KINDS if rx.search(text)), OTHER)


def shares(path):
    out = subprocess.run(
        ["perf", "report", "-i", path, "--no-children", "--sort", "sym", "--stdio", "-g", "none",
         "--percent-limit", "0"],
        capture_output=True, text=True, check=True).stdout
    got, samples = {}, None
    for line in out.splitlines():
        m = re.match(r"# Samples: (\S+)", line)
        if m:
            samples = m.group(1)
        m = re.match(r"\s+([\d.]+)%\s+(\[[.k]\])\s+(.*)", line)
        if not m:
            continue
        pct, mark, sym = float(m.group(1)), m.group(2), m.group(3)
        text = ("[k] " if mark == "[k]" else "") + sym
        kind = kind_of(text)
        got[kind] = got.get(kind, 0.0) + pct
    return got, samples


def parse(arg):
    """LABEL=FILE[@COST] -> (label, file, cost or None)"""
    label, rest = arg.split("=", 1)
    m = re.match(r"(.*)@([0-9.eE+-]+)$", rest)
    return (label, m.group(1), float(m.group(2))) if m else (label, rest, None)


def cell(d, kind, cost):
    pct = d.get(kind, 0.0)
    return "%.1f %%" % pct if cost is None else "%.1f %% (%.3g)" % (pct, cost * pct / 100)


def main(argv):
    cols = [parse(a) for a in argv]
    data = [(label, cost, *shares(path)) for label, path, cost in cols]
    print("| kind of work | " + " | ".join(label for label, _, _, _ in data) + " |")
    print("|---|" + "---|" * len(data))
    for kind in [k for k, _ in KINDS] + [OTHER]:
        print("| %s | %s |" % (kind, " | ".join(cell(d, kind, c) for _, c, d, _ in data)))
    print("| samples | %s |" % " | ".join(str(s) for _, _, _, s in data))
    if any(c is not None for _, c, _, _ in data):
        kern = [sum(v for k, v in d.items() if k.startswith("kernel")) for _, _, d, _ in data]
        print("| kernel, all kinds | %s |" % " | ".join(
            "%.1f %%" % k if c is None else "%.1f %% (%.3g)" % (k, c * k / 100)
            for k, (_, c, _, _) in zip(kern, data)))
        print("| user space, all kinds | %s |" % " | ".join(
            "%.1f %%" % (100 - k) if c is None else "%.1f %% (%.3g)" % (100 - k, c * (100 - k) / 100)
            for k, (_, c, _, _) in zip(kern, data)))


if __name__ == "__main__":
    main(sys.argv[1:])
