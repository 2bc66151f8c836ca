"""Parity with HF transformers on tiny random Llama and Qwen3 checkpoints, TP=2 and TP=4 (gloo) against TP=1,
and clear errors for bad requests."""
import pytest
import torch

from tests.support.checkpoints import make_tiny_llama, make_tiny_qwen3
from replicas import LLM, SamplingParams, SamplingParamsError
from replicas.request import RequestError
from tests.support.greedy import compare_greedy

transformers = pytest.importorskip("transformers")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def random_prompts(vocab, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    make = make_tiny_llama if request.param == "llama" else make_tiny_qwen3
    folder = make(str(tmp_path_factory.mktemp(request.param)), num_attention_heads=4, num_key_value_heads=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=folder, block_size=16, max_num_seqs=16)
    yield folder, hf, llm
    llm.shutdown()


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


def last_logits_fn(hf):
    @torch.no_grad()
    def last(ids):
        return hf(torch.tensor([ids])).logits[0, -1]
    return last


def test_tiny_greedy_and_logits_match_hf(tiny):
    folder, hf, llm = tiny
    prompts = random_prompts(hf.config.vocab_size)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    flips = compare_greedy(prompts, got, want, last_logits_fn(hf))
    assert len(flips) <= 1, flips
    # logprobs of the sampled tokens are the model's own: check them against HF's log-softmax
    out = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3))[0]
    ids = prompts[0] + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    for k, (tok, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        want_lp = ref[len(prompts[0]) + k - 1, tok].item()
        assert abs(entry[tok].logprob - want_lp) < 1e-4
        assert len(entry) >= 3


def tp_greedy(folder, prompts, tp: int) -> list[list[int]]:
    llm = LLM(model=folder, tensor_parallel_size=tp, block_size=16, max_num_seqs=16)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.shutdown()


def test_tp2_gloo_matches_tp1(tiny):
    folder, hf, llm = tiny
    prompts = random_prompts(hf.config.vocab_size, n=6, seed=1)
    one = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    compare_greedy(prompts, tp_greedy(folder, prompts, 2), one, last_logits_fn(hf))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp4_gloo_matches_tp1(arch, tmp_path):
    """Four gloo ranks, one KV head each (8 query heads over 4 KV heads), against TP=1 on the same weights."""
    make = make_tiny_llama if arch == "llama" else make_tiny_qwen3
    folder = make(str(tmp_path / arch), num_attention_heads=8, num_key_value_heads=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = random_prompts(hf.config.vocab_size, n=6, seed=2)
    compare_greedy(prompts, tp_greedy(folder, prompts, 4), tp_greedy(folder, prompts, 1), last_logits_fn(hf))


def test_bad_requests_get_clear_errors(tiny):
    folder, hf, llm = tiny
    with pytest.raises(RequestError, match="empty"):
        llm.engine.add_request("e", "", GREEDY)
    with pytest.raises(RequestError, match="empty"):
        llm.engine.add_request("e", [], GREEDY)
    too_long = [5] * (llm.engine.max_model_len + 1)
    with pytest.raises(RequestError, match="maximum context length"):
        llm.engine.add_request("l", too_long, GREEDY)
    with pytest.raises(RequestError, match="vocab"):
        llm.engine.add_request("v", [10 ** 9], GREEDY)
    for bad in (dict(temperature=-1), dict(top_p=0), dict(n=0), dict(max_tokens=0), dict(top_k=-5),
                dict(logprobs=50)):
        with pytest.raises(SamplingParamsError):
            SamplingParams(**bad)
    assert not llm.engine.has_unfinished        # nothing half-added
    assert llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids  # and it still serves
