"""Paged extend attention for mixed batches: prefill chunks, decodes and tree verifies in one launch.

Program (p, kv_head) owns BLOCK_M rows = BLOCK_M // group new tokens x the `group` query heads of one KV head,
so every K/V tile is loaded once for the whole head group. It streams the paged prefix (fully visible, no
per-key mask beyond the sliding window), then the new tokens under the causal or tree mask, with an online
softmax in float32 (exp2 domain).

The grid packs every request's tiles: tile_ends holds the running count of tiles through each request, and
program p works for the first request whose count exceeds p. That is cdiv(T, tokens per tile) + B programs
per KV head whatever the lengths, as a CUDA graph of T tokens and B lanes needs: a (longest request x B) grid
would be mostly empty there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from replicas.attention.spec import AttentionBatch, AttentionSpec

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class ExtendTuning:
    max_block_m: int = 128       # rows (token x head) per program
    block_n: int = 64            # keys per tile (32 when head_dim > 128)
    num_stages: int = 2


@triton.jit
def _attend_keys(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, key_pos, key_valid, visible,
                 kv_head, d, d_mask, stride_cb, stride_cs, stride_ch, scale_log2,
                 BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over the keys at absolute positions key_pos (gathered through the page table)."""
    page = tl.load(table + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
    row = page * stride_cb + (key_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    kv_mask = key_valid[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; exponentiate against 0 so it stays exactly 0.
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# Integer arguments that change from step to step are not specialized on (Triton would compile a variant per
# value class: == 1, divisible by 16, other), and the lane count is one power of two for every batch up to
# LANES: a variant compiled in the middle of serving stalls the engine for the length of a compile.
LANES = 256


@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "stride_tree_b", "stride_tree_i", "window"])
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr, tree_ptr,
    tile_ends_ptr, num_seqs, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt, stride_tree_b, stride_tree_i,
    scale_log2, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_TREE: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    p = tl.program_id(0)
    kv_head = tl.program_id(1)
    lanes = tl.arange(0, BLOCK_B)
    ends = tl.load(tile_ends_ptr + lanes, mask=lanes < num_seqs, other=2 ** 30)
    before = ends <= p
    # Programs past the last tile leave by the single early exit below: with a second `return` here, Triton
    # 3.6 failed to compile some configurations (LLVMDIScope pass).
    b_all = tl.sum(before.to(tl.int32))                 # p's request, or num_seqs past the last tile
    b = tl.minimum(b_all, num_seqs - 1)
    tile = p - tl.max(tl.where(before, ends, 0))
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.where(b_all < num_seqs, tl.load(query_start_ptr + b + 1) - q_start, 0)
    tok0 = tile * TOKENS
    if tok0 >= q_len:
        return
    prefix = tl.load(seq_lens_ptr + b) - q_len

    r = tl.arange(0, BLOCK_M)
    tok = tok0 + r // GROUP                       # new-token index of each row
    head = kv_head * GROUP + r % GROUP
    row_valid = (r < TOKENS * GROUP) & (tok < q_len)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt

    # Prefix keys [lo, prefix): visible to every new token (the window aside).
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(prefix + tok0 - window + 1, 0)
    for start in range(lo, prefix, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_valid = key_pos < prefix
        visible = key_valid[None, :]
        if HAS_WINDOW:
            visible = visible & ((prefix + tok)[:, None] - key_pos[None, :] < window)
        m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, key_pos, key_valid, visible,
                                     kv_head, d, d_mask, stride_cb, stride_cs, stride_ch, scale_log2,
                                     BLOCK_SIZE, DOT_PRECISION)

    # New keys j in [lo_new, hi): causal, tree-masked, or all visible.
    if CAUSAL and not HAS_TREE:
        hi = tl.minimum(tok0 + TOKENS, q_len)
    else:
        hi = q_len
    lo_new = 0
    if HAS_WINDOW:
        lo_new = tl.maximum(tok0 - window + 1, 0)
    for start in range(lo_new, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        key_valid = j < hi
        if HAS_TREE:
            tree = tl.load(tree_ptr + b.to(tl.int64) * stride_tree_b + tok[:, None] * stride_tree_i + j[None, :],
                           mask=row_valid[:, None] & key_valid[None, :], other=0)
            visible = tree != 0
        elif CAUSAL:
            visible = key_valid[None, :] & (j[None, :] <= tok[:, None])
        else:
            visible = key_valid[None, :] & (tok[:, None] >= 0)
        if HAS_WINDOW:
            visible = visible & (tok[:, None] - j[None, :] < window)
        m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, prefix + j, key_valid,
                                     visible, kv_head, d, d_mask, stride_cb, stride_cs, stride_ch, scale_log2,
                                     BLOCK_SIZE, DOT_PRECISION)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


def extend_block_m(max_query_len: int, group_size: int, tuning: ExtendTuning = ExtendTuning()) -> int:
    """Rows per program: enough for the longest request's (token x head) rows, in [16, max_block_m]."""
    rows = triton.next_power_of_2(max(1, max_query_len) * group_size)
    return max(16, triton.next_power_of_2(group_size), min(rows, tuning.max_block_m))


def paged_extend_attention(q: Tensor, kv_cache: Tensor, batch: AttentionBatch, spec: AttentionSpec,
                           out: Optional[Tensor] = None, tuning: ExtendTuning = ExtendTuning()) -> Tensor:
    """q [T, H, D] (the new tokens of every request, flattened) -> out [T, H, D]. See AttentionBatch for the
    layout and reference.visibility_mask for who sees what. Reads no tensor on the host."""
    num_tokens, num_heads, head_dim = q.shape
    assert (num_heads, head_dim) == (spec.num_heads, spec.head_dim) and q.stride(-1) == 1
    assert kv_cache.shape[2:] == (spec.block_size, spec.num_kv_heads, head_dim) and kv_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    num_seqs = batch.num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = spec.group_size
    block_m = extend_block_m(batch.max_query_len, group, tuning)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = tuning.block_n if block_d <= 128 else min(tuning.block_n, 32)
    tree = batch.tree_mask
    if tree is not None:
        assert tree.dtype == torch.bool and tree.stride(-1) == 1 and tree.shape[0] == num_seqs
        tree = tree.view(torch.uint8)
    k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]
    tokens_per_tile = block_m // group
    grid = (triton.cdiv(num_tokens, tokens_per_tile) + num_seqs, spec.num_kv_heads)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, batch.query_start_loc, batch.seq_lens, batch.block_tables,
        tree if tree is not None else batch.seq_lens, batch.tile_ends(tokens_per_tile), num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), batch.block_tables.stride(0),
        tree.stride(0) if tree is not None else 0, tree.stride(1) if tree is not None else 0,
        spec.scale * LOG2E, spec.sliding_window or 0,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=spec.block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        CAUSAL=spec.causal, HAS_TREE=tree is not None, HAS_WINDOW=spec.sliding_window is not None,
        DOT_PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",
        BLOCK_B=max(LANES, triton.next_power_of_2(num_seqs)),
        num_warps=8 if block_m >= 128 else 4, num_stages=tuning.num_stages,
    )
    return out
