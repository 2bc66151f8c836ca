"""DFlash-style block drafter with the Domino GRU correction head.

One forward drafts a whole block: the input is the last committed token (the root) followed by block-1 mask
embeddings at positions p .. p+block-1; attention inside the block is bidirectional, and every draft layer also
attends to the target's context: the target's residual stream after `target_layer_ids`, concatenated, projected
(fc + RMSNorm) and turned into extra keys/values. The target's frozen LM head maps the block's hidden states to
base logits [B, block, V]; slot k predicts the token at position p+1+k (label shift: slot 0 is the next token).
Drafters published in the DFlash layout (speculative/drafters/public.py) differ in two settings: the mask slots
embed the target's `mask_token_id`, and without the label shift the root's slot predicts nothing: the input is the
root and `block_size` mask slots, the root's output is dropped.

The Domino head adds a causal, path-dependent correction: a GRU reads the target embeddings of the root and the
path so far; slot k's logits are base_k + W2 SiLU(W1 [z_k; s_k]), with s_k the GRU state after root + k path
tokens. Slots below `uncorrected_positions` (slot 0 by default) keep their base logits.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from replicas.config import ModelConfig
from speculative.drafter_weights import load_weights, save_weights
from speculative.tree import gru_step


def evenly_spaced_layers(num_target_layers: int, count: int) -> tuple[int, ...]:
    """Target layers 1 .. L-3, evenly spaced (DFlash's choice); layer i means the residual stream after layer i."""
    if count == 1:
        return (num_target_layers // 2,)
    lo, hi = 1, max(num_target_layers - 3, 1)
    return tuple(int(round(lo + i * (hi - lo) / (count - 1))) for i in range(count))


def _round_up(x: int, m: int) -> int:
    return max(m, (x + m - 1) // m * m)


@dataclass(frozen=True)
class DrafterConfig:
    vocab_size: int
    hidden_size: int                   # the target's: embeddings and LM head are the target's
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    target_layer_ids: tuple[int, ...]
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    gru_hidden: int = 1024
    correction_rank: int = 256
    uncorrected_positions: int = 1
    mask_token_id: Optional[int] = None   # None: the learned mask embedding; else the target's embedding of it
    shift_label: bool = True              # False: the root's slot predicts nothing (published DFlash)

    @property
    def context_size(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def input_length(self) -> int:
        """Block inputs per round (root + mask slots); `block_size` is the number of drafted slots."""
        return self.block_size if self.shift_label else self.block_size + 1

    @staticmethod
    def for_target(model: ModelConfig, num_layers: int = 3, num_target_layers: Optional[int] = None,
                   block_size: int = 16, intermediate_size: Optional[int] = None) -> "DrafterConfig":
        """A drafter sized for `model`, its MLP as wide as the target's unless `intermediate_size`. Domino's Qwen3-8B
        head (hidden 4096) uses GRU 1024 and rank 256, i.e. hidden/4 and hidden/16; we keep those ratios, rounded up
        to multiples of 64 (SmolLM2: 192 and 64)."""
        return DrafterConfig(
            vocab_size=model.vocab_size, hidden_size=model.hidden_size,
            intermediate_size=intermediate_size or model.intermediate_size,
            num_layers=num_layers, num_heads=model.num_attention_heads, num_kv_heads=model.num_key_value_heads,
            head_dim=model.head_dim,
            target_layer_ids=evenly_spaced_layers(model.num_hidden_layers, num_target_layers or num_layers),
            block_size=block_size, rms_norm_eps=model.rms_norm_eps, rope_theta=model.rope_theta,
            gru_hidden=_round_up(model.hidden_size // 4, 64), correction_rank=_round_up(model.hidden_size // 16, 64))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @staticmethod
    def from_json(text: str) -> "DrafterConfig":
        d = json.loads(text)
        d["target_layer_ids"] = tuple(d["target_layer_ids"])
        return DrafterConfig(**d)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def apply_rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """x [B, T, heads, d], positions [B, T]; rotate-half convention."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.float()[..., None] * inv_freq                    # [B, T, d/2]
    cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@dataclass
class DraftContext:
    """Per-layer keys/values of the target context, ready for attention (RoPE applied), plus a padding mask.
    They depend only on the context tokens, so a caller can cache them across rounds and `concat` new ones."""
    keys: list[Tensor]      # per draft layer [B, T, kv_heads, head_dim]
    values: list[Tensor]
    valid: Tensor           # [B, T] bool; False = padding

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def concat(self, other: "DraftContext") -> "DraftContext":
        return DraftContext([torch.cat(p, 1) for p in zip(self.keys, other.keys)],
                            [torch.cat(p, 1) for p in zip(self.values, other.values)],
                            torch.cat([self.valid, other.valid], 1))

    @staticmethod
    def stack(items: list["DraftContext"]) -> "DraftContext":
        """Batch single-request contexts of different lengths, right-padded."""
        t = max(c.length for c in items)

        def pad(x: Tensor) -> Tensor:
            return F.pad(x, (0, 0, 0, 0, 0, t - x.shape[1])) if x.dim() == 4 else F.pad(x, (0, t - x.shape[1]))
        layers = range(len(items[0].keys))
        return DraftContext([torch.cat([pad(c.keys[i]) for c in items]) for i in layers],
                            [torch.cat([pad(c.values[i]) for c in items]) for i in layers],
                            torch.cat([pad(c.valid) for c in items]))


class DraftAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.nh, self.nkv, self.hd, self.theta = nh, nkv, hd, cfg.rope_theta
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def kv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        b, t, _ = x.shape
        k = apply_rope(self.k_norm(self.k_proj(x).view(b, t, self.nkv, self.hd)), positions, self.theta)
        return k, self.v_proj(x).view(b, t, self.nkv, self.hd)

    def forward(self, x: Tensor, positions: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor) -> Tensor:
        b, s, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, s, self.nh, self.hd)), positions, self.theta)
        k, v = self.kv(x, positions)
        k, v = torch.cat([ctx_k, k], 1), torch.cat([ctx_v, v], 1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if isinstance(mask, Tensor):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=self.nh != self.nkv)
        else:                                                  # a FlexAttention BlockMask (training, compiled)
            from torch.nn.attention.flex_attention import flex_attention
            out = flex_attention(q, k, v, block_mask=mask, enable_gqa=self.nh != self.nkv)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.nh * self.hd))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = DraftAttention(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, positions, ctx_k, ctx_v, mask):
        x = x + self.attn(self.input_norm(x), positions, ctx_k, ctx_v, mask)
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class BlockDrafter(nn.Module):
    """The DFlash backbone: block embeddings + target context -> block hidden states."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.context_size, cfg.hidden_size, bias=False)
        self.context_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))

    def context(self, target_hidden: Tensor, positions: Tensor, valid: Optional[Tensor] = None) -> DraftContext:
        """target_hidden [B, T, n_layers*hidden] at absolute `positions` [B, T] -> per-layer context K/V."""
        c = self.context_norm(self.fc(target_hidden))
        kvs = [layer.attn.kv(c, positions) for layer in self.layers]
        if valid is None:
            valid = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        return DraftContext([k for k, _ in kvs], [v for _, v in kvs], valid)

    def forward(self, block_embeds: Tensor, positions: Tensor, ctx: DraftContext, mask: Tensor) -> Tensor:
        """block_embeds [B, S, H] at `positions` [B, S]; mask [B, S, T+S] bool (True = may attend), or a
        FlexAttention BlockMask of that shape."""
        x = block_embeds
        for layer, k, v in zip(self.layers, ctx.keys, ctx.values):
            x = layer(x, positions, k, v, mask)
        return self.norm(x)


class DominoHead(nn.Module):
    """GRU over the path's target embeddings + low-rank logit correction W2 SiLU(W1 [z; s])."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gru = nn.GRU(cfg.hidden_size, cfg.gru_hidden, num_layers=1, batch_first=True, bias=False)
        self.w1 = nn.Linear(cfg.hidden_size + cfg.gru_hidden, cfg.correction_rank, bias=False)
        self.w2 = nn.Linear(cfg.correction_rank, cfg.vocab_size, bias=False)
        self.uncorrected = cfg.uncorrected_positions

    def path_states(self, path_embeds: Tensor) -> Tensor:
        """path_embeds [N, S, H] = embeddings of (root, t_1, .., t_{S-1}) -> float32 states [N, S, G]; state k
        has read root + k path tokens, which is what slot k's correction conditions on.

        `self.gru`'s recurrence written out over the S slots: the input gates of every slot in one GEMM, then S
        steps of W_hh h. The GEMMs follow autocast (bf16 in training) and a compiled loss fuses the cell into its
        graph; the state is carried in float32. nn.GRU itself would run cuDNN's kernel in the weights' dtype,
        outside the compiled graph."""
        w_ih, w_hh = self.gru.weight_ih_l0, self.gru.weight_hh_l0
        gate_in = F.linear(path_embeds.to(w_ih.dtype), w_ih)                            # [N, S, 3G]
        h = gate_in.new_zeros(gate_in.shape[0], w_hh.shape[1], dtype=torch.float32)
        states = []
        for k in range(gate_in.shape[1]):
            h = gru_step(gate_in[:, k].float(), F.linear(h.to(gate_in.dtype), w_hh).float(), h)
            states.append(h)
        return torch.stack(states, 1)

    def low_rank(self, hidden: Tensor, states: Tensor) -> Tensor:
        """SiLU(W1 [z; s]): what W2 projects onto the vocabulary."""
        return F.silu(self.w1(torch.cat([hidden, states.to(hidden.dtype)], dim=-1)))

    def correction(self, hidden: Tensor, states: Tensor) -> Tensor:
        return self.w2(self.low_rank(hidden, states))

    def correction_inputs(self, hidden: Tensor, path_embeds: Tensor) -> Tensor:
        """Teacher-forced `low_rank` for every slot, [N, S, rank], zero at the slots below `uncorrected`: slot
        k's logits are base + W2 of it (speculative/vocab_loss.py)."""
        u = self.uncorrected
        return F.pad(self.low_rank(hidden[:, u:], self.path_states(path_embeds)[:, u:]), (0, 0, u, 0))

    def corrected_logits(self, base_logits: Tensor, hidden: Tensor, path_embeds: Tensor) -> Tensor:
        """Teacher-forced logits for every slot: [N, S, V]; slots < uncorrected keep the base logits."""
        return base_logits + self.w2(self.correction_inputs(hidden, path_embeds)).to(base_logits.dtype)


@dataclass
class DraftBlock:
    hidden: Tensor          # [B, S, H] the block's hidden states (the Domino head's z)
    base_logits: Tensor     # [B, S, V] slot k predicts the token at root position + 1 + k


class DominoDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.backbone = BlockDrafter(cfg)
        self.head = DominoHead(cfg)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.backbone.mask_embedding.is_meta:     # a loader's skeleton (meta device): weights come from a file
            return
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[-1]))
        nn.init.normal_(self.backbone.mask_embedding, std=0.02)
        nn.init.zeros_(self.head.w2.weight)          # the head starts as "no correction"

    def block_inputs(self, root_ids: Tensor, root_positions: Tensor, embed_weight: Tensor) -> tuple[Tensor, Tensor]:
        """[root, mask x (S-1)] embeddings [B, S, H] and their positions [B, S]; S = cfg.input_length."""
        s, dtype = self.cfg.input_length, self.backbone.mask_embedding.dtype
        root = embed_weight[root_ids].to(dtype)[:, None]
        mask = self.backbone.mask_embedding if self.cfg.mask_token_id is None else \
            embed_weight[self.cfg.mask_token_id].to(dtype)
        masks = mask.expand(root.shape[0], s - 1, -1)
        pos = root_positions[:, None] + torch.arange(s, device=root_positions.device)
        return torch.cat([root, masks], 1), pos

    def draft(self, root_ids: Tensor, root_positions: Tensor, ctx: DraftContext, embed_weight: Tensor,
              lm_head_weight: Tensor) -> DraftBlock:
        """One drafting round. `ctx` must hold exactly the committed tokens before the root (positions <
        root_positions); the root's own target hidden state does not exist yet."""
        embeds, pos = self.block_inputs(root_ids, root_positions, embed_weight)
        b, s = pos.shape
        mask = torch.cat([ctx.valid[:, None, :].expand(b, s, ctx.length),
                          torch.ones(b, s, s, dtype=torch.bool, device=pos.device)], dim=2)
        hidden = self.backbone(embeds, pos, ctx, mask)[:, s - self.cfg.block_size:]   # no label shift: drop the root
        return DraftBlock(hidden, hidden @ lm_head_weight.to(hidden.dtype).t())

    def save(self, folder: str, int8: bool = False) -> None:
        os.makedirs(folder, exist_ok=True)
        save_weights(self.state_dict(), folder, int8)
        with open(os.path.join(folder, "config.json"), "w") as f:
            f.write(self.cfg.to_json())

    @staticmethod
    def load(folder: str, device="cpu", dtype: torch.dtype = torch.float32) -> "DominoDrafter":
        """A folder saved by `save` (published checkpoints: speculative.drafters.loading.load_drafter)."""
        with open(os.path.join(folder, "config.json")) as f:
            cfg = DrafterConfig.from_json(f.read())
        model = DominoDrafter(cfg)
        model.load_state_dict(load_weights(folder))
        return model.to(device=device, dtype=dtype)
