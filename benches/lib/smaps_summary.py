#!/usr/bin/env python3
"""Sums a process's resident memory by kind of mapping, from a copy of /proc/PID/smaps.

    benches/lib/smaps_summary.py FILE [FILE ...]

Kinds: the executable's own pages (text and data of the binary), shared libraries, [heap] (the
main arena), anonymous mappings of 64 MiB reservations (glibc's per-thread arenas) and other
anonymous memory (thread stacks, mmap'ed allocations, tables), [stack] and the rest. Prints one
column per file, in KiB.
"""
import re
import sys


def kinds(path):
    out = {}
    name, size = None, 0
    cur = None
    with open(path) as f:
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \d+\s*(.*)$", line)
            if m:
                lo, hi = int(m.group(1), 16), int(m.group(2), 16)
                perms, name = m.group(3), m.group(4).strip()
                size = hi - lo
                if name == "[heap]":
                    cur = "heap (main arena)"
                elif name.startswith("["):
                    cur = name
                elif name.endswith(("mbtunnel", "ztunnel")) or "/ztunnel" in name or "/mbtunnel" in name:
                    cur = "executable"
                elif name:
                    cur = "shared libraries"
                else:
                    cur = "anonymous"
                # Per-thread arenas live in 64 MiB-aligned reservations; their used part is rw-p.
                if cur == "anonymous" and perms.startswith("rw") and lo % (64 << 20) == 0:
                    cur = "anonymous: per-thread arena heaps"
                continue
            m = re.match(r"^Rss:\s+(\d+) kB", line)
            if m and cur:
                out[cur] = out.get(cur, 0) + int(m.group(1))
    return out


def main():
    files = sys.argv[1:]
    if not files:
        print(__doc__.strip())
        sys.exit(2)
    cols = [kinds(p) for p in files]
    names = sorted({k for c in cols for k in c}, key=lambda k: -max(c.get(k, 0) for c in cols))
    print("| kind | " + " | ".join(files) + " |")
    print("|---|" + "---|" * len(files))
    for k in names:
        print(f"| {k} | " + " | ".join(f"{c.get(k, 0):,} KiB" for c in cols) + " |")
    print("| total | " + " | ".join(f"{sum(c.values()):,} KiB" for c in cols) + " |")


if __name__ == "__main__":
    main()
