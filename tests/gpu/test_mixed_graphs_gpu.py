"""Mixed CUDA graphs on the GPU: steps with prefill chunks (alone or beside decodes) replay a graph of their
token bucket and give the eager step's logits; an engine whose prefills replay them decodes like the torch
reference backend run eagerly (near-tie rule), and a lone prompt's prefill replays a graph."""
import pytest
import torch

from tests.support.checkpoints import make_tiny_llama
from replicas import LLM, SamplingParams
from tests.support.greedy import compare_greedy
from tests.support.steps import mixed_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
KW = dict(dtype="float32", max_num_seqs=64, num_kv_blocks=2048, block_size=16, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("mixed-gpu")), num_attention_heads=12, num_key_value_heads=4,
                           hidden_size=384, head_dim=32, max_position_embeddings=2048)


def test_graphed_mixed_steps_equal_eager_on_cuda(folder):
    llm = LLM(model=folder, **KW)
    try:
        runner = llm.engine.runner
        graphs = runner.graphs
        assert graphs is not None and sorted(graphs.mixed[()]) == [16, 32, 64, 128, 192, 256, 384, 512]
        cases = [([128], [0]), ([7], [300]), ([50] + [1] * 40, [0] + list(range(3, 123, 3))),
                 ([1, 200, 1, 1, 90], [64, 17, 900, 5, 33]), ([512], [0]), ([130, 1, 130, 1], [0, 70, 260, 1])]
        for chunks, prefixes in cases:
            step = mixed_step((), chunks, prefixes)
            assert graphs.can_run(step), chunks
            runner.graphs = None
            eager = runner.forward(step)
            runner.graphs = graphs
            graphed = runner.forward(step)
            torch.testing.assert_close(graphed, eager, rtol=1e-3, atol=1e-3)
    finally:
        llm.shutdown()


def test_engine_with_graphed_prefills_matches_torch_backend(folder):
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, 300, (40,), generator=g)
    prompts = [torch.randint(3, 400, (int(k),), generator=g).tolist() for k in lengths]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = LLM(model=folder, attention_backend="torch", enforce_eager=True, **KW)
    try:
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, greedy)]
    finally:
        ref.shutdown()
    llm = LLM(model=folder, **KW)
    try:
        graphs, replays = llm.engine.runner.graphs, []
        run = graphs.run
        graphs.run = lambda step: (replays.append(graphs._shape(step)), run(step))[1]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        assert any(s[0] == 0 for s in replays) and any(s[0] > 0 for s in replays)    # mixed and decode graphs
        replays.clear()
        lone = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=2))
        assert replays and replays[0][0] == 0 and len(lone[0].outputs[0].token_ids) == 2   # the prefill replayed
    finally:
        llm.shutdown()

    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()

    @torch.no_grad()
    def last(ids):
        return hf(torch.tensor([ids], device="cuda")).logits[0, -1]

    assert len(compare_greedy(prompts, got, want, last, tie=1e-3)) <= 2
