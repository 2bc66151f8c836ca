"""The GPU tree builder's cost per round and its bit-identity with the reference builder (bench.speculative's
`tree_build_ms_b16`, `tree_build.by_mode` and `builder_bit_identical_cases`), and on its own:

    python -m bench.tree_builder [--cases 1000] [--rounds 200] [--batches 1 8 32] [--out FILE]

reports, on CUDA, GraphTreeBuilder's ms per round (DominoTree budget 16, SmolLM2-sized head, bf16 drafter
outputs) per batch size with the kernels per round counted by torch.profiler, and the fused builder against the
reference on `--cases` random rounds; anywhere, the kernels' sm_90 compile report (registers, spills, FMA
contraction flags), compiled offline by Triton."""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict
from typing import Optional

import torch

from bench.roofline import cuda_time_ms
from speculative.baselines import METHODS, chain_config
from speculative.drafter import DominoHead, DrafterConfig
from speculative.draft_tree import DraftTree, TreeConfig
from speculative.tree import gate_table, prepare_round
from speculative.tree_gpu import GraphTreeBuilder, build_frontier
from speculative.tree_reference import build_reference


def same_tree(a: DraftTree, b: DraftTree) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("tokens", "parents", "depths", "valid", "scores"))


def drafted_block(spec, batch: int, context: int, seed: int):
    """The engine drafter's block after a random target context of `context` tokens: (roots, hidden, base logits)."""
    dev, dtype = spec.embed_weight.device, spec.embed_weight.dtype
    g = torch.Generator(device=dev).manual_seed(seed)
    target = torch.randn(batch, context, spec.cfg.context_size, device=dev, dtype=dtype, generator=g)
    ctx = spec.drafter.backbone.context(target, torch.arange(context, device=dev).expand(batch, -1))
    roots = torch.randint(0, spec.vocab_size, (batch,), device=dev, generator=g)
    pos = torch.full((batch,), context, dtype=torch.long, device=dev)

    def draft():
        return spec.drafter.draft(roots, pos, ctx, spec.embed_weight, spec.lm_head_weight)

    block = draft()
    return roots, block.hidden, block.base_logits[..., :spec.vocab_size], draft


@torch.no_grad()
def time_tree_build(spec, budget: int, rounds: int, checks: int = 8) -> dict:
    """Batch 1, the engine's own builder for `budget` nodes: eager (what the engine runs) and graph-replayed;
    plus `checks` real batch-4 rounds compared with the reference builder, eager and replayed."""
    head, embed = spec.drafter.head, spec.embed_weight
    builder = spec.builder(budget)
    gates = gate_table(head, embed) if builder.cfg.corrected else None
    roots, hidden, base, draft = drafted_block(spec, 1, 256, 0)
    graphs = GraphTreeBuilder(head, embed, builder.cfg, spec.cfg.block_size, spec.vocab_size, hidden.shape[-1],
                              hidden.dtype, batch_sizes=(1, 4))

    def eager(r, h, b):
        return builder.build(prepare_round(head, h, b, r, embed, builder.cfg, gates))

    out = dict(eager_ms=cuda_time_ms(lambda: eager(roots, hidden, base), 20, rounds),
               graph_ms=cuda_time_ms(lambda: graphs.build(hidden, base, roots), 20, rounds),
               draft_ms=cuda_time_ms(draft, 20, rounds), draft_context_tokens=256, tree_config=asdict(builder.cfg))
    same = 0
    for seed in range(1, checks + 1):
        r, h, b, _ = drafted_block(spec, 4, 64 * seed, seed)
        want = build_reference(prepare_round(head, h, b, r, embed, builder.cfg, gates), builder.cfg)
        same += same_tree(want, eager(r, h, b)) and same_tree(want, graphs.build(h, b, r))
    out.update(real_rounds_checked=checks, real_rounds_identical=same)
    return out


def random_case(seed: int, device: str):
    """A random round (sizes, weights, exact ties on every 4th seed) and one method's config, seed % 3 picks it."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    method = ("dominotree", "chain", "ddtree")[seed % 3]
    ties = seed % 4 == 0
    v, h, s = rng.choice([64, 97, 300]), rng.choice([16, 32]), rng.choice([4, 8, 16])
    head = DominoHead(DrafterConfig(vocab_size=v, hidden_size=h, intermediate_size=32, num_layers=1, num_heads=2,
                                    num_kv_heads=1, head_dim=8, target_layer_ids=(0,), block_size=s,
                                    gru_hidden=rng.choice([8, 32, 64]), correction_rank=rng.choice([4, 16])))
    scale, tie_scale = rng.choice([0.3, 1.0, 3.0]), rng.choice([0.0, 0.5])
    for p in head.parameters():
        w = torch.randn(p.shape, generator=g) * scale * 4 / p.shape[-1] ** 0.5
        p.data = w.round() * tie_scale + 0.0 if ties else w
    b = rng.choice([1, 4, 8])
    hidden = torch.randn(b, s, h, generator=g)
    base = torch.randn(b, s, v, generator=g) * rng.choice([1.0, 3.0])
    base = base.round() + 0.0 if ties else base
    embed, roots = torch.randn(v, h, generator=g), torch.randint(0, v, (b,), generator=g)
    shape = dict(candidates=rng.choice([8, 32, 64]), max_depth=rng.choice([2, s]),
                 uncorrected_depths=rng.choice([0, 1, 2]))
    cfg = chain_config(**shape) if method == "chain" else \
        METHODS[method](budget=rng.choice([1, 6, 16, 32]), node_topk=rng.choice([1, 2, 4, 8]), **shape)

    def to(t):
        return t.to(device)

    return method, cfg, head.to(device), to(hidden), to(base), to(roots), to(embed)


@torch.no_grad()
def builder_identity(cases: int, device: str, seed: int = 0) -> dict:
    """build_frontier (the engine's builder) against build_reference on `cases` random rounds."""
    by_method = {m: [0, 0] for m in ("dominotree", "chain", "ddtree")}
    mismatched = []
    for case in range(seed * 1_000_003, seed * 1_000_003 + cases):
        method, cfg, head, hidden, base, roots, embed = random_case(case, device)
        rnd = prepare_round(head, hidden, base, roots, embed, cfg)
        ok = same_tree(build_reference(rnd, cfg), build_frontier(rnd, cfg))
        by_method[method][0] += ok
        by_method[method][1] += 1
        if not ok:
            mismatched.append(case)
    return dict(identical=sum(v[0] for v in by_method.values()), cases=cases,
                by_method={m: dict(identical=v[0], cases=v[1]) for m, v in by_method.items()},
                mismatched_seeds=mismatched[:20],
                builder="build_frontier (fused Triton launches on CUDA) vs build_reference, same device")


# ---- GraphTreeBuilder per batch size -------------------------------------------------------------------------

SMOLLM2 = dict(vocab=49152, hidden=576, gru=192, rank=64, block=16)


def smollm2_inputs(batch: int, seed: int = 0, device: str = "cuda"):
    """A SmolLM2-sized Domino head (bf16, random) and one draft block's outputs for `batch` requests."""
    s = SMOLLM2
    head = DominoHead(DrafterConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=64,
                                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, target_layer_ids=(0,),
                                    block_size=s["block"], gru_hidden=s["gru"], correction_rank=s["rank"]))
    g = torch.Generator().manual_seed(seed)
    for p in head.parameters():
        p.data = torch.randn(p.shape, generator=g) * 4 / p.shape[-1] ** 0.5
    hidden = torch.randn(batch, s["block"], s["hidden"], generator=g)
    base = torch.randn(batch, s["block"], s["vocab"], generator=g) * 4
    embed = torch.randn(s["vocab"], s["hidden"], generator=g) * 0.05
    roots = torch.randint(0, s["vocab"], (batch,), generator=g)

    def bf16(t):
        return t.to(device, torch.bfloat16)

    return head.to(device, torch.bfloat16), bf16(hidden), bf16(base), roots.to(device), bf16(embed)


def kernels_per_call(fn) -> Optional[int]:
    """CUDA kernels one call launches (graph replays included), by torch.profiler; None if it sees none."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    return len(kernels) or None


@torch.no_grad()
def graph_round_ms(batches=(1, 8, 32), budget: int = 16, rounds: int = 200) -> dict:
    """GraphTreeBuilder (DominoTree, `budget` nodes) per batch size: ms per round by CUDA events, kernels per
    round (the graph's kernels plus the builder's input copies and output clone), the eager fused path."""
    cfg = TreeConfig(budget=budget)
    head, _, _, _, embed = smollm2_inputs(1)
    s = SMOLLM2
    out = {}
    builder = GraphTreeBuilder(head, embed, cfg, s["block"], s["vocab"], s["hidden"], torch.bfloat16,
                               batch_sizes=tuple(sorted(set(batches))))
    for b in batches:
        _, hidden, base, roots, _ = smollm2_inputs(b, seed=b)

        def graph():
            return builder.build(hidden, base, roots)

        def eager():
            return build_frontier(prepare_round(head, hidden, base, roots, embed, cfg, builder.tables.gates), cfg)

        out[f"b{b}"] = dict(graph_ms=cuda_time_ms(graph, 20, rounds),
                            eager_ms=cuda_time_ms(eager, 20, max(10, rounds // 10)),
                            kernels_per_round=kernels_per_call(graph),
                            identical_to_reference=same_tree(
                                build_reference(prepare_round(head, hidden, base, roots, embed, cfg), cfg), graph()))
    return dict(tree_config=asdict(cfg), shapes=SMOLLM2, by_batch=out,
                timer="CUDA events over back-to-back rounds after 20 warm-up rounds")


# ---- offline compile report (no GPU needed) ------------------------------------------------------------------

def _kernel_specs():
    from speculative.kernels import tree_fused, tree_ops, tree_round, tree_rows, tree_walk

    def p(t):
        return "*" + t

    f32, i64, i32, bf = "fp32", "i64", "i32", "bf16"
    dot = tree_ops.dot_meta()
    expand = dict(cand_ids=p(i64), base_logp=p(f32), base_cand=p(f32), zproj=p(f32), root_state=p(f32),
                  gates=p(f32), w_hh_t=p(bf), w1s_t=p(bf), w2=p(bf), kid_score=p(f32), kid_cand=p(i32),
                  lane_h=p(f32), lane_gh=p(f32), lane_score=p(f32), led_score=p(f32), led_parent=p(i32),
                  led_token=p(i64), scratch=p(f32), t=i32, D=i32, M=i32, R=i32, G=i32, L=i32, K=i32,
                  uncorrected=i32)
    round_rows = dict(base=p(bf), root_ids=p(i64), part_keys=p(i64), n_lists=i32, part_max=p(f32), part_sum=p(f32),
                      cand_ids=p(i64), base_logp=p(f32), stride_b=i32, stride_s=i32, D=i32, V=i32, M=i32, NCH=i32,
                      hidden=p(bf), gates=p(f32), w1h_t=p(bf), base_cand=p(f32), zproj=p(f32), root_state=p(f32),
                      hidden_b=i32, hidden_s=i32, H=i32, G=i32, R=i32)
    ledger = dict(cand_ids=p(i64), kid_score=p(f32), kid_cand=p(i32), led_score=p(f32), led_parent=p(i32),
                  led_token=p(i64), pos=p(i32), tokens=p(i64), parents=p(i64), depths=p(i64), scores=p(f32),
                  valid=p("i1"), D=i32, M=i32, L=i32, K=i32, N_OUT=i32)
    vocab_chunk = dict(base=p(bf), part_keys=p(i64), part_max=p(f32), part_sum=p(f32), stride_b=i32, stride_s=i32,
                       D=i32, V=i32, NCH=i32)
    child_logp = dict(states=p(f32), rows=p(i64), cand_ids=p(i64), base_cand=p(f32), zproj=p(f32), w1s_t=p(bf),
                      w2=p(bf), scratch=p(f32), out=p(f32), depth=i32, D=i32, G=i32, R=i32, M=i32)
    child_state = dict(rows=p(i64), cand=p(i64), cand_ids=p(i64), gates=p(f32), parent_states=p(f32),
                       parent_gates=p(f32), out=p(f32), depth=i32, D=i32, G=i32, M=i32)
    return {
        "expand": (tree_fused.expand_kernel, expand,
                   dict(WITH_STATES=True, MP=64, LOG_MP=6, RP=64, GP=256, NP=128, BI=32, **dot), 4),
        "ledger": (tree_fused.ledger_kernel, ledger, dict(NP=128, EP=256, BI=32), 4),
        "vocab_chunk": (tree_round.vocab_chunk_kernel, vocab_chunk, dict(KP=64, CH=tree_ops.VOCAB_CHUNK), 1),
        "merge_keys": (tree_round.merge_keys_kernel, dict(src=p(i64), dst=p(i64), n_lists=i32),
                       dict(KP=64, GROUP=tree_ops.MERGE_GROUP), 1),
        "round_rows": (tree_round.round_rows_kernel, round_rows,
                       dict(CORRECTED=True, KP=64, NKP=512, NCHP=64, RP=64, GP=256, **dot), 4),
        "child_logp": (tree_rows.child_logp_kernel, child_logp, dict(MP=64, LOG_MP=6, RP=64, **dot), 4),
        "top_children": (tree_rows.top_children_kernel,
                         dict(logp=p(f32), out_idx=p(i64), out_val=p(f32), M=i32, K=i32), dict(MP=64, BI=32), 4),
        "hidden_gates": (tree_rows.hidden_gates_kernel, dict(states=p(f32), w_hh_t=p(bf), out=p(f32), G=i32),
                         dict(GP=256, **dot), 4),
        "child_state": (tree_rows.child_state_kernel, child_state, dict(GP=256), 4),
        "walk": (tree_walk.walk_kernel, dict(tokens=p(i64), parents=p(i64), valid=p("i1"), choices=p(i64),
                                             out=p(i64), N=i32, W=i32), dict(NP=64, WP=128), 1),
    }


def compile_report() -> dict:
    """Each kernel compiled for sm_90 at SmolLM2's sizes (no GPU needed): registers, spilled bytes, shared
    memory, and `contract` flags in its LLVM IR (0: no a*b+c may become an FMA; exp/log's own FMAs are
    explicit intrinsics, not contractions)."""
    import triton
    from triton.backends.compiler import GPUTarget
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    report = {}
    for name, (fn, sig, consts, warps) in _kernel_specs().items():
        src = triton.compiler.ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}},
                                        constexprs=consts)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=warps, enable_fp_fusion=False))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
        regs, stack, shared, local = (int(x) for x in found.groups())
        report[name] = dict(registers=regs, spilled_bytes=stack + local, shared_bytes=shared, num_warps=warps,
                            contract_flags=len(re.findall(r"\bcontract\b", kernel.asm["llir"])))
    return report


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.tree_builder", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=1000, help="random rounds for the identity check (CUDA)")
    p.add_argument("--rounds", type=int, default=200, help="timed rounds per batch size")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--compile-report", action="store_true", help="only the offline sm_90 compile report")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    report: dict = dict(compile=compile_report())
    if not args.compile_report:
        if not torch.cuda.is_available():
            raise SystemExit("timing and the identity check need CUDA (--compile-report works anywhere)")
        report["graph_builder"] = graph_round_ms(args.batches, rounds=args.rounds)
        report["identity"] = builder_identity(args.cases, "cuda")
        report["device"] = torch.cuda.get_device_name()
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    sys.exit(main() and 0)
