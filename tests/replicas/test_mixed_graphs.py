"""Mixed graphs (steps with prefill chunks, alone or beside decodes), on CPU through the graphs' real buffer
logic (tests/support/graphs.py): a graphed mixed step gives the eager step's logits whatever its lanes and
padding, steps past the largest token bucket or carrying a tree run eagerly, `mixed_graph_tokens=0` captures
none, and an engine whose prefills and decodes all replay graphs decodes like the eager engine."""
import pytest
import torch

from tests.support.checkpoints import make_tiny_llama
from replicas import LLM
from replicas.config import EngineConfig
from replicas.cuda_graphs import mixed_graph_limit, mixed_token_sizes
from tests.support.graphs import install_graphs
from tests.support.greedy import compare_greedy, plain_greedy_case
from tests.support.steps import mixed_step, random_verify_step

pytest.importorskip("transformers")
ENGINE = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("mixed")), num_attention_heads=4, num_key_value_heads=2)


def test_mixed_token_buckets():
    assert mixed_token_sizes(0) == []
    assert mixed_token_sizes(64) == [16, 32, 64]
    assert mixed_token_sizes(100) == [16, 32, 64, 128]                 # the first bucket that holds the budget
    sizes = mixed_token_sizes(8192)
    assert sizes[:12] == [16, 32, 64, 128, 192, 256, 384, 512, 640, 768, 896, 1024] and sizes[-1] == 8192
    assert sizes[12:16] == [1280, 1536, 1792, 2048]                      # four per doubling past 1,024
    assert all(b <= 1.25 * a for a, b in zip(sizes[11:], sizes[12:]))     # padding adds at most a quarter


def test_mixed_graph_limit_covers_every_step_only_for_a_small_step_with_elastic_off():
    cfg = EngineConfig.from_flat(max_num_batched_tokens=8192)
    gib = 1 << 30
    assert mixed_graph_limit(cfg, gib // 200, 100 * gib) == 8192          # 0.5% of the device: every step
    assert mixed_graph_limit(cfg, 2 * gib, 100 * gib) == 1024             # 2%: the activations are worth lending
    assert mixed_graph_limit(cfg, None, None) == 1024                     # not profiled
    assert mixed_graph_limit(cfg.with_(elastic="elastic"), gib // 200, 100 * gib) == 1024
    assert mixed_graph_limit(cfg.with_(mixed_graph_tokens=0), gib // 200, 100 * gib) == 0
    assert mixed_graph_limit(cfg.with_(mixed_graph_tokens=4096), 2 * gib, 100 * gib) == 4096
    assert mixed_graph_limit(cfg.with_(max_num_batched_tokens=512), None, None) == 512


def test_graphed_mixed_steps_equal_eager(folder):
    llm = LLM(model=folder, **ENGINE)
    try:
        runner = llm.engine.runner
        graphs = install_graphs(llm)
        assert sorted(graphs.mixed[()]) == [16, 32, 64]
        cases = [([13], [0]), ([9, 1, 1], [20, 5, 40]), ([1, 30, 1, 1, 1, 1, 2], [3, 17, 9, 33, 2, 60, 8]),
                 ([64], [0]), ([40, 24], [0, 50])]
        for i, (chunks, prefixes) in enumerate(cases):
            step = mixed_step((), chunks, prefixes)
            assert graphs.can_run(step)
            runner.graphs = None
            eager = runner.forward(step)
            runner.graphs = graphs
            before = dict(graphs.replays)
            graphed = runner.forward(step)
            bucket = next(t for t in (16, 32, 64) if t >= sum(chunks))
            assert graphs.replays.get(("mixed", bucket), 0) == before.get(("mixed", bucket), 0) + 1
            assert graphed.shape == eager.shape == (len(chunks), llm.engine.model_config.vocab_size)
            torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
        assert not graphs.can_run(mixed_step((), [65], [0]))                # past the largest bucket: eager
        assert not graphs.can_run(mixed_step((7,), [13], [0]))              # no aux-layer variant captured
        mixed_tree = random_verify_step((), 2, 3)
        mixed_tree.query_start_loc[1] = 2                                    # a 2-token chunk + a tree row
        assert not graphs.can_run(mixed_tree)
    finally:
        llm.shutdown()


def test_no_mixed_graphs_when_turned_off(folder):
    llm = LLM(model=folder, mixed_graph_tokens=0, **ENGINE)
    try:
        graphs = install_graphs(llm)
        assert graphs.mixed[()] == {} and not graphs.can_run(mixed_step((), [13], [0]))
        assert graphs.can_run(mixed_step((), [1, 1], [4, 9]))               # decodes still replay
    finally:
        llm.shutdown()


def test_engine_with_graphed_prefills_matches_eager(folder):
    prompts, params, want, last = plain_greedy_case(folder, (5, 90, 14, 3, 41, 7, 70), 1, 5, 3, **ENGINE)
    llm = LLM(model=folder, **ENGINE)
    try:
        graphs = install_graphs(llm)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        mixed = sum(v for k, v in graphs.replays.items() if isinstance(k, tuple))
        assert mixed > 0 and graphs.replays.get(1, 0) > 0       # chunked prefills (budget 64) and decodes replayed
        assert llm.engine.block_manager.num_used_blocks == 0
        compare_greedy(prompts, got, want, last)
    finally:
        llm.shutdown()
