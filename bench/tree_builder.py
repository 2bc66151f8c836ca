"""The GPU tree builder's cost per round and its bit-identity with the reference builder (bench.speculative's
`tree_build_ms_b16`, `tree_build.by_mode` and `builder_bit_identical_cases`)."""
from __future__ import annotations

import random
from dataclasses import asdict

import torch

from speculative.baselines import METHODS, chain_config
from speculative.drafter import DominoHead, DrafterConfig
from speculative.tree import DraftTree, gate_table, prepare_round
from speculative.tree_gpu import GraphTreeBuilder, build_frontier
from speculative.tree_reference import build_reference


def cuda_ms(fn, rounds: int, warmup: int = 20) -> float:
    """Mean ms per call over `rounds` back-to-back calls, by CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / rounds


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
    draft = lambda: spec.drafter.draft(roots, pos, ctx, spec.embed_weight, spec.lm_head_weight)
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
    eager = lambda r, h, b: builder.build(prepare_round(head, h, b, r, embed, builder.cfg, gates))
    out = dict(eager_ms=cuda_ms(lambda: eager(roots, hidden, base), rounds),
               graph_ms=cuda_ms(lambda: graphs.build(hidden, base, roots), rounds),
               draft_ms=cuda_ms(draft, rounds), draft_context_tokens=256, tree_config=asdict(builder.cfg))
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
    to = lambda t: t.to(device)
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
                mismatched_seeds=mismatched[:20], builder="build_frontier vs build_reference, same device")
