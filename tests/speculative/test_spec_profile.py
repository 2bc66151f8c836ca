"""The start-up VerifyProfile measurement, run on CPU (the engine wires it in on CUDA only): it times real
verify steps without touching the KV cache or leaving drafter contexts behind, and the cost-model policy built
from it only picks measured budgets and stops above the largest measured batch."""
import pytest
import torch

from tests.support.checkpoints import make_tiny_llama
from replicas import LLM, SamplingParams
from speculative.profile import measure_verify_profile, measured_budget_policy
from speculative.cost_model import KneeBudgetPolicy

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = make_tiny_llama(str(tmp_path_factory.mktemp("profile")), num_attention_heads=4, num_key_value_heads=2)
    llm = LLM(model=folder, speculative="dominotree", allow_random_drafter=True, spec_budget=8, block_size=16,
              max_num_seqs=4, max_num_batched_tokens=30)
    yield llm
    llm.shutdown()


def test_profile_times_verify_steps_and_leaves_no_trace(llm):
    engine = llm.engine
    runner, spec = engine.runner, engine.speculator
    assert isinstance(spec.policy, KneeBudgetPolicy)                  # CPU: no measurement at start-up
    before = [s.clone() for s in runner.kv_storages]
    profile = measure_verify_profile(runner, spec, [1, 2, 4], [4, 8], context_len=20, warmup=0, iters=1)
    assert profile.step_seconds.keys() == {1, 2, 4}
    assert set(profile.step_seconds[1]) == {0, 4, 8}
    assert set(profile.step_seconds[4]) == {0, 4}          # 4 x (1 + 8) = 36 tokens: over the 30-token budget
    assert all(t > 0 for row in profile.step_seconds.values() for t in row.values())
    assert profile.draft_seconds.keys() == {1, 2, 4} and min(profile.draft_seconds.values()) > 0
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_storages))
    assert not spec.contexts.lengths and len(spec.contexts.free) == spec.contexts.pool.shape[2]


def test_measured_policy_drives_the_engine(llm):
    spec = llm.engine.speculator
    old = spec.policy
    try:
        spec.policy = measured_budget_policy(llm.engine.runner, spec)
        assert all(spec.budget(b) in (0, 2, 4, 8) for b in range(1, 5))
        assert spec.budget(5) == 0                                    # above the largest measured batch
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 6
    finally:
        spec.policy = old
