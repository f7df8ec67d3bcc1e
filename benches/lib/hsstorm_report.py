#!/usr/bin/env python3
"""The table of benches/hsstorm.sh: handshake-bound connections between two nodes.

  hsstorm_report.py RUNS_DIR --cpu C --command CMD --date D --mbtunnel V --ztunnel V --note N
                    --readme FILE --write-readme 0|1

RUNS_DIR holds one directory per (N, configuration, round): first.json / again.json
(benches/lib/measure.py: both proxies' CPU), first.out / again.out (`mbtunnel tool storm`'s JSON
line), meta.json. Per N, pass and configuration: the median over rounds of connections per
second, of each proxy's CPU per connection and of the storm's p50/p99 latency, and the ratio of
the connections-per-second median to ztunnel's. With --write-readme 1 the text replaces what is
between the markers in FILE (appended the first time).
"""
import glob
import json
import os
import statistics
import sys

BEGIN = "<!-- hsstorm-bench:begin (written by benches/hsstorm.sh; a rerun replaces it) -->"
END = "<!-- hsstorm-bench:end -->"
CONFIGS = [
    ("ztunnel", "ztunnel pair (P-256)"),
    ("mbt-p256", "mbtunnel pair, P-256, resumption on"),
    ("mbt-p256-nores", "mbtunnel pair, P-256, resumption off"),
    ("mbt-p256-x25519", "mbtunnel pair, P-256, resumption on, X25519 (as the ztunnel pair)"),
    ("mbt-rsa", "mbtunnel pair, RSA-2048, resumption on"),
    ("mbt-rsa-nores", "mbtunnel pair, RSA-2048, resumption off"),
]
PASSES = [("first", "first contact"), ("again", "reconnect")]
# (configuration, pass) → (target ratio of conn/s to ztunnel's same pass, text)
TARGETS = {
    ("mbt-p256", "again"): (1.5, "≥ 1.5 (resumption)"),
    ("mbt-p256-nores", "again"): (1.0, "≥ 1.0 (no resumption)"),
    ("mbt-p256-nores", "first"): (1.0, "≥ 1.0 (no resumption)"),
}


def load(path):
    """The last JSON object line of `path` (a failed storm prints its error after it)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    return None


def collect(runs):
    """{(n, cfg, pass): [dict per round]} and the problems seen."""
    out, problems = {}, []
    for d in sorted(glob.glob(os.path.join(runs, "n*-*-r*"))):
        meta = load(os.path.join(d, "meta.json"))
        if not meta:
            problems.append("%s: no meta.json (the run did not finish)" % os.path.basename(d))
            continue
        held = meta.get("certs_held_before")
        if held is not None and held < meta["n"]:
            problems.append("%s: node A's proxy held %d of %d pod certificates when the storm began "
                            "(it fetches the rest on first use, inside the first-contact storm)"
                            % (os.path.basename(d), held, meta["n"]))
        for p, _ in PASSES:
            m, s = load(os.path.join(d, p + ".json")), load(os.path.join(d, p + ".out"))
            if not m or not s:
                problems.append("%s %s: no measurement" % (os.path.basename(d), p))
                continue
            if s.get("failed"):
                problems.append("%s %s: %d of %d connections failed (%s)"
                                % (os.path.basename(d), p, s["failed"], s["connections"],
                                   "; ".join(s.get("first_errors", [])[:2])))
            n = s["connections"]
            out.setdefault((meta["n"], meta["config"], p), []).append({
                "cps": s["conn_per_s"],
                "client_ms": m["cpu_client"] / n * 1000,
                "server_ms": m["cpu_server"] / n * 1000,
                "p50": s.get("p50_ms"),
                "p99": s.get("p99_ms"),
                "foreign": m.get("foreign", 0.0),
                # The machine's CPU per connection, by who spent it (ms): both proxies, the load
                # generator (`tool storm`), nginx, ksoftirqd, and the rest (kernel work charged to
                # no process of ours: interrupts, other threads).
                "proxies_ms": (m["cpu_client"] + m["cpu_server"]) / n * 1000,
                "loadgen_ms": m.get("cpu_loadgen", 0.0) / n * 1000,
                "apps_ms": m.get("cpu_apps", 0.0) / n * 1000,
                "ksoftirqd_ms": m.get("cpu_ksoftirqd", 0.0) / n * 1000,
                "busy_ms": m.get("busy", 0.0) / n * 1000,
                "cpus_busy": m.get("busy", 0.0) / m["wall"] if m.get("wall") else None,
                "others_ms": (m.get("busy", 0.0) - m["cpu_client"] - m["cpu_server"]) / n * 1000,
            })
    return out, problems


def med(rows, k):
    v = [r[k] for r in rows if r.get(k) is not None]
    return statistics.median(v) if v else None


def machine_table(data, ns):
    """Where the machine's CPU went per connection, and the rate the pair could reach at most.

    The storm saturates the machine (CPUs busy column), so connections per second are bounded by
    the machine's CPU per connection, of which the proxies are only a part: were an mbtunnel pair
    free, the ratio to ztunnel could reach at most ztunnel's machine CPU per connection over the
    rest of mbtunnel's (load generator, nginx, kernel), at the same CPUs busy.
    """
    out = ["Where the machine's CPU went, per connection (medians over the rounds; ms of CPU): "
           "*busy* is machine-wide user+system+irq+softirq time (`/proc/stat`) over the storm "
           "divided by N, *rest* is busy minus the named processes (kernel work charged to none "
           "of them). *Bound* is the connections-per-second ratio to ztunnel the pair would reach "
           "if its two proxies took no CPU at all: ztunnel's busy / (this pair's busy − its "
           "proxies, per round), valid while the machine is saturated. CPU times are counted in "
           "10 ms ticks: at N = 200 a tick is 0.05 ms per connection.", "",
           "| N | pass | pair | CPUs busy | busy / conn | both proxies | load generator | nginx | ksoftirqd | rest | bound vs ztunnel |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in ns:
        for p, pname in PASSES:
            zt = med(data.get((n, "ztunnel", p), []), "busy_ms")
            for cfg, cname in CONFIGS:
                rows = data.get((n, cfg, p))
                if not rows or med(rows, "busy_ms") is None:
                    continue
                busy, prox = med(rows, "busy_ms"), med(rows, "proxies_ms")
                named = prox + med(rows, "loadgen_ms") + med(rows, "apps_ms") + med(rows, "ksoftirqd_ms")
                bound = "–"
                others = med(rows, "others_ms")
                if cfg != "ztunnel" and zt and others and others > 0:
                    bound = "%.2f" % (zt / others)
                cb = med(rows, "cpus_busy")
                out.append("| {:,} | {} | {} | {} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {} |".format(
                    n, pname, cname, "%.2f" % cb if cb is not None else "–", busy, prox,
                    med(rows, "loadgen_ms"), med(rows, "apps_ms"), med(rows, "ksoftirqd_ms"),
                    max(0.0, busy - named), bound))
    return out + [""]


def main(argv):
    runs = argv[0]
    opts = {}
    i = 1
    while i < len(argv):
        opts[argv[i].lstrip("-")] = argv[i + 1]
        i += 2
    data, problems = collect(runs)
    ns = sorted({k[0] for k in data})
    conc = next((json.load(open(m)).get("conc") for m in glob.glob(os.path.join(runs, "*/meta.json"))), "?")
    lines = ["## Handshake-bound traffic between two nodes (`benches/hsstorm.sh`)", ""]
    lines.append("Measured %s on %s. Command: `%s` (as root). mbtunnel: `%s`; ztunnel: %s." % (
        opts.get("date", "?"), opts.get("cpu", "?"), opts.get("command", "?"), opts.get("mbtunnel", "?"),
        ("`%s`" % opts["ztunnel"]) if opts.get("ztunnel") else "absent"))
    if opts.get("note"):
        lines += ["", "**%s.**" % opts["note"]]
    lines += ["", "N client identities (one pod each, in-pod redirection on node A) each open one "
              "connection through both proxies, %s at a time; medians over the rounds (column R), configurations "
              "interleaved. *first contact*: a new HBONE connection and a full mTLS handshake per "
              "identity; *reconnect*: the same after the pooled connections idled out, where an "
              "mbtunnel client may resume its session. CPU per connection is each proxy's "
              "utime+stime over the storm divided by N; \"vs ztunnel\" is the ratio of connections "
              "per second to the ztunnel pair's in the same pass." % conc, ""]
    lines.append("| N | pass | pair | R | conn/s | vs ztunnel | client proxy CPU / conn | server proxy CPU / conn | p50 / p99 ms | target | met |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in ns:
        for p, pname in PASSES:
            zt = med(data.get((n, "ztunnel", p), []), "cps")
            for cfg, cname in CONFIGS:
                rows = data.get((n, cfg, p))
                if not rows:
                    continue
                cps = med(rows, "cps")
                ratio = ("%.2f" % (cps / zt)) if zt and cps is not None else "–"
                tgt, ttext = TARGETS.get((cfg, p), (None, "–"))
                met = "–"
                if tgt is not None and zt and cps is not None:
                    met = "yes" if cps / zt >= tgt else "no"
                lat = "%.1f / %.1f" % (med(rows, "p50"), med(rows, "p99")) if med(rows, "p50") is not None else "–"
                lines.append("| {:,} | {} | {} | {} | {:,.0f} | {} | {:.3f} ms | {:.3f} ms | {} | {} | {} |".format(
                    n, pname, cname, len(rows), cps, ratio, med(rows, "client_ms"), med(rows, "server_ms"), lat, ttext, met))
    lines.append("")
    lines += machine_table(data, ns)
    if problems:
        lines += ["Problems:", ""] + ["- " + p for p in problems] + [""]
    worst = max((r["foreign"] for v in data.values() for r in v), default=0.0)
    lines.append("Most CPUs of other load during a storm: %.2f." % worst)
    lines.append("")
    text = "\n".join(lines)
    print()
    print(text)
    if opts.get("write-readme") == "1" and opts.get("readme"):
        path = opts["readme"]
        try:
            with open(path) as f:
                cur = f.read()
        except OSError:
            cur = ""
        block = BEGIN + "\n" + text + END + "\n"
        if BEGIN in cur and END in cur:
            a = cur.index(BEGIN)
            b = cur.index(END) + len(END)
            cur = cur[:a] + block.rstrip("\n") + cur[b:]
        else:
            cur = cur.rstrip("\n") + "\n\n" + block
        with open(path, "w") as f:
            f.write(cur)
        print("hsstorm: table written to %s" % path)


if __name__ == "__main__":
    main(sys.argv[1:])
