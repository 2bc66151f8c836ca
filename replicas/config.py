"""Typed, frozen configuration. Runtime state (block counts, graph sizes) lives elsewhere."""
from __future__ import annotations

import argparse
import difflib
import functools
import numbers
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

from replicas.device import DEVICES, DTYPES


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


# ---- the engine's settings ------------------------------------------------------------------------------------
# `EngineConfig` is the one declaration of every engine setting: nested frozen groups whose fields each carry a
# one-line description and, derived from the declaration, a public flat name (the `LLM(...)` keyword and the Serve
# app's `engine_kwargs` key: the field's name unless `flat=` says otherwise) and a `tidal serve` flag
# (`--` + the flat name with dashes unless `flag=` says otherwise). `tidal serve`'s engine flags
# (`add_engine_arguments`), `LLM(...)`'s keywords and the Serve app's args (cluster/app.py) are generated from it
# and build through `EngineConfig.from_flat`.

def setting(default: Any, help: str, *, flat: Optional[str] = None, flag: Optional[str] = None,
            choices: Optional[tuple] = None, minimum: Optional[float] = None,
            maximum: Optional[float] = None) -> Any:
    """A field of an EngineConfig group: its default, its one-line description, and where the public names or
    the accepted values differ from the defaults."""
    return field(default=default, metadata={"help": help, "flat": flat, "flag": flag, "choices": choices,
                                            "minimum": minimum, "maximum": maximum})


def group(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help, "group": True})


@dataclass(frozen=True)
class Setting:
    """One leaf field of EngineConfig, as the generators see it."""
    flat: str                        # LLM(...) keyword, engine_kwargs key
    path: tuple[str, ...]            # attributes from EngineConfig: ("scheduling", "max_num_seqs")
    flag: str                        # `tidal serve` flag
    help: str
    type: type                       # int | float | str | bool
    optional: bool                   # None allowed (and the meaning of "not given")
    default: Any
    choices: Optional[tuple] = None
    minimum: Optional[float] = None
    maximum: Optional[float] = None

    def get(self, config: "EngineConfig") -> Any:
        value = config
        for name in self.path:
            value = getattr(value, name)
        return value

    def check(self, value: Any) -> Any:
        """`value` as the field stores it (numbers normalised), or ValueError with a user-facing message."""
        if value is None:
            if self.optional:
                return None
            raise ValueError(f"{self.flat} must be set (got None)")
        if self.type is bool:
            ok = isinstance(value, bool)
        elif self.type is int:
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            value = int(value) if ok else value
        elif self.type is float:
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
            value = float(value) if ok else value
        else:
            ok = isinstance(value, self.type)
        if not ok:
            raise ValueError(f"{self.flat} must be {_TYPE_WORDS[self.type]}, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.flat}={value!r}: choose one of {', '.join(map(str, self.choices))}")
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"{self.flat} must be >= {self.minimum}, got {value!r}")
        if self.maximum is not None and value > self.maximum:
            raise ValueError(f"{self.flat} must be <= {self.maximum}, got {value!r}")
        return value

    def cli_help(self) -> str:
        text = self.help
        if self.type is bool:
            text += " (default: on)" if self.default else ""
        elif self.default is not None:
            text += f" (default: {self.default})"
        return text.replace("%", "%%")

    def add_argument(self, parser) -> None:
        """This setting as an argparse flag whose value is None when it is not given (the engine's default)."""
        kw: dict[str, Any] = dict(dest=self.flat, default=None, help=self.cli_help())
        if self.type is bool:
            kw["action"] = "store_true" if self.default is False else argparse.BooleanOptionalAction
        else:
            kw["type"] = self.type
            if self.choices is not None:
                kw["choices"] = self.choices
            else:
                kw["metavar"] = self.flag.lstrip("-").upper().replace("-", "_")
        parser.add_argument(self.flag, **kw)


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


class _Checked:
    """Checks every setting of the group when it is built (types, choices, bounds)."""

    def __post_init__(self) -> None:
        for s in _own_settings(type(self)):
            value = getattr(self, s.path[-1])
            checked = s.check(value)
            if checked is not value:
                object.__setattr__(self, s.path[-1], checked)
        for f in fields(self):
            kind = _hints(type(self))[f.name]
            if f.metadata.get("group") and not isinstance(getattr(self, f.name), kind):
                raise ValueError(f"{type(self).__name__}.{f.name} is a group ({kind.__name__}), got "
                                 f"{getattr(self, f.name)!r}; flat settings go through EngineConfig.from_flat(...)")


@dataclass(frozen=True)
class SchedulingConfig(_Checked):
    """What one engine step may schedule. `max_num_batched_tokens` changes at run time (`Scheduler.set_budget`)."""
    max_num_batched_tokens: int = setting(8192, "tokens one engine step schedules at most (prefill chunks and "
                                                "decodes: the token budget)", minimum=1)
    max_num_seqs: int = setting(256, "sequences one engine step runs at most", minimum=1)
    max_model_len: Optional[int] = setting(None, "longest sequence, prompt and output (default: the model's "
                                                 "max_position_embeddings)", minimum=1)
    async_scheduling: Optional[bool] = setting(None, "schedule and launch a decode step before the last step's "
                                                     "tokens are read back, so the host's work between steps "
                                                     "overlaps the device's (one rank, no speculation, elastic "
                                                     "lending off; docs/engine.md) (default: on CUDA, off on CPU)")


@dataclass(frozen=True)
class CacheConfig(_Checked):
    """The paged KV cache."""
    block_size: int = setting(16, "tokens per KV cache block", minimum=1)
    num_kv_blocks: Optional[int] = setting(None, "KV cache blocks (default: sized from --gpu-memory-utilization on "
                                                 "a GPU, --kv-cache-bytes on CPU)", minimum=1)
    kv_cache_bytes: int = setting(1 << 30, "CPU: bytes of the KV cache when --num-kv-blocks is not given",
                                  minimum=1)
    gpu_memory_utilization: float = setting(0.90, "share of the GPU the engine sizes its KV cache into",
                                            minimum=0.0, maximum=1.0)
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of a prompt prefix already cached")


@dataclass(frozen=True)
class ElasticConfig(_Checked):
    """Elastic KV: the prefill-activation reserve lent to the KV pool during decode (docs/elastic-kv.md)."""
    mode: str = setting("off", "lend the prefill-activation reserve to the KV pool during decode "
                               "(docs/elastic-kv.md); static: the reserve kept apart (the baseline)",
                        flat="elastic", choices=("off", "elastic", "static"))
    reserve_blocks: int = setting(0, "size of the elastic reserve in KV blocks: on CPU (a logical reserve), or "
                                     "on a GPU together with --num-kv-blocks (default there: sized by profiling)",
                                  minimum=0)
    lend_step_tokens: Optional[int] = setting(None, "a step of more tokens than this takes the reserve back before "
                                                    "it runs (default: a full decode batch or a short prompt)",
                                              flat="elastic_lend_step_tokens", minimum=1)
    lend_after_steps: int = setting(4, "consecutive steps with no large step ahead before the reserve is lent",
                                    flat="elastic_lend_after_steps", minimum=0)
    min_lend_steps: int = setting(16, "a lend reclaimed sooner than this many steps was thrash: the wait before "
                                      "the next lend doubles", flat="elastic_min_lend_steps", minimum=0)
    budget_grants: bool = setting(True, "a max_num_batched_tokens below the one the reserve was sized for gives the "
                                        "reserve blocks its steps no longer need to the KV pool until it rises "
                                        "again (docs/elastic-kv.md)", flat="elastic_budget_grants")


@dataclass(frozen=True)
class SpeculativeConfig(_Checked):
    """Speculative decoding with a drafter (docs/speculative.md)."""
    method: Optional[str] = setting(None, "speculative decoding with a drafter (docs/speculative.md); needs "
                                          "--drafter or a drafter shipped for the model (default: off)",
                                    flat="speculative", choices=("dominotree", "chain", "ddtree"))
    drafter: Optional[str] = setting(None, "folder of a trained drafter (DominoDrafter.save; default: the one "
                                           "shipped for the model's shape)")
    budget: int = setting(16, "draft tree nodes per sequence and step (max; the policy may pick fewer)",
                          flat="spec_budget", minimum=0)
    allow_random_drafter: bool = setting(False, "tests only: a randomly initialised drafter when none is given "
                                                "or bundled")
    policy: str = setting("measured", "how the draft budget per batch size is chosen: measured (a cost model over "
                                      "verify and draft times profiled at start-up, on any device: never a budget "
                                      "that loses to plain decoding), knee (no profile: speculate while the verify "
                                      "step stays below the memory-bound knee), fixed (--spec-budget at every batch "
                                      "size; benchmarks of acceptance)",
                          flat="spec_policy", choices=("measured", "knee", "fixed"))


@dataclass(frozen=True)
class GraphsConfig(_Checked):
    """CUDA graphs of the engine's steps (GPU)."""
    enforce_eager: bool = setting(False, "no CUDA graphs (GPU)")
    mixed_graph_tokens: Optional[int] = setting(None, "steps with prefill chunks of up to this many tokens replay "
                                                      "CUDA graphs (0: they run eagerly; default: every step for a "
                                                      "model whose full step's activations take at most 1% of the "
                                                      "GPU, with elastic KV off; else 1024)", minimum=0)


@dataclass(frozen=True)
class ServingConfig(_Checked):
    """How the engine reports to a server streaming its outputs, how the server watches it and what it admits."""
    stream_item_ms: Optional[float] = setting(None, "with n requests streaming in a step, each reports at most every "
                                                    "(n-1) x this many ms (default: 0 offline, an output per step; "
                                                    "$TIDAL_STREAM_ITEM_MS or 0.1 in a Serve replica)",
                                              minimum=0.0)
    watchdog_s: float = setting(30.0, "the engine core counts as stuck (its requests fail, health checks fail) "
                                      "after this many seconds without finishing a step or an idle wait",
                                flat="engine_watchdog_s", minimum=0.1)
    max_queued_tokens: Optional[int] = setting(None, "a Serve replica admits generation requests while their prompt "
                                                     "plus most output tokens (n x max_tokens) add up to at most "
                                                     "this; beyond it a 503 with Retry-After (default: 4 x the "
                                                     "tokens the KV cache holds)", minimum=1)


@dataclass(frozen=True)
class StructuredOutputConfig(_Checked):
    """Grammar-guided decoding: response_format and forced tool calls (docs/structured_outputs.md)."""
    backend: str = setting("xgrammar", "grammar backend of structured outputs (none: requests that need a grammar "
                                       "are refused)", flat="grammar_backend", choices=("xgrammar", "none"))
    cache_size: int = setting(64, "compiled grammars kept, one per distinct schema (least recently used dropped)",
                              flat="grammar_cache_size", minimum=1)


@dataclass(frozen=True)
class LimitsConfig(_Checked):
    """Bounds on what one request may ask for; beyond them the request is refused with a 400 naming the
    parameter."""
    max_stop_token_ids: int = setting(64, "stop_token_ids one request may give", minimum=0)
    max_stop_strings: int = setting(16, "stop strings one request may give", minimum=0)
    max_stop_string_chars: int = setting(256, "characters of one stop string", minimum=1)
    max_schema_bytes: int = setting(65536, "bytes of the JSON schemas one request's grammar is compiled from "
                                           "(response_format's schema, or the parameters of the tools it forces)",
                                    minimum=2)


@dataclass(frozen=True)
class EngineConfig(_Checked):
    """Engine settings: the model, where it runs, and one group per concern. Build it from the public flat
    names with `EngineConfig.from_flat(**kw)`, or nested (`EngineConfig(scheduling=SchedulingConfig(...))`)."""
    model: Optional[str] = setting(None, "HF folder or .gguf file (default: embedded SmolLM2)")
    load_format: str = setting("auto", "dummy: random weights of the model's config (benchmarks of a shape, no "
                                       "checkpoint)", choices=("auto", "dummy"))
    tensor_parallel_size: int = setting(1, "tensor-parallel ranks per replica", flag="--tp", minimum=1)
    dtype: str = setting("auto", "weights and activations: bfloat16 (GPU default), float16, float32 (CPU default)",
                         choices=DTYPES)
    device: str = setting("auto", "where the engine runs (auto: cuda when there is a GPU)", choices=DEVICES)
    quantization: str = setting("auto", "linear-layer weights: auto (on CPU, GGUF Q4_0/Q4_1/Q8_0 stay quantized "
                                        "and run weight-only kernels; on a GPU they are dequantized and a "
                                        "checkpoint published in FP8 stays FP8), none "
                                        "(dequantized), fp8 (linear weights in FP8 with a scale per output channel, "
                                        "activations quantized per token, torch._scaled_mm: for Hopper GPUs; the "
                                        "CPU runs it too, slowly)", choices=("auto", "none", "fp8"))
    attention_backend: str = setting("auto", "attention kernels (auto: triton on a GPU, torch on CPU)",
                                     choices=("auto", "torch", "triton"))
    distributed_backend: str = setting("auto", "TP collectives (auto: nccl on a GPU, gloo on CPU)",
                                       choices=("auto", "gloo", "nccl"))
    seed: int = setting(0, "seed of the engine's random state (dummy weights, a random drafter, sampling without "
                           "a request seed)")
    scheduling: SchedulingConfig = group(SchedulingConfig, "what one step schedules")
    cache: CacheConfig = group(CacheConfig, "the paged KV cache")
    elastic: ElasticConfig = group(ElasticConfig, "elastic KV")
    speculative: SpeculativeConfig = group(SpeculativeConfig, "speculative decoding")
    graphs: GraphsConfig = group(GraphsConfig, "CUDA graphs")
    serving: ServingConfig = group(ServingConfig, "streaming to a server")
    structured: StructuredOutputConfig = group(StructuredOutputConfig, "structured outputs")
    limits: LimitsConfig = group(LimitsConfig, "per-request limits")

    @classmethod
    def settings(cls) -> tuple[Setting, ...]:
        """Every leaf setting, in declaration order."""
        return _settings()

    @classmethod
    def flat_names(cls) -> frozenset[str]:
        """The public flat names: `LLM(...)` keywords, the Serve app's `engine_kwargs` keys."""
        return frozenset(_by_flat())

    @classmethod
    def from_flat(cls, **kw: Any) -> "EngineConfig":
        """The config from public flat names (`max_num_seqs=`, `elastic=`, `speculative=`, `spec_budget=`, ...);
        a name left out keeps its default. Unknown names -> ValueError naming them."""
        by_flat = _by_flat()
        unknown = [k for k in kw if k not in by_flat]
        if unknown:
            raise ValueError(unknown_settings_message(unknown))
        tree: dict = {}
        for name, value in kw.items():
            node = tree
            *groups, leaf = by_flat[name].path
            for g in groups:
                node = node.setdefault(g, {})
            node[leaf] = value
        return _build(cls, tree)

    def to_flat(self) -> dict[str, Any]:
        """Every setting by its public flat name: `EngineConfig.from_flat(**c.to_flat()) == c`."""
        return {s.flat: s.get(self) for s in _settings()}

    def with_(self, **kw: Any) -> "EngineConfig":
        """A copy with some settings changed, by their flat names."""
        return type(self).from_flat(**{**self.to_flat(), **kw})


def unknown_settings_message(names) -> str:
    known = sorted(_by_flat())
    hints = []
    for name in names:
        close = difflib.get_close_matches(str(name), known, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (f"unknown engine setting{'s' if len(hints) > 1 else ''} {', '.join(hints)}; the engine settings are: "
            f"{', '.join(known)}")


def add_engine_arguments(parser) -> None:
    """One argparse flag per EngineConfig setting (on a parser or an argument group); each is None when not
    given, so `engine_kwargs_from_args` passes only what was given and the rest keeps the engine's defaults."""
    for s in _settings():
        s.add_argument(parser)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flat settings given on a command line parsed with `add_engine_arguments`."""
    return {s.flat: getattr(args, s.flat) for s in _settings() if getattr(args, s.flat, None) is not None}


def _unwrap(annotation: Any) -> tuple[type, bool]:
    """(base type, optional) of `int`, `Optional[int]`, ..."""
    if get_origin(annotation) is Union:
        args = [a for a in get_args(annotation) if a is not type(None)]
        assert len(args) == 1, annotation
        return args[0], True
    return annotation, False


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


@functools.lru_cache(maxsize=None)
def _own_settings(cls: type) -> tuple[Setting, ...]:
    """The leaf settings declared on `cls` itself (paths relative to it)."""
    out = []
    for f in fields(cls):
        if f.metadata.get("group"):
            continue
        meta = f.metadata
        base, optional = _unwrap(_hints(cls)[f.name])
        flat = meta["flat"] or f.name
        out.append(Setting(flat=flat, path=(f.name,), flag=meta["flag"] or "--" + flat.replace("_", "-"),
                           help=meta["help"], type=base, optional=optional, default=f.default,
                           choices=meta["choices"], minimum=meta["minimum"], maximum=meta["maximum"]))
    return tuple(out)


def _walk(cls: type, prefix: tuple[str, ...]) -> list[Setting]:
    out = [replace(s, path=prefix + s.path) for s in _own_settings(cls)]
    for f in fields(cls):
        if f.metadata.get("group"):
            out += _walk(_hints(cls)[f.name], prefix + (f.name,))
    order = {f.name: i for i, f in enumerate(fields(cls))}
    return sorted(out, key=lambda s: order[s.path[len(prefix)]])


@functools.lru_cache(maxsize=None)
def _settings() -> tuple[Setting, ...]:
    found = tuple(_walk(EngineConfig, ()))
    for attr in ("flat", "flag"):
        names = [getattr(s, attr) for s in found]
        assert len(names) == len(set(names)), f"EngineConfig: duplicate {attr} names"
    return found


@functools.lru_cache(maxsize=None)
def _by_flat() -> dict[str, Setting]:
    return {s.flat: s for s in _settings()}


def _build(cls: type, tree: dict) -> Any:
    hints = _hints(cls)
    return cls(**{name: _build(hints[name], value) if is_dataclass(hints[name]) else value
                  for name, value in tree.items()})
