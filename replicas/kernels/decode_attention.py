"""Paged decode attention, split-KV (flash-decoding) with GQA heads packed into one tl.dot.

Program (b, kv_head, split) reads the K/V tiles of one KV head once for all `group_size` query heads (padded
to >= 16 rows for tl.dot) over one partition of the context, and writes the partial max / sum / accumulator;
a reduce kernel merges the partitions. With one split the partial kernel writes the output directly; a grid
that already fills the GPU (B x Hkv programs, several per SM) runs unsplit, since splitting it only adds the
fp32 partials and the reduce kernel. DecodeTuning holds every knob bench/decode_tune.py sweeps.
The grid depends only on (B, H, max_seq_len), never on seq_lens' values: safe to capture in a CUDA graph.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from replicas.attention.spec import AttentionSpec

LOG2E = 1.4426950408889634
SPLIT_POLICIES = ("auto", "fill", "never")


@dataclass(frozen=True)
class DecodeTuning:
    block_n: int = 64                # keys per tile (may span several pages)
    num_warps: int = 4
    num_stages: int = 3              # block_n/num_warps/num_stages tuned: python -m bench.decode_tune re-tunes them
    # "auto": a grid of B * Hkv programs that already has full_programs_per_sm per SM runs unsplit (no partials,
    # no reduce kernel); a smaller one is split like "fill". "fill": always split up to programs_per_sm per SM.
    # "never": one program per (sequence, KV head).
    split_policy: str = "auto"
    full_programs_per_sm: float = 2.0
    programs_per_sm: int = 4         # split the context until B * Hkv * splits reaches this many programs per SM
    min_split_tokens: int = 256      # ... but never below this many keys per split
    max_splits: int = 64

    def __post_init__(self):
        if self.split_policy not in SPLIT_POLICIES:
            raise ValueError(f"split_policy must be one of {SPLIT_POLICIES}, not {self.split_policy!r}")


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms_of(device: torch.device) -> int:
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 132


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      tuning: DecodeTuning = DecodeTuning()) -> int:
    """How many partitions of the context each (sequence, KV head) is cut into so the grid fills the GPU."""
    programs = max(1, num_seqs * num_kv_heads)
    if tuning.split_policy == "never" or (
            tuning.split_policy == "auto" and programs >= tuning.full_programs_per_sm * num_sms):
        return 1
    want = math.ceil(tuning.programs_per_sm * num_sms / programs)
    by_length = max(1, math.ceil(max_seq_len / tuning.min_split_tokens))
    return max(1, min(want, by_length, tuning.max_splits))


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, m_ptr, l_ptr, acc_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    num_splits, partition_size, scale_log2, window,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    lo = split * partition_size
    # The last split runs to seq_len, so a max_seq_len that is too small costs speed, never correctness.
    hi = tl.where(split == num_splits - 1, seq_len, tl.minimum(lo + partition_size, seq_len))
    if HAS_WINDOW:
        lo = tl.maximum(lo, seq_len - window)   # the query sits at seq_len - 1

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        k_mask = pos < hi
        page = tl.load(table + pos // BLOCK_SIZE, mask=k_mask, other=0).to(tl.int64)
        row = page * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = k_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        # Every tile holds at least one key below hi, so m_new is finite: no -inf - -inf here.
        s = tl.where(k_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = (b.to(tl.int64) * NUM_HEADS + heads) * num_splits + split      # [BLOCK_G] partial index
        tl.store(m_ptr + part, m_i, mask=g_mask)
        tl.store(l_ptr + part, l_i, mask=g_mask)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, stride_ob, stride_oh, num_splits,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    part = (b * NUM_HEADS + h) * num_splits + s
    m = tl.load(m_ptr + part, mask=s_mask, other=float("-inf"))
    denom = tl.load(l_ptr + part, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)    # all splits empty: weights 0, output 0
    w = tl.exp2(m - m_max)
    total = tl.sum(denom * w, 0)
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
                  mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode_attention(q: Tensor, kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                           spec: AttentionSpec, max_seq_len: int, out: Optional[Tensor] = None,
                           tuning: DecodeTuning = DecodeTuning()) -> Tensor:
    """q [B, H, D] (one token per request, at position seq_lens[b] - 1) -> out [B, H, D].

    max_seq_len is an upper bound on seq_lens fixing the grid (CUDA graphs pass the model's length bucket);
    seq_lens are never read on the host."""
    num_seqs, num_heads, head_dim = q.shape
    assert (num_heads, head_dim) == (spec.num_heads, spec.head_dim) and q.stride(-1) == 1
    assert kv_cache.shape[2:] == (spec.block_size, spec.num_kv_heads, head_dim) and kv_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]
    splits = decode_num_splits(num_seqs, spec.num_kv_heads, max_seq_len, num_sms_of(q.device), tuning)
    partition = triton.cdiv(triton.cdiv(max(max_seq_len, 1), splits), tuning.block_n) * tuning.block_n
    if splits > 1:
        m = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
        denom = torch.empty_like(m)
        acc = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    else:
        m = denom = acc = out       # unused by the kernel without SPLIT
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_partial_kernel[(num_seqs, spec.num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, m, denom, acc,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        splits, partition, spec.scale * LOG2E, spec.sliding_window or 0,
        NUM_HEADS=num_heads, GROUP=spec.group_size, HEAD_DIM=head_dim, BLOCK_SIZE=spec.block_size,
        BLOCK_G=max(16, triton.next_power_of_2(spec.group_size)), BLOCK_N=tuning.block_n, BLOCK_D=block_d,
        SPLIT=splits > 1, HAS_WINDOW=spec.sliding_window is not None,
        DOT_PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )
    if splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            m, denom, acc, out, out.stride(0), out.stride(1), splits,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, num_warps=4,
        )
    return out
