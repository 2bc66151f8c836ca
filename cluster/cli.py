"""The `tidal` command line: serve, generate, bench, controller, train-drafter."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from replicas.device import DEVICES


def _add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="answer one chat prompt with a model (default: embedded SmolLM2)")
    p.add_argument("prompt")
    p.add_argument("--model", default=None, help="HF model folder or .gguf file")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", action="store_true", help="complete the prompt as text, without the chat template")
    p.add_argument("--device", default="auto", choices=DEVICES)


def _run_generate(args) -> int:
    from replicas import LLM, SamplingParams

    llm = LLM(model=args.model, tensor_parallel_size=args.tp, device=args.device)
    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        if args.raw:
            out = llm.generate(args.prompt, params)[0]
        else:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        print(out.outputs[0].text)
    finally:
        llm.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidal", description="tidal: a Ray-distributed LLM serving cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    from cluster.benchmark.cli import add_bench_parser
    from cluster.serve_cmd import add_serve_parser

    add_serve_parser(sub)
    _add_generate_parser(sub)
    add_bench_parser(sub)
    from cluster.controller_status import add_controller_parser
    add_controller_parser(sub)
    from speculative.train import add_arguments as add_train_drafter_arguments
    add_train_drafter_arguments(sub.add_parser(
        "train-drafter", help="train a DominoTree drafter by self-distillation (Ray Train, resumable)"))
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return _run_generate(args)
    if args.command == "serve":
        from cluster.serve_cmd import run_serve
        return run_serve(args)
    if args.command == "bench":
        from cluster.benchmark.cli import run_bench
        return run_bench(args)
    if args.command == "controller":
        from cluster.controller_status import run_controller_command
        return run_controller_command(args)
    if args.command == "train-drafter":
        from speculative.train import run as run_train_drafter
        return run_train_drafter(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
