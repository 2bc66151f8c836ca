"""Grammar-guided decoding inside the engine, on CPU with a tiny random model: constrained and plain rows in one
batch, the grammar cache, a grammar's state across preemption and resync, bad schemas, and constrained requests
that never speculate."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from replicas import LLM, SamplingParams
from replicas.request import RequestError
from replicas.sequence import Sequence
from replicas.structured.bitmask import allowed_tokens
from replicas.structured.guided import GuidedDecoding
from replicas.structured.spec import GrammarSpec
from tests.support.checkpoints import make_tiny_llama

ENGINE = dict(device="cpu", block_size=16, max_num_seqs=8, max_num_batched_tokens=256)
# A finite language (enums, bounded integers, fixed-length arrays): a random model must end it.
SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["alpha", "beta", "gamma"]},
    "size": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["x", "yy"]}, "minItems": 12, "maxItems": 12},
    "ok": {"type": "boolean"}}, "required": ["kind", "size", "tags", "ok"]}
OTHER = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]}
PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [14, 15], [20, 21, 22, 23, 24]]


def constrained(schema=SCHEMA, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=200, grammar=GrammarSpec.json_schema(schema), **kw)


def assert_valid(text: str, schema=SCHEMA) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("structured")))


@pytest.fixture(scope="module")
def llm(tiny):
    engine = LLM(model=tiny, **ENGINE)
    yield engine
    engine.shutdown()


def test_constrained_and_plain_rows_in_one_batch(llm):
    """Plain rows give exactly what they give alone; constrained rows (greedy and sampled) follow their schema."""
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, seed=3)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], [plain, sampled])]
    params = [plain, constrained(), sampled, SamplingParams(temperature=1.0, seed=4, max_tokens=200,
                                                            grammar=GrammarSpec.json_schema(SCHEMA))]
    mixed = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]], params)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    for out in (mixed[1], mixed[3]):
        assert out.outputs[0].finish_reason == "stop"                 # the grammar ended it (EOS), not max_tokens
        assert_valid(out.outputs[0].text)


def test_n2_sequences_each_follow_the_grammar_with_their_own_matcher(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=200,
                                                  grammar=GrammarSpec.json_schema(SCHEMA)))[0]
    texts = [choice.text for choice in out.outputs]
    for text in texts:
        assert_valid(text)
    assert texts[0] != texts[1]


def test_grammar_cache_hits_misses_and_evicts(tiny):
    llm = LLM(model=tiny, grammar_cache_size=1, **ENGINE)
    try:
        cache = llm.engine.guided.cache
        llm.generate(PROMPTS[:2], [constrained(), constrained()])
        assert (cache.misses, cache.hits, cache.compiles) == (1, 1, 1)
        llm.generate(PROMPTS[0], constrained(OTHER))                  # evicts SCHEMA (capacity 1)
        llm.generate(PROMPTS[0], constrained())
        assert (cache.misses, cache.hits, cache.compiles, len(cache)) == (3, 1, 3, 1)
        stats = llm.engine.get_stats()
        assert stats.constrained_requests == {"json_schema": 4} and stats.grammar_compiles == 3
        assert len(stats.grammar_compile_latencies) == 3 and stats.grammar_mask_steps > 0
        assert stats.bookkeeping["grammar_compiling"] == 0
    finally:
        llm.shutdown()


def test_preempted_request_keeps_its_grammar_state(llm):
    """A constrained sequence preempted mid-output recomputes and continues: its matcher has accepted all of its
    tokens but the last step's (accepted by the next fill) at every step, and the output equals the one of a run
    without preemption (greedy)."""
    engine = llm.engine
    want = llm.generate(PROMPTS[1], constrained())[0].outputs[0].text
    engine.add_request("pre", PROMPTS[1], constrained(), stream=False)
    engine.add_request("other", PROMPTS[0], constrained(OTHER), stream=False)
    outs, preempted = {}, 0
    while engine.has_unfinished:
        for out in engine.step():
            outs[out.request_id] = out
        running = [s for s in engine.scheduler.running if s.grammar is not None]
        for seq in running:
            assert seq.grammar.num_tokens == seq.num_output_tokens - 1
        seq = next((s for s in running if s.request_id == "pre"), None)
        if seq is not None and seq.num_output_tokens in (4, 15):
            engine.scheduler.preempt(seq)
            preempted += 1
    assert preempted == 2 and not engine.take_failed()
    assert outs["pre"].outputs[0].text == want
    assert_valid(want)
    assert_valid(outs["other"].outputs[0].text, OTHER)


def test_sync_rolls_a_matcher_back_and_forward_to_its_sequence(llm):
    """`sync` brings a matcher in line with its sequence's tokens whichever way they changed: the bitmask it gives
    afterwards equals the one of a fresh matcher fed the same tokens."""
    tok, engine = llm.tokenizer, llm.engine
    guided = GuidedDecoding("xgrammar", 4, tok, engine.model_config.vocab_size, engine.eos_token_ids, 2, "cpu")
    try:
        compiled = guided.compile(GrammarSpec.json_schema(SCHEMA)).result()
        text = '{"kind": "beta", "size": 42, "tags": ["x", "yy", "x"'
        ids = tok.encode(text, add_special_tokens=False)
        seq, fresh = (Sequence("s", 0, [1, 2], SamplingParams(), 0, 0.0) for _ in range(2))
        guided.attach([seq, fresh], compiled)
        seq.token_ids += ids
        guided.sync(seq)                                              # forward: accepts the tokens it had not seen
        assert seq.grammar.num_tokens == len(ids)
        del seq.token_ids[-3:]                                        # cut back to a prefix
        guided.sync(seq)
        fresh.token_ids += ids[:-3]
        guided.sync(fresh)
        masks = [allowed_tokens(guided.fill([s], []).clone(), guided.vocab_size) for s in (seq, fresh)]
        assert seq.grammar.num_tokens == len(ids) - 3 and torch.equal(masks[0], masks[1])
        assert not torch.equal(masks[0], torch.ones_like(masks[0]))
    finally:
        guided.shutdown()


def test_each_steps_rows_equal_a_fresh_fill_and_a_refused_token_is_reported(llm):
    """The step pipeline: whatever the row order, new sequences or sequences leaving, each step's row of a sequence
    equals a fresh matcher's for the same tokens (the last step's tokens accepted by this step's fill, in one
    batch); `refused` reports a sampled token its row does not allow, without touching the matchers, and the next
    fill reports that sequence as broken."""
    tok, engine = llm.tokenizer, llm.engine
    vocab = engine.model_config.vocab_size
    guided = GuidedDecoding("xgrammar", 4, tok, vocab, engine.eos_token_ids, 4, "cpu")
    reference = GuidedDecoding("xgrammar", 4, tok, vocab, engine.eos_token_ids, 1, "cpu")
    try:
        compiled = guided.compile(GrammarSpec.json_schema(SCHEMA)).result()
        ids = tok.encode('{"kind": "beta", "size": 42, "tags": ["x"', add_special_tokens=False)
        a, b, c = (Sequence(name, 0, [1, 2], SamplingParams(), 0, 0.0) for name in "abc")
        guided.attach([a, b, c], compiled)

        def expected(seq) -> torch.Tensor:
            fresh = Sequence("ref", 0, list(seq.token_ids), SamplingParams(), 0, 0.0)
            fresh.num_prompt_tokens = seq.num_prompt_tokens
            reference.attach([fresh], compiled)
            return allowed_tokens(reference.fill([fresh], []).clone(), vocab)

        def step(seqs, tokens) -> list:
            broken: list = []
            mask = guided.token_mask(seqs, list(range(len(seqs))), broken)
            assert not broken and mask.leading
            for row, seq in enumerate(seqs):
                assert seq.grammar.num_tokens == seq.num_output_tokens
                assert torch.equal(allowed_tokens(mask.bitmask[row:row + 1], vocab), expected(seq)), seq.request_id
            refused = guided.refused(seqs, tokens)
            for seq, token in zip(seqs, tokens):
                seq.token_ids.append(token)
            return refused

        for i in range(4):                                            # a steady decode
            assert step([a, b], [ids[i], ids[i]]) == []
        assert guided.mask_steps == 4
        assert step([c, b, a], [ids[0], ids[4], ids[4]]) == []        # order changed, c new
        assert step([a], [ids[5]]) == []                              # b and c left the batch
        refused = step([b, a], [ids[5], tok.encode("]]]", add_special_tokens=False)[0]])
        assert [(seq.request_id, token) for seq, token in refused] == [("a", a.token_ids[-1])]
        assert a.grammar.num_tokens == a.num_output_tokens - 1        # not accepted yet: the next fill does
        broken: list = []
        guided.fill([a, b], broken)
        assert [seq.request_id for seq, _ in broken] == ["a"]
        assert a.grammar.num_tokens == a.num_output_tokens - 1 and b.grammar.num_tokens == b.num_output_tokens
    finally:
        guided.shutdown()
        reference.shutdown()


@pytest.mark.parametrize("schema,error", [({"type": "array", "minItems": 100000}, "minItems"),
                                          ({"$ref": "#/definitions/missing"}, "definitions"),
                                          ({"type": "object", "properties": {"a": {"type": "array",
                                                                                 "uniqueItems": True}}},
                                           "uniqueItems is not supported (at #/properties/a)")])
def test_a_schema_the_backend_refuses_fails_its_request_only(llm, schema, error):
    engine = llm.engine
    engine.add_request("bad", PROMPTS[0], constrained(schema), stream=False)
    engine.add_request("good", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=3), stream=False)
    done = {}
    while engine.has_unfinished:
        done.update((o.request_id, o) for o in engine.step())
    failed = dict(engine.take_failed())
    assert list(done) == ["good"] and list(failed) == ["bad"]
    assert isinstance(failed["bad"], RequestError) and failed["bad"].param == "response_format"
    assert error in str(failed["bad"])


def test_limits_logit_bias_and_a_server_without_grammars(tiny, llm):
    engine = llm.engine
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(4000)}}
    with pytest.raises(RequestError, match="bytes") as e:
        engine.add_request("big", PROMPTS[0], constrained(big))
    assert e.value.param == "response_format"
    with pytest.raises(RequestError, match="token id") as e:
        engine.add_request("bias", PROMPTS[0], SamplingParams(logit_bias={engine.vocab_size: 1.0}))
    assert e.value.param == "logit_bias"
    biased = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    top = llm.generate(PROMPTS[0], biased)[0].outputs[0].token_ids
    banned = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                     logit_bias={top[0]: -100.0}))[0].outputs[0].token_ids
    assert top[0] not in banned
    off = LLM(model=tiny, grammar_backend="none", **ENGINE)
    try:
        with pytest.raises(RequestError, match="off") as e:
            off.engine.add_request("x", PROMPTS[0], constrained())
        assert e.value.param == "response_format" and off.engine.guided is None
    finally:
        off.shutdown()


def test_constrained_requests_never_speculate(tiny):
    """With a speculating engine, grammar and logit_bias requests decode plainly (their rows never carry a draft
    tree) and are counted; plain requests beside them still draft; outputs equal a plain engine's (greedy)."""
    spec = LLM(model=tiny, speculative="chain", allow_random_drafter=True, spec_policy="fixed", spec_budget=3,
               **ENGINE)
    try:
        proposer = spec.engine.speculator
        drafted: set[str] = set()
        propose = proposer.propose

        def recording(seqs, n):
            drafted.update(s.request_id for s in seqs)
            return propose(seqs, n)
        proposer.propose = recording
        params = [constrained(), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                logit_bias={3: -100.0}),
                  SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
        outs = spec.generate(PROMPTS[:3], params)
        stats = spec.engine.get_stats()
        assert drafted == {outs[2].request_id} and stats.spec_drafts > 0
        assert stats.spec_constrained_plain >= len(outs[0].outputs[0].token_ids) - 1
        assert stats.constrained_requests == {"json_schema": 1, "logit_bias": 1}
        assert_valid(outs[0].outputs[0].text)
    finally:
        spec.shutdown()


def test_vocabulary_type_from_the_tokenizer(tiny):
    from replicas.loaders import load_checkpoint
    from replicas.structured.xgrammar_backend import vocab_type, xgr

    backend = load_checkpoint(tiny).tokenizer.backend
    assert vocab_type(json.loads(backend.to_str())) == (xgr.VocabType.BYTE_LEVEL, False)
    sentencepiece = {"normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}]},
                     "decoder": {"type": "Sequence", "decoders": [{"type": "Replace"}, {"type": "ByteFallback"}]}}
    assert vocab_type(sentencepiece) == (xgr.VocabType.BYTE_FALLBACK, True)
    assert vocab_type({"decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}]},
                       "pre_tokenizer": {"type": "Metaspace", "prepend_scheme": "never"}}) == \
        (xgr.VocabType.BYTE_FALLBACK, False)
    assert vocab_type({"decoder": None}) == (xgr.VocabType.RAW, False)
