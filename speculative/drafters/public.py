"""Drafters published in the DFlash layout, loaded into a `DominoDrafter`: z-lab's DFlash drafters
(`DFlashDraftModel`, e.g. z-lab/Qwen3-8B-DFlash-b16) and Domino's (the same backbone plus a GRU head,
`dflash_config.projector_type = "domino"`, architecture `DFlashDraftModel` or `DominoDraftModel`).

The published forward is our backbone's math: the target's hidden states after `target_layer_ids`, concatenated,
go through `fc` and `hidden_norm` and become extra keys/values of every layer (k_proj/v_proj, per-head k_norm,
RoPE at their own positions); the block [root, mask x (block_size - 1)] is embedded with the target's embedding
(the mask slots embed `mask_token_id`) and attends bidirectionally to the context and itself; Qwen3 layers
(per-head q/k RMSNorm, SwiGLU MLP), a final `norm`, the target's LM head. The differences are settings of
`DrafterConfig`: `mask_token_id`, and `shift_label`: without it (plain DFlash) the root's output is dropped and
output slot j predicts the token at root + j, so a "b16" drafter drafts 15 slots (our `block_size` 15, 16 inputs).

Domino's head is ours: `prefix_gru` (bias-free GRU over the target embeddings of root and path) and `embed_proj`
(Linear, SiLU, Linear, bias-free) adding W2 SiLU(W1 [z_k; s_k]) to slot k's logits from slot
`pure_draft_prefix_len` on. A checkpoint without that head gets a zero one: the correction is 0 and DominoTree
scores the base logits (docs/speculative.md, "Public drafters").

Tensor names (published -> ours): fc -> backbone.fc, hidden_norm -> backbone.context_norm, norm -> backbone.norm,
layers.i.{input_layernorm, post_attention_layernorm} -> backbone.layers.i.{input_norm, post_norm},
layers.i.self_attn.* -> backbone.layers.i.attn.*, layers.i.mlp.{gate_proj; up_proj} -> backbone.layers.i.gate_up
(stacked), layers.i.mlp.down_proj -> backbone.layers.i.down, prefix_gru.* -> head.gru.*, embed_proj.{0, 2} ->
head.{w1, w2} (early Domino checkpoints nest the head under `logit_head.`). `embed_tokens` / `lm_head`, if a
checkpoint carries them, are not read: the published forward uses the target's.
"""
from __future__ import annotations

import glob
import json
import logging
import os
from typing import Optional

import torch
from safetensors.torch import load_file
from torch import Tensor

from replicas.config import ModelConfig
from speculative.drafter import DominoDrafter, DrafterConfig, evenly_spaced_layers

log = logging.getLogger(__name__)

ARCHITECTURES = ("DFlashDraftModel", "DominoDraftModel")
DOMINO_PROJECTORS = ("domino",)
UNUSED = ("embed_tokens.weight", "lm_head.weight", "rotary_emb.inv_freq")
HEADLESS_GRU, HEADLESS_RANK = 64, 64         # the zero head of a checkpoint without one: small, it corrects nothing
LAYOUT_HELP = "docs/speculative.md, section Public drafters"


def published_layout(config: dict) -> Optional[str]:
    """"dflash" or "domino" for a published checkpoint's config.json, None for a folder saved by
    `DominoDrafter.save`; a ValueError for anything else."""
    if "architectures" not in config and "dflash_config" not in config:
        if {"gru_hidden", "correction_rank", "target_layer_ids"} <= config.keys():
            return None
        raise ValueError(f"unknown drafter layout: config.json has neither tidal's DrafterConfig keys nor a "
                         f"published architecture ({LAYOUT_HELP})")
    archs = config.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs) or not isinstance(config.get("dflash_config"), dict):
        raise ValueError(f"unsupported drafter layout: architectures={archs}; tidal loads {list(ARCHITECTURES)} "
                         f"with a dflash_config ({LAYOUT_HELP})")
    projector = config["dflash_config"].get("projector_type")
    if projector is None and "DominoDraftModel" not in archs:
        return "dflash"
    if projector in DOMINO_PROJECTORS or (projector is None and "DominoDraftModel" in archs):
        return "domino"
    raise ValueError(f"unsupported drafter head: dflash_config.projector_type={projector!r} (tidal loads plain "
                     f"DFlash and projector_type 'domino'; {LAYOUT_HELP})")


def _setting(config: dict, key: str, default=None):
    """A setting from dflash_config, else from the top level (published configs use both places)."""
    value = config["dflash_config"].get(key, config.get(key, default))
    if value is None:
        raise ValueError(f"published drafter config: {key} is missing")
    return value


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError(f"published drafter config: rope scaling {scaling} is not supported (default RoPE only)")
    return float(config.get("rope_theta", params.get("rope_theta", 10000.0)))


def _check_supported(config: dict) -> None:
    n = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        window = config.get("use_sliding_window") and config.get("sliding_window")
        types = ["sliding_attention" if window and i >= config.get("max_window_layers", n) else "full_attention"
                 for i in range(n)]
    if any(t != "full_attention" for t in types):
        raise ValueError(f"published drafter config: sliding-window layers {types} are not supported")
    if config.get("attention_bias"):
        raise ValueError("published drafter config: attention_bias=true is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"published drafter config: hidden_act={config['hidden_act']!r} (silu only)")


def drafter_config(config: dict, target: Optional[ModelConfig] = None) -> DrafterConfig:
    """Our DrafterConfig for a published config.json; with `target`, checked against the served model."""
    layout = published_layout(config)
    if layout is None:
        raise ValueError("not a published drafter config (a folder saved by DominoDrafter.save)")
    _check_supported(config)
    hidden, heads, layers = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    num_target_layers = config["dflash_config"].get("num_target_layers", config.get("num_target_layers"))
    layer_ids = config["dflash_config"].get("target_layer_ids")
    if layer_ids is None:
        if num_target_layers is None:
            raise ValueError("published drafter config: neither target_layer_ids nor num_target_layers is given")
        layer_ids = evenly_spaced_layers(num_target_layers, layers)
    shift_label = _setting(config, "shift_label", False)
    if not isinstance(shift_label, bool):
        raise ValueError(f"published drafter config: shift_label must be a bool, got {shift_label!r}")
    block = int(_setting(config, "block_size"))
    if layout == "domino":
        gru, rank = int(_setting(config, "gru_hidden_dim")), int(_setting(config, "emb_dim"))
        prefix = int(_setting(config, "pure_draft_prefix_len", 0))
        if prefix not in (0, 1):
            raise ValueError(f"published drafter config: pure_draft_prefix_len={prefix} is not supported (0 or 1)")
    else:
        gru, rank, prefix = HEADLESS_GRU, HEADLESS_RANK, 1
    cfg = DrafterConfig(
        vocab_size=config["vocab_size"], hidden_size=hidden, intermediate_size=config["intermediate_size"],
        num_layers=layers, num_heads=heads, num_kv_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or hidden // heads, target_layer_ids=tuple(int(i) for i in layer_ids),
        block_size=block if shift_label else block - 1, rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(config), gru_hidden=gru, correction_rank=rank, uncorrected_positions=prefix,
        mask_token_id=int(_setting(config, "mask_token_id")), shift_label=shift_label)
    check_target(cfg, target, num_target_layers)
    return cfg


def check_target(cfg: DrafterConfig, target: Optional[ModelConfig], num_target_layers: Optional[int]) -> None:
    """The published drafter reads the target's embedding, LM head and hidden states: their shapes must agree."""
    if cfg.mask_token_id is not None and not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise ValueError(f"mask_token_id {cfg.mask_token_id} is outside the vocabulary ({cfg.vocab_size})")
    if target is None:
        return
    for name in ("vocab_size", "hidden_size"):
        if getattr(cfg, name) != getattr(target, name):
            raise ValueError(f"the drafter was trained for another target: {name} {getattr(cfg, name)} != the "
                             f"served model's {getattr(target, name)}")
    if num_target_layers is not None and num_target_layers != target.num_hidden_layers:
        raise ValueError(f"the drafter was trained for a target of {num_target_layers} layers, the served model "
                         f"has {target.num_hidden_layers}")
    if max(cfg.target_layer_ids) >= target.num_hidden_layers:
        raise ValueError(f"target_layer_ids {cfg.target_layer_ids} exceed the served model's "
                         f"{target.num_hidden_layers} layers")


def _our_name(name: str) -> Optional[str]:
    """Our parameter name for a published tensor name (None: not one of the layout's names)."""
    name = name.removeprefix("logit_head.")
    direct = {"fc.weight": "backbone.fc.weight", "hidden_norm.weight": "backbone.context_norm.weight",
              "norm.weight": "backbone.norm.weight", "embed_proj.0.weight": "head.w1.weight",
              "embed_proj.2.weight": "head.w2.weight", "prefix_gru.weight_ih_l0": "head.gru.weight_ih_l0",
              "prefix_gru.weight_hh_l0": "head.gru.weight_hh_l0"}
    if name in direct:
        return direct[name]
    parts = name.split(".", 2)
    if len(parts) < 3 or parts[0] != "layers" or not parts[1].isdigit():
        return None
    inner = {"input_layernorm.weight": "input_norm.weight", "post_attention_layernorm.weight": "post_norm.weight",
             "mlp.down_proj.weight": "down.weight"}
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
        inner[f"self_attn.{proj}.weight"] = f"attn.{proj}.weight"
    rest = inner.get(parts[2])
    return f"backbone.layers.{parts[1]}.{rest}" if rest else None


def state_dict(tensors: dict[str, Tensor], model: DominoDrafter, domino: bool) -> dict[str, Tensor]:
    """`model`'s state dict (only its shapes are read) from the published tensors; errors name the published key."""
    ours = model.state_dict()
    out: dict[str, Tensor] = {}
    gate_up: dict[str, dict[str, Tensor]] = {}
    unknown = []
    for name, w in tensors.items():
        if name in UNUSED:
            continue
        if name.startswith("layers.") and name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            layer = name.split(".")[1]
            gate_up.setdefault(f"backbone.layers.{layer}.gate_up.weight", {})[name.split(".")[3]] = w
            continue
        key = _our_name(name)
        if key is None or key not in ours:
            unknown.append(name)
            continue
        if tuple(w.shape) != tuple(ours[key].shape):
            raise ValueError(f"published tensor {name}: shape {tuple(w.shape)}, the config implies "
                             f"{tuple(ours[key].shape)}")
        out[key] = w
    for key, parts in gate_up.items():
        if set(parts) != {"gate_proj", "up_proj"} or key not in ours:
            unknown.append(f"{key} (gate_proj/up_proj incomplete)")
            continue
        w = torch.cat([parts["gate_proj"], parts["up_proj"]], 0)
        if tuple(w.shape) != tuple(ours[key].shape):
            raise ValueError(f"published tensors layers.{key.split('.')[2]}.mlp.gate_proj/up_proj: shape "
                             f"{tuple(w.shape)} stacked, the config implies {tuple(ours[key].shape)}")
        out[key] = w
    if unknown:
        raise ValueError(f"unknown tensors in the published drafter: {sorted(unknown)[:8]}")
    out["backbone.mask_embedding"] = torch.zeros(ours["backbone.mask_embedding"].shape)   # mask_token_id instead
    if not domino:
        out.update({k: torch.zeros(v.shape) for k, v in ours.items() if k.startswith("head.")})
    missing = sorted(set(ours) - set(out))
    if missing:
        raise ValueError(f"the published drafter lacks tensors for {missing[:8]}")
    return out


def load_public_drafter(folder: str, device="cpu", dtype: torch.dtype = torch.float32,
                        target: Optional[ModelConfig] = None) -> DominoDrafter:
    """A published DFlash / Domino checkpoint (config.json + *.safetensors, possibly sharded) as a DominoDrafter."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    domino = published_layout(config) == "domino"
    cfg = drafter_config(config, target)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors in {folder}")
    tensors = {name: w for path in files for name, w in load_file(path).items()}
    with torch.device("meta"):                  # no random initialisation of weights about to be replaced
        model = DominoDrafter(cfg)
    model.load_state_dict(state_dict(tensors, model, domino), assign=True)
    if not domino:
        log.info("%s: a DFlash drafter without a Domino head; its correction is zero, so trees score the base "
                 "logits", folder)
    return model.to(device=device, dtype=dtype)
