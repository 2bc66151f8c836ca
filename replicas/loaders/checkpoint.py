"""A model checkpoint on disk: its HF-style config, tokenizer, generation defaults and a lazy weight stream."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator, Protocol

import torch
from tqdm.auto import tqdm

from replicas.config import ModelConfig
from replicas.tokenizer import Tokenizer


class TensorSource(Protocol):
    """Where a checkpoint's tensors live; `names` are HF parameter names in file order. `quantized_format`: "gguf"
    or "fp8" when linear weights are stored quantized, else None. With `keep_quantized`, a linear layer's weight
    stored in such a format comes back as replicas.layers.quantized_linear.QuantizedWeight (GGUF Q4_0 / Q4_1 /
    Q8_0) or replicas.layers.fp8_linear.Fp8Weight instead of a float tensor."""

    quantized_format: str | None

    def names(self) -> list[str]: ...

    def read(self, name: str, keep_quantized: bool = False) -> torch.Tensor: ...


@dataclass
class Checkpoint:
    path: str                      # folder or .gguf file
    hf_config: dict                # HF-style config (for GGUF: built from its metadata under HF key names)
    model_config: ModelConfig
    tokenizer: Tokenizer
    generation_config: dict
    source: TensorSource = field(repr=False)

    def weight_names(self) -> list[str]:
        return self.source.names()

    def weights(self, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor), one tensor at a time: the checkpoint's dtype for safetensors, float32 for GGUF and
        dequantized FP8 (`keep_quantized`: quantized linear weights in their own format, see TensorSource)."""
        for name in tqdm(self.source.names(), desc="Loading weights", unit="tensor"):
            yield name, self.source.read(name, keep_quantized)


def model_config_from_hf(hf_config: dict, generation_config: dict) -> ModelConfig:
    """ModelConfig.from_hf on a copy normalized for transformers-5 keys, with the EOS ids of the
    generation config added to the config's (chat models stop on either)."""
    cfg = dict(hf_config)
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    if cfg.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    config = ModelConfig.from_hf(cfg)
    eos = generation_config.get("eos_token_id")
    extra = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    return replace(config, eos_token_ids=tuple(dict.fromkeys([*config.eos_token_ids, *extra])))
