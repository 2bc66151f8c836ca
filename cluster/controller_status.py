"""`tidal controller status`: per replica of a running server, the settings the fleet controller tunes, the KV and
reserve state they act on, and the controller's last decisions with their reasons (GET /stats)."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from cluster.controller_policies import ChunkPolicy
from replicas import envs

LAST_DECISIONS = 5


def add_controller_parser(subparsers) -> None:
    p = subparsers.add_parser("controller", help="the fleet controller of a running server")
    sub = p.add_subparsers(dest="controller_command", required=True)
    status = sub.add_parser("status", help="per replica: budget, elastic mode, reserve, KV usage, last decisions")
    status.add_argument("--address", default="http://127.0.0.1:8000", help="the server's URL (tidal serve prints it)")
    status.add_argument("--api-key", default=envs.api_key(), help="the server's API key (default: $TIDAL_API_KEY)")
    status.add_argument("--json", action="store_true", help="the replicas' controller view as JSON")


def fetch_replicas(address: str, api_key: str | None) -> list[dict]:
    request = urllib.request.Request(f"{address.rstrip('/')}/stats")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.load(r)["data"]


def controller_view(replica: dict) -> dict:
    s, ctl = replica["stats"], replica.get("controller", {})
    state = ctl.get("state", {})
    return {"replica_id": replica["replica_id"],
            "policy": state.get("policy", "static"),
            "arm": state.get("arm"), "phase": state.get("phase"), "scores": state.get("scores"),
            "slo_loads": state.get("loads"), "prompts_waiting": state.get("queue"),
            "rounds": state.get("round", 0),
            "max_num_batched_tokens": s["max_num_batched_tokens"], "budget_limit": replica["budget_limit"],
            "elastic_mode": s["elastic_mode"], "elastic_available": replica["elastic_available"],
            "reserve_bytes": s["reserve_bytes"], "reserve_lent_bytes": s["reserve_lent_bytes"],
            "reserve_granted_blocks": s.get("reserve_granted_blocks", 0),
            "kv_blocks_used": s["kv_blocks_used"], "kv_blocks_total": s["kv_blocks_total"],
            "preemptions": s["preemptions"], "kv_admission_waits": s["kv_admission_waits"],
            "budget_evidence": ChunkPolicy.evidence_report(state),
            "decisions": ctl.get("log", [])[-LAST_DECISIONS:]}


def render(views: list[dict]) -> str:
    lines = []
    for v in views:
        kv = v["kv_blocks_used"] / v["kv_blocks_total"] if v["kv_blocks_total"] else 0.0
        reserve = "none" if not v["reserve_bytes"] else \
            f"{v['reserve_lent_bytes'] / 2**20:.0f} of {v['reserve_bytes'] / 2**20:.0f} MiB lent"
        if v["reserve_granted_blocks"]:
            reserve += f", {v['reserve_granted_blocks']} blocks given to KV at this budget"
        loads = ", ".join(f"{a} {x['ttft']:.2f}/{x['itl']:.2f}" for a, x in (v.get("slo_loads") or {}).items() if x)
        queue = ", ".join(f"{a} {x:.1f}" for a, x in (v.get("prompts_waiting") or {}).items())
        policy = v["policy"] + (f" ({v['phase']} {v['arm']}, scores {v['scores']}"
                                f"{f', mean TTFT/ITL over SLO {loads}' if loads else ''}"
                                f"{f', prompts waiting {queue}' if queue else ''})" if v["arm"] else "")
        lines += [f"replica {v['replica_id']}: policy {policy}, {v['rounds']} rounds",
                  f"  max_num_batched_tokens {v['max_num_batched_tokens']} (limit {v['budget_limit']}), "
                  f"elastic {v['elastic_mode']}{'' if v['elastic_available'] else ' (not available)'}, "
                  f"reserve {reserve}, KV {kv:.0%} of {v['kv_blocks_total']} blocks",
                  f"  since start: {v['preemptions']} preemptions, {v['kv_admission_waits']} admissions waited for KV"]
        if v["budget_evidence"]:
            lines.append("  chunk's evidence, requests that met both SLOs per budget: " + ", ".join(
                f"{b}: {e['met']:g} of {e['requests']}" for b, e in v["budget_evidence"].items()))
        for d in reversed(v["decisions"]):
            when = time.strftime("%H:%M:%S", time.localtime(d["at"]))
            lines.append(f"  {when} {'set' if d['applied'] else 'advised'} {d['knob']}={d['value']} ({d['reason']})")
        if not v["decisions"]:
            lines.append("  no decisions yet")
    return "\n".join(lines)


def run_controller_command(args) -> int:
    try:
        replicas = fetch_replicas(args.address, args.api_key)
    except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
        print(f"tidal controller status: cannot read {args.address}/stats: {e}")
        return 1
    views = [controller_view(r) for r in replicas]
    print(json.dumps(views, indent=1) if args.json else render(views))
    return 0
