"""The Serve application: `num_replicas` `LLMReplica`s, each an engine that serves the OpenAI routes itself, or
with `api_server_count` N > 1, N `IngressReplica`s per engine replica serving the routes (cluster/ingress_replica.py).

Usable as a Serve import path: `serve run cluster.app:build_app model=/m.gguf tensor_parallel_size=2`,
or in a RayService config (`import_path: cluster.app:build_app`, `args: {...}`).
"""
from __future__ import annotations

from typing import Any, Optional

import ray
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray.serve import Application

from cluster.admission import MAX_QUEUED_REQUESTS
from cluster.controller import start_controller
from cluster.controller_policies import POLICIES, ControllerConfig
from cluster.ingress import DEFAULT_MAX_BODY_BYTES
from cluster.rank_actor import rank_bundle
from cluster.ingress_replica import LLMIngress
from cluster.replica import DEFAULT_REQUEST_TIMEOUT_S, LLMEngineReplica, LLMReplica
from replicas import envs
from replicas.config import EngineConfig, unknown_settings_message
from replicas.device import resolve_device

UNBOUNDED = 1 << 20          # generation requests per replica when max_queued_requests is -1
# On CUDA an engine steps fast enough that one serving process cannot write its streams' chunks at hundreds of
# streams (docs/serving.md, "Ingress replicas"): each engine replica gets this many ingress replicas by default.
CUDA_API_SERVER_COUNT = 4
CONTROL_REQUESTS = 64        # Serve's headroom above the replica's queue, for the non-generating routes


class ControllerArgs(BaseModel):
    """The fleet controller of the app (cluster/controller.py); `static` starts none."""
    model_config = ConfigDict(extra="forbid")

    policy: str = "static"
    interval_s: float = Field(5.0, gt=0)
    advisory: bool = False                       # decide, log and export, apply nothing
    ttft_slo_ms: float = Field(1000.0, gt=0)
    itl_slo_ms: float = Field(100.0, gt=0)
    min_budget: int = Field(256, ge=1)
    app_name: str = "tidal"                      # the Serve application it tunes (the RayService's name for it)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, policy: str) -> str:
        if policy not in POLICIES:
            raise ValueError(f"unknown controller policy {policy!r}; choose one of {POLICIES}")
        return policy

    def config(self) -> ControllerConfig:
        return ControllerConfig(policy=self.policy, interval_s=self.interval_s, advisory=self.advisory,
                                ttft_slo_ms=self.ttft_slo_ms, itl_slo_ms=self.itl_slo_ms, min_budget=self.min_budget)


class AppArgs(BaseModel):
    """Everything `build_app` takes; Serve fills it from the `args` of a config or `serve run`.

    The engine's settings are `engine_kwargs`, by their flat names (`EngineConfig.from_flat`: the `LLM(...)`
    keywords); a few of them may also be given at the top level (PROMOTED: `serve run ... model=/m.gguf
    tensor_parallel_size=2`), where they win over `engine_kwargs`. None there, or a name left out: the engine's
    default."""
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: Optional[str] = None                   # HF folder or .gguf; None = the embedded SmolLM2
    served_model_name: Optional[str] = None       # default: the engine's model name
    tensor_parallel_size: Optional[int] = None
    num_replicas: int = Field(1, ge=1)
    # HTTP processes per engine replica (cluster/ingress_replica.py); 1: the engine replica serves HTTP itself;
    # None: CUDA_API_SERVER_COUNT on CUDA, 1 on CPU
    api_server_count: Optional[int] = Field(None, ge=1, le=64)
    autoscaling_config: Optional[dict[str, Any]] = None   # replaces num_replicas when set
    device: Optional[str] = None                  # auto | cpu | cuda; auto: cuda when the cluster has GPUs
    max_num_batched_tokens: Optional[int] = None
    max_num_seqs: Optional[int] = None
    max_model_len: Optional[int] = None
    engine_kwargs: dict[str, Any] = {}            # EngineConfig settings by flat name (EngineConfig.from_flat)
    knobs: Optional[dict[str, Any]] = None        # initial runtime knobs (Serve user_config -> reconfigure)
    api_key: Optional[str] = Field(default_factory=envs.api_key)   # Bearer key; default $TIDAL_API_KEY; None: no auth
    cpus_per_rank: float = Field(1.0, gt=0)       # CPU share of each TP rank (torch threads on CPU)
    max_ongoing_requests: Optional[int] = Field(None, ge=1)   # per replica; default: the engine's max_num_seqs
    # per replica, beyond max_ongoing: a safety bound on the request count (-1: none); beyond -> 503
    max_queued_requests: int = Field(MAX_QUEUED_REQUESTS, ge=-1)
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024)
    graceful_shutdown_timeout_s: float = Field(120.0, ge=0)   # a stopping replica's drain of in-flight requests
    request_timeout_s: float = Field(DEFAULT_REQUEST_TIMEOUT_S, gt=0)   # a request still running then: aborted, 504
    controller: Optional[ControllerArgs] = None   # None: `auto` on CUDA, `static` (none) on CPU

    @field_validator("engine_kwargs")
    @classmethod
    def _known_settings(cls, kw: dict[str, Any]) -> dict[str, Any]:
        unknown = [k for k in kw if k not in EngineConfig.flat_names()]
        if unknown:
            raise ValueError(f"engine_kwargs: {unknown_settings_message(unknown)}")
        return kw

    @model_validator(mode="after")
    def _valid_engine(self) -> "AppArgs":
        EngineConfig.from_flat(**engine_settings(self))       # types, choices and bounds, before deploying
        if (self.api_server_count or 1) > 1 and self.autoscaling_config:
            raise ValueError("api_server_count > 1 pairs a fixed number of ingress replicas with each engine "
                             "replica: give num_replicas, not autoscaling_config")
        return self


PROMOTED = ("model", "tensor_parallel_size", "device", "max_num_batched_tokens", "max_num_seqs", "max_model_len")


def engine_settings(args: AppArgs) -> dict[str, Any]:
    """The flat engine settings of the app: `engine_kwargs`, and the PROMOTED top-level args that are set."""
    return {**args.engine_kwargs, **{k: getattr(args, k) for k in PROMOTED if getattr(args, k) is not None}}


def api_server_count(args: AppArgs, device: str) -> int:
    """The app's HTTP processes per engine replica: the one given, else CUDA_API_SERVER_COUNT on CUDA (1 with
    autoscaling, which pairs no fixed count), else 1."""
    if args.api_server_count is not None:
        return args.api_server_count
    return CUDA_API_SERVER_COUNT if device == "cuda" and not args.autoscaling_config else 1


def cluster_device(device: str) -> str:
    """'auto' means cuda when the cluster (or, without Ray, this machine) has a GPU."""
    has_gpu = None
    if device == "auto" and ray.is_initialized():
        has_gpu = ray.cluster_resources().get("GPU", 0) > 0
    return resolve_device(device, has_gpu=has_gpu).type


def engine_config(args: AppArgs) -> EngineConfig:
    flat = engine_settings(args)
    return EngineConfig.from_flat(**{**flat, "device": cluster_device(flat.get("device", "auto"))})


def build_app(args: AppArgs) -> Application:
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args or {})
    config = engine_config(args)
    use_gpu = config.device == "cuda"
    controller = args.controller or ControllerArgs(policy="auto" if use_gpu else "static")
    if controller.policy != "static":
        start_controller(controller.app_name, controller.config())
    scale = ({"autoscaling_config": args.autoscaling_config} if args.autoscaling_config
             else {"num_replicas": args.num_replicas})
    ongoing = args.max_ongoing_requests or config.scheduling.max_num_seqs
    request_limit = ongoing + args.max_queued_requests if args.max_queued_requests >= 0 else UNBOUNDED
    # The replica refuses what is beyond its queue itself (by tokens, then by this count), as an OpenAI 503; Serve's
    # own limits sit above it (room for /health, /v1/models, /stats), so its proxy never answers with a bare-text
    # refusal.
    engine_options = dict(
        ray_actor_options={"num_cpus": args.cpus_per_rank, "num_gpus": 1 if use_gpu else 0},
        placement_group_bundles=[rank_bundle(use_gpu, args.cpus_per_rank)] * config.tensor_parallel_size,
        placement_group_strategy="STRICT_PACK",
        max_queued_requests=-1,
        graceful_shutdown_timeout_s=args.graceful_shutdown_timeout_s,
        user_config=args.knobs)
    http = dict(api_key=args.api_key, served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
                request_timeout_s=args.request_timeout_s)
    count = api_server_count(args, config.device)
    if count == 1:
        return LLMReplica.options(**scale, **engine_options, max_ongoing_requests=request_limit + CONTROL_REQUESTS
                                  ).bind(config, args.cpus_per_rank, request_limit=request_limit, **http)
    engines = LLMEngineReplica.options(num_replicas=args.num_replicas, **engine_options,
                                       max_ongoing_requests=CONTROL_REQUESTS).bind(
        config, args.cpus_per_rank, request_limit=request_limit, **http, ingress_replicas=count,
        drain_s=args.graceful_shutdown_timeout_s)
    # On CPU the TP ranks take every core (`tidal serve`'s cpus_per_rank), so the ingress replicas reserve none.
    return LLMIngress.options(
        num_replicas=args.num_replicas * count,
        ray_actor_options={"num_cpus": 1 if use_gpu else 0},
        max_ongoing_requests=request_limit // count + CONTROL_REQUESTS,
        max_queued_requests=-1,
        graceful_shutdown_timeout_s=args.graceful_shutdown_timeout_s,
    ).bind(engines, config, num_engines=args.num_replicas, ingresses_per_engine=count, request_limit=request_limit,
           **http)
