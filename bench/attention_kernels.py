"""Attention kernel benchmark (GPU): decode bandwidth vs a device copy, and tree-mask overhead of extend.

    python -m bench.attention_kernels [--no-sweep] [--out bench/results/attention_kernels.json]

Decode: B=64, 32 query / 8 KV heads, head_dim 128, 4096-token contexts, block 16, bf16, page tables shuffled
across the whole pool. Counted bytes = K and V of every context token read once + q read + out written
(page tables and split partials are left out: < 0.5% of the total). Achieved bandwidth is compared with a
1 GiB device-to-device copy timed in the same run, counted as read + write (2 x bytes).
Extend: B=32, 4096-token prefix, 64 new tokens each, same heads; causal vs a random 64-node tree mask
(each node sees its ancestors and itself). Timing: triton.testing.do_bench (25 ms warm-up, 100 ms of
repetitions, L2 flushed before each, median). Seed 0. Outputs are checked against the torch reference.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random

import torch
import triton
from triton.testing import do_bench

from replicas.attention.reference import attention_reference
from replicas.attention.spec import AttentionBatch, AttentionSpec
from replicas.kernels.decode_attention import DecodeTuning, decode_num_splits, num_sms_of, paged_decode_attention
from replicas.kernels.extend_attention import ExtendTuning, paged_extend_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16


def time_us(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting read + write."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * src.numel() / (time_us(lambda: dst.copy_(src)) * 1e-6)


def paged_batch(num_seqs: int, q_lens: list[int], seq_len: int, gen, tree: bool):
    spec = AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, BLOCK, HEAD_DIM ** -0.5)
    blocks_per_seq = triton.cdiv(seq_len, BLOCK)
    kv = torch.randn(spec.kv_cache_shape(num_seqs * blocks_per_seq), generator=gen, device="cuda", dtype=DTYPE)
    tables = torch.randperm(num_seqs * blocks_per_seq, generator=gen, device="cuda").int().view(num_seqs, -1)
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
    starts = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
    mask = None
    if tree:
        rng, width = random.Random(0), max(q_lens)
        mask = torch.zeros(num_seqs, width, width, dtype=torch.bool)
        for b in range(num_seqs):
            mask[b].fill_diagonal_(True)
            for i in range(1, width):
                mask[b, i] |= mask[b, rng.randrange(i)]
        mask = mask.cuda()
    return spec, q, kv, AttentionBatch(starts, seq_lens, tables, max(q_lens), seq_len, mask)


def max_err(out, q, kv, batch, spec) -> float:
    return (out.float() - attention_reference(q, kv, batch, spec).float()).abs().max().item()


def bench_decode(sweep: bool, copy_bw: float) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_seqs, ctx = 64, 4096
    spec, q, kv, batch = paged_batch(num_seqs, [1] * num_seqs, ctx, gen, tree=False)
    elem = q.element_size()
    bytes_moved = num_seqs * ctx * KV_HEADS * HEAD_DIM * 2 * elem + 2 * q.numel() * elem
    out = torch.empty_like(q)

    def run(tuning: DecodeTuning) -> float:
        return time_us(lambda: paged_decode_attention(q, kv, batch.block_tables, batch.seq_lens, spec, ctx,
                                                      out=out, tuning=tuning))

    default = DecodeTuning()
    us = run(default)
    err = max_err(paged_decode_attention(q, kv, batch.block_tables, batch.seq_lens, spec, ctx), q, kv, batch, spec)
    result = {"decode_us": us, "decode_bytes": bytes_moved, "decode_TBps": bytes_moved / (us * 1e-6) / 1e12,
              "decode_splits": decode_num_splits(num_seqs, KV_HEADS, ctx, num_sms_of(q.device), default),
              "decode_max_abs_err": err}
    result["attention_decode_bw_fraction"] = bytes_moved / (us * 1e-6) / copy_bw
    if sweep:
        trials = []
        for block_n, warps, stages, pps in itertools.product([32, 64, 128], [4, 8], [2, 3, 4], [1, 4, 8]):
            tuning = DecodeTuning(block_n=block_n, num_warps=warps, num_stages=stages, programs_per_sm=pps)
            try:
                trials.append((run(tuning), tuning))
            except Exception as e:   # e.g. out of shared memory for a large tile x many stages
                print(f"  decode {tuning}: {type(e).__name__}")
        best_us, best = min(trials, key=lambda t: t[0])
        result["decode_best_us"], result["decode_best_tuning"] = best_us, best.__dict__
        result["decode_best_bw_fraction"] = bytes_moved / (best_us * 1e-6) / copy_bw
    sdpa_q = q.view(num_seqs, HEADS, 1, HEAD_DIM)
    k = torch.randn(num_seqs, KV_HEADS, ctx, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    result["sdpa_contiguous_decode_us"] = time_us(
        lambda: torch.nn.functional.scaled_dot_product_attention(sdpa_q, k, v, enable_gqa=True))
    return result


def bench_tree_extend(sweep: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_seqs, prefix, nodes = 32, 4096, 64
    spec, q, kv, tree_batch = paged_batch(num_seqs, [nodes] * num_seqs, prefix + nodes, gen, tree=True)
    causal_batch = AttentionBatch(tree_batch.query_start_loc, tree_batch.seq_lens, tree_batch.block_tables,
                                  nodes, prefix + nodes, None)
    out = torch.empty_like(q)

    def run(batch, tuning: ExtendTuning) -> float:
        return time_us(lambda: paged_extend_attention(q, kv, batch, spec, out=out, tuning=tuning))

    default = ExtendTuning()
    causal_us, tree_us = run(causal_batch, default), run(tree_batch, default)
    result = {"extend_causal_us": causal_us, "extend_tree_us": tree_us, "tree_mask_overhead": tree_us / causal_us,
              "extend_tree_max_abs_err": max_err(paged_extend_attention(q, kv, tree_batch, spec), q, kv,
                                                 tree_batch, spec)}
    if sweep:
        trials = []
        for block_m, block_n, stages in itertools.product([64, 128], [32, 64, 128], [2, 3]):
            tuning = ExtendTuning(max_block_m=block_m, block_n=block_n, num_stages=stages)
            try:
                trials.append((run(causal_batch, tuning), run(tree_batch, tuning), tuning))
            except Exception as e:
                print(f"  extend {tuning}: {type(e).__name__}")
        c_us, t_us, best = min(trials, key=lambda t: t[1])
        result.update(extend_best_tuning=best.__dict__, extend_best_causal_us=c_us, extend_best_tree_us=t_us,
                      extend_best_tree_mask_overhead=t_us / c_us)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-sweep", action="store_true", help="time only the default tunings")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                   "attention_kernels.json"))
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    copy_bw = copy_bandwidth()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "copy_TBps": copy_bw / 1e12}
    result.update(bench_decode(not args.no_sweep, copy_bw))
    result.update(bench_tree_extend(not args.no_sweep))
    result["method"] = __doc__.strip()
    rows = [("device-to-device copy (read+write)", f"{result['copy_TBps']:.2f} TB/s"),
            ("decode B64 4k ctx, default tuning", f"{result['decode_us']:.1f} us, {result['decode_TBps']:.2f} TB/s, "
             f"{result['decode_splits']} split(s), max err {result['decode_max_abs_err']:.3g}"),
            ("attention_decode_bw_fraction", f"{result['attention_decode_bw_fraction']:.3f}"),
            ("SDPA decode, contiguous K/V (info)", f"{result['sdpa_contiguous_decode_us']:.1f} us"),
            ("extend B32 4k+64, causal", f"{result['extend_causal_us']:.1f} us"),
            ("extend B32 4k+64, tree mask", f"{result['extend_tree_us']:.1f} us, "
             f"max err {result['extend_tree_max_abs_err']:.3g}"),
            ("tree_mask_overhead", f"{result['tree_mask_overhead']:.3f}x")]
    if "decode_best_us" in result:
        rows += [("decode best sweep", f"{result['decode_best_us']:.1f} us ({result['decode_best_bw_fraction']:.3f}) "
                  f"{result['decode_best_tuning']}"),
                 ("extend best sweep (tree)", f"{result['extend_best_tree_us']:.1f} us "
                  f"({result['extend_best_tree_mask_overhead']:.3f}x) {result['extend_best_tuning']}")]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
