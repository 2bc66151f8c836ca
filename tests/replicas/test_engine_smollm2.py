"""The engine on the embedded SmolLM2-135M-Instruct GGUF (dequantized to float32), against HF transformers
on the same file, and against itself under prefix caching, chunked prefill and preemption. (SmolLM2's 9 heads
do not split over TP=2: tests/test_engine_tiny.py covers TP on tiny checkpoints.)"""
import os

import pytest
import torch

from memory.block_manager import BlockManager
from replicas import LLM, SamplingParams
from replicas.loaders import default_model_path
from replicas.sequence import Sequence
from replicas.scheduler import ScheduledBatch
from replicas.step_input import StepInput
from tests.support.greedy import compare_greedy

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three prime numbers.", "Who wrote Hamlet?", "Translate 'good morning' into Spanish.",
    "What is 12 times 7?", "Give me a tip for learning to code.", "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?", "Name a famous painting.", "What does a compiler do?", "Suggest a name for a dog.",
    "How many legs does a spider have?", "Summarize the plot of Cinderella.", "What is the boiling point of water?",
    "Write a Python function that reverses a string.", "What is the largest ocean?", "Tell me a short joke.",
    "What are clouds made of?",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module")
def llm():
    engine = LLM(max_num_seqs=32, quantization="none")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_last_logits(hf_model):
    @torch.no_grad()
    def last(ids):
        return hf_model(torch.tensor([ids])).logits[0, -1]
    return last


@pytest.fixture(scope="module")
def baseline(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_greedy_matches_hf_transformers(prompts, baseline, hf_model, hf_last_logits, llm):
    eos = list(llm.engine.eos_token_ids)
    want = []
    with torch.no_grad():
        for p in prompts:
            out = hf_model.generate(torch.tensor([p]), max_new_tokens=64, do_sample=False, eos_token_id=eos,
                                    pad_token_id=eos[0], repetition_penalty=None, temperature=None, top_p=None,
                                    top_k=None)
            want.append(out[0, len(p):].tolist())
    flips = compare_greedy(prompts, baseline, want, hf_last_logits)
    print(f"near-tie flips vs HF: {[(f.prompt_index, f.position, f'{f.gap:.1e}') for f in flips]}")
    assert sum(len(t) for t in baseline) >= 20 * 8
    assert len(flips) <= 2


@torch.no_grad()
def test_prompt_logits_match_hf(llm, prompts, hf_model):
    engine = llm.engine
    for ids in prompts[:4]:
        seq = Sequence("logits", 0, ids, GREEDY, 0, 0.0)
        engine.block_manager.allocate(seq, len(ids))
        step = StepInput.from_batch(ScheduledBatch([seq], [len(ids)]), engine.config.cache.block_size)
        step.sample_indices = torch.arange(len(ids)).numpy()
        ours = engine.runner.execute(step)
        engine.block_manager.free(seq)
        ref = hf_model(torch.tensor([ids])).logits[0]
        rel = ((ours - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-4, rel


def test_prefix_caching_does_not_change_greedy(llm, prompts, baseline, hf_last_logits):
    bm = llm.engine.block_manager
    hits = bm.hits
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert bm.hits > hits                          # the chat template prefix is shared by every prompt
    compare_greedy(prompts, first, baseline, hf_last_logits)
    bm.enable_prefix_caching = False
    try:
        off = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        bm.enable_prefix_caching = True
    compare_greedy(prompts, off, baseline, hf_last_logits)


def test_chunked_prefill_with_16_token_budget(llm, prompts, baseline, hf_last_logits):
    sched = llm.engine.scheduler
    budget = sched.max_num_batched_tokens
    sched.set_budget(16)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts[:8], GREEDY)]
    finally:
        sched.set_budget(budget)
    compare_greedy(prompts[:8], got, baseline[:8], hf_last_logits)


def test_forced_preemption(llm, prompts, baseline, hf_last_logits):
    engine = llm.engine
    old = engine.block_manager
    small = BlockManager(24, 0, engine.config.cache.block_size, enable_prefix_caching=True)
    engine.block_manager = engine.scheduler.block_manager = small
    before = engine.scheduler.num_preemptions
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts[:8], GREEDY)]
    finally:
        engine.block_manager = engine.scheduler.block_manager = old
    assert engine.scheduler.num_preemptions > before
    assert small.num_used_blocks == 0
    compare_greedy(prompts[:8], got, baseline[:8], hf_last_logits)
