"""Llama (Llama 2/3, SmolLM2, Mistral-style) and its Qwen2 variant (qkv bias), as in the HF modeling file.

Qwen3 adds per-head q/k RMSNorm (models/qwen3.py). Layers are tensor-parallel even at TP=1; the
model knows nothing of paging or scheduling: attention metadata comes from the forward context.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from replicas.config import ModelConfig
from replicas.distributed.parallel_state import tp_size
from replicas.layers.activation import SiluAndMul
from replicas.layers.attention import PagedAttention
from replicas.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from replicas.layers.fp8_linear import Fp8Weight
from replicas.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from replicas.layers.norm import RMSNorm
from replicas.layers.quantized_linear import QuantizedWeight
from replicas.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        tp = tp_size()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = config.num_key_value_heads // tp
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def split_qkv(self, hidden: torch.Tensor):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_qkv(hidden)
        q, k = self.rotary_emb(positions, q.view(-1, self.num_heads, self.head_dim),
                               k.view(-1, self.num_kv_heads, self.head_dim))
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = self.attention_cls(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([self.layer_cls(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, aux_layers: tuple[int, ...] = ()):
        """Returns the final normed hidden states and, for the drafter, the residual stream after `aux_layers`."""
        hidden, residual = self.embed_tokens(input_ids), None
        aux = []
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual)
            if i in aux_layers:
                aux.append(hidden + residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden, aux


class LlamaForCausalLM(nn.Module):
    model_cls = LlamaModel
    # HF name fragment -> (fused parameter fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    # a quantized vocabulary matrix loads as float and the LM head also keeps it quantized for its matmul
    vocab_weights = ("model.embed_tokens.weight", "lm_head.weight")

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = self.model_cls(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, aux_layers: tuple[int, ...] = ()):
        return self.model(input_ids, positions, aux_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = name, None
            for frag, (fused, shard_id) in self.packed_modules.items():
                if f".{frag}." in name:
                    target, shard = name.replace(f".{frag}.", f".{fused}."), shard_id
                    break
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            param = params[target]
            if isinstance(tensor, Fp8Weight):
                tensor, param = self._fp8_part(target, tensor, param, params, loaded)
            if isinstance(tensor, QuantizedWeight) and target in self.vocab_weights:
                if target == "lm_head.weight" or self.config.tie_word_embeddings:
                    self.lm_head.keep_quantized(tensor)
                tensor = tensor.dequantize()
            if isinstance(tensor, QuantizedWeight) and (target not in loaded or isinstance(param, QuantizedWeight)):
                param = params[target] = self._quantized_weight(target, tensor.bits)
            elif isinstance(tensor, QuantizedWeight):      # a fused layer whose first parts were float
                tensor = tensor.dequantize().to(param.dtype)
            elif not isinstance(param, (QuantizedWeight, Fp8Weight)):   # (a float part into a quantized layer:
                tensor = tensor.to(param.dtype)                           # its copy_ refuses it)
            loader = getattr(param, "weight_loader", _copy_loader)
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(target)
        missing = {n for n in params if n not in loaded}
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint lacks parameters: {sorted(missing)[:8]}")
        return loaded

    def _fp8_part(self, target: str, tensor: Fp8Weight, param, params: dict, loaded: set[str]):
        """(tensor, param) for an FP8 checkpoint part: the linear layer's Fp8Weight, made on its first part, takes
        it; a part whose layer is not linear, or one into a layer whose first parts were float, loads dequantized."""
        if isinstance(param, Fp8Weight):
            return tensor, param
        layer = self.get_submodule(target.rpartition(".")[0])
        if isinstance(layer, LinearBase) and target not in loaded:
            params[target] = layer.fp8_weight()
            return tensor, params[target]
        return tensor.dequantize().to(param.dtype), param

    def _quantized_weight(self, target: str, bits: int) -> QuantizedWeight:
        """The quantized weight of the linear layer owning `target`, made on its first quantized part."""
        layer = self.get_submodule(target.rpartition(".")[0])
        if not isinstance(layer, LinearBase):
            raise ValueError(f"checkpoint tensor {target!r} is quantized but its layer is not a linear layer")
        if isinstance(layer.weight, QuantizedWeight):
            return layer.weight
        return layer.quantize_weight(bits)


def _copy_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)
