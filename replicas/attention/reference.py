"""Plain-torch definitions of every kernel in this package: the executable spec the Triton kernels are tested against.

Slow on purpose (one Python iteration per request); never on a hot path.
"""
from __future__ import annotations

import torch
from torch import Tensor

from replicas.attention.spec import AttentionBatch, AttentionSpec


def gather_kv(kv_cache: Tensor, block_table: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """K and V of one sequence's first seq_len tokens, [seq_len, Hkv, D] each, read through its page table."""
    block_size = kv_cache.shape[2]
    pages = block_table[: (seq_len + block_size - 1) // block_size].long()
    kv = kv_cache[pages]                                   # [n, 2, bs, Hkv, D]
    k = kv[:, 0].reshape(-1, *kv.shape[-2:])[:seq_len]
    v = kv[:, 1].reshape(-1, *kv.shape[-2:])[:seq_len]
    return k, v


def visibility_mask(q_len: int, seq_len: int, spec: AttentionSpec, tree_mask: Tensor | None, device) -> Tensor:
    """[q_len, seq_len] bool: which keys each new token sees.

    Prefix keys are always visible; among the new tokens the tree mask decides, else causal (or all when
    spec.causal is False). A sliding window then also hides key p from query t unless t - p < window, with
    t and p the flat positions (prefix_len + index).
    """
    prefix = seq_len - q_len
    mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=device)
    if tree_mask is not None:
        mask[:, prefix:] = tree_mask[:q_len, :q_len]
    elif spec.causal:
        mask[:, prefix:] = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    if spec.sliding_window is not None:
        t = torch.arange(prefix, seq_len, device=device)[:, None]
        p = torch.arange(seq_len, device=device)[None, :]
        mask &= (t - p) < spec.sliding_window
    return mask


def attention_reference(q: Tensor, kv_cache: Tensor, batch: AttentionBatch, spec: AttentionSpec) -> Tensor:
    """q [T, H, D] -> out [T, H, D] (q's dtype), softmax in float32. A query that sees no key outputs zeros."""
    out = torch.zeros_like(q)
    qsl = batch.query_start_loc.tolist()
    seq_lens = batch.seq_lens.tolist()
    for b, seq_len in enumerate(seq_lens):
        start, end = qsl[b], qsl[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k, v = gather_kv(kv_cache, batch.block_tables[b], seq_len)
        k = k.float().repeat_interleave(spec.group_size, dim=1)          # [S, H, D]
        v = v.float().repeat_interleave(spec.group_size, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * spec.scale
        tree = batch.tree_mask[b] if batch.tree_mask is not None else None
        mask = visibility_mask(q_len, seq_len, spec, tree, q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)            # all-masked rows -> 0
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def decode_attention_reference(q: Tensor, kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                               spec: AttentionSpec) -> Tensor:
    """q [B, H, D]: one new token per request, at position seq_lens[b] - 1."""
    batch = AttentionBatch.for_decode(block_tables, seq_lens, int(seq_lens.max()))
    return attention_reference(q, kv_cache, batch, spec)


def kv_store_reference(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write k/v [T, Hkv, D] into kv_cache at slot_mapping [T] (int64); slot -1 writes nowhere."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = k[keep].to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = v[keep].to(kv_cache.dtype)


# ---- fused elementwise ops -------------------------------------------------------------------------------------

def rms_norm_reference(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out, new_residual). With a residual, h = x + residual (rounded to x's dtype) is both normed and returned;
    without, x itself is the new residual. Normalisation in float32, rounded before the weight, as HF Llama does."""
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed.to(x.dtype).float()).to(x.dtype), h


def rotary_cos_sin_cache(inv_freq: Tensor, max_position: int) -> Tensor:
    """[max_position, rot_dim] float32: cos(pos * inv_freq) in the first half, sin in the second.
    inv_freq [rot_dim // 2] carries any RoPE scaling (llama3, yarn...) already applied."""
    pos = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(pos, inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary_reference(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> None:
    """In place, neox / HF-llama rotate_half layout on the first rot_dim dims of each head; q [T, H, D], k [T, Hkv, D]."""
    rot = cos_sin_cache.shape[1]
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, : rot // 2], cs[:, None, rot // 2:]
    for x in (q, k):
        x1, x2 = x[..., : rot // 2].float(), x[..., rot // 2: rot].float()   # views when x is float32
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x[..., :rot] = rotated.to(x.dtype)


def silu_and_mul_reference(x: Tensor) -> Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I], computed in float32."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
