"""The Serve application: `num_replicas` `LLMReplica`s, each an engine that serves the OpenAI routes itself.

Usable as a Serve import path: `serve run cluster.app:build_app model=/m.gguf tensor_parallel_size=2`,
or in a RayService config (`import_path: cluster.app:build_app`, `args: {...}`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

import ray
from pydantic import BaseModel, ConfigDict, Field
from ray.serve import Application

from cluster.ingress import DEFAULT_MAX_BODY_BYTES
from cluster.rank_actor import rank_bundle
from cluster.replica import LLMReplica
from replicas.config import EngineConfig

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
UNBOUNDED = 1 << 20          # generation requests per replica when max_queued_requests is -1
CONTROL_REQUESTS = 64        # Serve's headroom above the replica's queue, for the non-generating routes


class AppArgs(BaseModel):
    """Everything `build_app` takes; Serve fills it from the `args` of a config or `serve run`."""
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: Optional[str] = None                   # HF folder or .gguf; None = the embedded SmolLM2
    served_model_name: Optional[str] = None       # default: the engine's model name
    tensor_parallel_size: int = Field(1, ge=1)
    num_replicas: int = Field(1, ge=1)
    autoscaling_config: Optional[dict[str, Any]] = None   # replaces num_replicas when set
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_num_batched_tokens: Optional[int] = Field(None, ge=1)
    max_num_seqs: Optional[int] = Field(None, ge=1)
    max_model_len: Optional[int] = Field(None, ge=1)
    engine_kwargs: dict[str, Any] = {}            # any other EngineConfig field
    knobs: Optional[dict[str, Any]] = None        # initial runtime knobs (Serve user_config -> reconfigure)
    api_key: Optional[str] = None                 # Bearer key; None = no auth
    cpus_per_rank: float = Field(1.0, gt=0)       # CPU share of each TP rank (torch threads on CPU)
    max_ongoing_requests: Optional[int] = Field(None, ge=1)   # per replica; default: the engine's max_num_seqs
    max_queued_requests: int = Field(256, ge=-1)  # per replica, waiting beyond max_ongoing; beyond -> 503 (-1: no cap)
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024)


def resolve_device(device: str) -> str:
    """'auto' means cuda when the cluster (or, without Ray, this machine) has a GPU."""
    if device != "auto":
        return device
    if ray.is_initialized():
        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_config(args: AppArgs) -> EngineConfig:
    unknown = set(args.engine_kwargs) - _ENGINE_FIELDS
    if unknown:
        raise ValueError(f"engine_kwargs has unknown EngineConfig fields {sorted(unknown)}")
    explicit = {"max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
                "max_model_len": args.max_model_len}
    fields = {**args.engine_kwargs, **{k: v for k, v in explicit.items() if v is not None}}
    return EngineConfig(model=args.model, tensor_parallel_size=args.tensor_parallel_size,
                        device=resolve_device(args.device), **fields)


def build_app(args: AppArgs) -> Application:
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args or {})
    config = engine_config(args)
    use_gpu = config.device == "cuda"
    scale = ({"autoscaling_config": args.autoscaling_config} if args.autoscaling_config
             else {"num_replicas": args.num_replicas})
    ongoing = args.max_ongoing_requests or config.max_num_seqs
    queue_limit = ongoing + args.max_queued_requests if args.max_queued_requests >= 0 else UNBOUNDED
    # The replica refuses what is beyond its queue itself, as an OpenAI 503; Serve's own limits sit above it
    # (room for /health, /v1/models, /stats), so its proxy never answers with a bare-text refusal.
    return LLMReplica.options(
        **scale,
        ray_actor_options={"num_cpus": args.cpus_per_rank, "num_gpus": 1 if use_gpu else 0},
        placement_group_bundles=[rank_bundle(use_gpu, args.cpus_per_rank)] * config.tensor_parallel_size,
        placement_group_strategy="STRICT_PACK",
        max_ongoing_requests=queue_limit + CONTROL_REQUESTS,
        max_queued_requests=-1,
        user_config=args.knobs,
    ).bind(config, args.cpus_per_rank, queue_limit=queue_limit, api_key=args.api_key,
           served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes)
