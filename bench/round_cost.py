"""What a speculative round costs the engine beyond its two measured parts, for bench.speculative.

    round_ms    the engine's decode-only step with a draft tree per sequence, end to end as the engine times it
                for its budget policy (`Proposer.record_round`: scheduling to outputs), median over the run's
                rounds at exactly that batch size
    draft_ms    the drafting half alone (context update, drafter pass, tree build, verify rows) and
    verify_ms   the target's forward over b x (1 + n) tree tokens alone (through its CUDA graph where the engine
                has one), both from the start-up profile's timers (speculative/profile.py), measured after the run
    overhead_ms round_ms - draft_ms - verify_ms: acceptance, the step input, sampling the tree rows, the host read,
                KV compaction, drafter-context bookkeeping and every synchronization between them

`breakdown` then times the same rounds under torch.profiler with the engine's parts wrapped in labels: host and
device ms per round for each (a host time includes waiting for the device where the part synchronizes).
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from speculative.profile import measure_verify_profile

# Rounds at one batch size below which their median is not reported as an overhead (bench.speculative
# --min-rounds): a closed loop reaches its full batch only while every request decodes, so the largest batch can
# see few rounds.
MIN_ROUNDS = 16
LABELS = ("round:step", "round:schedule", "round:propose", "round:forward", "round:verify", "round:apply")


class RoundLog:
    """Collects the engine's decode-only speculative rounds, seconds by (temperature key, batch size, nodes)."""

    def __init__(self, speculator):
        self.rounds: dict[tuple[str, int, int], list[float]] = defaultdict(list)
        self.temp = ""
        record = speculator.record_round

        def recorded(batch_size: int, nodes: int, seconds: float, tokens_per_seq: float) -> None:
            if nodes:
                self.rounds[(self.temp, batch_size, nodes)].append(seconds)
            record(batch_size, nodes, seconds, tokens_per_seq)
        speculator.record_round = recorded

    @property
    def count(self) -> int:
        return sum(map(len, self.rounds.values()))


def round_cost(engine, log: RoundLog, batches, nodes: int, iters: int = 20,
               min_rounds: int = MIN_ROUNDS) -> dict:
    """temperature key -> b<batch> -> {round_ms, draft_ms, verify_ms, plain_ms, overhead_ms, rounds} (batches with
    rounds; plain_ms: a plain decode step, timed with the others)."""
    measured = sorted({b for (_, b, n) in log.rounds if n == nodes and b in batches})
    if not measured:
        return {}
    profile = measure_verify_profile(engine.runner, engine.speculator, measured, [nodes], warmup=3, iters=iters)
    out: dict = defaultdict(dict)
    for (temp, b, n), seconds in sorted(log.rounds.items()):
        if n != nodes or b not in profile.step_seconds:
            continue
        round_ms = 1e3 * statistics.median(seconds)
        draft_ms, verify_ms = 1e3 * profile.draft_time(b), 1e3 * profile.step_time(b, nodes)
        enough = len(seconds) >= min_rounds
        out[temp][f"b{b}"] = dict(round_ms=round_ms, draft_ms=draft_ms, verify_ms=verify_ms,
                                  plain_ms=1e3 * profile.step_time(b, 0),
                                  overhead_ms=round_ms - draft_ms - verify_ms if enough else None,
                                  rounds=len(seconds), verify_graphed=(b, nodes) in profile.graphed)
        if not enough:
            out[temp][f"b{b}"]["overhead_null_reason"] = f"{len(seconds)} rounds at this batch size, < {min_rounds}"
    return dict(out)


def _labelled(label: str, fn: Callable, host: dict) -> Callable:
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            with record_function(label):
                return fn(*args, **kwargs)
        finally:
            host[label] += time.perf_counter() - start
    return run


def breakdown(engine, drive: Callable[[], object]) -> dict:
    """Run `drive` (a closed loop of requests on `engine`) under torch.profiler with the engine's parts labelled;
    per label the total host ms (wall time inside the part) and device ms (its kernels), and the kernels with the
    most device time (totals)."""
    wrapped = dict(step=engine, schedule=engine.scheduler, propose=engine.speculator, forward=engine.runner,
                   verify=engine.verifier, apply=engine)
    names = dict(step="step", schedule="schedule", propose="propose", forward="execute", verify="verify",
                 apply="_apply_verified")
    saved, host = [], defaultdict(float)
    for part, owner in wrapped.items():
        fn = getattr(owner, names[part])
        saved.append((owner, names[part], owner.__dict__.get(names[part])))
        setattr(owner, names[part], _labelled(f"round:{part}", fn, host))
    cuda = engine.runner.device.type == "cuda"
    try:
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            drive()
    finally:
        for owner, name, before in reversed(saved):
            if before is None:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
    events = prof.key_averages()
    rows = {e.key: e for e in events if e.key in LABELS}
    kernels = sorted((e for e in events if e.key not in LABELS and _self_device_us(e) > 0), key=_self_device_us,
                     reverse=True)[:12]
    return dict(parts={k: dict(host_ms=1e3 * host[k], device_ms=_device_us(rows[k]) / 1e3 if k in rows else 0.0)
                       for k in LABELS},
                kernels=[dict(name=e.key[:120], device_ms=_self_device_us(e) / 1e3, calls=e.count) for e in kernels])


def _self_device_us(evt) -> float:
    return getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)


def _device_us(evt) -> float:
    return getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
