"""The block drafter and Domino head: configs and checkpoints, context caching, train/inference alignment (a
drafter trained on a copy task drafts whole blocks the target accepts), training smoke and data plumbing."""
import json
import random

import pytest

import torch

from speculative.acceptance import accept
from speculative.drafter import DominoDrafter, DraftContext, DrafterConfig, evenly_spaced_layers
from speculative.train import HFTarget, TrainConfig, Trainer, block_losses, step_flops, training_mask
from speculative.train_data import (PAD_MULTIPLE, PairBatcher, in_heldout, iter_sharegpt, make_batch, read_pairs,
                                    write_pairs)
from speculative.draft_tree import TreeConfig
from speculative.tree import prepare_round
from speculative.tree_gpu import build_frontier
from replicas.config import ModelConfig


from tests.support.threads import one_thread  # noqa: F401,E402  (autouse)


def tiny_config(**kw) -> DrafterConfig:
    base = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, target_layer_ids=(0,), block_size=16, gru_hidden=16, correction_rank=8)
    base.update(kw)
    return DrafterConfig(**base)


def test_layer_choice_and_config_for_a_target():
    assert evenly_spaced_layers(30, 3) == (1, 14, 27)
    assert evenly_spaced_layers(36, 5) == (1, 9, 17, 25, 33)
    assert evenly_spaced_layers(30, 1) == (15,)
    smol = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                       max_position_embeddings=8192)
    cfg = DrafterConfig.for_target(smol)
    assert (cfg.gru_hidden, cfg.correction_rank, cfg.target_layer_ids, cfg.context_size) == (192, 64, (1, 14, 27),
                                                                                               3 * 576)
    qwen8b = ModelConfig(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                         num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=40960)
    big = DrafterConfig.for_target(qwen8b)
    assert (big.gru_hidden, big.correction_rank) == (1024, 256)
    assert DrafterConfig.from_json(cfg.to_json()) == cfg


def make_drafter(seed=0, **kw):
    torch.manual_seed(seed)
    d = DominoDrafter(tiny_config(**kw))
    for p in d.head.w2.parameters():
        p.data.normal_(std=0.3)                       # a non-trivial correction head
    return d.eval()


def test_save_load_roundtrip(tmp_path):
    d = make_drafter()
    d.save(str(tmp_path / "drafter"))
    loaded = DominoDrafter.load(str(tmp_path / "drafter")).eval()
    assert loaded.cfg == d.cfg
    embed = torch.randn(32, 32)
    ctx_hidden, pos = torch.randn(2, 9, 32), torch.arange(9).expand(2, 9)
    with torch.no_grad():
        a = d.draft(torch.tensor([1, 2]), torch.tensor([9, 9]), d.backbone.context(ctx_hidden, pos), embed, embed)
        b = loaded.draft(torch.tensor([1, 2]), torch.tensor([9, 9]), loaded.backbone.context(ctx_hidden, pos),
                         embed, embed)
    assert torch.equal(a.base_logits, b.base_logits) and a.base_logits.shape == (2, 16, 32)


def test_cached_context_pieces_and_padding_match_one_shot():
    d, embed = make_drafter(), torch.randn(32, 32)
    hidden = torch.randn(2, 12, 32)
    with torch.no_grad():
        whole = d.backbone.context(hidden, torch.arange(12).expand(2, 12))
        pieces = d.backbone.context(hidden[:, :5], torch.arange(5).expand(2, 5)).concat(
            d.backbone.context(hidden[:, 5:], torch.arange(5, 12).expand(2, 7)))
        roots, rpos = torch.tensor([3, 4]), torch.tensor([12, 12])
        one = d.draft(roots, rpos, whole, embed, embed).base_logits
        assert torch.allclose(one, d.draft(roots, rpos, pieces, embed, embed).base_logits, atol=1e-5)
        # two requests of different lengths, stacked with right padding (garbage behind the padding is ignored)
        short = d.backbone.context(hidden[1:, :7], torch.arange(7)[None])
        lone = d.draft(roots[1:], torch.tensor([7]), short, embed, embed).base_logits
        stacked = DraftContext.stack([d.backbone.context(hidden[:1], torch.arange(12)[None]), short])
        stacked.keys[0][1, 7:] = 1e4
        both = d.draft(roots, torch.tensor([12, 7]), stacked, embed, embed).base_logits
        assert torch.allclose(both[0], one[0], atol=1e-5) and torch.allclose(both[1], lone[0], atol=1e-5)


def test_block_attention_is_bidirectional():
    d = make_drafter()
    ctx = d.backbone.context(torch.randn(1, 4, 32), torch.arange(4)[None])
    embeds, pos = d.block_inputs(torch.tensor([5]), torch.tensor([4]), torch.randn(32, 32))
    mask = torch.ones(1, 16, 20, dtype=torch.bool)
    with torch.no_grad():
        a = d.backbone(embeds, pos, ctx, mask)
        embeds[0, 9] += 1.0
        b = d.backbone(embeds, pos, ctx, mask)
    assert not torch.allclose(a[0, 2], b[0, 2])                     # an earlier slot sees a later one


def test_training_blocks_equal_inference_drafts():
    """The training path (many anchors, one masked forward, teacher-forced head) computes exactly what inference
    computes for a root at the anchor with the context strictly before it: same hidden, same logits."""
    d, embed = make_drafter(), torch.randn(32, 32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (1, 40), generator=g)
    target_hidden = torch.randn(1, 40, 32, generator=g)
    anchors = torch.tensor([[3, 17, 22]])
    mask = training_mask(anchors, torch.ones(1, 3, dtype=torch.bool), 40, 16)
    assert mask[0, 16, :40].tolist() == [True] * 17 + [False] * 23      # block 1 sees positions < 17
    assert mask[0, 16, 40:].tolist() == [False] * 16 + [True] * 16 + [False] * 16
    with torch.no_grad():
        ctx = d.backbone.context(target_hidden, torch.arange(40)[None])
        embeds, pos = d.block_inputs(ids.gather(1, anchors).view(-1), anchors.view(-1), embed)
        train_hidden = d.backbone(embeds.view(1, 48, -1), pos.view(1, 48), ctx, mask)
        for j, a in enumerate(anchors[0].tolist()):
            infer = d.draft(ids[:, a], torch.tensor([a]), d.backbone.context(target_hidden[:, :a],
                                                                               torch.arange(a)[None]), embed, embed)
            assert torch.allclose(train_hidden[0, 16 * j:16 * (j + 1)], infer.hidden[0], atol=1e-5)
        # head: slot 0 keeps the base logits; slot k reads the GRU state after root + k true tokens
        path = ids[:, 17:33]
        base = train_hidden[:, 16:32] @ embed.t()
        final = d.head.corrected_logits(base, train_hidden[:, 16:32], embed[path])
        assert torch.equal(final[:, 0], base[:, 0])
        state5 = d.head.path_states(embed[ids[:, 17:23]])[:, -1]
        assert torch.allclose(final[0, 5], base[0, 5] + d.head.correction(train_hidden[0, 21], state5[0]), atol=1e-5)


def test_path_states_are_the_gru_recurrence():
    """The written-out recurrence equals torch.nn.GRU on the same weights: states and every gradient (float32)."""
    torch.manual_seed(0)
    head = DominoDrafter(tiny_config()).head
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(5, 16, 32, requires_grad=True)
    ours, ref = head.path_states(x), head.gru(x)[0]
    assert ours.dtype == torch.float32 and torch.allclose(ours, ref, atol=1e-5)
    upstream = torch.randn_like(ref)
    g_ours = torch.autograd.grad((ours * upstream).sum(), [x, *head.gru.parameters()])
    g_ref = torch.autograd.grad((ref * upstream).sum(), [x, *head.gru.parameters()])
    for a, b in zip(g_ours, g_ref):
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()


V, H, PERIOD = 16, 32, 20


class CopyTarget:
    """A deterministic target over sequences with period PERIOD: the next token is the one PERIOD-1 back.
    Its 'hidden state' at a position is the embedding of the token there. Embeddings span half the hidden
    space, so the root slot can form a token-independent query."""

    def __init__(self):
        q = torch.linalg.qr(torch.randn(H, H, generator=torch.Generator().manual_seed(0)))[0]
        self.embed_weight = 4.0 * q[:V]                             # orthogonal: tokens are separable
        self.lm_head_weight = self.embed_weight

    def hidden(self, ids):
        return self.embed_weight[ids]


def periodic(rng, n):
    pattern = [rng.randrange(V) for _ in range(PERIOD)]
    return [pattern[i % PERIOD] for i in range(n)]


def test_copy_task_alignment_perfect_drafter_accepts_whole_blocks(tmp_path):
    """Trained through the real training path, a drafter that learned the task must get accept length == block
    through the real inference path. Any off-by-one in labels, context cut or slot order gives ~0."""
    rng, target = random.Random(0), CopyTarget()
    pairs = [(s[:PERIOD + 2], s[PERIOD + 2:]) for s in (periodic(rng, 80) for _ in range(256))]
    torch.manual_seed(0)
    d = DominoDrafter(tiny_config(vocab_size=V, rope_theta=30.0))   # sharp relative positions for a tiny model
    cfg = TrainConfig(steps=300, batch_size=8, seq_len=80, anchors_per_seq=8, lr=5e-3, warmup_steps=20,
                      curriculum_steps=100, log_every=50, checkpoint_every=1000)
    Trainer(d, target, PairBatcher(pairs, 8, 80, 8), cfg, str(tmp_path)).train()
    d.eval()
    x = torch.tensor([periodic(rng, 100) for _ in range(16)])
    p, emb = 50, target.embed_weight
    with torch.no_grad():
        block = d.draft(x[:, p], torch.full((16,), p), d.backbone.context(emb[x[:, :p]], torch.arange(p).expand(16, p)),
                        emb, emb)
        for tcfg in (TreeConfig(budget=16, node_topk=1), TreeConfig()):
            tree = build_frontier(prepare_round(d.head, block.hidden, block.base_logits, x[:, p], emb, tcfg), tcfg)
            slot_positions = p + tree.position_offsets()
            target_logits = torch.nn.functional.one_hot(x.gather(1, slot_positions + 1 - PERIOD), V).float()
            out = accept(tree, target_logits)
            assert out.num_accepted.tolist() == [16] * 16
            assert torch.equal(out.tokens[:, :17], x[:, p + 1:p + 18])
        # the unshifted-label convention (slot k taken for the token at root + k) is caught: ~nothing accepted
        shifted = torch.cat([block.base_logits[:, 1:], block.base_logits[:, -1:]], 1)
        tcfg = TreeConfig(budget=16, node_topk=1)
        tree = build_frontier(prepare_round(d.head, block.hidden, shifted, x[:, p], emb, tcfg), tcfg)
        target_logits = torch.nn.functional.one_hot(x.gather(1, p + tree.position_offsets() + 1 - PERIOD), V).float()
        assert accept(tree, target_logits).num_accepted.float().mean() < 0.5


def test_training_smoke_on_a_tiny_random_target_resumes(tmp_path):
    from transformers import AutoModelForCausalLM
    from tests.support.checkpoints import make_tiny_llama
    model = AutoModelForCausalLM.from_pretrained(make_tiny_llama(tmp_path / "target"), dtype=torch.float32)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab, (24, 12), generator=g)
    with torch.no_grad():                                           # self-distillation: the target answers
        full = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=28, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
    pairs = [(r[:12].tolist(), r[12:].tolist()) for r in full]
    write_pairs(str(tmp_path / "pairs.jsonl"), pairs)
    assert read_pairs(str(tmp_path / "pairs.jsonl")) == pairs
    target = HFTarget(model, (0, 1))
    cfg = DrafterConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_layers=1, num_heads=4,
                        num_kv_heads=2, head_dim=16, target_layer_ids=(0, 1), block_size=8, gru_hidden=16,
                        correction_rank=8)
    tc = TrainConfig(steps=30, batch_size=4, seq_len=40, anchors_per_seq=4, lr=3e-3, warmup_steps=5,
                     curriculum_steps=10, log_every=5, checkpoint_every=15, peak_flops=1e12)
    torch.manual_seed(0)
    first = Trainer(DominoDrafter(cfg), target, PairBatcher(pairs, 4, 40, 4), tc, str(tmp_path / "run")).train()
    assert first[-1]["loss"] < 0.8 * first[0]["loss"]
    assert all(r["query_tokens_per_s"] > 0 and r["peak_memory_gib"] > 0 and 0 < r["mfu"] < 1 for r in first)
    longer = TrainConfig(**{**tc.__dict__, "steps": 40})
    resumed = Trainer(DominoDrafter(cfg), target, PairBatcher(pairs, 4, 40, 4), longer, str(tmp_path / "run"))
    assert resumed.step == 30
    assert [r["step"] for r in resumed.train()] == [35, 40]
    steps = [json.loads(line)["step"] for line in open(tmp_path / "run" / "train_log.jsonl")]
    assert steps == [5, 10, 15, 20, 25, 30, 35, 40]
    assert step_flops(cfg, 4, 40, 4) > 0


def test_anchor_batches_and_resumable_order():
    rng = random.Random(0)
    pairs = [([1] * rng.randint(2, 9), [2] * rng.randint(1, 20)) for _ in range(10)]
    batch = make_batch(pairs, 24, 6, rng)
    for i, (prompt, response) in enumerate(pairs):
        for a, ok in zip(batch.anchors[i].tolist(), batch.anchor_valid[i].tolist()):
            if ok:
                assert a >= 1 and batch.loss_mask[i, a + 1] and a + 1 < min(24, len(prompt) + len(response))
    one = PairBatcher(pairs, 3, 24, 4, seed=5)
    for _ in range(4):
        one.next()
    two = PairBatcher(pairs, 3, 24, 4, seed=5)
    two.load_state(one.state())
    a, b = one.next(), two.next()
    assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("input_ids", "loss_mask", "anchors", "anchor_valid"))
    assert a.num_tokens == b.num_tokens


def test_a_batch_is_padded_to_its_longest_sequence_only():
    """The width is the longest sequence rounded up to PAD_MULTIPLE, never past seq_len; the token count leaves
    the padding out; the same batch padded to seq_len (`full_width`, for a compiled loss) gives the same losses
    (the padding is masked)."""
    pairs = [([3] * 5, [4] * 30), ([3] * 7, [4] * 50)]
    batch = make_batch(pairs, 1024, 4, random.Random(0))
    assert batch.input_ids.shape == (2, PAD_MULTIPLE) and batch.num_tokens == 35 + 57 and batch.width == PAD_MULTIPLE
    assert make_batch(pairs, 40, 4, random.Random(0)).input_ids.shape == (2, 40)
    cfg = DrafterConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=16, target_layer_ids=(0,), block_size=4, gru_hidden=8,
                        correction_rank=4)
    torch.manual_seed(0)
    drafter, embed = DominoDrafter(cfg), torch.randn(64, 32)
    wide = make_batch(pairs, 128, 4, random.Random(0), full_width=True)
    assert wide.input_ids.shape == (2, 128) and wide.width == PAD_MULTIPLE and torch.equal(wide.anchors, batch.anchors)
    hidden = torch.randn(2, 128, 32)
    narrow_losses = block_losses(drafter, batch, hidden[:, :PAD_MULTIPLE], embed, embed, 7.0)
    wide_losses = block_losses(drafter, wide, hidden, embed, embed, 7.0)
    for key in ("final", "base", "accuracy"):
        assert torch.allclose(narrow_losses[key], wide_losses[key], atol=1e-5), key


def test_sharegpt_stream_and_stable_heldout_split():
    first = [c for _, c in zip(range(5), iter_sharegpt())]
    assert len(first) == 5 and all("conversations" in c for c in first)
    ids = [f"conv-{i}" for i in range(5000)]
    held = sum(in_heldout(i) for i in ids)
    assert 50 < held < 150 and in_heldout("conv-7") == in_heldout("conv-7")


def test_regeneration_cuts_a_prompt_longer_than_the_context_and_passes_add_sampled_answers():
    from replicas.llm import LLM
    from speculative.train_data import Ask, passes_of, regenerate
    asks = passes_of(["tell me about the sea " * 200, "name three colours"], 3, 1.0)
    assert [(a.temperature, a.seed) for a in asks] == [(0.0, None)] * 2 + [(1.0, 1_000_003), (1.0, 1_000_004),
                                                                            (1.0, 2_000_006), (1.0, 2_000_007)]
    llm = LLM(max_model_len=128, max_num_seqs=4)
    try:
        pairs = regenerate(llm, asks, max_tokens=16)
        again = regenerate(llm, [asks[3], Ask(asks[3].prompt, 1.0, asks[3].seed + 1)], max_tokens=16)
    finally:
        llm.shutdown()
    assert len(pairs) == 6 and all(response for _, response in pairs)
    assert len(pairs[0][0]) + 16 <= 128 and len(pairs[0][0]) > 64
    assert {len(pairs[k][0]) for k in (0, 2, 4)} == {len(pairs[0][0])}     # every pass asks the same (cut) prompt
    assert again[0] == pairs[3] and again[1][1] != pairs[3][1]              # a pass's answer is its seed's


def test_all_turn_prompts_follow_the_first_turns_and_end_with_a_chat_prompt():
    from speculative.train_data import sharegpt_prompts
    first = sharegpt_prompts("heldout")
    every = sharegpt_prompts("heldout", turns="all")
    assert every[:len(first)] == first and len(every) > len(first)
    for conversation in every[len(first):]:
        assert len(conversation) % 2 == 1 and conversation[-1]["role"] == "user"
        assert [m["role"] for m in conversation] == ["user", "assistant"] * (len(conversation) // 2) + ["user"]
        assert all(m["content"].strip() for m in conversation)
    assert sharegpt_prompts("heldout", turns="all", limit=3) == first[:3]
    with pytest.raises(ValueError):
        sharegpt_prompts("heldout", turns="some")


def test_a_conversation_too_long_for_the_context_loses_its_oldest_exchanges_first():
    from replicas.llm import LLM
    from speculative.train_data import _chat_prompt, check_prompts, regenerate, passes_of
    conversation = [{"role": "user", "content": "tell me about the sea " * 40},
                    {"role": "assistant", "content": "the sea is wide " * 40},
                    {"role": "user", "content": "and the sky?"}]
    llm = LLM(max_model_len=128, max_num_seqs=4)
    try:
        tok = llm.tokenizer
        whole = _chat_prompt(tok, conversation, 10_000)
        assert whole == tok.encode_chat(conversation)
        assert _chat_prompt(tok, conversation, 112) == tok.encode_chat(conversation[2:])    # the last turn alone
        long_last = conversation[:2] + [{"role": "user", "content": "and the sky? " * 80}]
        cut = _chat_prompt(tok, long_last, 112)
        assert 64 < len(cut) <= 112 and tok.decode(cut).count("and the sky?") < 80
        pairs = regenerate(llm, passes_of(check_prompts([conversation, "name three colours"], "test"), 1, 1.0),
                           max_tokens=16)
    finally:
        llm.shutdown()
    assert pairs[0][0] == tok.encode_chat(conversation[2:]) and all(response for _, response in pairs)
    for bad in ([[]], [[{"role": "assistant", "content": "hi"}]], [[{"role": "user", "content": 3}]], [7]):
        with pytest.raises(ValueError, match="prompt 0"):
            check_prompts(bad, "prompts.json")
