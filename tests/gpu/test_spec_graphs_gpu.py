"""A speculative engine on CUDA: decode graphs with the drafter's aux outputs give the eager step's logits and
hidden states, the budget comes from a profile measured at start-up, trees come from GraphTreeBuilder, and
greedy output equals plain greedy (near-tie rule) with plain steps graphed and speculative steps mixed in."""
import numpy as np
import pytest
import torch

from checkpoints import make_tiny_llama
from replicas import LLM, SamplingParams
from replicas.step_input import StepInput
from speculative.cost_model import BudgetPolicy, KneeBudgetPolicy
from support.greedy import compare_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
KW = dict(dtype="float32", max_num_seqs=32, num_kv_blocks=1024, block_size=16)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("spec-graphs")), num_attention_heads=8, num_key_value_heads=2,
                           hidden_size=256, head_dim=32, max_position_embeddings=1024)


def decode_step(aux_layers, b):
    lens = np.arange(20, 20 + b, dtype=np.int32)
    blocks = np.arange(1, 2 * b + 1, dtype=np.int32).reshape(b, 2)
    last = lens - 1
    return StepInput(input_ids=np.arange(5, 5 + b, dtype=np.int64), positions=last.astype(np.int64),
                     slot_mapping=(blocks[:, 1] * 16 + last % 16).astype(np.int64),
                     query_start_loc=np.arange(b + 1, dtype=np.int32), seq_lens=lens, block_tables=blocks,
                     sample_indices=np.arange(b, dtype=np.int64), aux_layers=aux_layers)


def test_graphed_aux_step_equals_eager(folder):
    llm = LLM(model=folder, speculative="dominotree", allow_random_drafter=True, **KW)
    try:
        runner, spec = llm.engine.runner, llm.engine.speculator
        graphs = runner.graphs
        assert graphs is not None and tuple(spec.aux_layers) in graphs.graphs and () in graphs.graphs
        assert isinstance(spec.policy, BudgetPolicy) and spec._graph_builders
        for b in (1, 3, 17, 32):
            step = decode_step(spec.aux_layers, b)
            assert graphs.can_run(step)
            graphed = runner.forward(step)
            graphed_aux = runner.last_aux_hidden
            runner.graphs = None
            eager = runner.forward(step)
            eager_aux = runner.last_aux_hidden
            runner.graphs = graphs
            torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
            assert len(graphed_aux) == len(eager_aux) == len(spec.aux_layers)
            for g, e in zip(graphed_aux, eager_aux):
                assert g.shape == e.shape == (b, 256)
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
            runner.forward(decode_step(spec.aux_layers, 2))             # the clone survives the next replay
            for g, e in zip(graphed_aux, eager_aux):
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    finally:
        llm.shutdown()


def test_speculative_engine_on_cuda_matches_plain(folder):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 120, (40,), generator=g)
    prompts = [torch.randint(3, 400, (int(k),), generator=g).tolist() for k in lengths]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 2 * i, ignore_eos=True) for i in range(len(prompts))]
    plain = LLM(model=folder, **KW)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    plain.shutdown()
    llm = LLM(model=folder, speculative="dominotree", allow_random_drafter=True, **KW)
    try:
        graphs, box = llm.engine.runner.graphs, [0]
        run = graphs.run

        def counted(step):
            box[0] += bool(step.aux_layers)
            return run(step)
        graphs.run = counted
        llm.engine.speculator.policy = KneeBudgetPolicy(16)    # 32 running: plain (graphed); below 26: trees
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.get_stats()
        assert box[0] > 0 and stats.spec_drafts > 0
        assert llm.engine.block_manager.num_used_blocks == 0
    finally:
        llm.shutdown()
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()

    @torch.no_grad()
    def last(ids):
        return hf(torch.tensor([ids], device="cuda")).logits[0, -1]
    assert len(compare_greedy(prompts, got, want, last, tie=1e-3)) <= 2
