"""A speculative engine on CUDA: decode graphs with the drafter's aux outputs give the eager step's logits and
hidden states (and the plain graph's logits bit for bit), verify graphs give the eager verify step's, the budget
comes from a profile measured at start-up over graphed verify steps and keeps only the verify graphs it uses,
trees come from GraphTreeBuilder, greedy output equals plain greedy (near-tie rule) with decode and verify
steps graphed, and a policy that never speculates leaves a plain engine (plain graphs, no aux, no context)."""
from dataclasses import replace

import pytest
import torch

from tests.support.checkpoints import make_tiny_llama
from replicas import LLM, SamplingParams
from speculative.cost_model import BudgetPolicy, FixedBudgetPolicy, KneeBudgetPolicy
from speculative.profile import VERIFY_GRAPH_TOKENS
from tests.support.greedy import compare_greedy
from tests.support.steps import decode_step, random_verify_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
KW = dict(dtype="float32", max_num_seqs=32, num_kv_blocks=1024, block_size=16)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("spec-graphs")), num_attention_heads=8, num_key_value_heads=2,
                           hidden_size=256, head_dim=32, max_position_embeddings=1024)


def eager_and_graphed(runner, step):
    graphs = runner.graphs
    runner.graphs = None
    try:
        eager = runner.forward(step)
        eager_aux = [a.clone() for a in runner.last_aux_hidden]
    finally:
        runner.graphs = graphs
    assert graphs.can_run(step)
    graphed = runner.forward(step)
    return eager, eager_aux, graphed, runner.last_aux_hidden


def test_graphed_aux_and_verify_steps_equal_eager(folder):
    llm = LLM(model=folder, speculative="dominotree", allow_random_drafter=True, **KW)
    try:
        runner, spec = llm.engine.runner, llm.engine.speculator
        graphs = runner.graphs
        assert graphs is not None and () in graphs.graphs and tuple(spec.aux_layers) in graphs.graphs
        assert isinstance(spec.policy, BudgetPolicy)
        for b in (1, 3, 17, 32):
            eager, eager_aux, graphed, graphed_aux = eager_and_graphed(runner, decode_step(spec.aux_layers, b))
            torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
            assert len(graphed_aux) == len(eager_aux) == len(spec.aux_layers)
            for g, e in zip(graphed_aux, eager_aux):
                assert g.shape == e.shape == (b, 256)
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
            runner.forward(decode_step(spec.aux_layers, 2))             # the clone survives the next replay
            for g, e in zip(graphed_aux, eager_aux):
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        graphs.capture_verify(spec.aux_layers, {(4, 3), (16, 8), (32, 4)})
        for b, n in ((3, 3), (4, 3), (11, 8), (16, 8), (29, 4)):
            step = random_verify_step(spec.aux_layers, b, n, b, max_prefix=60, device="cuda")
            eager, eager_aux, graphed, graphed_aux = eager_and_graphed(runner, step)
            assert graphed.shape == (b * (1 + n), llm.engine.model_config.vocab_size)
            torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
            for g, e in zip(graphed_aux, eager_aux):
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        assert not graphs.can_run(random_verify_step(spec.aux_layers, 4, 5))
    finally:
        llm.shutdown()


def test_aux_decode_graph_gives_the_plain_graphs_logits_in_bf16(folder):
    """The aux variant only adds outputs: in bf16 its logits are the plain graph's, bit for bit, so a speculative
    engine's plain steps cannot flip a near-tie that the plain engine decides the other way."""
    llm = LLM(model=folder, speculative="dominotree", allow_random_drafter=True, **{**KW, "dtype": "bfloat16"})
    try:
        runner, spec = llm.engine.runner, llm.engine.speculator
        for b in (1, 5, 32):
            step = decode_step(spec.aux_layers, b)
            with_aux = runner.forward(step).clone()
            plain = runner.forward(replace(step, aux_layers=()))
            assert torch.equal(with_aux, plain), (b, (with_aux - plain).abs().max().item())
    finally:
        llm.shutdown()


def test_startup_profile_keeps_the_verify_graphs_its_policy_uses(folder):
    llm = LLM(model=folder, speculative="chain", allow_random_drafter=True, **KW)
    try:
        runner, spec = llm.engine.runner, llm.engine.speculator
        policy, graphs = spec.policy, runner.graphs
        assert isinstance(policy, BudgetPolicy)
        assert {(1, 16), (1, 8), (1, 4)} <= set(policy.verify.graphed)      # timed through graphs
        limit = min(VERIFY_GRAPH_TOKENS, runner.config.scheduling.max_num_batched_tokens)
        want = {(graphs.bucket(b), spec.budget(b)) for b in range(1, 33) if spec.budget(b)}
        want = {(s, n) for s, n in want if s * (1 + n) <= limit}
        assert graphs.verify_shapes(spec.aux_layers) == want
        report = policy.describe()
        assert set(report["by_batch"]) == {f"b{b}" for b in policy.verify.batch_sizes}
        assert all(row["reason"] for row in report["by_batch"].values())
        spec.use_policy(FixedBudgetPolicy(8), runner)
        assert graphs.verify_shapes(spec.aux_layers) == {(s, 8) for s in graphs.sizes if s * 9 <= limit}
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
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()

    @torch.no_grad()
    def last(ids):
        return hf(torch.tensor([ids], device="cuda")).logits[0, -1]

    llm = LLM(model=folder, speculative="dominotree", allow_random_drafter=True, **KW)
    try:
        engine, graphs, kinds = llm.engine, llm.engine.runner.graphs, {}
        run = graphs.run

        def counted(step):
            key = "verify" if step.trees is not None else ("aux" if step.aux_layers else "plain")
            kinds[key] = kinds.get(key, 0) + 1
            return run(step)
        graphs.run = counted
        engine.speculator.use_policy(KneeBudgetPolicy(16), engine.runner)   # 32 running: plain; below 26: trees
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert kinds.get("aux", 0) > 0 and kinds.get("verify", 0) > 0 and engine.get_stats().spec_drafts > 0
        assert engine.block_manager.num_used_blocks == 0
        assert len(compare_greedy(prompts, got, want, last, tie=1e-3)) <= 2

        engine.speculator.use_policy(FixedBudgetPolicy(0), engine.runner)   # never speculates: a plain engine
        kinds.clear()
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert set(kinds) == {"plain"} and not engine.speculator.contexts.lengths
        compare_greedy(prompts, again, want, last, tie=1e-3)      # prefix-cache hits now: near-ties may flip
    finally:
        llm.shutdown()
