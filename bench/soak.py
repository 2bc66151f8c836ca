"""Soak benchmark: a `tidal serve` under long mixed load with random client disconnects and a small KV pool.

    python -m bench.soak [--device cpu|cuda] [--model PATH] [--duration-s 600] [--concurrency 24]
        [--num-kv-blocks 48] [--max-model-len 512] [--max-num-seqs 16] [--sample-s 5] [--seed 0]
        [--request-timeout-s 120] [--client-timeout-s 180]
        [--serve-arg=--elastic=elastic ...] [--out bench/results/soak.json]

One server (`--replicas 1`, the KV pool fixed at --num-kv-blocks so that long prompts preempt), --concurrency
clients in a closed loop over raw HTTP (aiohttp: a client can drop its connection at any byte), each request
drawn (seeded) from KINDS: complete streams and plain answers, n > 1, several prompts per request, streams the
client drops after a few chunks, plain requests the client abandons before the answer, prompts near the model
length (KV pressure, preemption), prompts over it (400) and malformed bodies (4xx). Every answer is checked
against what its kind must get; anything else counts as lost (a 5xx, a stream without its [DONE], a dropped
connection the client did not drop, an error without an OpenAI error object, no answer within --client-timeout-s);
a request the server aborted at its deadline (`--request-timeout-s`, a 504 or an in-band `timeout` error) got its
answer and counts as `deadline`.
Every --sample-s the benchmark reads GET /stats (KV blocks in use, running and waiting sequences, the entries of
every per-request map, `EngineStats.bookkeeping`) and the resident memory of every process of the server's
session. After the load it waits for the server to go idle and records the same once more.

Verdicts: KV blocks in use back to 0 and every per-request map empty once idle; nothing lost; resident memory
flat: the median of the last quarter of the run within RSS_GROWTH_LIMIT of the median of its second quarter (the
first quarter is warm-up: allocator pools, compiled kernels, Ray's own caches).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import aiohttp
import psutil

from bench.provenance import provenance
from cluster.local_server import REPO, LocalServer

RSS_GROWTH_LIMIT = 0.05
IDLE_WITHIN_S = 60.0
WORDS = ("river", "engine", "garden", "winter", "signal", "harbor", "lantern", "orbit", "meadow", "circuit",
         "canyon", "violin", "glacier", "market", "compass", "thunder", "library", "pepper", "falcon", "mosaic")

# kind: (weight, what the client must get)
KINDS = {
    "chat_stream": (22, "200, chunks, a finish_reason, [DONE]"),
    "completion_n2": (12, "200, two choices, usage"),
    "multi_prompt_stream": (10, "200, every prompt's finish_reason, [DONE]"),
    "stream_dropped": (20, "200, the client drops the connection after 1-4 chunks"),
    "plain_abandoned": (10, "the client gives up after 0.05-1 s (or the answer came first: 200)"),
    "near_max_len": (10, "200 (a prompt of about 60% of the model length)"),
    "over_max_len": (8, "400 with an OpenAI error object"),
    "malformed": (8, "4xx with an OpenAI error object"),
}


@dataclass(frozen=True)
class Outcome:
    kind: str
    result: str             # "ok" | "dropped_by_client" | "deadline" | "lost"
    status: Optional[int]
    detail: str = ""


def deadline_or_lost(status: int, reply) -> str:
    """A 504 `timeout` error object is the server's answer at its deadline; any other failure lost the request."""
    error = reply.get("error") if isinstance(reply, dict) else None
    return "deadline" if status == 504 and isinstance(error, dict) and error.get("code") == "timeout" else "lost"


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class SoakClient:
    def __init__(self, url: str, model: str, args, rng: random.Random):
        self.url, self.model, self.args, self.rng = url, model, args, rng
        self.kinds = list(KINDS)
        self.weights = [KINDS[k][0] for k in self.kinds]

    async def one(self, session: aiohttp.ClientSession) -> Outcome:
        kind = self.rng.choices(self.kinds, self.weights)[0]
        try:
            return await asyncio.wait_for(getattr(self, kind)(session, kind), self.args.client_timeout_s)
        except asyncio.TimeoutError:
            return Outcome(kind, "lost", None, f"no answer within {self.args.client_timeout_s:g} s")
        except aiohttp.ClientError as e:
            return Outcome(kind, "lost", None, f"{type(e).__name__}: {e}")

    def _tokens(self) -> int:
        return self.rng.randint(4, 48)

    async def _stream(self, session, path: str, body: dict, kind: str, drop_after: Optional[int] = None,
                      choices: int = 1) -> Outcome:
        async with session.post(f"{self.url}{path}", json={**body, "stream": True}) as r:
            if r.status != 200:
                return Outcome(kind, "lost", r.status, (await r.text())[:200])
            finished, chunks = set(), 0
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    if len(finished) == choices:
                        return Outcome(kind, "ok", 200)
                    return Outcome(kind, "lost", 200, f"[DONE] with {len(finished)} of {choices} choices finished")
                event = json.loads(data)
                if "error" in event:
                    result = "deadline" if event["error"].get("code") == "timeout" else "lost"
                    return Outcome(kind, result, 200, f"in-band error {event['error']}")
                chunks += 1
                for choice in event.get("choices", []):
                    if choice.get("finish_reason"):
                        finished.add(choice["index"])
                if drop_after is not None and chunks >= drop_after:
                    r.close()                       # the client goes away mid-stream
                    return Outcome(kind, "dropped_by_client", 200)
            return Outcome(kind, "lost", 200, "the stream ended without [DONE]")

    async def chat_stream(self, session, kind):
        body = {"model": self.model, "max_tokens": self._tokens(), "temperature": self.rng.choice([0, 0.8]),
                "messages": [{"role": "user", "content": f"Write about {sentence(self.rng, 6)}."}]}
        return await self._stream(session, "/v1/chat/completions", body, kind)

    async def multi_prompt_stream(self, session, kind):
        prompts = [f"A story of {sentence(self.rng, 5)}:" for _ in range(3)]
        body = {"model": self.model, "prompt": prompts, "max_tokens": self._tokens(), "temperature": 0.7,
                "stop": [".", "\n\n"]}
        return await self._stream(session, "/v1/completions", body, kind, choices=len(prompts))

    async def stream_dropped(self, session, kind):
        body = {"model": self.model, "prompt": f"Tell me about {sentence(self.rng, 8)}.", "max_tokens": 200,
                "ignore_eos": True}
        return await self._stream(session, "/v1/completions", body, kind, drop_after=self.rng.randint(1, 4))

    async def completion_n2(self, session, kind):
        body = {"model": self.model, "prompt": f"Name {sentence(self.rng, 4)}:", "max_tokens": self._tokens(),
                "n": 2, "temperature": 1.0, "seed": self.rng.randrange(1 << 30)}
        async with session.post(f"{self.url}/v1/completions", json=body) as r:
            reply = await r.json(content_type=None)
            if r.status == 200 and len(reply.get("choices", [])) == 2 and reply.get("usage"):
                return Outcome(kind, "ok", 200)
            return Outcome(kind, deadline_or_lost(r.status, reply), r.status, json.dumps(reply)[:200])

    async def plain_abandoned(self, session, kind):
        body = {"model": self.model, "prompt": f"Explain {sentence(self.rng, 6)}.", "max_tokens": 200,
                "ignore_eos": True}
        try:
            async with asyncio.timeout(self.rng.uniform(0.05, 1.0)):
                async with session.post(f"{self.url}/v1/completions", json=body) as r:
                    reply = await r.json(content_type=None)
                    if r.status == 200:
                        return Outcome(kind, "ok", 200)
                    return Outcome(kind, deadline_or_lost(r.status, reply), r.status, json.dumps(reply)[:200])
        except TimeoutError:
            return Outcome(kind, "dropped_by_client", None)

    async def near_max_len(self, session, kind):
        words = int(self.args.max_model_len * 0.6)
        body = {"model": self.model, "prompt": sentence(self.rng, words), "max_tokens": 24, "ignore_eos": True}
        async with session.post(f"{self.url}/v1/completions", json=body) as r:
            reply = await r.json(content_type=None)
            if r.status == 200 and reply["usage"]["completion_tokens"] == 24:
                return Outcome(kind, "ok", 200)
            return Outcome(kind, deadline_or_lost(r.status, reply), r.status, json.dumps(reply)[:200])

    async def over_max_len(self, session, kind):
        body = {"model": self.model, "prompt": sentence(self.rng, 2 * self.args.max_model_len), "max_tokens": 8}
        return await self._expect_error(session, "/v1/completions", json.dumps(body), kind, {400})

    async def malformed(self, session, kind):
        bodies = [
            "{not json",
            json.dumps({"model": self.model, "prompt": "x", "temperature": -1}),
            json.dumps({"model": self.model, "prompt": "x", "max_tokens": -5}),
            json.dumps({"model": self.model, "messages": [{"role": "nobody", "content": "x"}]}),
            json.dumps({"model": "no-such-model", "prompt": "x"}),
            json.dumps({"model": self.model, "prompt": "x", "stop": ["s"] * 1000}),
            json.dumps({"model": self.model, "prompt": [[-1, 5]]}),
        ]
        path = "/v1/chat/completions" if "messages" in (body := self.rng.choice(bodies)) else "/v1/completions"
        return await self._expect_error(session, path, body, kind, set(range(400, 500)))

    async def _expect_error(self, session, path: str, body: str, kind: str, statuses: set[int]) -> Outcome:
        async with session.post(f"{self.url}{path}", data=body, headers={"Content-Type": "application/json"}) as r:
            try:
                error = (await r.json(content_type=None))["error"]
                ok = r.status in statuses and isinstance(error.get("message"), str)
            except (ValueError, KeyError, TypeError):
                ok = False
            return Outcome(kind, "ok" if ok else "lost", r.status, "" if ok else (await r.text())[:200])


def server_processes(server: LocalServer) -> list[psutil.Process]:
    try:
        root = psutil.Process(server.process.pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def role(proc: psutil.Process) -> str:
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return "gone"
    for needle, name in (("spawn_main", "engine_core"), ("LLMReplica", "replica"), ("haproxy", "haproxy"),
                         ("gcs_server", "ray_gcs"), ("raylet", "raylet"), ("ServeController", "serve_controller"),
                         ("Ingress", "ingress"), ("ProxyActor", "serve_proxy"), ("serve", "cli")):
        if needle in cmd:
            return name
    return "other"


def rss_by_role(server: LocalServer) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for proc in server_processes(server):
        try:
            out[role(proc)] += proc.memory_info().rss / 2**20
        except psutil.Error:
            continue
    return dict(out)


def read_stats(server: LocalServer) -> Optional[dict]:
    import urllib.request
    try:
        with urllib.request.urlopen(f"{server.url}/stats", timeout=30) as r:
            replicas = json.load(r)["data"]
    except (OSError, ValueError, KeyError):
        return None
    keys = ("kv_blocks_used", "kv_blocks_total", "num_running", "num_waiting", "preemptions", "requests_finished")
    stats = {k: sum(d["stats"][k] for d in replicas) for k in keys}
    maps: Counter = Counter()
    for d in replicas:
        maps.update(d["stats"].get("bookkeeping", {}))
    stats["bookkeeping"] = dict(maps)
    return stats


async def sample(server: LocalServer, t0: float, samples: list, every_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        stats = await asyncio.to_thread(read_stats, server)
        rss = await asyncio.to_thread(rss_by_role, server)
        samples.append({"t_s": round(time.monotonic() - t0, 2), "stats": stats, "rss_mib": rss,
                        "rss_total_mib": round(sum(rss.values()), 1)})
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


async def load(server: LocalServer, model: str, args) -> tuple[list[Outcome], list[dict], float]:
    outcomes: list[Outcome] = []
    samples: list[dict] = []
    stop_sampling = asyncio.Event()
    t0 = time.monotonic()
    end = t0 + args.duration_s
    sampler = asyncio.create_task(sample(server, t0, samples, args.sample_s, stop_sampling))
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def worker(i: int) -> None:
            client = SoakClient(server.url, model, args, random.Random(args.seed * 1000 + i))
            while time.monotonic() < end:
                outcome = await client.one(session)
                outcomes.append(outcome)
                if len(outcomes) % 100 == 0:
                    lost = sum(o.result == "lost" for o in outcomes)
                    print(f"  {time.monotonic() - t0:6.0f} s  {len(outcomes)} requests  {lost} lost", flush=True)

        await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
    loaded_s = time.monotonic() - t0
    stop_sampling.set()
    await sampler
    return outcomes, samples, loaded_s


def wait_idle(server: LocalServer) -> tuple[Optional[dict], float]:
    """The stats once KV blocks and every per-request map are back to 0 (or the last ones after IDLE_WITHIN_S)."""
    start = time.monotonic()
    stats = None
    while time.monotonic() - start < IDLE_WITHIN_S:
        stats = read_stats(server)
        if stats is not None and stats["kv_blocks_used"] == 0 and not any(stats["bookkeeping"].values()):
            break
        time.sleep(1.0)
    return stats, time.monotonic() - start


def rss_verdict(samples: list[dict]) -> dict:
    n = len(samples)
    if n < 8:
        return {"flat": None, "why": f"{n} samples: too few to judge"}
    second = [s["rss_total_mib"] for s in samples[n // 4:n // 2]]
    last = [s["rss_total_mib"] for s in samples[3 * n // 4:]]
    base, end = statistics.median(second), statistics.median(last)
    growth = (end - base) / base
    by_role = {}
    for name in samples[-1]["rss_mib"]:
        a = statistics.median(s["rss_mib"].get(name, 0.0) for s in samples[n // 4:n // 2])
        b = statistics.median(s["rss_mib"].get(name, 0.0) for s in samples[3 * n // 4:])
        by_role[name] = {"second_quarter_mib": round(a, 1), "last_quarter_mib": round(b, 1)}
    return {"flat": growth <= RSS_GROWTH_LIMIT, "limit": RSS_GROWTH_LIMIT, "growth": round(growth, 4),
            "second_quarter_median_mib": round(base, 1), "last_quarter_median_mib": round(end, 1), "by_role": by_role}


def report(result: dict) -> str:
    rows = [f"{'kind':<22}{'sent':>7}{'ok':>7}{'dropped':>9}{'deadline':>10}{'lost':>6}  must get"]
    for kind, counts in result["outcomes"].items():
        rows.append(f"{kind:<22}{counts['sent']:>7}{counts['ok']:>7}{counts['dropped_by_client']:>9}"
                    f"{counts['deadline']:>10}{counts['lost']:>6}  {KINDS[kind][1]}")
    idle, rss = result["idle"], result["rss"]
    v = result["verdicts"]
    rows += ["",
             f"requests {result['requests']} in {result['loaded_s']:.0f} s, preemptions {result['preemptions']}, "
             f"peak KV blocks {result['peak_kv_blocks_used']}/{result['kv_blocks_total']}",
             f"idle after {idle['after_s']:.1f} s: KV blocks in use {idle['kv_blocks_used']}, "
             f"per-request maps {idle['bookkeeping']}",
             f"RSS: second quarter {rss.get('second_quarter_median_mib')} MiB -> last quarter "
             f"{rss.get('last_quarter_median_mib')} MiB (growth {rss.get('growth')}, limit {RSS_GROWTH_LIMIT})",
             f"verdicts: {v}"]
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--num-kv-blocks", type=int, default=48, help="the KV pool (blocks of 16 tokens)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="the server's deadline per request")
    p.add_argument("--client-timeout-s", type=float, default=180.0, help="a client waiting longer lost its request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-arg", action="append", default=[], help="one more `tidal serve` flag (repeatable)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "soak.json")
    args = p.parse_args(argv)

    flags = ["--device", args.device, "--replicas", "1", "--num-kv-blocks", str(args.num_kv_blocks),
             "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
             "--max-ongoing-requests", str(4 * args.concurrency), "--request-timeout-s", str(args.request_timeout_s),
             *([] if args.model is None else ["--model", args.model]), *args.serve_arg]
    server = LocalServer(flags)
    try:
        model = server.wait_ready()
        print(f"soak: {args.concurrency} clients for {args.duration_s:.0f} s against {server.url} ({' '.join(flags)})",
              flush=True)
        outcomes, samples, loaded_s = asyncio.run(load(server, model, args))
        idle, idle_after_s = wait_idle(server)
        samples.append({"t_s": round(loaded_s + idle_after_s, 2), "stats": idle, "rss_mib": rss_by_role(server),
                        "idle": True})
        samples[-1]["rss_total_mib"] = round(sum(samples[-1]["rss_mib"].values()), 1)
        exit_code = server.stop()
    except BaseException:
        server.stop()
        raise

    by_kind: dict[str, dict] = {k: {"sent": 0, "ok": 0, "dropped_by_client": 0, "deadline": 0, "lost": 0}
                                for k in KINDS}
    for o in outcomes:
        by_kind[o.kind]["sent"] += 1
        by_kind[o.kind][o.result] += 1
    lost = [o for o in outcomes if o.result == "lost"]
    loaded = [s for s in samples if not s.get("idle") and s["stats"] is not None]
    rss = rss_verdict([s for s in samples if not s.get("idle")])
    idle = idle or {"kv_blocks_used": None, "bookkeeping": {}, "preemptions": None}
    result = {
        "requests": len(outcomes), "loaded_s": round(loaded_s, 1), "concurrency": args.concurrency,
        "outcomes": by_kind, "lost_examples": [vars(o) for o in lost[:20]],
        "preemptions": idle.get("preemptions"),
        "kv_blocks_total": max((s["stats"]["kv_blocks_total"] for s in loaded), default=None),
        "peak_kv_blocks_used": max((s["stats"]["kv_blocks_used"] for s in loaded), default=None),
        "peak_bookkeeping": {k: max(s["stats"]["bookkeeping"].get(k, 0) for s in loaded)
                             for k in (loaded[-1]["stats"]["bookkeeping"] if loaded else {})},
        "idle": {"after_s": round(idle_after_s, 1), "kv_blocks_used": idle["kv_blocks_used"],
                 "bookkeeping": idle["bookkeeping"]},
        "rss": rss,
        "server_exit_code": exit_code,
        "verdicts": {"nothing_lost": not lost, "kv_back_to_zero": idle["kv_blocks_used"] == 0,
                     "maps_back_to_zero": bool(idle["bookkeeping"]) and not any(idle["bookkeeping"].values()),
                     "rss_flat": rss["flat"], "clean_exit": exit_code == 0},
        "config": {k: (str(v.resolve().relative_to(REPO)) if isinstance(v, Path) and v.resolve().is_relative_to(REPO)
                       else str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "server_flags": flags,
        "samples": samples,
        "method": __doc__,
        "provenance": provenance(
            "bench.soak", argv, args.device, args.seed,
            warm_up="the first quarter of the run (excluded from the memory verdict)",
            counted="every request the clients sent, by kind and result; /stats and process RSS every --sample-s"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(report(result))
    print(f"wrote {args.out}")
    return 0 if all(v is not False for v in result["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
