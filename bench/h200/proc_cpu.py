"""Per-process CPU during bench.serve_overhead's loaded runs (which process limits a Serve path).

    python proc_cpu.py sample OUT.tsv          # every 0.25 s until killed: time, pid, role, CPU seconds
    python proc_cpu.py report OUT.tsv RESULT.json
The report gives each role's CPU use (cores) over every loaded run that RESULT.json records (`ended_at`,
`seconds`)."""
import collections
import json
import os
import sys
import time

ROLES = (("LLMReplica", "replica"), ("spawn_main", "engine core"), ("ProxyActor", "proxy"),
         ("bench.serve_overhead", "client"), ("haproxy -f", "haproxy"), ("raylet", "raylet"), ("gcs_server", "gcs"),
         ("ServeController", "controller"))
TICK = os.sysconf("SC_CLK_TCK")


def role(pid: str) -> str | None:
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return next((r for key, r in ROLES if key in cmd), None)


def sample(path: str) -> None:
    with open(path, "w") as f:
        while True:
            now = time.time()
            for pid in filter(str.isdigit, os.listdir("/proc")):
                r = role(pid)
                if r is None:
                    continue
                try:
                    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
                except OSError:
                    continue
                f.write(f"{now:.3f}\t{pid}\t{r}\t{(int(fields[11]) + int(fields[12])) / TICK:.2f}\n")
            f.flush()
            time.sleep(0.25)


def report(path: str, result_path: str) -> None:
    series = collections.defaultdict(list)          # (pid, role) -> [(t, cpu)]
    for line in open(path):
        t, pid, r, cpu = line.rstrip("\n").split("\t")
        series[(pid, r)].append((float(t), float(cpu)))
    res = json.load(open(result_path))
    runs = [(f"direct {i + 1}", r["loaded"]) for i, r in enumerate(res.get("direct_runs", [res["direct"]]))]
    runs += [(f"front door {i + 1}", r["loaded"]) for i, r in enumerate(res.get("serve_runs", [res["serve"]]))]
    rep = res.get("replica_direct_ingress", {})
    runs += [(f"replica port {i + 1}", r["loaded"]) for i, r in enumerate(rep.get("serve_runs", []))]
    for name, run in runs:
        end = run["ended_at"]
        start = end - run["seconds"]
        use = collections.Counter()
        for (pid, r), pts in series.items():
            inside = [(t, c) for t, c in pts if start <= t <= end]
            if len(inside) >= 2:
                use[r] += (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
        print(f"{name:<16}" + "  ".join(f"{r} {u:.2f}" for r, u in use.most_common()))


if __name__ == "__main__":
    sample(sys.argv[2]) if sys.argv[1] == "sample" else report(sys.argv[2], sys.argv[3])
