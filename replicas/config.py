"""Typed, frozen configuration. Runtime state (block counts, graph sizes) lives elsewhere."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional


@dataclass(frozen=True)
class ModelConfig:
    """The architecture, read from an HF config.json or GGUF metadata."""
    architecture: str            # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # qkv bias (Qwen2)
    qk_norm: bool = False             # per-head q/k RMSNorm (Qwen3)
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()

    @staticmethod
    def from_hf(cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(model_type)
        if arch is None:
            raise ValueError(f"unsupported model_type {model_type!r} (llama, qwen2, qwen3 are supported)")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "qwen2"),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs. `max_num_batched_tokens` may be changed at runtime via `Scheduler.set_budget`."""
    model: Optional[str] = None          # path to an HF folder or a .gguf file; None = embedded SmolLM2
    load_format: str = "auto"            # "auto" | "dummy" (random weights from a config.json, for benchmarks)
    tensor_parallel_size: int = 1
    dtype: str = "auto"                  # "auto" = bfloat16 on GPU, float32 on CPU
    device: str = "auto"                 # "auto" | "cuda" | "cpu"
    max_model_len: Optional[int] = None  # default: model's max_position_embeddings, capped at 8192
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    block_size: int = 16
    num_kv_blocks: Optional[int] = None  # default: sized from gpu_memory_utilization (GPU) / kv_cache_bytes (CPU)
    kv_cache_bytes: int = 1 << 30        # CPU KV budget when num_kv_blocks is None
    gpu_memory_utilization: float = 0.90
    reserve_blocks: int = 0              # CPU: blocks of the elastic reserve region (GPU: sized by profiling)
    elastic: str = "off"                 # "off" | "elastic" (lend the prefill reserve to KV) | "static" (baseline)
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"      # "auto" | "torch" | "triton"
    enforce_eager: bool = False          # no CUDA graphs
    mixed_graph_tokens: int = 1024       # steps with prefill chunks of up to this many tokens replay graphs (0: eager)
    seed: int = 0
    distributed_backend: str = "auto"    # "auto" | "gloo" | "nccl"
    speculative: Optional[str] = None    # None | "dominotree" | "chain" | "ddtree" (docs/speculative.md)
    drafter: Optional[str] = None        # folder saved by DominoDrafter.save
    spec_budget: int = 16                # draft nodes per request at small batches (the policy may pick 0)
    allow_random_drafter: bool = False   # tests only: a randomly initialised drafter when `drafter` is None
    stream_item_ms: float = 0.0          # serving: with n requests streaming, each reports at most every (n-1) x this

    def with_(self, **kw) -> "EngineConfig":
        return replace(self, **kw)
