"""Data-parallel drafter training with Ray Train: one worker per GPU of the machine (NCCL), or CPU workers (gloo).

`run_training` starts a TorchTrainer; every worker (`worker_loop`, then `train_worker`) loads the frozen target on
its device (a full replica per worker), builds the drafter from the same seed, reads its shard of the pairs (every
`world_size`-th line of the jsonl) and runs `train_loop.Trainer` with the loss module under DDP
(`ray.train.torch.prepare_model`), so only the drafter's gradients are all-reduced. Rank 0 writes the log and
the checkpoints into the output folder, which all workers share: they run on this machine.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
from torch import nn

from replicas.config import ModelConfig
from speculative.drafter import DominoDrafter, DrafterConfig
from speculative.train_checkpoint import find_checkpoint, read_manifest
from speculative.train_data import Pair, PairBatcher, read_pairs, trim_loops
from speculative.train_loop import LOG_NAME, TrainConfig, Trainer, last_log_record, load_hf_target


@dataclass(frozen=True)
class TrainJob:
    pairs: str                          # jsonl of {prompt_ids, response_ids}
    out: str                            # log, checkpoints/, drafter/ (the final weights)
    cfg: TrainConfig
    target: Optional[str] = None        # HF folder or .gguf; None: the embedded SmolLM2
    layers: int = 3
    block_size: int = 16
    intermediate_size: Optional[int] = None     # the drafter's MLP width; None: the target's
    workers: int = 0                    # 0: one per GPU, or one CPU worker on a machine without GPUs
    use_gpu: Optional[bool] = None      # None: when CUDA is available
    resume: Optional[str] = None        # a checkpoint folder, or an output folder holding checkpoints/
    deadline: Optional[float] = None    # time.time() by which the run stops, checkpointed (from --max-seconds)
    init_drafter: Optional[str] = None  # a warm restart: a fresh run starts from this drafter folder's weights


def shard_seed(seed: int, rank: int) -> int:
    """The data-order seed of one worker's shard (rank 0 keeps the run's seed)."""
    return seed + 1_000_033 * rank


def train_worker(job: TrainJob, rank: int, world: int, device: torch.device,
                 wrap: Optional[Callable[[nn.Module], nn.Module]] = None) -> Trainer:
    """One worker's whole run: target, drafter, its shard of the pairs, the training loop; rank 0 saves the
    final drafter once the run has reached `cfg.steps`."""
    cfg = job.cfg
    if device.type == "cuda":
        torch.cuda.set_device(device)          # collectives on objects (the checkpoint's states) use it
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, hf_config = load_hf_target(job.target, (), device, dtype)
    dcfg = DrafterConfig.for_target(ModelConfig.from_hf(hf_config), num_layers=job.layers,
                                    block_size=job.block_size, intermediate_size=job.intermediate_size)
    target.layer_ids = dcfg.target_layer_ids
    torch.manual_seed(cfg.seed)
    drafter = DominoDrafter(dcfg).to(device)
    tokens_before = warm_start(drafter, job.init_drafter) if job.init_drafter else 0
    pairs, heldout = worker_pairs(job, rank, world, device)
    batcher = PairBatcher(pairs, cfg.batch_size, cfg.seq_len, cfg.anchors_per_seq, seed=shard_seed(cfg.seed, rank))
    trainer = Trainer(drafter, target, batcher, cfg, job.out, resume_from=job.resume, deadline=job.deadline,
                      wrap=wrap, tokens_before=tokens_before, heldout=heldout)
    trainer.train()
    if rank == 0 and trainer.finished:
        final = os.path.join(job.out, "drafter")
        drafter.save(final)
        shutil.copyfile(trainer.log_path, os.path.join(final, LOG_NAME))
    return trainer


def worker_pairs(job: TrainJob, rank: int, world: int, device: torch.device) -> tuple[list[Pair], list[Pair]]:
    """This worker's shard of the training pairs and all of `cfg.heldout_pairs` (every worker evaluates its own
    batches of the same held-out set), looping tails trimmed unless `cfg.trim_loops` is off; rank 0 prints the
    counts, summed over the workers (a collective: every worker calls it)."""
    cfg = job.cfg
    pairs = read_pairs(job.pairs, rank, world)
    heldout = read_pairs(cfg.heldout_pairs) if cfg.heldout_pairs else []
    if cfg.heldout_pairs and not heldout:
        raise ValueError(f"no held-out pairs in {cfg.heldout_pairs}")
    trimmed = removed = 0
    if cfg.trim_loops:
        pairs, trimmed, removed = trim_loops(pairs)
        heldout = trim_loops(heldout)[0]
    counts = torch.tensor([len(pairs), trimmed, removed], dtype=torch.float64, device=device)
    if world > 1:
        torch.distributed.all_reduce(counts)
    if rank == 0:
        total, trimmed, removed = (int(x) for x in counts.tolist())
        loops = (f"looping tails trimmed from {trimmed:,} of them ({removed:,} response tokens removed)"
                 if cfg.trim_loops else "looping tails kept (--no-trim-loops)")
        print(f"training pairs: {total:,}, {loops}; held-out pairs: {len(heldout):,}", flush=True)
    return pairs, heldout


def warm_start(drafter: DominoDrafter, folder: str) -> int:
    """Load the weights of a drafter folder (`DominoDrafter.save`'s layout, as `drafter/` of a finished run or a
    bundled drafter) into `drafter`, whose shape it must have; returns the tokens it was trained on (its
    train_log.jsonl's last `tokens_seen`, 0 without one). The optimizer starts afresh (with the LR warm-up): a
    warm restart, for runs that continue on a machine the full checkpoint cannot reach."""
    init = DominoDrafter.load(folder)
    if init.cfg != drafter.cfg:
        raise ValueError(f"{folder} holds a drafter of another shape: {init.cfg} (this run trains {drafter.cfg})")
    drafter.load_state_dict(init.state_dict())
    return int((last_log_record(folder) or {}).get("tokens_seen") or 0)


def worker_loop(config: dict) -> None:
    """A Ray Train worker: `config` is a TrainJob as plain data."""
    import ray.train
    import ray.train.torch
    ctx = ray.train.get_context()
    train_worker(TrainJob(**{**config, "cfg": TrainConfig(**config["cfg"])}), ctx.get_world_rank(),
                 ctx.get_world_size(), ray.train.torch.get_device(), wrap=ray.train.torch.prepare_model)


def worker_count(job: TrainJob) -> tuple[int, bool]:
    use_gpu = torch.cuda.is_available() if job.use_gpu is None else job.use_gpu
    return job.workers or (torch.cuda.device_count() if use_gpu else 1), use_gpu


def run_training(job: TrainJob) -> dict:
    """Train on the Ray cluster this process is connected to (see `local_ray`); returns where the run stands:
    its step, whether it finished, and its newest checkpoint."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    workers, use_gpu = worker_count(job)
    storage = tempfile.mkdtemp(prefix="tidal-train-")        # Ray Train's own run state; ours is in job.out
    try:
        TorchTrainer(worker_loop, train_loop_config={**asdict(job), "cfg": asdict(job.cfg)},
                     scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu),
                     torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
                     run_config=RunConfig(name="drafter", storage_path=storage)).fit()
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    checkpoint = find_checkpoint(job.out)
    meta = read_manifest(checkpoint)["meta"] if checkpoint else {}
    return {"step": meta.get("step", 0), "steps": job.cfg.steps, "finished": bool(meta.get("finished")),
            "checkpoint": checkpoint, "workers": workers, "backend": "nccl" if use_gpu else "gloo"}


def run_in_process(job: TrainJob) -> dict:
    """The same run without Ray: one worker in this process, on cuda:0 or the CPU (for a machine whose
    Python has no Ray; with one device it computes what a one-worker Ray run computes)."""
    device = torch.device("cuda", 0) if (torch.cuda.is_available() if job.use_gpu is None else job.use_gpu) \
        else torch.device("cpu")
    trainer = train_worker(job, 0, 1, device)
    return {"step": trainer.step, "steps": job.cfg.steps, "finished": trainer.finished,
            "checkpoint": find_checkpoint(job.out), "workers": 1, "backend": "none (in process)"}


def ray_train_available() -> bool:
    try:
        import ray.train.torch  # noqa: F401
    except ImportError:
        return False
    return True


class local_ray:
    """A Ray cluster on this machine for the block, unless this process is already connected to one."""

    def __enter__(self):
        import ray
        self.started = not ray.is_initialized()
        if self.started:
            ray.init(include_dashboard=False, logging_level="ERROR")
        return self

    def __exit__(self, *exc):
        if self.started:
            import ray
            ray.shutdown()
