"""TP ranks 1..N-1 as Ray actors pinned to their bundles of the replica's placement group.

The Serve replica (rank 0) holds bundle 0; rank r is scheduled into bundle r, so a STRICT_PACK
group keeps the whole TP group on one node. Each actor's single call runs
`replicas.distributed.launch.run_worker`, which blocks until the engine shuts the group down;
step inputs travel over torch.distributed, never through Ray calls.
"""
from __future__ import annotations

import logging
from typing import Optional

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from replicas.config import EngineConfig

logger = logging.getLogger("tidal.rank_actor")


def rank_bundle(use_gpu: bool, cpus: float = 1) -> dict[str, float]:
    """The resources of one TP rank; a replica's placement group is `tp` of these."""
    return {"CPU": cpus, "GPU": 1} if use_gpu else {"CPU": cpus}


@ray.remote(max_restarts=0, max_task_retries=0)
class RankWorker:
    """One TP rank's process. `run` blocks for the life of the engine."""

    def run(self, config: EngineConfig, rank: int, world_size: int, init_method: str,
            device_index: Optional[int]) -> int:
        from replicas.distributed.launch import run_worker
        run_worker(config, rank, world_size, init_method, device_index)
        return rank


class RayRankLauncher:
    """A `replicas.distributed.launch.WorkerLauncher` that starts ranks as `RankWorker` actors."""

    def __init__(self, use_gpu: bool, cpus_per_rank: float = 1.0, placement_group: Optional[PlacementGroup] = None):
        self.use_gpu = use_gpu
        self.cpus_per_rank = cpus_per_rank          # as in `rank_bundle`, so rank r fits bundle r
        self.placement_group = placement_group or get_current_placement_group()
        self.actors: dict[int, ray.actor.ActorHandle] = {}
        self.runs: dict[int, ray.ObjectRef] = {}

    def launch(self, config: EngineConfig, rank: int, world_size: int, init_method: str) -> None:
        assert 0 < rank < world_size and rank not in self.actors, f"bad rank {rank} of {world_size}"
        options = {"num_cpus": self.cpus_per_rank, "num_gpus": 1 if self.use_gpu else 0}
        if self.placement_group is not None:
            assert rank < self.placement_group.bundle_count, (
                f"rank {rank} needs bundle {rank}; the placement group has {self.placement_group.bundle_count}")
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=rank,
                placement_group_capture_child_tasks=False)
        actor = RankWorker.options(**options).remote()
        self.actors[rank] = actor
        # Ray shows each rank only its own GPU (CUDA_VISIBLE_DEVICES), so it is device 0 there.
        device_index = 0 if self.use_gpu else None
        self.runs[rank] = actor.run.remote(config, rank, world_size, init_method, device_index)
        logger.info("launched TP rank %d/%d", rank, world_size)

    def exited_ranks(self) -> list[int]:
        """Ranks whose `run` returned or failed; while the engine lives this must stay empty."""
        if not self.runs:
            return []
        done, _ = ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=0)
        done_ids = {ref.hex() for ref in done}
        return sorted(rank for rank, ref in self.runs.items() if ref.hex() in done_ids)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Wait for the ranks to leave `run_worker` (the engine told them to), then free their actors."""
        if self.runs:
            ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=timeout_s)
        for rank, actor in self.actors.items():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                logger.warning("could not kill TP rank %d", rank)
        self.actors.clear()
        self.runs.clear()
