"""The start-up VerifyProfile measurement, run on CPU: it times real verify steps without touching the KV cache or
leaving drafter contexts behind, and the cost-model policy built from it (the default on every device) only picks
measured budgets that beat plain decoding and stops above the largest measured batch."""
import pytest
import torch

from tests.support.checkpoints import make_tiny_llama
from replicas import LLM, SamplingParams
from speculative.cost_model import BudgetPolicy, KneeBudgetPolicy
from speculative.profile import CPU_LARGEST_BATCH, measure_verify_profile, measured_budget_policy

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = make_tiny_llama(str(tmp_path_factory.mktemp("profile")), num_attention_heads=4, num_key_value_heads=2)
    llm = LLM(model=folder, speculative="dominotree", allow_random_drafter=True, spec_budget=8, block_size=16,
              max_num_seqs=4, max_num_batched_tokens=30, spec_policy="knee")
    yield llm
    llm.shutdown()


def test_profile_times_verify_steps_and_leaves_no_trace(llm):
    engine = llm.engine
    runner, spec = engine.runner, engine.speculator
    assert isinstance(spec.policy, KneeBudgetPolicy)                  # spec_policy="knee": no profile
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


@pytest.mark.timeout(300)
def test_default_policy_is_measured_on_cpu_and_never_picks_a_losing_budget(tmp_path):
    """The default spec_policy profiles at start-up on any device; every budget it picks beats plain decoding in
    its own measurements, and it never speculates above the batches it profiled (on CPU at most 8)."""
    folder = make_tiny_llama(str(tmp_path), num_attention_heads=4, num_key_value_heads=2)
    llm = LLM(model=folder, speculative="dominotree", allow_random_drafter=True, spec_budget=4, block_size=16,
              max_num_seqs=2, max_num_batched_tokens=64)
    try:
        policy = llm.engine.speculator.policy
        assert isinstance(policy, BudgetPolicy) and CPU_LARGEST_BATCH == 8
        assert policy.verify.batch_sizes == [1, 2]
        assert all(policy.budget(b) == 0 for b in range(3, 17))
        for choice in policy.choices.values():
            assert choice.budget == 0 or choice.speedup > 1.0
        report = policy.describe()["by_batch"]
        for row in report.values():
            if row["budget"]:
                assert row["round_ms_per_token"][str(row["budget"])] < row["plain_ms"]
    finally:
        llm.shutdown()
