"""Paged attention in plain torch: runs on any device; the CPU serving path.

Decodes (one new token) are batched into one padded gather + matmul per layer; prefill chunks and
tree verifies run one SDPA per sequence. The plan (gather indices, masks) is built once per step.
On a CPU with a float32 cache the KV store and the decode rows run replicas/kernels/attention_cpu.py instead
(the same arithmetic without the gathers).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from replicas.attention.context import ForwardContext
from replicas.kernels import attention_cpu


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, block_size: int):
        self.block_size = block_size

    def plan(self, ctx: ForwardContext) -> None:
        qlens, slens = ctx.query_lens_host, ctx.seq_lens_host
        assert qlens is not None and slens is not None, "the torch backend plans from host lengths"
        b = ctx.batch
        dev = b.seq_lens.device
        decode = [i for i, q in enumerate(qlens) if q == 1 and b.tree_mask is None]
        decode_set = set(decode)
        other = [i for i in range(len(qlens)) if i not in decode_set]
        st: dict = {"decode_rows": None, "prefill": [], "native": None}
        if decode:
            rows = torch.tensor(decode, device=dev)
            st["decode_rows"] = rows
            # the dtypes attention_cpu.decode_attention takes (the torch path reads them as well)
            st["decode_tokens"] = b.query_start_loc[rows].long()
            st["decode_lens"] = b.seq_lens[rows].to(torch.int32)
            st["decode_tables"] = b.block_tables[rows].to(torch.int32)
            st["decode_max_len"] = max(slens[i] for i in decode)
        starts = b.query_start_loc.tolist() if other else []
        for i in other:
            n, L = qlens[i], slens[i]
            pos = torch.arange(L, device=dev)
            blk = b.block_tables[i, pos // self.block_size].long()
            q_pos = torch.arange(L - n, L, device=dev).unsqueeze(1)
            mask = pos.unsqueeze(0) <= q_pos                   # causal over the context
            if b.tree_mask is not None:
                mask = mask.clone()
                mask[:, L - n:] = b.tree_mask[i, :n, :n]
            st["prefill"].append((starts[i], n, blk, pos % self.block_size, mask))
        ctx.backend_state["torch"] = st

    def _decode_gather_plan(self, st: dict) -> None:
        """The torch path's gather indices and mask of the decode rows, made on first use."""
        if "decode_blk" in st:
            return
        tables, lens = st["decode_tables"].long(), st["decode_lens"].unsqueeze(1).long()
        pos = torch.arange(st["decode_max_len"], device=tables.device).unsqueeze(0)
        n = tables.shape[0]
        st["decode_blk"] = tables.gather(1, (pos // self.block_size).clamp_max(tables.shape[1] - 1).expand(n, -1))
        st["decode_off"] = (pos % self.block_size).expand(n, -1)
        st["decode_mask"] = pos < lens                         # [Bd, L]

    @staticmethod
    def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int):
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        blk, off = slots // block_size, slots % block_size
        kv_cache[blk, 0, off] = k[keep]
        kv_cache[blk, 1, off] = v[keep]

    def forward(self, q, k, v, kv_cache, ctx: ForwardContext, scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (new tokens); kv_cache [NB, 2, BS, Hkv, D]. Returns [T, H, D]."""
        st = ctx.backend_state["torch"]
        native = st["native"]
        if native is None:             # every layer's cache is a view of one pool: the first layer decides the step
            native = st["native"] = attention_cpu.supports(q, kv_cache)
        if native:
            attention_cpu.kv_store(k, v, kv_cache, ctx.slot_mapping)
        else:
            self.store_kv(k, v, kv_cache, ctx.slot_mapping, self.block_size)
        out = torch.empty_like(q)
        H, Hkv = q.shape[1], k.shape[1]
        if st["decode_rows"] is not None and native:
            attention_cpu.decode_attention(q, kv_cache, st["decode_tables"], st["decode_tokens"], st["decode_lens"],
                                           st["decode_max_len"], scale, out)
        elif st["decode_rows"] is not None:
            self._decode_gather_plan(st)
            blk, off, mask = st["decode_blk"], st["decode_off"], st["decode_mask"]
            keys = kv_cache[blk, 0, off].float()               # [Bd, L, Hkv, D]
            vals = kv_cache[blk, 1, off].float()
            qd = q[st["decode_tokens"]].float()                # [Bd, H, D]
            qd = qd.view(qd.shape[0], Hkv, H // Hkv, -1)       # [Bd, Hkv, G, D]
            scores = torch.einsum("bhgd,blhd->bhgl", qd, keys) * scale
            scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
            probs = scores.softmax(-1)
            o = torch.einsum("bhgl,blhd->bhgd", probs, vals)
            out[st["decode_tokens"]] = o.reshape(o.shape[0], H, -1).to(q.dtype)
        for start, n, blk, off, mask in st["prefill"]:
            keys = kv_cache[blk, 0, off].transpose(0, 1)       # [Hkv, L, D]
            vals = kv_cache[blk, 1, off].transpose(0, 1)
            qs = q[start:start + n].transpose(0, 1)            # [H, n, D]
            o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask, scale=scale, enable_gqa=H != Hkv)
            out[start:start + n] = o.transpose(0, 1)
        return out
