"""Structured-output benchmark (GPU target): decode throughput with a json_schema grammar against the same run
without one.

    python -m bench.structured [--model PATH] [--device auto] [--concurrency 64] [--seconds 10] [--repeats 5]
        [--records 8] [--warmup 64] [--seed 0] [--out bench/results/structured.json]
    python -m bench.structured --device cpu --model TINY --concurrency 4 --seconds 0.5 --repeats 2   (smoke)

Workload: --concurrency requests in flight in a closed loop (a finished request is replaced at once) on one
offline engine (`LLMEngine`, default settings: CUDA graphs and prefix caching on), greedy, token ids only. Every
constrained request carries the same JSON schema (an object holding an array of exactly --records small records:
an integer with bounds, an enum, a boolean), so its output has nearly the same length every time and the grammar
ends it. A first warm-up runs every prompt once constrained; the unconstrained run gets the same prompts, each
with max_tokens set to its own constrained output's length and ignore_eos, so both runs generate the same tokens
per request and their requests end at the same steps (the scheduler admits the same prompts at the same points;
only the grammar differs). The grammar is compiled once (that warm-up) and cached.

Cells: plain, then constrained, repeated --repeats times (interleaved, so drift in clocks or load hits both);
each cell runs for --seconds of wall time after its own warm-up of --warmup requests, then the requests still in
flight are aborted. Counted: the engine's generation-token counter over the cell's wall time (tokens of aborted
requests included: they were generated). `ratio` = median constrained tokens/s over median plain tokens/s;
`ratio_paired` = the median over repeats of each repeat's constrained / plain (the two cells of a repeat run
back to back, so a slow or fast stretch of a shared machine hits both). Also
recorded: the host time to fill one step's bitmask (on CUDA it overlaps the forward), and whether every constrained
output that finished (warm-ups included) parses and validates.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Union


from bench.provenance import provenance
from replicas import LLM, SamplingParams
from replicas.structured.spec import GrammarSpec

REPO = Path(__file__).resolve().parent.parent
MODES = ("plain", "json_schema")


def record_schema(records: int) -> dict:
    item = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                             "kind": {"enum": ["alpha", "beta", "gamma"]},
                                             "active": {"type": "boolean"}},
            "required": ["id", "kind", "active"]}
    return {"type": "object", "properties": {"records": {"type": "array", "items": item, "minItems": records,
                                                         "maxItems": records}},
            "required": ["records"]}


class Loop:
    """A closed loop of `concurrency` requests on one engine."""

    def __init__(self, llm: LLM, prompts: list[list[int]], concurrency: int):
        self.engine, self.prompts, self.concurrency = llm.engine, prompts, concurrency
        self.serial = 0
        self.in_flight: dict[str, int] = {}          # request id -> its prompt's index

    def add(self, params: Union[SamplingParams, list[SamplingParams]]) -> None:
        rid, prompt = f"bench-{self.serial}", self.serial % len(self.prompts)
        self.engine.add_request(rid, self.prompts[prompt], params if isinstance(params, SamplingParams)
                                else params[prompt], stream=False)
        self.in_flight[rid] = prompt
        self.serial += 1

    def run(self, params: Union[SamplingParams, list[SamplingParams]], seconds: Optional[float] = None,
            requests: Optional[int] = None) -> dict:
        """For `seconds` of wall time (then abort what is in flight), or until `requests` finished. `params`: one
        for every request, or one per prompt. `outputs`: (prompt index, token ids) of each finished request."""
        for _ in range(self.concurrency):
            self.add(params)
        before, start, finished, steps = self.engine.get_stats(), time.perf_counter(), [], 0
        while self.in_flight:
            for out in self.engine.step():
                if out.finished:
                    finished.append((self.in_flight.pop(out.request_id), out.outputs[0].token_ids))
                    if requests is None or len(finished) + len(self.in_flight) < requests:
                        self.add(params)
            steps += 1
            failed = self.engine.take_failed()
            if failed:                  # e.g. the grammar backend cannot load: stop, do not wait for it forever
                rid, error = failed[0]
                raise RuntimeError(f"benchmark request {rid} failed: {error}")
            if seconds is not None and time.perf_counter() - start >= seconds:
                break
        wall = time.perf_counter() - start
        for rid in list(self.in_flight):
            self.engine.abort(rid)
        self.in_flight.clear()
        after = self.engine.get_stats()
        tokens = after.generation_tokens - before.generation_tokens
        new_masks = after.grammar_mask_steps - before.grammar_mask_steps
        masks = after.grammar_mask_latencies[-new_masks:] if new_masks else []
        return {"seconds": round(wall, 3), "steps": steps, "steps_ahead": after.steps_ahead - before.steps_ahead,
                "output_tokens": tokens,
                "tokens_per_s": round(tokens / wall, 1), "requests_finished": len(finished),
                "mean_output_tokens": round(statistics.fmean(len(t) for _, t in finished), 1) if finished else None,
                "mask_ms_per_step": round(statistics.fmean(masks) * 1e3, 4) if masks else None,
                "outputs": finished}


def valid_outputs(llm: LLM, outputs: list[tuple[int, list[int]]], schema: dict) -> int:
    import jsonschema
    ok = 0
    for _, ids in outputs:
        try:
            jsonschema.validate(json.loads(llm.tokenizer.decode(ids)), schema)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok


def main(argv: Optional[list[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--device", default="auto")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=10.0, help="wall time of one cell")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--records", type=int, default=8, help="records in the schema's array (sets the output length)")
    p.add_argument("--warmup", type=int, default=None, help="requests before each cell (default: --concurrency)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine schedules each decode step before the last one's tokens are read back "
                        "(default: the engine's, on CUDA)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "structured.json")
    args = p.parse_args(argv)
    if args.repeats < 2:
        p.error("--repeats must be at least 2 (the cells are interleaved)")
    args.warmup = args.concurrency if args.warmup is None else args.warmup

    llm = LLM(model=args.model, device=args.device, seed=args.seed, max_num_seqs=max(args.concurrency, 1),
              async_scheduling=args.async_scheduling)
    device = str(llm.engine.runner.device)
    schema = record_schema(args.records)
    prompts = []
    for i in range(4 * args.concurrency):
        text = f"List {args.records} records of inventory batch {i} as JSON."
        if llm.tokenizer.chat_templates:
            prompts.append(llm.tokenizer.encode_chat([{"role": "user", "content": text}]))
        else:
            prompts.append(llm.tokenizer.encode(text))
    loop = Loop(llm, prompts, args.concurrency)
    grammar = GrammarSpec.json_schema(schema)
    constrained = SamplingParams(temperature=0.0, max_tokens=40 * args.records + 32, grammar=grammar,
                                 detokenize=False)
    checked = {"finished": 0, "valid": 0}

    def check(outputs: list[tuple[int, list[int]]]) -> None:
        checked["finished"] += len(outputs)
        checked["valid"] += valid_outputs(llm, outputs, schema)

    warm = loop.run(constrained, requests=len(prompts))        # every prompt once: its constrained length
    by_prompt = dict((prompt, len(ids)) for prompt, ids in warm["outputs"])
    check(warm.pop("outputs"))
    lengths = [max(1, by_prompt[i]) for i in range(len(prompts))]
    plain = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in lengths]
    params = {"plain": plain, "json_schema": constrained}

    cells = []
    for r in range(args.repeats):
        for mode in MODES:
            if args.warmup:
                warm = loop.run(params[mode], requests=args.warmup)
                if mode == "json_schema":
                    check(warm["outputs"])
            cell = loop.run(params[mode], seconds=args.seconds)
            outputs = cell.pop("outputs")
            if mode == "json_schema":
                check(outputs)
            cells.append({"repeat": r, "mode": mode, **cell})
            print(f"repeat {r} {mode:>11}: {cell['tokens_per_s']:9.1f} tok/s over {cell['seconds']:.1f} s, "
                  f"{cell['requests_finished']} requests, mean {cell['mean_output_tokens']} tokens", flush=True)
    stats = llm.engine.get_stats()
    llm.shutdown()

    median = {m: statistics.median(c["tokens_per_s"] for c in cells if c["mode"] == m) for m in MODES}
    masks = [c["mask_ms_per_step"] for c in cells if c["mask_ms_per_step"] is not None]
    result = {
        "model": args.model or "SmolLM2-135M-Instruct (embedded GGUF)", "device": device,
        "concurrency": args.concurrency, "seconds_per_cell": args.seconds, "repeats": args.repeats,
        "schema": schema, "plain_max_tokens_by_prompt": lengths,
        "cells": cells,
        "tokens_per_s": {m: round(v, 1) for m, v in median.items()},
        "ratio": round(median["json_schema"] / median["plain"], 4),
        "ratio_paired": round(statistics.median(
            cj["tokens_per_s"] / cp["tokens_per_s"] for cp, cj in zip(cells[0::2], cells[1::2])), 4),
        "grammar": {"compile_ms": [round(s * 1e3, 2) for s in stats.grammar_compile_latencies],
                    "cache_hits": stats.grammar_cache_hits,
                    "mask_ms_per_step_median": round(statistics.median(masks), 4) if masks else None,
                    "finished_outputs": checked["finished"], "valid_outputs": checked["valid"]},
        "method": __doc__,
        "provenance": provenance(
            "bench.structured", argv, device, args.seed,
            warm_up=f"every prompt once constrained (compiles the grammar, sets the plain lengths), then "
                    f"{args.warmup} requests per cell before its clock starts",
            counted="the engine's generated tokens over each cell's wall time, aborted requests' tokens included"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"json_schema / plain = {result['ratio']:.3f} ({median['json_schema']:.1f} / {median['plain']:.1f} tok/s); "
          f"{checked['valid']}/{checked['finished']} constrained outputs valid; wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
