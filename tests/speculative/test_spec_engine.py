"""Speculative decoding inside the engine, on CPU: greedy parity with plain decoding (random and perfect
drafters), the target's law at T>0, stops inside an accepted run, and KV blocks all given back."""
import json
import math
import os

import pytest
import torch

from tests.support.checkpoints import make_tiny_llama
from replicas import LLM, SamplingParams
from replicas.config import ModelConfig
from replicas.speculation_api import DraftProposal
from speculative.speculator import Speculator
from speculative.cost_model import KneeBudgetPolicy
from speculative.drafter import DominoDrafter, DrafterConfig
from speculative.draft_tree import DraftTree
from tests.support.greedy import compare_greedy

transformers = pytest.importorskip("transformers")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ENGINE = dict(block_size=16, max_num_seqs=16, max_num_batched_tokens=48, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_llama(str(tmp_path_factory.mktemp("spec")), num_attention_heads=4, num_key_value_heads=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    plain = LLM(model=folder, **ENGINE)
    yield folder, hf, plain
    plain.shutdown()


def prompts_for(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (20,), generator=g).tolist()          # a prefix-cache hit for some
    own = [torch.randint(3, vocab, (k,), generator=g).tolist() for k in (4, 11, 27, 45, 6)]
    return own + [shared + own[0], shared + own[1]]


def last_logits_fn(hf):
    @torch.no_grad()
    def last(ids):
        return hf(torch.tensor([ids])).logits[0, -1]
    return last


def spec_llm(folder, method="dominotree", **kw):
    """A speculative engine whose policy speculates without a profile (the knee), so the rounds run on CPU."""
    return LLM(model=folder, speculative=method, allow_random_drafter=True, spec_policy="knee", **{**ENGINE, **kw})


def generate_ids(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def perfect_propose(monkeypatch, reference: dict, decoy: bool = True):
    """Replace the drafter by the target's own greedy continuation (`reference`: prompt tuple -> full token ids).
    With `decoy`, node 0 is a wrong child of the root, so the accepted path sits in scratch slots 2.. and the
    KV compaction really moves it."""
    def propose(self, seqs, n):
        rows = []
        for s in seqs:
            full = reference[tuple(s.prompt_token_ids)]
            nxt = full[s.num_tokens:s.num_tokens + n - (1 if decoy else 0)]
            first = nxt[0] if nxt else 3
            toks = [(first + 1) % self.vocab_size] + nxt if decoy else nxt
            toks = (toks + [0] * n)[:n]
            parents = ([-1, -1] + list(range(1, n - 1))) if decoy else [-1] + list(range(n - 1))
            depths = ([0, 0] + list(range(1, n - 1))) if decoy else list(range(n))
            k = (1 if decoy else 0) + len(nxt)
            rows.append((toks, parents[:n], depths[:n], [i < k for i in range(n)]))
        t = [torch.tensor([r[j] for r in rows]) for j in range(4)]
        valid = t[3].bool()
        tree = DraftTree(t[0].long(), torch.where(valid, t[1], -1).long(), torch.where(valid, t[2], 0).long(),
                         torch.where(valid, 0.0, float("-inf")), valid)
        return DraftProposal(tree.verify_rows(), tree)
    monkeypatch.setattr(Speculator, "propose", propose)


@pytest.mark.parametrize("method", ["dominotree", "chain", "ddtree"])
def test_greedy_random_drafter_matches_plain(tiny, method):
    folder, hf, plain = tiny
    prompts = prompts_for(hf.config.vocab_size)
    want = generate_ids(plain, prompts, GREEDY)
    llm = spec_llm(folder, method)
    try:
        got = generate_ids(llm, prompts, GREEDY)
        again = generate_ids(llm, prompts, GREEDY)                         # now with prefix-cache hits
        stats = llm.engine.get_stats()
        assert stats.spec_drafts > 0 and stats.spec_draft_tokens >= stats.spec_drafts
        assert llm.engine.block_manager.num_used_blocks == 0
    finally:
        llm.shutdown()
    compare_greedy(prompts, got, want, last_logits_fn(hf))
    compare_greedy(prompts, again, want, last_logits_fn(hf))


@pytest.mark.parametrize("decoy", [False, True])
def test_perfect_drafter_accepts_runs_and_keeps_greedy(tiny, monkeypatch, decoy):
    folder, hf, plain = tiny
    prompts = prompts_for(hf.config.vocab_size, seed=1)
    want = generate_ids(plain, prompts, GREEDY)
    perfect_propose(monkeypatch, {tuple(p): p + w for p, w in zip(prompts, want)}, decoy)
    llm = spec_llm(folder, spec_budget=6)
    try:
        got = generate_ids(llm, prompts, GREEDY)
        s = llm.engine.get_stats()
        assert llm.engine.block_manager.num_used_blocks == 0
    finally:
        llm.shutdown()
    assert got == want
    assert s.spec_accepted_tokens / s.spec_drafts > 1
    assert sum(s.spec_accepted_by_position) == s.spec_accepted_tokens


@pytest.mark.parametrize("tp", [2, 4])
def test_gloo_ranks_verify_rank_zeros_trees(tiny, monkeypatch, tmp_path, tp):
    """TP=2 and 4: rank 0 drafts with the gathered embedding and head, the trees reach the other ranks over the TP
    group, every rank compacts the accepted K/V; greedy output equals plain TP=1 under the near-tie rule."""
    folder, hf, plain = tiny
    if tp == 4:                                   # one KV head per rank
        folder = make_tiny_llama(str(tmp_path / "tp4"), num_attention_heads=8, num_key_value_heads=4)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        plain = LLM(model=folder, **ENGINE)
    prompts = prompts_for(hf.config.vocab_size, seed=1)
    try:
        want = generate_ids(plain, prompts, GREEDY)
    finally:
        if tp == 4:
            plain.shutdown()
    perfect_propose(monkeypatch, {tuple(p): p + w for p, w in zip(prompts, want)}, decoy=True)
    llm = spec_llm(folder, spec_budget=6, tensor_parallel_size=tp)
    try:
        spec = llm.engine.speculator
        assert spec.embed_weight.shape == (hf.config.vocab_size, hf.config.hidden_size)
        torch.testing.assert_close(spec.lm_head_weight, hf.lm_head.weight)
        got = generate_ids(llm, prompts, GREEDY)
        s = llm.engine.get_stats()
        assert llm.engine.block_manager.num_used_blocks == 0
    finally:
        llm.shutdown()
    compare_greedy(prompts, got, want, last_logits_fn(hf))
    assert s.spec_accepted_tokens / s.spec_drafts > 1


def test_stops_inside_an_accepted_run_match_plain(tiny, monkeypatch):
    folder, hf, plain = tiny
    prompts = prompts_for(hf.config.vocab_size, seed=2)[:4]
    want = generate_ids(plain, prompts, GREEDY)
    perfect_propose(monkeypatch, {tuple(p): p + w for p, w in zip(prompts, want)})
    text = plain.tokenizer.decode(want[0][6:9])
    cases = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[want[1][7]]),
             SamplingParams(temperature=0.0, max_tokens=24, stop=[text.strip()[:3] or text], ignore_eos=True)]
    llm = spec_llm(folder, spec_budget=8)
    engine, spec = llm.engine, llm.engine.speculator
    pending_after_round, apply = [], engine._apply_verified

    def applied(*args):     # the round's context work was started before its tokens were emitted
        apply(*args)
        pending_after_round.append(bool(spec._pending))
    engine._apply_verified = applied
    try:
        for params in cases:
            ref = plain.generate(prompts, params)
            out = llm.generate(prompts, params)
            for a, b in zip(out, ref):
                assert (a.outputs[0].token_ids, a.outputs[0].text, a.outputs[0].finish_reason) == \
                    (b.outputs[0].token_ids, b.outputs[0].text, b.outputs[0].finish_reason)
            assert llm.engine.block_manager.num_used_blocks == 0
            assert spec.num_tracked == 0 and not spec._pending       # stopped mid-round: its context dropped too
        assert pending_after_round and not any(pending_after_round)
        assert llm.engine.get_stats().spec_accepted_tokens > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3),
                                       {}])
def test_penalties_min_tokens_and_logprobs_see_the_path(tiny, monkeypatch, penalties):
    """Node rows are processed with the output history extended by their path: a perfect drafter under
    penalties accepts long runs and reproduces plain decoding, logprobs included; without penalties, rows
    sample with their sequence's params repeated, min_tokens still masking the stops until reached."""
    folder, hf, plain = tiny
    prompts = prompts_for(hf.config.vocab_size, seed=5)[:4]
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=6, logprobs=2, **penalties)
    ref = plain.generate(prompts, params)
    perfect_propose(monkeypatch, {tuple(p): p + r.outputs[0].token_ids for p, r in zip(prompts, ref)})
    llm = spec_llm(folder, spec_budget=8)
    try:
        out = llm.generate(prompts, params)
        assert llm.engine.get_stats().spec_accepted_tokens / llm.engine.get_stats().spec_drafts > 1
    finally:
        llm.shutdown()
    for a, b in zip(out, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)


def test_sampling_is_seeded_and_follows_the_target(tiny, monkeypatch):
    """Joint law of the first 2 tokens (top_k=4, so 16 cells) against HF's probabilities. The tree proposes
    the target's 2 most likely tokens as children of the root: the second token is an accepted node about
    half the time and the bonus token otherwise."""
    folder, hf, plain = tiny
    prompt = prompts_for(hf.config.vocab_size, seed=3)[1]
    params = [SamplingParams(temperature=1.0, top_k=4, max_tokens=2, ignore_eos=True, seed=s) for s in range(1600)]
    with torch.no_grad():
        first = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
    top1 = first.topk(4).indices.tolist()
    cond = {}
    for t in top1:
        with torch.no_grad():
            cond[t] = torch.softmax(hf(torch.tensor([prompt + [t]])).logits[0, -1], -1)

    def propose(self, seqs, n):
        toks = [cond[s.token_ids[-1]].topk(2).indices.tolist() + [0] * (n - 2) for s in seqs]
        valid = torch.tensor([[i < 2 for i in range(n)]] * len(seqs))
        tree = DraftTree(torch.tensor(toks), torch.full((len(seqs), n), -1), torch.zeros(len(seqs), n).long(),
                         torch.where(valid, 0.0, float("-inf")), valid)
        return DraftProposal(tree.verify_rows(), tree)
    monkeypatch.setattr(Speculator, "propose", propose)
    llm = spec_llm(folder, spec_budget=4, max_num_seqs=256, max_num_batched_tokens=4096)
    llm.engine.speculator.policy = KneeBudgetPolicy(4, knee_tokens=1 << 30)    # speculate at batch 256 too
    try:
        got = [o.outputs[0].token_ids for o in llm.generate([prompt] * len(params), params)]
        again = [o.outputs[0].token_ids for o in llm.generate([prompt] * 50, params[:50])]
        assert llm.engine.get_stats().spec_accepted_tokens > 0
    finally:
        llm.shutdown()
    assert again == got[:50]
    assert generate_ids(plain, [prompt] * 50, params[:50]) == got[:50]     # same seed, same sample as plain
    counts = {}
    for a, b in got:
        counts[(a, b)] = counts.get((a, b), 0) + 1
    z1 = sum(float(first[t]) for t in top1)
    stat = 0.0
    for a in top1:
        top2 = cond[a].topk(4).indices.tolist()
        z2 = sum(float(cond[a][t]) for t in top2)
        for b in top2:
            expected = len(params) * float(first[a]) / z1 * float(cond[a][b]) / z2
            stat += (counts.pop((a, b), 0) - expected) ** 2 / expected
    assert not counts, counts                                           # nothing outside the top-4 x top-4
    k, z = 15, 3.09                                                       # Wilson-Hilferty 0.999 quantile
    assert stat < k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3, stat


def test_reconfigure_turns_speculation_off_and_on(tiny):
    folder, hf, plain = tiny
    prompts = prompts_for(hf.config.vocab_size, seed=4)[:3]
    llm = spec_llm(folder)
    try:
        assert llm.engine.reconfigure(speculation=False)["speculation"] is False
        generate_ids(llm, prompts, GREEDY)
        assert llm.engine.get_stats().spec_drafts == 0
        assert llm.engine.reconfigure(speculation=True)["speculation"] is True
        generate_ids(llm, prompts, GREEDY)
        assert llm.engine.get_stats().spec_drafts > 0
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="speculative decoding needs"):
        plain.engine.reconfigure(speculation=True)
    with pytest.raises(ValueError, match="drafter"):
        LLM(model=folder, speculative="dominotree", **ENGINE)


def test_saved_drafter_under_preemption_matches_plain(tiny, tmp_path):
    """A drafter loaded from its folder; a KV cache so small that sequences are preempted mid-speculation (their
    drafter context is cut back and rebuilt on recompute) and tree scratch blocks are given back."""
    folder, hf, plain = tiny
    with open(os.path.join(folder, "config.json")) as f:
        DominoDrafter(DrafterConfig.for_target(ModelConfig.from_hf(json.load(f)))).save(str(tmp_path / "d"))
    prompts = prompts_for(hf.config.vocab_size, seed=6)
    want = generate_ids(plain, prompts, GREEDY)
    llm = LLM(model=folder, speculative="dominotree", drafter=str(tmp_path / "d"), spec_policy="knee",
              **{**ENGINE, "num_kv_blocks": 14})
    try:
        got = generate_ids(llm, prompts, GREEDY)
        stats = llm.engine.get_stats()
        assert stats.preemptions > 0 and stats.spec_drafts > 0
        assert llm.engine.block_manager.num_used_blocks == 0
    finally:
        llm.shutdown()
    compare_greedy(prompts, got, want, last_logits_fn(hf))
