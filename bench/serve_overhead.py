"""Serve overhead benchmark: what Ray Serve adds over calling the engine in-process, with the same requests.

    python -m bench.serve_overhead [--model PATH|SHAPE] [--load-format auto|dummy] [--device cuda|cpu]
        [--num-prompts 256] [--max-tokens 128] [--concurrency 64] [--repeats 1] [--ingress auto|haproxy|proxy]
        [--streaming] [--out bench/results/serve_overhead.json]

Workload: prompts of --input-len random token ids (uniform in [100, vocab - 100), seed 0), each generating
exactly --max-tokens tokens (temperature 0, ignore_eos). Disjoint prompt sets (warm-up, idle, loaded; new ones
every repeat), so no measured prompt finds an earlier one in its engine's prefix cache. Every path takes its
SamplingParams from the same /v1/completions body (`CompletionRequest.sampling_params`: detokenization
included) and runs the EngineConfig that `tidal serve` builds from the same flags (1 replica, TP 1, elastic off,
default knobs; on a GPU each side gets its share of the GPU's memory, see GPU_MEMORY_UTILIZATION), with the
replica's stream-item budget (`EngineConfig.serving.stream_item_ms`: both engines merge a request's outputs alike).
Direct: AsyncLLMEngine in this process (its engine core in a child process, as in a replica); TTFT =
`generate()` entered -> first output carrying a token id; tokens = the token ids streamed.
Serve: `tidal serve --replicas 1 --tp 1` in a subprocess with its own local Ray cluster; POST /v1/completions,
stream=true, over one keep-alive aiohttp session in this process; TTFT = POST sent (body already encoded) ->
first SSE chunk holding a choice (a token, even if its text is still empty); tokens = the usage chunk's
completion_tokens. The client only scans SSE lines for fixed byte patterns and parses JSON once per request.
Two Serve paths: the front door (the URL `tidal serve` prints: HAProxy, or Serve's Python proxy with
--ingress proxy) with the direct run's prompts, and the replica's own HTTP port (Ray Serve's direct ingress,
which the throughput preset `tidal serve` sets turns on: no proxy hop, what a load balancer in front of the
replicas would use) with fresh prompts of the same kind (`replica_direct_ingress` in the JSON).
The direct engine stays up beside the server and every repeat runs all three paths, in an order that rotates:
each Serve run is compared with the direct run of its own repeat (the shared machines drift), and the headline
figures are the medians over repeats (`each_repeat`; `serve_runs`, `direct_runs`: every run's details).
Each path: the warm-up set (--warmup, default --concurrency, all at once), the idle set one request at a
time (concurrency 1), then the loaded set in a closed loop of --concurrency streams. Throughput = output tokens
/ wall time from the first send to the last token. process_cpu_s: this process's CPU time during a run (engine
caller and client on the direct path, only the HTTP client on a Serve path: close to `seconds` would mean the
client set the Serve figure).
Streaming figures of every run: TPOT per request ((last token - first token) / (tokens - 1), from the client's
clock: `tpot_ms` mean/median/p90/p99) and ITL, the gaps between a request's consecutive chunks that carry tokens,
all requests pooled (`itl_ms`; direct: engine outputs, Serve: SSE chunks with a choice), and those of the
steady state alone (`itl_ms_steady`: both chunks after the opening wave of --concurrency requests all had their
first token and before the last request was sent, so neither the burst of first prefills nor the drain counts);
`ttft_ms_after_opening_wave`: the TTFT of the requests sent after the first --concurrency.
A request that fails (an HTTP error, an error event, an incomplete stream) is counted in `failed`, not measured.
The loaded run also records the engine's counters meanwhile (`engine`: tokens per step, ms per step, steps
that ran a prefill, mean requests running and waiting in the engine sampled every 0.1 s; direct:
`AsyncLLMEngine.stats()`, Serve: GET /stats): a slower path either left the engine fewer requests to batch or
made its steps slower. On a Serve path it also records the CPU seconds the server's
processes spent on it by role (`server_cpu_s`: replica, ingress replicas, engine core, front door) and per chunk
streamed (`server_cpu_us_per_chunk`; `chunks`: the chunks that carried tokens): what the stream-item budget is set
against.
JSON keys ending in _c64 / _64 hold the --concurrency level (64 by default; `concurrency` records it).
Targets: added median TTFT <= 5 ms, Serve/direct output throughput >= 0.90 at 64 streams.
--streaming: the direct engine and the front door only, --concurrency 256 by default; writes the `streaming`
section of --out, keeping the file's other keys (`tpot_ms_c1`: mean TPOT of the one-at-a-time run through the front
door; `p99_itl_ms_c256`, `median_itl_ms_c256`, `mean_tpot_ms_c256`: its loaded run (`p99_itl_ms_c256_steady`: of
its steady state); `throughput_ratio`: Serve over direct output tok/s loaded, each path's repeats pooled (tokens
over seconds); `failed`: requests that failed on any path; the _c256 keys hold --concurrency, `concurrency` records
it; the others medians over repeats, `each_repeat` each repeat's with its own ratio). Targets:
TPOT <= 1.3 ms at one stream, p99 ITL <= 50 ms and median ITL <= 3x mean TPOT at 256 streams, throughput ratio >=
0.90, nothing failed.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Awaitable, Callable, Optional

import aiohttp
import torch

from cluster.app import AppArgs, api_server_count, engine_config
from cluster.benchmark.report import Summary, request_tpot
from cluster.local_server import LocalServer
from cluster.replica import replica_engine_config
from cluster.protocol import CompletionRequest
from bench.provenance import provenance
from bench.serve_overhead_report import (ITL_OVER_TPOT_TARGET, ITL_P99_TARGET_MS, THROUGHPUT_TARGET, TPOT_TARGET_MS,
                                         TTFT_TARGET_MS, progress, report, report_streaming)
from cluster.serve_cmd import READY_TIMEOUT_S
from replicas.async_engine import AsyncLLMEngine
from replicas import envs
from replicas.config import EngineConfig
from replicas.device import resolve_device



@dataclass(frozen=True)
class Workload:
    warmup: list[list[int]]
    idle: list[list[int]]
    loaded: list[list[int]]
    max_tokens: int
    concurrency: int


@dataclass(frozen=True)
class Stream:
    """One request as the caller saw it: `chunks` are the times (perf_counter) of the chunks that carried tokens;
    `error` is set, and nothing measured, when it failed."""
    start: float
    chunks: tuple[float, ...] = ()
    tokens: int = 0
    error: str = ""

    @property
    def ttft_s(self) -> float:
        return self.chunks[0] - self.start


MAX_ERRORS_KEPT = 10


def make_workload(args: argparse.Namespace, vocab: int, seed_offset: int = 0) -> Workload:
    rng = random.Random(args.seed + 1000 * seed_offset)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(100, vocab - 100) for _ in range(args.input_len)] for _ in range(n)]

    return Workload(prompts(args.warmup), prompts(args.idle_prompts), prompts(args.num_prompts), args.max_tokens,
                    args.concurrency)


def completion_body(model_id: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def closed_loop(send: Callable[[list[int]], Awaitable[Stream]], prompts: list[list[int]],
                      concurrency: int) -> tuple[list[Stream], float, float]:
    """Every prompt once, `concurrency` in flight; returns the streams, first send -> last token seconds and
    this process's CPU seconds meanwhile."""
    pending = iter(enumerate(prompts))
    streams: list[Optional[Stream]] = [None] * len(prompts)

    async def worker():
        for i, prompt in pending:
            start = time.perf_counter()
            try:
                streams[i] = await send(prompt)
            except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
                streams[i] = Stream(start, error=f"{type(e).__name__}: {e}"[:300])

    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    return streams, time.perf_counter() - start, time.process_time() - cpu


def summarize(streams: list[Stream], seconds: float, cpu_seconds: float, concurrency: int) -> dict:
    ok = [s for s in streams if not s.error]
    errors = [s.error for s in streams if s.error]
    tokens = sum(s.tokens for s in ok)
    tpots = [request_tpot(s.chunks[-1] - s.start, s.ttft_s, s.tokens) for s in ok]
    gaps = [b - a for s in ok for a, b in zip(s.chunks, s.chunks[1:])]
    return {"concurrency": concurrency, "num_requests": len(streams), "failed": len(errors),
            "errors": errors[:MAX_ERRORS_KEPT], "output_tokens": tokens, "chunks": sum(len(s.chunks) for s in ok),
            "seconds": seconds,
            "output_tok_s": tokens / seconds, "ttft_ms": asdict(Summary.of_seconds([s.ttft_s for s in ok])),
            "tpot_ms": asdict(Summary.of_seconds([t for t in tpots if t is not None])),
            "itl_ms": asdict(Summary.of_seconds(gaps)),
            "itl_ms_steady": asdict(Summary.of_seconds(steady_gaps(streams, concurrency))),
            "ttft_ms_after_opening_wave": asdict(Summary.of_seconds(
                [s.ttft_s for s in streams[concurrency:] if not s.error])),
            "process_cpu_s": cpu_seconds, "ended_at": time.time()}


def steady_gaps(streams: list[Stream], concurrency: int) -> list[float]:
    """The chunk gaps of the closed loop's steady state: both chunks after every stream of the opening wave (the
    first `concurrency` sent at once) had its first token, and before the last request was sent (after it, fewer
    streams run); empty when the two do not leave a span."""
    firsts = [s.chunks[0] for s in streams[:concurrency] if not s.error and s.chunks]
    if len(streams) <= concurrency or not firsts:
        return []
    begin, end = max(firsts), max(s.start for s in streams)
    return [b - a for s in streams if not s.error for a, b in zip(s.chunks, s.chunks[1:]) if begin <= a and b <= end]


COUNTED = ("num_steps", "prefill_steps", "generation_tokens", "num_running", "num_waiting", "max_num_batched_tokens")
Counters = Callable[[], Awaitable[dict[str, int]]]
SAMPLE_EVERY_S = 0.1            # how often the loaded run samples the engine's running and waiting requests


async def sample_queue(counters: Counters, samples: list[tuple[int, int]]) -> None:
    """Until cancelled: the engine's (running, waiting) requests every SAMPLE_EVERY_S."""
    while True:
        c = await counters()
        samples.append((c["num_running"], c["num_waiting"]))
        await asyncio.sleep(SAMPLE_EVERY_S)


async def measure(send: Callable[[list[int]], Awaitable[Stream]], work: Workload, counters: Counters,
                  cpu: Optional[Callable[[], Optional[dict[str, float]]]] = None) -> dict:
    """The three sets; the loaded run also records the engine's steps and generated tokens meanwhile (its mean
    batch and step time: whether a slower path starved the engine of requests or slowed its steps) and the
    requests it held, running and waiting, sampled every SAMPLE_EVERY_S (fewer running than --concurrency with none
    waiting: requests spent the difference between the client and the engine), its step budget at the start and the
    end (a served engine's controller may move it), and with `cpu` (CPU seconds so far
    per server role) what each role spent on it, in all and per streamed chunk."""
    await closed_loop(send, work.warmup, max(1, len(work.warmup)))
    idle = summarize(*await closed_loop(send, work.idle, 1), concurrency=1)
    before = await counters()
    cpu0 = cpu() if cpu is not None else None
    samples: list[tuple[int, int]] = []
    sampler = asyncio.create_task(sample_queue(counters, samples))
    try:
        loaded = summarize(*await closed_loop(send, work.loaded, work.concurrency), concurrency=work.concurrency)
    finally:
        sampler.cancel()
    cpu1 = cpu() if cpu0 is not None else None
    after = await counters()
    steps = max(1, after["num_steps"] - before["num_steps"])
    loaded["engine"] = {"steps": after["num_steps"] - before["num_steps"],
                        "prefill_steps": after["prefill_steps"] - before["prefill_steps"],
                        "mean_tokens_per_step": (after["generation_tokens"] - before["generation_tokens"]) / steps,
                        "step_ms": 1e3 * loaded["seconds"] / steps,
                        "mean_running": statistics.fmean(r for r, _ in samples) if samples else None,
                        "mean_waiting": statistics.fmean(w for _, w in samples) if samples else None,
                        "max_num_batched_tokens": [before["max_num_batched_tokens"], after["max_num_batched_tokens"]]}
    if cpu0 is not None and cpu1 is not None:
        spent = {role: cpu1[role] - cpu0[role] for role in cpu0}
        loaded["server_cpu_s"] = spent
        loaded["server_cpu_us_per_chunk"] = {role: 1e6 * v / max(1, loaded["chunks"]) for role, v in spent.items()}
    return {"idle": idle, "loaded": loaded}


def server_cpu_seconds(root_pid: int) -> Optional[dict[str, float]]:
    """CPU seconds so far of the server's processes (descendants of `root_pid`) by role: `replica` (Ray's
    ServeReplica workers), `ingress` (those of ingress replicas), `engine_core` (the replicas' children: the engine
    core, multiprocessing's helpers) and `front_door` (HAProxy, or Serve's proxy actor). None without psutil (Ray's
    own copy counts once ray is imported)."""
    try:
        import psutil
    except ImportError:
        return None
    out = {"replica": 0.0, "ingress": 0.0, "engine_core": 0.0, "front_door": 0.0}
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            command, parent = " ".join(proc.cmdline()), proc.parent()
            if "IngressReplica" in command:
                role = "ingress"
            elif "ServeReplica" in command:
                role = "replica"
            elif "haproxy" in proc.name() or "ProxyActor" in command:
                role = "front_door"
            elif parent is not None and "ServeReplica" in " ".join(parent.cmdline()):
                role = "engine_core"
            else:
                continue
            times = proc.cpu_times()
            out[role] += times.user + times.system
        except psutil.Error:
            continue
    return out


# ---- the direct path --------------------------------------------------------------------------

async def measure_direct(engine: AsyncLLMEngine, work: Workload) -> dict:
    body = CompletionRequest.model_validate(completion_body("direct", [0], work.max_tokens))
    params = body.sampling_params(engine.config.limits.max_schema_bytes)
    ids = itertools.count()

    async def send(prompt: list[int]) -> Stream:
        start, chunks, tokens = time.perf_counter(), [], 0
        async for out in engine.generate(prompt, params, f"direct-{next(ids)}"):
            n = len(out.outputs[0].delta_token_ids)
            if n:
                chunks.append(time.perf_counter())
            tokens += n
        return Stream(start, tuple(chunks), tokens)

    async def counters() -> dict[str, int]:
        stats = await asyncio.to_thread(engine.stats)
        return {k: getattr(stats, k) for k in COUNTED}

    return await measure(send, work, counters)


# ---- the Serve path ---------------------------------------------------------------------------

async def measure_serve(base_url: str, model_id: str, work: Workload, server_pid: Optional[int] = None) -> dict:
    url = f"{base_url}/v1/completions"
    headers = {"Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def send(prompt: list[int]) -> Stream:
            body = json.dumps(completion_body(model_id, prompt, work.max_tokens)).encode()
            start, chunks, usage, done = time.perf_counter(), [], None, False
            async with session.post(url, data=body, headers=headers) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                async for line in resp.content:
                    if b'"choices":[{' in line:
                        chunks.append(time.perf_counter())
                    elif line.startswith(b"data: [DONE]"):
                        done = True
                    elif line.startswith(b'data: {"error"'):
                        raise RuntimeError(f"error event: {line[6:306].decode(errors='replace')}")
                    elif b'"usage":' in line:
                        usage = json.loads(line[6:])["usage"]
            if not done or not chunks or usage is None:
                raise RuntimeError(f"incomplete stream (done={done}, chunks={len(chunks)}, usage={usage})")
            return Stream(start, tuple(chunks), int(usage["completion_tokens"]))

        async def counters() -> dict[str, int]:
            async with session.get(f"{base_url}/stats") as resp:
                stats = [r["stats"] for r in (await resp.json())["data"]]
            return {k: (max if k == "max_num_batched_tokens" else sum)(s[k] for s in stats) for k in COUNTED}

        return await measure(send, work, counters,
                             (lambda: server_cpu_seconds(server_pid)) if server_pid is not None else None)


# ---- driver -----------------------------------------------------------------------------------

def resolve_model(args: argparse.Namespace) -> Optional[str]:
    """A bench.engine shape name with --load-format dummy becomes a folder holding its config.json."""
    from bench.shapes import SHAPES, write_shape
    if args.load_format == "dummy" and args.model in SHAPES:
        return write_shape(args.model)
    return os.path.abspath(args.model) if args.model else None


# The direct engine stays up beside the server so that every repeat measures both, minutes apart at most: on a
# shared machine the engine core's speed drifts by a quarter between runs. Each side's KV cache is sized from
# what the GPU has free (other processes included): the direct engine takes 0.3 of the GPU, the server's limit
# of 0.6 leaves it about as much. Both are far more blocks than the load needs.
GPU_MEMORY_UTILIZATION = {"direct": 0.3, "serve": 0.6}


def serve_flags(model: Optional[str], args: argparse.Namespace) -> list[str]:
    flags = ["--device", args.device, "--replicas", "1", "--tp", "1", "--ingress", args.ingress,
             "--api-server-count", str(serving_processes(args))]
    if model is not None:
        flags += ["--model", model]
    if args.load_format != "auto":
        flags += ["--load-format", args.load_format]
    if args.device == "cuda":
        flags += ["--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION["serve"])]
    if args.async_scheduling is not None:
        flags += ["--async-scheduling" if args.async_scheduling else "--no-async-scheduling"]
    return flags


def direct_config(model: Optional[str], args: argparse.Namespace) -> EngineConfig:
    """What `tidal serve` builds from serve_flags() (cluster.serve_cmd: elastic off, no other engine kwargs), with
    the direct engine's share of the GPU."""
    extra = {"load_format": args.load_format} if args.load_format != "auto" else {}
    if args.device == "cuda":
        extra["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION["direct"]
    if args.async_scheduling is not None:
        extra["async_scheduling"] = args.async_scheduling
    return engine_config(AppArgs(model=model, device=args.device, tensor_parallel_size=1, num_replicas=1,
                                 engine_kwargs={"elastic": "off", **extra}))


def direct_engine_config(model: Optional[str], args: argparse.Namespace) -> EngineConfig:
    """The engine a replica runs for that config: with the replica's stream-item budget (cluster.replica), so the
    direct engine reports as sparingly as the served one and only Serve differs between the paths."""
    return replica_engine_config(direct_config(model, args), serving_processes(args))


def serving_processes(args: argparse.Namespace) -> int:
    """`--api-server-count`, or what `tidal serve` picks on the device."""
    return api_server_count(AppArgs(api_server_count=args.api_server_count), args.device)


def overhead(serve: dict, direct: dict) -> dict:
    """What a Serve path adds over the direct engine: median TTFT at 1 and `concurrency` streams, throughput ratio."""
    added = {k: serve[k]["ttft_ms"]["median"] - direct[k]["ttft_ms"]["median"] for k in ("idle", "loaded")}
    ratio = serve["loaded"]["output_tok_s"] / direct["loaded"]["output_tok_s"]
    return {"added_median_ttft_ms_c1": added["idle"], "added_median_ttft_ms_c64": added["loaded"],
            "throughput_ratio_64": ratio}


def over_repeats(serves: list[dict], directs: list[dict]) -> dict:
    """`overhead` of each repeat against the same repeat's direct run; the medians are the headline."""
    each = [overhead(s, d) for s, d in zip(serves, directs)]
    med = {k: statistics.median(e[k] for e in each) for k in each[0]}
    return {**med, "meets_targets": {"added_median_ttft_ms_c1": med["added_median_ttft_ms_c1"] <= TTFT_TARGET_MS,
                                     "throughput_ratio_64": med["throughput_ratio_64"] >= THROUGHPUT_TARGET},
            "each_repeat": each}


def streaming(serve: dict, direct: dict) -> dict:
    """The streaming figures of one repeat: the front door's TPOT and chunk gaps, and its throughput over the direct
    engine's, at the loaded run's concurrency."""
    return {"failed": sum(r[level]["failed"] for r in (serve, direct) for level in ("idle", "loaded")),
            "tpot_ms_c1": serve["idle"]["tpot_ms"]["mean"],
            "p99_itl_ms_c256": serve["loaded"]["itl_ms"]["p99"],
            "median_itl_ms_c256": serve["loaded"]["itl_ms"]["median"],
            "p99_itl_ms_c256_steady": serve["loaded"]["itl_ms_steady"]["p99"],
            "mean_tpot_ms_c256": serve["loaded"]["tpot_ms"]["mean"],
            "throughput_ratio": serve["loaded"]["output_tok_s"] / direct["loaded"]["output_tok_s"]}


def pooled_tok_s(runs: list[dict]) -> float:
    """Output tok/s of the loaded runs taken together: their tokens over their seconds."""
    return sum(r["loaded"]["output_tokens"] for r in runs) / sum(r["loaded"]["seconds"] for r in runs)


def streaming_over_repeats(serves: list[dict], directs: list[dict]) -> dict:
    """`streaming` of each repeat; the headline is each figure's median and every failure of every repeat, but the
    throughput ratio pools each path's repeats (tokens over seconds): a loaded run lasts a few seconds, and the
    two paths are separate engines, so pairing them by repeat only adds the noise of two short runs."""
    each = [streaming(s, d) for s, d in zip(serves, directs)]
    out = {k: statistics.median(e[k] for e in each) for k in each[0]}
    out["failed"] = sum(e["failed"] for e in each)
    out["throughput_ratio"] = pooled_tok_s(serves) / pooled_tok_s(directs)
    out["meets_targets"] = {"failed": out["failed"] == 0, "tpot_ms_c1": out["tpot_ms_c1"] <= TPOT_TARGET_MS,
                            "p99_itl_ms_c256": out["p99_itl_ms_c256"] <= ITL_P99_TARGET_MS,
                            "median_itl_ms_c256":
                                out["median_itl_ms_c256"] <= ITL_OVER_TPOT_TARGET * out["mean_tpot_ms_c256"],
                            "throughput_ratio": out["throughput_ratio"] >= THROUGHPUT_TARGET}
    return {**out, "each_repeat": each}


def write_section(path: str, key: str, section: dict) -> None:
    """`section` as `key` of the JSON at `path`, keeping the file's other keys."""
    doc = {}
    if os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
    doc[key] = section
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)


def run(args: argparse.Namespace) -> dict:
    model = resolve_model(args)
    engine = AsyncLLMEngine(direct_engine_config(model, args))
    server = None
    runs: dict[str, list[dict]] = {"direct": [], "front_door": [], "replica": []}
    try:
        vocab = engine.info.vocab_size
        device = torch.cuda.get_device_name() if args.device == "cuda" else \
            f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"
        server = LocalServer(serve_flags(model, args))
        model_id = server.wait_ready(READY_TIMEOUT_S)
        server_front_door = "HAProxy" if "(HAProxy;" in server.log_path.read_text(errors="replace") else "Serve proxy"
        replica_url, pid = (server.replica_urls() or [None])[0], server.process.pid
        for r in range(args.repeats):
            # Each repeat: new prompts (no prefix-cache hits across repeats); the direct engine and the front door
            # get the same ones (separate engines), the replica port fresh ones (the server's engine saw those).
            # The order rotates, so no path always runs first.
            same, fresh = make_workload(args, vocab, seed_offset=2 * r), make_workload(args, vocab, 2 * r + 1)
            paths = [("direct", lambda w: measure_direct(engine, w), same),
                     ("front_door", lambda w: measure_serve(server.url, model_id, w, pid), same)]
            if replica_url is not None and not args.streaming:
                paths.append(("replica", lambda w: measure_serve(replica_url, model_id, w, pid), fresh))
            for path, measure_path, load in paths[r % len(paths):] + paths[:r % len(paths)]:
                runs[path].append(asyncio.run(measure_path(load)))
                progress(f"{path} run {r + 1}", runs[path][-1])
    finally:
        if server is not None:
            server.stop()
        engine.shutdown()
    res = {**over_repeats(runs["front_door"], runs["direct"]), "concurrency": args.concurrency,
           "serve": runs["front_door"][0], "serve_runs": runs["front_door"], "direct": runs["direct"][0],
           "direct_runs": runs["direct"]}
    if runs["replica"]:
        res["replica_direct_ingress"] = {**over_repeats(runs["replica"], runs["direct"]),
                                         "serve": runs["replica"][0], "serve_runs": runs["replica"]}
    return {**res, "front_door": server_front_door, "repeats": args.repeats, "device": device,
            "torch": torch.__version__,
            "model": args.model or "embedded SmolLM2-135M-Instruct (Q4_1 GGUF)", "load_format": args.load_format,
            "ingress": args.ingress, "seed": args.seed, "input_len": args.input_len, "max_tokens": args.max_tokens,
            "warmup_requests": args.warmup, "idle_requests": args.idle_prompts, "loaded_requests": args.num_prompts,
            "gpu_memory_utilization": GPU_MEMORY_UTILIZATION if args.device == "cuda" else None,
            "stream_item_ms": envs.stream_item_ms() / serving_processes(args),
            "api_server_count": serving_processes(args),
            "counted": "generated tokens only (direct: streamed token ids; serve: usage.completion_tokens)",
            "method": __doc__.strip()}


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file, HF folder, or with --load-format dummy a folder "
                                                   "with a config.json or a bench.shapes shape (qwen3-0.6b, llama3-8b)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--device", default=resolve_device().type, choices=["cuda", "cpu"])
    ap.add_argument("--num-prompts", type=int, default=256, help="requests of the loaded run")
    ap.add_argument("--idle-prompts", type=int, default=32, help="requests of the one-at-a-time run")
    ap.add_argument("--warmup", type=int, default=None,
                    help="warm-up requests on each path, all at once (default: --concurrency, so that the loaded "
                         "run's batch sizes and prefill chunks have run once before it is timed)")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (ignore_eos)")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="streams in flight in the loaded run (default: 64; 256 with --streaming)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every path (direct, front door, replica port; "
                                                            "the order rotates); headline = the medians of each "
                                                            "repeat's Serve/direct figures")
    ap.add_argument("--ingress", default="auto", choices=["auto", "haproxy", "proxy"],
                    help="the front door `tidal serve` puts up (auto: HAProxy when installed)")
    ap.add_argument("--api-server-count", type=int, default=None,
                    help="`tidal serve --api-server-count`: HTTP processes streaming the replica's engine (default: "
                         "tidal serve's on the device)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--streaming", action="store_true",
                    help="the direct engine and the front door only; writes the `streaming` section of --out")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="both engines schedule each decode step before the last one's tokens are read back "
                         "(default: the engine's, on CUDA)")
    ap.add_argument("--out", default="bench/results/serve_overhead.json")
    args = ap.parse_args(argv)
    if args.concurrency is None:
        args.concurrency = 256 if args.streaming else 64
    if args.warmup is None:
        args.warmup = args.concurrency
    res = run(args)
    if args.streaming:
        section = {**streaming_over_repeats(res["serve_runs"], res["direct_runs"]),
                   **{k: v for k, v in res.items() if k not in ("added_median_ttft_ms_c1", "added_median_ttft_ms_c64",
                                                                "throughput_ratio_64", "meets_targets",
                                                                "each_repeat", "serve", "direct")},
                   "provenance": provenance("bench.serve_overhead", list(sys.argv[1:] if argv is None else argv),
                                            args.device, args.seed)}
        write_section(args.out, "streaming", section)
        print(f"wrote the streaming section of {args.out}")
        report_streaming(section)
        return section
    if res["serve"]["loaded"]["output_tokens"] != res["direct"]["loaded"]["output_tokens"]:
        print("warning: the two paths generated different numbers of tokens", file=sys.stderr)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.out}")
    report(res)
    return res


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # unwind through the finally blocks: stop the server
    main()
