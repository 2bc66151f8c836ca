"""The start-up VerifyProfile measurement, run on CPU: it times real verify steps without touching the KV cache or
leaving drafter contexts behind, and the cost-model policy built from it (the default on every device) only picks
measured budgets that beat plain decoding and stops above the largest measured batch."""
import pytest
import torch

from tests.support.checkpoints import make_tiny_llama
from replicas import LLM, SamplingParams
from speculative.cost_model import AcceptanceProfile, BudgetPolicy, KneeBudgetPolicy, VerifyProfile
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


def favoring_policy(**kw) -> BudgetPolicy:
    """A profile in which 4 draft nodes at batch 1 pay (verify as cheap as plain, tau 2)."""
    verify = VerifyProfile({1: {0: 0.010, 4: 0.010}, 2: {0: 0.012, 4: 0.014}}, {1: 0.001, 2: 0.001})
    return BudgetPolicy(verify, AcceptanceProfile({4: 1.0}), **kw)


def test_measured_rounds_that_lose_to_measured_plain_steps_turn_speculation_off():
    policy = favoring_policy(min_rounds=32, probe_every=256, probe_steps=8)
    assert policy.choices[1].budget == 4
    for _ in range(8):                       # plain is measured first where the profile says speculate
        assert policy.budget(1) == 0
        policy.observe(1, 0, 0.010, 1.0)
    for _ in range(31):
        assert policy.budget(1) == 4
        policy.observe(1, 4, 0.030, 1.5)     # 50 tokens/s against plain's 100
    assert policy.budget(1) == 4             # not yet: 31 rounds measured
    policy.observe(1, 4, 0.030, 1.5)
    assert policy.budget(1) == 0 and policy.choices[2].budget == policy.top_budget == 4   # row 2: not measured
    assert policy.describe()["by_batch"]["b1"]["reason"].startswith("turned off")
    policy.observe(1, 0, 0.010, 1.0)
    assert policy.budget(1) == 0             # it only ever turns speculation down


def test_measured_rounds_that_pay_keep_speculating_with_plain_probes():
    policy = favoring_policy(min_rounds=8, probe_every=16, probe_steps=2)
    kinds = []
    for _ in range(60):
        n = policy.budget(1)
        kinds.append(n)
        policy.observe(1, n, 0.012 if n else 0.010, 2.5 if n else 1.0)    # 208 tokens/s against 100
    assert policy.budget(1) == 4 and not policy.turned_off
    assert kinds[:2] == [0, 0] and kinds.count(0) == 2 + 2 * 3         # a plain probe after every 16 rounds
    row = policy.describe()["by_batch"]["b1"]
    assert row["measured_round_ms"] == pytest.approx(12.0) and row["measured_plain_ms"] == pytest.approx(10.0)


def test_the_engine_reports_its_decode_steps_to_the_policy(llm):
    """Every decode-only step reaches the policy with its nodes, its time and the tokens it emitted."""
    spec = llm.engine.speculator
    old, seen = spec.policy, []

    class Recording:
        top_budget = 4

        def budget(self, batch_size):
            return 4 if len(seen) % 3 else 0

        def observe(self, batch_size, nodes, seconds, tokens_per_seq):
            seen.append((batch_size, nodes, seconds, tokens_per_seq))

        def describe(self):
            return {}
    try:
        spec.policy = Recording()
        llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    finally:
        spec.policy = old
    assert seen and all(b == 1 and s > 0 for b, _, s, _ in seen)
    assert {n for _, n, _, _ in seen} == {0, 4}
    assert all(t == 1.0 for _, n, _, t in seen if n == 0) and all(1.0 <= t <= 5.0 for _, n, _, t in seen if n)
