"""GGUF files (llama.cpp): HF-style config from the metadata, tensors under HF names: dequantized float32, or
(`keep_quantized`) linear weights in Q4_0 / Q4_1 / Q8_0 as QuantizedWeight blocks.

Follows HF transformers' GGUF conventions, so a state dict from here equals the one
`AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)` builds.
"""
from __future__ import annotations

import logging
import re

import numpy as np
import torch

from replicas.layers.quantized_linear import QuantizedWeight
from replicas.loaders.checkpoint import Checkpoint, model_config_from_hf
from replicas.tokenizer import Tokenizer

log = logging.getLogger(__name__)

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# `{arch}.<key>` metadata -> HF config key
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
_TOKEN_ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unknown": "unk_token_id",
                  "padding": "pad_token_id"}

_TOP_LEVEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# the vocabulary matrices, kept quantized for the LM head's matmul (the embedding lookup dequantizes them)
_VOCAB_TENSORS = {"token_embd.weight", "output.weight"}
_LINEAR_TENSORS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_IGNORED_TENSORS = {"rope_freqs.weight"}


def _value(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a llama.cpp tensor name, or None if it has none."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_LEVEL_TENSORS:
        return f"{_TOP_LEVEL_TENSORS[stem]}.{suffix}"
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if m and m[2] in _LAYER_TENSORS:
        return f"model.layers.{m[1]}.{_LAYER_TENSORS[m[2]]}.{m[3]}"
    return None


def hf_config_from_gguf(reader) -> dict:
    arch = _value(reader, "general.architecture")
    if arch not in HF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(HF_ARCHITECTURES)})")
    cfg: dict = {"architectures": [HF_ARCHITECTURES[arch]], "model_type": arch, "torch_dtype": "float32"}
    for key, hf_key in _CONFIG_KEYS.items():
        value = _value(reader, f"{arch}.{key}")
        if value is not None:
            cfg[hf_key] = max(value) if isinstance(value, list) else value   # per-layer lists: the widest
    head_dim = _value(reader, f"{arch}.attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = _value(reader, "llama.rope.dimension_count")   # equals head_dim for llama models
    if head_dim is not None:
        cfg["head_dim"] = head_dim
    scaling = _value(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": _value(reader, f"{arch}.rope.scaling.factor"),
                               "original_max_position_embeddings":
                                   _value(reader, f"{arch}.rope.scaling.original_context_length")}
    for key, hf_key in _TOKEN_ID_KEYS.items():
        token_id = _value(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            cfg[hf_key] = token_id
    if "vocab_size" not in cfg:
        cfg["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {t.name for t in reader.tensors}
    cfg["tie_word_embeddings"] = "output.weight" not in names
    cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    return cfg


def _unpermute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: it interleaves each head's two rotary halves."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# block layouts (ggml-common.h): float16 d (and m for Q4_1), then the quants; w = d * q + m, Q4_0: d * (q - 8)
_BLOCKS = {"Q4_0": (18, 2), "Q4_1": (20, 4), "Q8_0": (34, 2)}     # (block bytes, header bytes)


class GGUFSource:
    quantized_format = "gguf"      # its Q4_0 / Q4_1 / Q8_0 tensors; read() dequantizes the others either way

    def __init__(self, reader, hf_config: dict):
        import gguf
        self._dequantize = gguf.quants.dequantize
        self._heads = {"attn_q": hf_config["num_attention_heads"],
                       "attn_k": hf_config.get("num_key_value_heads", hf_config["num_attention_heads"])}
        self._permuted = hf_config["model_type"] == "llama"   # llama.cpp permutes q/k for llama models only
        self._tensors = {}
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is None:
                if t.name in _IGNORED_TENSORS:
                    log.warning("ignoring GGUF tensor %s (rope frequency factors are not applied)", t.name)
                    continue
                raise ValueError(f"GGUF tensor {t.name!r} has no counterpart in a {hf_config['model_type']} model")
            if name == "lm_head.weight" and hf_config["tie_word_embeddings"]:
                continue
            self._tensors[name] = t

    def names(self) -> list[str]:
        return list(self._tensors)

    def read(self, name: str, keep_quantized: bool = False) -> torch.Tensor | QuantizedWeight:
        t = self._tensors[name]
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
        linear = kind in _LINEAR_TENSORS or t.name in _VOCAB_TENSORS
        if keep_quantized and linear and t.name.endswith(".weight") and t.tensor_type.name in _BLOCKS:
            return self._read_blocks(t, kind)
        try:
            w = self._dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"GGUF tensor {t.name}: quantization {t.tensor_type.name} is not supported") from e
        if self._permuted and kind in self._heads:
            w = _unpermute_rotary_rows(w, self._heads[kind])
        w = np.ascontiguousarray(w, dtype=np.float32)
        return torch.from_numpy(w if w.flags.writeable else w.copy())

    def _read_blocks(self, t, kind: str) -> QuantizedWeight:
        rows = np.asarray(t.data).reshape(int(t.shape[1]), -1)          # GGUF shapes list columns first
        if self._permuted and kind in self._heads:
            rows = _unpermute_rotary_rows(rows, self._heads[kind])    # whole rows move: blocks stay intact
        return quantized_weight(rows, t.tensor_type.name)


def quantized_weight(rows: np.ndarray, type_name: str) -> QuantizedWeight:
    """GGUF blocks as they are, uint8 [rows, row bytes] of Q4_0 / Q4_1 / Q8_0 -> the QuantizedWeight."""
    size, header = _BLOCKS[type_name]
    blocks = rows.reshape(rows.shape[0], -1, size)
    halves = np.ascontiguousarray(blocks[..., :header]).view(np.float16).astype(np.float32)
    scale = torch.from_numpy(np.ascontiguousarray(halves[..., 0]))
    quants = np.ascontiguousarray(blocks[..., header:])
    if type_name == "Q8_0":
        return QuantizedWeight(torch.from_numpy(quants.view(np.int8)), scale, None)
    zero = torch.from_numpy(np.ascontiguousarray(halves[..., 1])) if type_name == "Q4_1" else -8 * scale
    return QuantizedWeight(torch.from_numpy(quants), scale, zero)


def load_gguf(path: str) -> Checkpoint:
    import gguf
    reader = gguf.GGUFReader(path)
    hf_config = hf_config_from_gguf(reader)
    generation_config = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id") if k in hf_config}
    try:
        model_config = model_config_from_hf(hf_config, generation_config)
    except KeyError as e:
        raise ValueError(f"{path}: GGUF metadata lacks {e}") from e
    return Checkpoint(path=path, hf_config=hf_config, model_config=model_config,
                      tokenizer=Tokenizer.from_gguf(reader), generation_config=generation_config,
                      source=GGUFSource(reader, hf_config))
