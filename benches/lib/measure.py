#!/usr/bin/env python3
"""CPU and memory accounting around one workload of benches/dataplane.sh.

  measure.py run --client PID --server PID [--apps PID,...] [--profilers PID,...] [--rss-at SECS]
                 --out FILE -- CMD...
      Runs CMD (stdout and stderr to FILE) and prints one JSON object:
        wall            seconds CMD ran
        cpu_client      CPU seconds (utime+stime from /proc/PID/stat, all threads) of the
        cpu_server      client-side and server-side proxy during that time
        cpu_apps        the same for the apps behind the server (nginx master and workers,
                        iperf3 server: the given PIDs and their children)
        cpu_loadgen     CPU seconds of CMD and its descendants (getrusage RUSAGE_CHILDREN)
        cpu_ksoftirqd   ksoftirqd threads (network receive work deferred out of our processes)
        cpu_profilers   the --profilers PIDs (`perf record` of a PERF=1 run): part of the bench,
                        so not foreign load, but CPU the proxies and apps could not use
        busy            machine-wide user+nice+system+irq+softirq seconds (/proc/stat), all CPUs
        foreign         (busy - all of the above) / wall: CPUs' worth of work done by processes
                        that are not part of the bench while it ran (other users' load)
        steal           steal seconds / wall (the hypervisor gave the CPU to someone else)
        rss_client_kib  VmRSS of each proxy (/proc/PID/status), read at --rss-at seconds into
        rss_server_kib  the run (default: at the end, before CMD's exit is noticed)
        csw_client      context switches (voluntary + involuntary, summed over the process's
        csw_server      threads from /proc/PID/task/*/status) of each proxy during the run
        rc              CMD's exit status
  measure.py idle --secs S
      Prints {"foreign": CPUs busy (user+nice+system+irq+softirq, all processes) / S, "steal": ...}.

Kernel note: without CONFIG_IRQ_TIME_ACCOUNTING, softirq work (the veth receive path) is charged
to the process that was running, usually the proxies or the apps, so it is part of their CPU, the
same way for both products. /proc/stat files those ticks under irq and softirq, not system, so
`busy` counts them too: without them, `busy - ours` would subtract from the machine's figure
work it never counted (hiding as much foreign load), and the machine would look idler than it
was (a wrk run at ~1.9 of 2 CPUs read as ~1.4).
"""
import json
import os
import resource
import subprocess
import sys
import threading
import time

TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return 0.0
    fields = s[s.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TCK  # utime, stime


def children_of(pids):
    """pids plus all their descendants (one scan of /proc)."""
    parent = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
        except OSError:
            continue
        parent[int(d)] = int(s[s.rindex(")") + 2:].split()[1])
    out = set(pids)
    grew = True
    while grew:
        grew = False
        for p, pp in parent.items():
            if pp in out and p not in out:
                out.add(p)
                grew = True
    return sorted(out)


def ksoftirqd_pids():
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/comm") as f:
                    if f.read().startswith("ksoftirqd"):
                        out.append(int(d))
            except OSError:
                pass
    return out


def stat_cpu():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user (guest included) + nice + system + irq + softirq: the per-process times this is
    # compared with include the interrupt work done while those processes ran.
    busy = v[0] + v[1] + v[2] + v[5] + v[6]
    steal = v[7] if len(v) > 7 else 0
    return busy / TCK, steal / TCK


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def ctx_switches(pid):
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total


def run(argv):
    opts = {"--apps": "", "--profilers": "", "--rss-at": "-1"}
    i = 0
    while argv[i] != "--":
        opts[argv[i]] = argv[i + 1]
        i += 2
    cmd = argv[i + 1:]
    client, server = int(opts["--client"]), int(opts["--server"])
    apps = children_of([int(p) for p in opts["--apps"].split(",") if p])
    ksirq = ksoftirqd_pids()
    profilers = [int(p) for p in opts["--profilers"].split(",") if p]
    rss_at = float(opts["--rss-at"])
    rss = {}

    def sample_rss():
        rss["client"], rss["server"] = rss_kib(client), rss_kib(server)

    c0, s0 = proc_cpu(client), proc_cpu(server)
    x0 = ctx_switches(client), ctx_switches(server)
    a0 = sum(proc_cpu(p) for p in apps)
    k0 = sum(proc_cpu(p) for p in ksirq)
    f0 = sum(proc_cpu(p) for p in profilers)
    b0, st0 = stat_cpu()
    t0 = time.monotonic()
    with open(opts["--out"], "w") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        timer = None
        if rss_at >= 0:
            timer = threading.Timer(rss_at, sample_rss)
            timer.start()
        rc = p.wait()
        if timer is not None:
            timer.cancel()
    t1 = time.monotonic()
    if "client" not in rss:
        sample_rss()
    c1, s1 = proc_cpu(client), proc_cpu(server)
    x1 = ctx_switches(client), ctx_switches(server)
    a1 = sum(proc_cpu(p) for p in apps)
    k1 = sum(proc_cpu(p) for p in ksirq)
    f1 = sum(proc_cpu(p) for p in profilers)
    b1, st1 = stat_cpu()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = t1 - t0
    r = {
        "wall": wall,
        "cpu_client": c1 - c0,
        "cpu_server": s1 - s0,
        "cpu_apps": a1 - a0,
        "cpu_loadgen": ru.ru_utime + ru.ru_stime,
        "cpu_ksoftirqd": k1 - k0,
        "cpu_profilers": f1 - f0,
        "busy": b1 - b0,
        "steal": (st1 - st0) / wall,
        "rss_client_kib": rss["client"],
        "rss_server_kib": rss["server"],
        "csw_client": x1[0] - x0[0],
        "csw_server": x1[1] - x0[1],
        "rc": rc,
    }
    ours = r["cpu_client"] + r["cpu_server"] + r["cpu_apps"] + r["cpu_loadgen"] + r["cpu_ksoftirqd"]
    ours += r["cpu_profilers"]
    r["foreign"] = max(0.0, r["busy"] - ours) / wall
    print(json.dumps(r))


def idle(argv):
    secs = float(argv[argv.index("--secs") + 1])
    b0, st0 = stat_cpu()
    time.sleep(secs)
    b1, st1 = stat_cpu()
    print(json.dumps({"foreign": (b1 - b0) / secs, "steal": (st1 - st0) / secs}))


if __name__ == "__main__":
    {"run": run, "idle": idle}[sys.argv[1]](sys.argv[2:])
