"""Tiny random checkpoints for tests: HF safetensors folders (Llama-3 and Qwen3 shaped, with a small trained
byte-level BPE tokenizer and a chat template) and GGUF files converted from them the way llama.cpp does.

    make_tiny_llama(path, **overrides) -> folder      overrides: config.json keys, plus dtype= and seed=
    make_tiny_qwen3(path, **overrides) -> folder
    make_tiny_gguf(path, arch="llama", qtype="F32", **overrides) -> .gguf file
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer
from tokenizers.models import BPE

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris.",
    "Hello world! How are you today? I'm fine, thanks; we've been busy, they'll see.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, 2))\n",
    "import torch\nx = torch.zeros(3, 4)\nif x.sum() == 0:\n    raise ValueError('empty')\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159",
    "Café, naïve, résumé, Zürich, São Paulo, mañana, straße.",
    "日本語のテキストと中文文本，한국어 문장도 있습니다。",
    "Emoji: 🙂 🚀 🤗 ❤️ 👍🏽 and symbols © ® ™ € £ ¥ → ∞.",
    "A user asks a question and the assistant answers it helpfully and briefly.",
    "Once upon a time there was a small model that learned to count: one, two, three.",
]

LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools:\n"
    "{% for tool in tools %}{{ tool | tojson(indent=2) }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

QWEN3_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{%- endif %}"
    "# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}{%- continue %}{%- endif %}"
    "{%- if message.role == 'assistant' and message.tool_calls is defined %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls %}"
    "{{- '\\n<tool_call>\\n' + (call.function | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def _train_tokenizer(split: str, special: list[str], plain_added: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in plain_added])
    return tok


def _write_json(path: str, obj: dict):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _random_weights(cfg: dict, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def linear(out_f, in_f):
        return torch.randn(out_f, in_f, generator=g) / in_f ** 0.5

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = {"model.embed_tokens.weight": torch.randn(cfg["vocab_size"], h, generator=g)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = linear(nq * hd, h)
        w[p + "self_attn.k_proj.weight"] = linear(nkv * hd, h)
        w[p + "self_attn.v_proj.weight"] = linear(nkv * hd, h)
        w[p + "self_attn.o_proj.weight"] = linear(h, nq * hd)
        if cfg.get("attention_bias"):
            for proj, n in (("q_proj", nq * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
                w[p + f"self_attn.{proj}.bias"] = 0.1 * torch.randn(n, generator=g)
        if cfg["model_type"] == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = linear(inter, h)
        w[p + "mlp.up_proj.weight"] = linear(inter, h)
        w[p + "mlp.down_proj.weight"] = linear(h, inter)
    w["model.norm.weight"] = norm(h)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = linear(cfg["vocab_size"], h)
    return {k: v.to(dtype).contiguous() for k, v in w.items()}


def _write_folder(path: str, cfg: dict, overrides: dict, tok: Tokenizer, tok_config: dict, gen_config: dict) -> str:
    dtype = getattr(torch, overrides.pop("dtype", "float32"))
    seed = overrides.pop("seed", 0)
    cfg.update(overrides)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    if cfg["vocab_size"] < tok.get_vocab_size():
        raise ValueError(f"vocab_size {cfg['vocab_size']} < tokenizer size {tok.get_vocab_size()}")
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    _write_json(os.path.join(path, "tokenizer_config.json"), tok_config)
    _write_json(os.path.join(path, "config.json"), cfg)
    _write_json(os.path.join(path, "generation_config.json"), gen_config)
    save_file(_random_weights(cfg, seed, dtype), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def make_tiny_llama(path, **overrides) -> str:
    """A Llama-3 shaped model: BOS added by the post-processor and written by the chat template, untied lm_head."""
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = _train_tokenizer(LLAMA3_SPLIT, special, [], 400)
    ids = {t: tok.token_to_id(t) for t in special}
    bos, eot, eos = ids["<|begin_of_text|>"], ids["<|eot_id|>"], ids["<|end_of_text|>"]
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": tok.get_vocab_size(),
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
           "bos_token_id": bos, "eos_token_id": [eos, eot]}
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                  "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": False,
                  "model_max_length": 512, "chat_template": LLAMA_CHAT_TEMPLATE}
    gen_config = {"bos_token_id": bos, "eos_token_id": [eos, eot], "do_sample": True, "temperature": 0.6,
                  "top_p": 0.9}
    return _write_folder(path, cfg, overrides, tok, tok_config, gen_config)


def make_tiny_qwen3(path, **overrides) -> str:
    """A Qwen3 shaped model: no BOS, q/k norms, head_dim != hidden/heads, tied embeddings, padded vocab."""
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    plain = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    tok = _train_tokenizer(QWEN2_SPLIT, special, plain, 420)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    endoftext, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
           "vocab_size": -(-tok.get_vocab_size() // 64) * 64, "hidden_size": 64, "intermediate_size": 160,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "hidden_act": "silu", "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "tie_word_embeddings": True, "attention_bias": False, "use_sliding_window": False,
           "sliding_window": None, "max_window_layers": 2, "bos_token_id": endoftext, "eos_token_id": im_end}
    tok_config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
                  "pad_token": "<|endoftext|>", "unk_token": None, "add_prefix_space": False,
                  "clean_up_tokenization_spaces": False, "model_max_length": 1024,
                  "chat_template": QWEN3_CHAT_TEMPLATE}
    gen_config = {"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext], "do_sample": True,
                  "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    return _write_folder(path, cfg, overrides, tok, tok_config, gen_config)


# ---- GGUF, converted the way llama.cpp's convert_hf_to_gguf.py lays a model out ------------------------------
_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{suffix}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order: within each head, the two rotary halves are interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_tiny_gguf(path, arch: str = "llama", qtype: str = "F32", **overrides) -> str:
    """A .gguf file with the tiny model's weights (2-D ones stored as `qtype`) and tokenizer; its source HF
    folder is written beside it (path + '.hf')."""
    import gguf
    from safetensors.torch import load_file

    folder = {"llama": make_tiny_llama, "qwen3": make_tiny_qwen3}[arch](str(path) + ".hf", **overrides)
    cfg, tok_json, tok_config = (_read_json(os.path.join(folder, name))
                                 for name in ("config.json", "tokenizer.json", "tokenizer_config.json"))
    vocab = dict(tok_json["model"]["vocab"])
    added = {t["content"]: t for t in tok_json["added_tokens"]}
    vocab.update({t: a["id"] for t, a in added.items()})
    tokens = [f"[PAD{i}]" for i in range(cfg["vocab_size"])]
    types = [gguf.TokenType.UNUSED] * cfg["vocab_size"]
    for t, i in vocab.items():
        tokens[i] = t
        types[i] = (gguf.TokenType.CONTROL if added[t]["special"] else gguf.TokenType.USER_DEFINED) \
            if t in added else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]]

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    if arch == "llama":
        w.add_rope_dimension_count(cfg["head_dim"])
    else:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe" if arch == "llama" else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    bos = tok_config.get("bos_token")
    w.add_bos_token_id(vocab[bos] if bos else cfg["bos_token_id"])
    w.add_eos_token_id(vocab[tok_config["eos_token"]])
    if tok_config.get("pad_token"):
        w.add_pad_token_id(vocab[tok_config["pad_token"]])
    w.add_add_bos_token(arch == "llama")
    w.add_chat_template(tok_config["chat_template"])
    quant = gguf.GGMLQuantizationType[qtype]
    for name, tensor in load_file(os.path.join(folder, "model.safetensors")).items():
        data = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            data = _llama_cpp_permute(data, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            data = _llama_cpp_permute(data, cfg["num_key_value_heads"])
        if data.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            w.add_tensor(_gguf_name(name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


FP8_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_fp8_checkpoint(float_folder: str, path: str, scheme: str) -> str:
    """A copy of an HF folder whose linear weights are stored in FP8 (E4M3), as published FP8 checkpoints hold
    them. scheme: "channel" (compressed-tensors FP8-dynamic: weight_scale [N, 1] per output channel), "tensor"
    (weight_scale [] and a static input_scale), "block" (Transformers' fine-grained FP8: weight_scale_inv per
    32 x 32 block, the config's weight_block_size)."""
    fp8 = torch.float8_e4m3fn
    fmax = torch.finfo(fp8).max
    tensors = load_file(os.path.join(float_folder, "model.safetensors"))
    out = {}
    for name, w in tensors.items():
        if not any(f".{p}.weight" in name for p in FP8_LINEAR):
            out[name] = w
            continue
        w = w.float()
        base = name[: -len("weight")]
        if scheme == "block":
            n, k = w.shape
            blocks = w.reshape(n // 32, 32, k // 32, 32).abs().amax(dim=(1, 3)) / fmax
            scale = blocks.repeat_interleave(32, 0).repeat_interleave(32, 1)
            out[name] = (w / scale).to(fp8)
            out[base + "weight_scale_inv"] = blocks
            continue
        scale = (w.abs().amax(dim=1, keepdim=True) if scheme == "channel" else w.abs().amax()) / fmax
        out[name] = (w / scale).to(fp8)
        out[base + "weight_scale"] = scale.float()
        if scheme == "tensor":
            out[base + "input_scale"] = torch.tensor(0.01)
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(float_folder):
        if f != "model.safetensors":
            shutil.copy(os.path.join(float_folder, f), os.path.join(path, f))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = ({"quant_method": "fp8", "weight_block_size": [32, 32]} if scheme == "block"
                                  else {"quant_method": "compressed-tensors", "format": "float-quantized"})
    _write_json(os.path.join(path, "config.json"), cfg)
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return str(path)
