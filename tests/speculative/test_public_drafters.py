"""Drafters in the published DFlash / Domino layout (speculative/drafters/public.py): a synthetic checkpoint with
the published config keys and tensor names loads into a DominoDrafter whose draft logits equal an independent
port of the published forward; unknown layouts and mismatched shapes fail clearly; an engine serves with one."""
import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

from replicas import LLM, SamplingParams
from replicas.config import ModelConfig
from speculative.drafter import DraftContext
from speculative.drafters.loading import load_drafter
from speculative.drafters.public import drafter_config, published_layout
from tests.support.checkpoints import make_tiny_llama
from tests.support.greedy import compare_greedy
from tests.support.threads import one_thread  # noqa: F401  (autouse)

SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_target_layers=6, target_layer_ids=[1, 3, 4], block_size=6,
             mask_token_id=90, gru_hidden_dim=24, emb_dim=12)


# ---- a synthetic checkpoint in the published layout ------------------------------------------------------------
def published_config(domino: bool, shift_label: bool, s: dict) -> dict:
    """config.json as z-lab's DFlash drafters (and Domino's, with its head keys) write it."""
    dflash = {"mask_token_id": s["mask_token_id"], "target_layer_ids": s["target_layer_ids"]}
    config = {"architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
              "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0, "block_size": s["block_size"],
              "dflash_config": dflash, "head_dim": s["head_dim"], "hidden_act": "silu",
              "hidden_size": s["hidden_size"], "intermediate_size": s["intermediate_size"],
              "layer_types": ["full_attention"] * s["num_hidden_layers"], "max_position_embeddings": 4096,
              "num_attention_heads": s["num_attention_heads"], "num_hidden_layers": s["num_hidden_layers"],
              "num_key_value_heads": s["num_key_value_heads"], "num_target_layers": s["num_target_layers"],
              "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
              "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": s["vocab_size"]}
    if domino:
        config["emb_dim"] = s["emb_dim"]
        dflash.update(projector_type="domino", pure_draft_prefix_len=1, emb_dim=s["emb_dim"],
                      gru_hidden_dim=s["gru_hidden_dim"], shift_label=shift_label)
    return config


def published_tensors(domino: bool, s: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def linear(out, inp):
        return torch.randn(out, inp, generator=g) / math.sqrt(inp)

    def norm(n):
        return 1 + 0.2 * torch.randn(n, generator=g)
    h, i, hd = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    nh, nkv = s["num_attention_heads"], s["num_key_value_heads"]
    w = {"fc.weight": linear(h, len(s["target_layer_ids"]) * h), "hidden_norm.weight": norm(h),
         "norm.weight": norm(h)}
    for n in range(s["num_hidden_layers"]):
        p = f"layers.{n}."
        w.update({p + "self_attn.q_proj.weight": linear(nh * hd, h), p + "self_attn.k_proj.weight": linear(nkv * hd, h),
                  p + "self_attn.v_proj.weight": linear(nkv * hd, h), p + "self_attn.o_proj.weight": linear(h, nh * hd),
                  p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
                  p + "mlp.gate_proj.weight": linear(i, h), p + "mlp.up_proj.weight": linear(i, h),
                  p + "mlp.down_proj.weight": linear(h, i), p + "input_layernorm.weight": norm(h),
                  p + "post_attention_layernorm.weight": norm(h)})
    if domino:
        gru, emb = s["gru_hidden_dim"], s["emb_dim"]
        w.update({"prefix_gru.weight_ih_l0": linear(3 * gru, h), "prefix_gru.weight_hh_l0": linear(3 * gru, gru),
                  "embed_proj.0.weight": linear(emb, h + gru), "embed_proj.2.weight": linear(s["vocab_size"], emb)})
    return w


def write_checkpoint(folder, domino=True, shift_label=True, seed=0, **sizes) -> str:
    s = {**SIZES, **sizes}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(published_config(domino, shift_label, s), f, indent=2)
    save_file(published_tensors(domino, s, seed), os.path.join(folder, "model.safetensors"))
    return str(folder)


# ---- an independent port of the published forward (Qwen3 layers, HF conventions), one request ----------------
def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def reference_hidden(w, config, target_hidden, embed, root):
    """The published draft forward for one request: context = all of `target_hidden` [T, n*H] at positions
    0..T-1, block = [root, mask...] at T..; returns the block's final hidden states [block, H]."""
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    bs, t = config["block_size"], target_hidden.shape[0]
    ids = torch.tensor([root] + [config["dflash_config"]["mask_token_id"]] * (bs - 1))
    x = embed[ids]
    ctx = rms(target_hidden @ w["fc.weight"].T, w["hidden_norm.weight"])
    inv_freq = 1.0 / config["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
    freqs = torch.arange(t + bs).float()[:, None] * inv_freq
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    for n in range(config["num_hidden_layers"]):
        p = f"layers.{n}."
        a = rms(x, w[p + "input_layernorm.weight"])
        q = rms((a @ w[p + "self_attn.q_proj.weight"].T).view(bs, nh, hd), w[p + "self_attn.q_norm.weight"])
        both = torch.cat([ctx, a])
        k = rms((both @ w[p + "self_attn.k_proj.weight"].T).view(t + bs, nkv, hd), w[p + "self_attn.k_norm.weight"])
        v = (both @ w[p + "self_attn.v_proj.weight"].T).view(t + bs, nkv, hd)
        q = q * cos[-bs:, None] + rotate_half(q) * sin[-bs:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5            # no mask: the block is non-causal
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(bs, nh * hd)
        x = x + out @ w[p + "self_attn.o_proj.weight"].T
        m = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["norm.weight"])


def gru_cell(x, h, w_ih, w_hh):
    g = len(h)
    gi, gh = w_ih @ x, w_hh @ h
    r, z = torch.sigmoid(gi[:g] + gh[:g]), torch.sigmoid(gi[g:2 * g] + gh[g:2 * g])
    n = torch.tanh(gi[2 * g:] + r * gh[2 * g:])
    return (1 - z) * n + z * h


def reference_logits(w, config, target_hidden, embed, lm_head, root, path):
    """Draft logits [k, V] (slot i: the token at root + 1 + i) and, for Domino, the head's logits teacher-forced
    on `path` (the rollout of the published spec_generate with path[i] as the token drafted at slot i)."""
    d = config["dflash_config"]
    z = reference_hidden(w, config, target_hidden, embed, root)
    if not d.get("shift_label", False):
        z = z[1:]                                             # the published [:, 1 - block_size:]
    base = z @ lm_head.T
    if d.get("projector_type") != "domino":
        return base, base
    prefix = d["pure_draft_prefix_len"]
    state = torch.zeros(d["gru_hidden_dim"])
    corrected = base.clone()
    for i, token in enumerate([root] + path[:len(z) - 1]):
        state = gru_cell(embed[token], state, w["prefix_gru.weight_ih_l0"], w["prefix_gru.weight_hh_l0"])
        if i >= prefix:
            hid = torch.nn.functional.silu(torch.cat([z[i], state]) @ w["embed_proj.0.weight"].T)
            corrected[i] = base[i] + hid @ w["embed_proj.2.weight"].T
    return base, corrected


# ---- tests --------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("domino,shift_label", [(False, False), (True, True), (True, False)],
                         ids=["dflash", "domino", "domino-no-shift"])
def test_draft_logits_equal_the_published_forward(tmp_path, domino, shift_label):
    folder = write_checkpoint(tmp_path / "ckpt", domino, shift_label)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    weights = published_tensors(domino, SIZES, 0)
    drafter = load_drafter(folder).eval()
    assert drafter.cfg.block_size == (SIZES["block_size"] if shift_label else SIZES["block_size"] - 1)
    g = torch.Generator().manual_seed(1)
    v, h, n = SIZES["vocab_size"], SIZES["hidden_size"], len(SIZES["target_layer_ids"])
    embed, lm_head = torch.randn(v, h, generator=g), torch.randn(v, h, generator=g) / math.sqrt(h)
    lengths, roots = [7, 3], [5, 17]
    hiddens = [torch.randn(t, n * h, generator=g) for t in lengths]
    paths = [torch.randint(0, v, (SIZES["block_size"],), generator=g).tolist() for _ in lengths]
    with torch.no_grad():
        ctx = DraftContext.stack([drafter.backbone.context(x[None], torch.arange(len(x))[None]) for x in hiddens])
        block = drafter.draft(torch.tensor(roots), torch.tensor(lengths), ctx, embed, lm_head)
        k = drafter.cfg.block_size
        path_embeds = embed[torch.tensor([[r] + p[:k - 1] for r, p in zip(roots, paths)])]
        corrected = drafter.head.corrected_logits(block.base_logits, block.hidden, path_embeds)
        for b in range(len(lengths)):
            want_base, want_corrected = reference_logits(weights, config, hiddens[b], embed, lm_head, roots[b],
                                                         paths[b])
            for got, want in ((block.base_logits[b], want_base), (corrected[b], want_corrected)):
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()
    if not domino:                                            # no head: the correction is zero
        assert torch.equal(corrected, block.base_logits)


@pytest.mark.timeout(30)
def test_unknown_layouts_and_mismatches_fail_clearly(tmp_path):
    good = published_config(True, True, SIZES)
    assert published_layout(good) == "domino"
    assert published_layout(published_config(False, False, SIZES)) == "dflash"
    with pytest.raises(ValueError, match="unsupported drafter layout"):
        published_layout({**good, "architectures": ["DFlash2DraftModel"]})
    with pytest.raises(ValueError, match="unknown drafter layout"):
        published_layout({"hidden_size": 8})
    with pytest.raises(ValueError, match="projector_type='dspark'"):
        published_layout({**good, "dflash_config": {**good["dflash_config"], "projector_type": "dspark"}})
    with pytest.raises(ValueError, match="sliding-window"):
        drafter_config({**good, "layer_types": ["sliding_attention", "full_attention"]})
    with pytest.raises(ValueError, match="rope scaling"):
        drafter_config({**good, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    target = ModelConfig(architecture="qwen3", vocab_size=96, hidden_size=48, intermediate_size=64,
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=512)
    with pytest.raises(ValueError, match="hidden_size 32 != the served model's 48"):
        drafter_config(good, target)
    folder = write_checkpoint(tmp_path / "bad", intermediate_size=40)          # tensors of another size
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "intermediate_size": 48}, f)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj\.weight: shape \(32, 40\), the config "
                                         r"implies \(32, 48\)"):
        load_drafter(folder)


@pytest.mark.timeout(120)
def test_engine_generates_with_a_published_domino_drafter(tmp_path):
    """A Domino checkpoint sized for the tiny target drives DominoTree in the engine; greedy output is the
    target's own (verification keeps it lossless whatever the drafter)."""
    folder = make_tiny_llama(str(tmp_path / "target"), num_attention_heads=4, num_key_value_heads=2)
    with open(os.path.join(folder, "config.json")) as f:
        target = json.load(f)
    drafter = write_checkpoint(tmp_path / "domino", vocab_size=target["vocab_size"], hidden_size=64,
                               intermediate_size=96, num_hidden_layers=1, num_target_layers=2, target_layer_ids=[0, 1],
                               block_size=8, mask_token_id=target["vocab_size"] - 1, gru_hidden_dim=32, emb_dim=16)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, target["vocab_size"], (k,), generator=g).tolist() for k in (5, 23)]
    engine = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=64)
    plain = LLM(model=folder, **engine)
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    finally:
        plain.shutdown()
    llm = LLM(model=folder, speculative="dominotree", drafter=drafter, spec_budget=6, spec_policy="knee", **engine)
    try:
        assert llm.engine.speculator.drafter.cfg.mask_token_id == target["vocab_size"] - 1
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.get_stats().spec_drafts > 0
    finally:
        llm.shutdown()

    @torch.no_grad()
    def last_logits(ids):                                     # only asked where the two differ (near-ties)
        hf = pytest.importorskip("transformers").AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        return hf(torch.tensor([ids])).logits[0, -1]
    compare_greedy(prompts, got, want, last_logits)
