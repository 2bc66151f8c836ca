"""Decode and verify graphs, on CPU: the graphs' buffer logic (static inputs, padded buckets and lanes, per
aux-layer variants, tree masks, views handed out) with a replay that reruns the model eagerly on the static
buffers, as a CUDA graph would. A graphed step returns the eager step's logits and aux hidden states, and a
speculative engine whose decode and verify steps replay these graphs still decodes exactly like plain greedy
decoding; with a policy that never speculates it replays the plain graphs only and records no context."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.support.checkpoints import make_tiny_llama
from replicas import LLM
from speculative.cost_model import FixedBudgetPolicy, KneeBudgetPolicy
from tests.support.graphs import install_graphs
from tests.support.greedy import compare_greedy, plain_greedy_case
from tests.support.steps import decode_step, random_verify_step

pytest.importorskip("transformers")
ENGINE = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("graphs")), num_attention_heads=4, num_key_value_heads=2)


def test_graphed_aux_step_equals_eager(folder):
    llm = LLM(model=folder, speculative="dominotree", allow_random_drafter=True, spec_policy="knee",
              **ENGINE)
    try:
        runner, aux_layers = llm.engine.runner, llm.engine.speculator.aux_layers
        for b in (1, 3, 8):
            step = decode_step(aux_layers, b, first_len=4)
            eager = runner.forward(step)
            eager_aux = [a.clone() for a in runner.last_aux_hidden]
            graphs = install_graphs(llm)
            assert graphs.can_run(step) and not graphs.can_run(decode_step((0,), b, first_len=4))   # no variant for (0,)
            graphed = runner.forward(step)
            assert graphs.replays == {1: 1}
            torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
            assert len(runner.last_aux_hidden) == len(aux_layers) == len(eager_aux)
            for g, e in zip(runner.last_aux_hidden, eager_aux):
                assert g.shape == e.shape == (b, llm.engine.model_config.hidden_size)
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
            kept = [a.clone() for a in runner.last_aux_hidden]
            runner.forward(decode_step(aux_layers, b, first_len=4))                 # a later replay leaves earlier outputs
            for g, e in zip(kept, eager_aux):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
            runner.graphs = None
    finally:
        llm.shutdown()


def test_graphed_verify_step_equals_eager(folder):
    llm = LLM(model=folder, speculative="dominotree", allow_random_drafter=True, spec_policy="knee",
              **ENGINE)
    try:
        runner, aux_layers = llm.engine.runner, llm.engine.speculator.aux_layers
        graphs = install_graphs(llm)
        graphs.capture_verify(aux_layers, {(4, 3), (8, 5)})
        assert graphs.verify_shapes(aux_layers) == {(4, 3), (8, 5)}
        for b, n in ((3, 3), (4, 3), (7, 5)):
            step = random_verify_step(aux_layers, b, n, seed=b)
            assert graphs.can_run(step)
            runner.graphs = None
            eager = runner.forward(step)
            eager_aux = [a.clone() for a in runner.last_aux_hidden]
            runner.graphs = graphs
            graphed = runner.forward(step)
            torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
            for g, e in zip(runner.last_aux_hidden, eager_aux):
                assert g.shape == e.shape == (b * (1 + n), llm.engine.model_config.hidden_size)
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
        assert graphs.replays == {4: 2, 6: 1}
        assert not graphs.can_run(random_verify_step(aux_layers, 3, 4))                 # no graph for 4 nodes
        assert not graphs.can_run(replace(random_verify_step(aux_layers, 3, 3), aux_layers=()))   # nor without aux
        mixed = random_verify_step(aux_layers, 2, 3)
        mixed.query_start_loc = np.asarray([0, 2, 8], dtype=np.int32)          # a 2-token chunk + a tree row
        assert not graphs.can_run(mixed)
        graphs.drop_verify(aux_layers, {(8, 5)})
        assert graphs.verify_shapes(aux_layers) == {(8, 5)} and not graphs.can_run(random_verify_step(aux_layers, 3, 3))
    finally:
        llm.shutdown()


def test_speculative_engine_with_graphed_steps_matches_plain(folder):
    prompts, params, want, last = plain_greedy_case(folder, (5, 9, 14, 3, 21, 7, 11), 0, 6, 4, **ENGINE)
    llm = LLM(model=folder, speculative="dominotree", allow_random_drafter=True, spec_policy="knee",
              **ENGINE)
    try:
        graphs, spec = install_graphs(llm), llm.engine.speculator
        spec.use_policy(KneeBudgetPolicy(8, knee_tokens=30), llm.engine.runner)    # batch >= 7: plain, graphed
        assert graphs.verify_shapes(spec.aux_layers) == {(1, 8), (2, 8), (4, 8), (4, 6), (8, 5), (8, 4)}
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert graphs.replays[1] > 0 and sum(v for q, v in graphs.replays.items() if isinstance(q, int) and q > 1) > 0
        assert sum(v for q, v in graphs.replays.items() if isinstance(q, tuple)) > 0     # prefills graphed
        assert llm.engine.get_stats().spec_drafts > 0
        assert llm.engine.block_manager.num_used_blocks == 0
        compare_greedy(prompts, got, want, last)

        spec.use_policy(FixedBudgetPolicy(0), llm.engine.runner)     # never speculates: a plain engine
        assert not spec.enabled and not graphs.verify_shapes(spec.aux_layers)
        asked, run = [], graphs.run
        graphs.run = lambda step: (asked.append(step.aux_layers), run(step))[1]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert asked and set(asked) == {()} and llm.engine.runner.last_aux_hidden == []
        assert not spec.contexts.lengths and not spec._pending
        compare_greedy(prompts, again, want, last)
    finally:
        llm.shutdown()
