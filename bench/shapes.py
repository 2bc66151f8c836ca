"""Model shapes the benchmarks run with random weights (`load_format="dummy"`): an HF config.json per shape."""
from __future__ import annotations

import json
import os
import tempfile

SHAPES = {
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, eos_token_id=128009),
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, eos_token_id=151645),
    # the embedded default's architecture: Serve measurements with its speed but without staging its GGUF
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, eos_token_id=2),
}


def write_shape(name: str, tp: int = 1, **overrides) -> str:
    """A temporary folder holding the shape's config.json; with tp > 1, the shape of one TP rank's shard
    (heads, KV heads and MLP width divided by tp)."""
    cfg = {**SHAPES[name], **overrides}
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        cfg[key] //= tp
    folder = tempfile.mkdtemp(prefix=f"tidal-{name}-tp{tp}-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder
