"""The engine core's pipe: what one step's Outputs message costs to build, encode and load, msgpack against pickle.

    python -m bench.core_wire [--outputs 1,64,256] [--tokens 1] [--logprobs 0] [--seconds 1.0] [--repeats 3]
        [--out bench/results/core_wire.json]

Per cell (outputs per message): N RequestOutputs of one choice each, as a streaming step makes them (a 32-hex
request id, `--tokens` new token ids and their text, with `--logprobs` top alternatives per token when > 0;
seed 0). Three costs, each timed over at least --seconds of back-to-back calls, repeated --repeats times,
interleaved: `build` (constructing the message's objects, what `Request.make_output` pays), `encode` and `load`,
the wire (`engine_messages.encode_core_message` / `decode_core_message`: a kind byte and msgpack) against pickle
(protocol 5) of the same objects in the same run. The core pays build + encode on its step loop; the serving
process pays load in its reader thread, on the GIL its HTTP side needs. JSON: every repeat, the medians, bytes
per message, and `load_speedup` / `encode_speedup` (pickle / msgpack) per cell. One warm-up call per cost.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import statistics
import sys
import time

from bench.provenance import REPO, provenance
from replicas.engine_messages import Outputs, decode_core_message, encode_core_message
from replicas.outputs import CompletionOutput, Logprob, RequestOutput


def step_values(n: int, tokens: int, logprobs: int, rng: random.Random) -> list[tuple]:
    """What a step hands `Request.make_output` per request: id, new token ids, their text, logprobs (or None)."""
    values = []
    for _ in range(n):
        ids = [rng.randrange(100, 49000) for _ in range(tokens)]
        lps = None
        if logprobs:
            lps = [[(t, -rng.random(), 1, f" w{t % 997}")] +
                   [(a, -1 - rng.random(), r, f" w{a % 997}")
                    for r, a in enumerate((rng.randrange(100, 49000) for _ in range(logprobs)), start=2)]
                   for t in ids]
        values.append((f"cmpl-{rng.getrandbits(128):032x}", ids, "".join(f" w{t % 997}" for t in ids), lps))
    return values


def build(values: list[tuple]) -> Outputs:
    def choice(ids, text, lps) -> CompletionOutput:
        logprobs = None if lps is None else [{t: Logprob(v, r, s) for t, v, r, s in per} for per in lps]
        return CompletionOutput(0, text, ids, text, ids, -1.0 if lps else None, logprobs)
    return Outputs([RequestOutput(rid, None, None, [choice(ids, text, lps)]) for rid, ids, text, lps in values])


def per_call_us(fn, seconds: float) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        for _ in range(16):
            fn()
        calls += 16
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / calls * 1e6


def cell(n: int, args) -> dict:
    values = step_values(n, args.tokens, args.logprobs, random.Random(0))
    msg = build(values)
    wire, pickled = bytes(encode_core_message(msg)), pickle.dumps(msg, protocol=5)
    assert decode_core_message(wire) == pickle.loads(pickled) == msg
    costs = {"build": lambda: build(values),
             "msgpack_encode": lambda: encode_core_message(msg), "pickle_encode": lambda: pickle.dumps(msg, 5),
             "msgpack_load": lambda: decode_core_message(wire), "pickle_load": lambda: pickle.loads(pickled)}
    runs = {name: [] for name in costs}
    for _ in range(args.repeats):
        for name, fn in costs.items():
            runs[name].append(per_call_us(fn, args.seconds))
    med = {name: statistics.median(v) for name, v in runs.items()}
    return {"outputs": n, "bytes": {"msgpack": len(wire), "pickle": len(pickled)}, "us_each_repeat": runs,
            "us_median": med, "encode_speedup": med["pickle_encode"] / med["msgpack_encode"],
            "load_speedup": med["pickle_load"] / med["msgpack_load"]}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--outputs", default="1,64,256")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--logprobs", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(REPO, "bench/results/core_wire.json"))
    args = ap.parse_args(argv)
    cells = [cell(int(n), args) for n in args.outputs.split(",")]
    result = {"provenance": provenance("bench.core_wire", argv, "cpu", 0, warm_up="one call per cost",
                                       counted="microseconds per call, back-to-back calls for at least --seconds, "
                                               "medians over repeats"),
              "tokens_per_output": args.tokens, "logprobs": args.logprobs, "cells": cells}
    print(f"{'outputs':>8} {'build':>9} {'msgpack enc':>12} {'pickle enc':>11} {'msgpack load':>13} "
          f"{'pickle load':>12} {'bytes mp/pk':>13}   (us per message)")
    for c in cells:
        m = c["us_median"]
        print(f"{c['outputs']:>8} {m['build']:>9.1f} {m['msgpack_encode']:>12.1f} {m['pickle_encode']:>11.1f} "
              f"{m['msgpack_load']:>13.1f} {m['pickle_load']:>12.1f} {c['bytes']['msgpack']:>6}/{c['bytes']['pickle']}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
