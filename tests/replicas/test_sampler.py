"""The batched sampler: greedy, seeded reproducibility, distributions, penalties, min_tokens, logprobs, logit_bias
and grammar bitmasks."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from replicas.sampler import (_SALTS, Sampler, apply_penalties, counter_uniforms, first_max_index,
                              gumbel_noise, mix32, row_keys, vocab_codes)
from replicas.sampling_batch import SamplingBatch
from replicas.sampling_params import SamplingParams
from replicas.structured.bitmask import TokenMask, allowed_tokens, apply_token_bitmask_, pack_allowed

EOS = 2
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton kernels: a GPU's, else the interpreter


def on(*tensors):
    """The tensors where the Triton kernels under test run."""
    return [t.to(KERNEL_DEVICE) for t in tensors]


M32 = 0xFFFFFFFF


def build(params, seeds=None, positions=None, outputs=None, prompts=None, vocab=8, eos=(EOS,), device="cpu",
          token_mask=None):
    n = len(params)
    return SamplingBatch.build(
        params, seeds if seeds is not None else [1000 + i for i in range(n)],
        positions if positions is not None else [5] * n,
        outputs if outputs is not None else [[] for _ in range(n)],
        prompts if prompts is not None else [[] for _ in range(n)],
        eos, vocab, device, token_mask=token_mask)


# ---------------------------------------------------------------- the counter-based hash

def py_mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def py_uniform(seed: int, position: int, token: int) -> float:
    s = seed & ((1 << 64) - 1)
    seed_key = py_mix32(py_mix32((s >> 32) ^ 0x5BD1E995) ^ (s & M32))
    key = py_mix32(seed_key ^ py_mix32(position ^ 0x27D4EB2F))
    code = py_mix32(token ^ 0x165667B1)
    return ((py_mix32(code ^ key) >> 9) * 2 + 1) / 2.0 ** 24


def test_mix32_is_exact_32_bit_arithmetic():
    rng = np.random.default_rng(0)
    xs = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, M32] + rng.integers(0, 1 << 32, 2000).tolist()
    got = mix32(torch.tensor(xs, dtype=torch.long)).tolist()
    assert got == [py_mix32(x) for x in xs]
    assert all(0 <= g <= M32 for g in got)


def test_uniforms_match_reference_for_any_seed():
    seeds = [0, 1, -1, 2 ** 63 - 1, -(2 ** 63), 2 ** 70 + 12345, 987654321]
    positions = [0, 1, 7, 4095, 2 ** 31, 123456, 3]
    batch = build([SamplingParams(temperature=1.0)] * len(seeds), seeds, positions, vocab=50)
    u = counter_uniforms(row_keys(batch.seed_lo, batch.seed_hi, batch.positions), vocab_codes(50, "cpu"))
    want = torch.tensor([[py_uniform(s, p, t) for t in range(50)] for s, p in zip(seeds, positions)])
    assert torch.equal(u, want.float())
    assert (u > 0).all() and (u < 1).all()


# ---------------------------------------------------------------- greedy and reproducibility

def test_first_max_index_is_argmax_on_ties_infinities_and_nan():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 49152, generator=g)
    x[0, [7, 30000]] = 9.0                                   # a tie: the first
    x[1] = 0.0                                               # all equal: 0
    x[2] = float("-inf")                                     # nothing allowed (a fully masked row): 0
    x[3, 40000:] = float("inf")
    x[4, [11, 20]] = float("nan")                            # NaN wins, the first one
    x[5, -1] = 50.0
    assert torch.equal(first_max_index(x), x.argmax(-1))
    assert first_max_index(x).tolist() == [7, 0, 0, 40000, 11, 49151]


def test_greedy_is_argmax_and_skips_everything_random():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    batch = build([SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 16, vocab=50)
    assert batch.all_greedy and batch.random_rows.numel() == 0
    out = Sampler()(logits, batch)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None


@pytest.mark.parametrize("extra, argmax_only", [
    ({}, True), (dict(top_k=3, top_p=0.5, seed=7), True), (dict(temperature=0.5), False),
    (dict(repetition_penalty=1.1), False), (dict(presence_penalty=0.5), False), (dict(frequency_penalty=0.5), False),
    (dict(logit_bias={3: 5.0}), False), (dict(min_tokens=2), False), (dict(logprobs=0), False)])
def test_argmax_only_means_the_sampler_takes_the_argmax(extra, argmax_only):
    """What the tree verifier's shortcut relies on: argmax_only rows come out of the sampler as the plain argmax,
    and every logits processor or logprobs request turns it off."""
    params = SamplingParams(**{"temperature": 0.0, **extra})
    assert params.argmax_only is argmax_only
    if argmax_only:
        logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
        out = Sampler()(logits, build([params] * 6, outputs=[[1, 2]] * 6, prompts=[[3]] * 6, vocab=50))
        assert torch.equal(out.token_ids, logits.argmax(-1)) and out.logprobs is None


REQUESTS = [  # (params, seed, position)
    (SamplingParams(temperature=1.0), 11, 0),
    (SamplingParams(temperature=0.8, top_k=40), 12, 3),
    (SamplingParams(temperature=1.2, top_p=0.9), 13, 17),
    (SamplingParams(temperature=0.9, min_p=0.05), 14, 2),
    (SamplingParams(temperature=1.0, top_k=100, top_p=0.95, min_p=0.01), 15, 9),
    (SamplingParams(temperature=0.0), 16, 4),
    (SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5), 17, 6),
]


def run_requests(order, logits, extra=0):
    """Sample REQUESTS[i] for i in `order`, with `extra` unrelated rows appended; tokens by request."""
    V = logits.shape[1]
    params = [REQUESTS[i][0] for i in order] + [SamplingParams(temperature=1.5, top_k=7)] * extra
    seeds = [REQUESTS[i][1] for i in order] + list(range(500, 500 + extra))
    positions = [REQUESTS[i][2] for i in order] + [1] * extra
    outputs = [[1, 2, 3, 3] for _ in order] + [[]] * extra
    prompts = [[4, 5, 6] for _ in order] + [[]] * extra
    rows = torch.cat([logits[list(order)], torch.randn(extra, V)])
    batch = build(params, seeds, positions, outputs, prompts, vocab=V)
    tokens = Sampler()(rows, batch).token_ids.tolist()
    return {req: tokens[row] for row, req in enumerate(order)}


def test_seeded_rows_do_not_depend_on_run_batch_or_row_order():
    V = 1000
    logits = torch.randn(len(REQUESTS), V, generator=torch.Generator().manual_seed(1)) * 0.5
    everything = list(range(len(REQUESTS)))
    reference = run_requests(everything, logits)
    assert run_requests(everything, logits) == reference                     # another run
    assert run_requests(everything[::-1], logits, extra=9) == reference      # other order and neighbours
    for i in everything:                                                     # alone (other fast paths)
        assert run_requests([i], logits) == {i: reference[i]}
    assert run_requests([3, 0, 5], logits, extra=3) == {i: reference[i] for i in (3, 0, 5)}


def test_different_seeds_and_positions_give_different_samples():
    V, n = 1000, 32
    logits = torch.zeros(2 * n, V)
    params = [SamplingParams(temperature=1.0)] * (2 * n)
    seeds = [1] * n + [2] * n
    positions = list(range(n)) * 2
    tokens = Sampler()(logits, build(params, seeds, positions, vocab=V)).token_ids.tolist()
    first, second = tokens[:n], tokens[n:]
    assert sum(a != b for a, b in zip(first, second)) > n - 3
    assert len(set(first)) > n - 3 and len(set(second)) > n - 3


# ---------------------------------------------------------------- distributions

def analytic(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """The sampling distribution written directly in probability space, float64."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    if 0 < top_k < len(p):
        p[p < np.sort(p)[::-1][top_k - 1]] = 0.0
        p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        p[order[before >= top_p]] = 0.0
        p /= p.sum()
    if min_p > 0.0:
        p[p < min_p * p.max()] = 0.0
        p /= p.sum()
    return p


def chi_square(counts, probs):
    """(statistic, critical value at significance 1e-4); asserts no sample lands outside the support."""
    counts, probs = np.asarray(counts, dtype=np.float64), np.asarray(probs)
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts} vs {probs}"
    expected = probs[support] * counts.sum()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    try:
        from scipy.stats import chi2
        return stat, float(chi2.isf(1e-4, df))
    except ImportError:  # Wilson-Hilferty; z = 3.7190 is the standard normal's upper 1e-4 point
        a = 2.0 / (9.0 * df)
        return stat, df * (1.0 - a + 3.7190 * math.sqrt(a)) ** 3


LOGITS = [2.0, 1.6, 1.2, 0.9, 0.5, 0.0, -0.5, -1.2]
CONFIGS = [
    dict(temperature=0.7),
    dict(temperature=1.6),
    dict(top_k=3),
    dict(top_p=0.6),
    dict(min_p=0.2),
    dict(temperature=1.3, top_k=6, top_p=0.8, min_p=0.2),
    dict(temperature=0.9, top_k=5, top_p=0.7),
    dict(temperature=0.8, top_k=7, top_p=0.8, min_p=0.3),     # every cut removes tokens
]
N = 20_000


def sample(param_rows, seeds, positions):
    logits = torch.tensor(LOGITS).repeat(len(param_rows), 1)
    return Sampler()(logits, build(param_rows, seeds, positions, vocab=len(LOGITS))).token_ids


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_distribution_matches_analytic(cfg):
    # Half the rows: distinct seeds; half: one seed at distinct positions.
    seeds = list(range(N // 2)) + [424242] * (N // 2)
    positions = [7] * (N // 2) + list(range(N // 2))
    tokens = sample([SamplingParams(**cfg)] * N, seeds, positions)
    counts = np.bincount(tokens.numpy(), minlength=len(LOGITS))
    stat, critical = chi_square(counts, analytic(LOGITS, **cfg))
    assert stat < critical, (cfg, counts, stat, critical)


def test_mixed_batch_rows_follow_their_own_params():
    rows = len(CONFIGS) * N // 4
    params = [SamplingParams(**CONFIGS[i % len(CONFIGS)]) for i in range(rows)]
    tokens = sample(params, [90_000 + i for i in range(rows)], [3] * rows).numpy()
    for c, cfg in enumerate(CONFIGS):
        counts = np.bincount(tokens[c::len(CONFIGS)], minlength=len(LOGITS))
        stat, critical = chi_square(counts, analytic(LOGITS, **cfg))
        assert stat < critical, (cfg, counts, stat, critical)


def test_chi_square_rejects_the_wrong_order_of_cuts():
    # The test above has teeth: min-p before top-p gives another distribution, and it is rejected.
    cfg = dict(temperature=0.8, top_k=7, top_p=0.8, min_p=0.3)
    tokens = sample([SamplingParams(**cfg)] * N, list(range(N)), [0] * N)
    counts = np.bincount(tokens.numpy(), minlength=len(LOGITS))
    wrong = analytic(LOGITS, temperature=0.8, top_k=7, min_p=0.3)
    wrong = analytic(np.log(np.maximum(wrong, 1e-300)), top_p=0.8)
    assert not np.allclose(wrong, analytic(LOGITS, **cfg))
    with pytest.raises(AssertionError):
        stat, critical = chi_square(counts, wrong)
        assert stat < critical


@pytest.mark.parametrize("vary", ["position", "seed"])
def test_neighbouring_counters_are_independent(vary):
    # Joint counts of (sample at counter c, sample at counter c + 1) over a uniform vocab of 4.
    V, pairs = 4, 8000
    base = np.arange(pairs) * 2
    if vary == "position":
        seeds, positions = [77] * (2 * pairs), np.stack([base, base + 1], 1).ravel().tolist()
    else:
        seeds, positions = np.stack([base, base + 1], 1).ravel().tolist(), [5] * (2 * pairs)
    params = [SamplingParams(temperature=1.0)] * (2 * pairs)
    tokens = Sampler()(torch.zeros(2 * pairs, V), build(params, seeds, positions, vocab=V)).token_ids
    joint = tokens.view(pairs, 2)
    counts = np.bincount((joint[:, 0] * V + joint[:, 1]).numpy(), minlength=V * V)
    stat, critical = chi_square(counts, np.full(V * V, 1.0 / (V * V)))
    assert stat < critical, counts


# ---------------------------------------------------------------- penalties, min_tokens, logprobs

def test_penalties_follow_the_formulas():
    V = 30
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, V, generator=g) * 3
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, presence_penalty=1.2, frequency_penalty=0.4),
              SamplingParams(temperature=0.0, repetition_penalty=0.7, presence_penalty=-0.5, frequency_penalty=1.0),
              SamplingParams(temperature=0.0)]
    outputs = [[1, 1, 7, 20], [3, 3, 3, 9], [0, 29, 29, 4], [5, 6]]
    prompts = [[2, 7, 8], [10, 11], [4, 12, 13], [5]]
    batch = build(params, outputs=outputs, prompts=prompts, vocab=V)
    want = logits.clone().double()
    for b, p in enumerate(params):
        for t in range(V):
            count = outputs[b].count(t)
            if count or t in prompts[b]:
                x = want[b, t]
                want[b, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            want[b, t] -= p.frequency_penalty * count + (p.presence_penalty if count else 0.0)
    got = apply_penalties(logits, batch.penalties)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[3], logits[3])               # a row without penalties is untouched
    assert torch.equal(Sampler()(logits, batch).token_ids, want.argmax(-1))


def test_penalties_are_not_built_when_unused():
    batch = build([SamplingParams(temperature=1.0, top_k=3)] * 3, outputs=[[1]] * 3, prompts=[[2]] * 3)
    assert batch.penalties is None and batch.stop_mask is None and not batch.use_top_p


@pytest.mark.parametrize("temps", [(0.0, 0.0), (0.0, 0.8), (1.0, 0.7)])
def test_repeated_rows_equal_rows_built_one_by_one(temps):
    """A draft tree's verify rows: each sequence's params and seed repeated for its `width` rows on the device give
    the batch that building every row on the host gives, and the same samples."""
    width = 3
    params = [SamplingParams(temperature=t, top_k=4 if t else -1, top_p=0.9, min_p=0.05 * i)
              for i, t in enumerate(temps)]
    seeds, positions = [7, 2**40 + 3], [11, 30]
    repeated = build(params, seeds, positions).repeat_rows(width)
    rows = build([p for p in params for _ in range(width)], [s for s in seeds for _ in range(width)],
                 [q for q in positions for _ in range(width)])
    for name, value in vars(rows).items():
        got = getattr(repeated, name)
        assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, name
    logits = torch.randn(len(params) * width, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(Sampler()(logits, repeated).token_ids, Sampler()(logits, rows).token_ids)
    with pytest.raises(ValueError):
        build([SamplingParams(temperature=1.0, presence_penalty=0.5)], outputs=[[1]]).repeat_rows(width)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    V, stop = 10, 7
    logits = torch.zeros(5, V)
    logits[:, EOS] = 9.0
    logits[:, stop] = 8.0
    logits[:, 4] = 1.0
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(stop,)),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(stop,)),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(stop,), ignore_eos=True),
              SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(stop, 99)),
              SamplingParams(temperature=0.0)]
    outputs = [[1], [1, 1, 1], [1], [1], []]
    out = Sampler()(logits, build(params, outputs=outputs, vocab=V))
    assert out.token_ids.tolist() == [4, EOS, EOS, 4, EOS]

    rows = 4000   # random rows too: EOS holds nearly all the mass, yet is never drawn
    params = [SamplingParams(temperature=1.0, min_tokens=5)] * rows
    tokens = Sampler()(logits[:1].repeat(rows, 1),
                       build(params, list(range(rows)), [1] * rows, [[3]] * rows, vocab=V)).token_ids
    assert (tokens != EOS).all() and (tokens == stop).float().mean() > 0.9


def test_logprobs_are_raw_log_softmax_with_top_k_alternatives():
    V = 40
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(4)) * 2
    params = [SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.8),
              SamplingParams(temperature=0.7, top_k=5, logprobs=1),
              SamplingParams(temperature=1.0, logprobs=0),
              SamplingParams(temperature=1.0, min_p=0.1)]
    out = Sampler()(logits, build(params, outputs=[[int(logits[0].argmax())]] + [[]] * 3,
                                  prompts=[[]] * 4, vocab=V))
    raw = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(out.logprobs.double(), raw.gather(1, out.token_ids[:, None])[:, 0])
    assert out.top_ids.shape == (4, 3) and out.top_logprobs.dtype == torch.float32
    for b in range(4):
        order = sorted(range(V), key=lambda t: -raw[b, t].item())[:3]
        assert out.top_ids[b].tolist() == order
        torch.testing.assert_close(out.top_logprobs[b].double(), raw[b, order])
    assert out.token_ids[0] != logits[0].argmax()       # the penalty moved the greedy pick

    only_sampled = Sampler()(logits, build([SamplingParams(logprobs=0)] * 4, vocab=V))
    assert only_sampled.logprobs is not None and only_sampled.top_ids is None


def test_padded_vocab_columns_are_never_sampled():
    logits = torch.zeros(64, 12)
    logits[:, 8:] = 50.0                                # LM-head padding beyond the real vocab of 8
    params = [SamplingParams(temperature=1.0)] * 32 + [SamplingParams(temperature=0.0)] * 32
    tokens = Sampler()(logits, build(params, vocab=8)).token_ids
    assert (tokens < 8).all()



@pytest.mark.parametrize("extreme", [dict(temperature=1e-40), dict(top_p=5e-324), dict(repetition_penalty=1e-300)])
def test_extreme_values_in_range_sample_a_valid_token(extreme):
    """Values the API accepts whose float32 form overflows the logits or is 0 (found by tests/cluster/test_api_fuzz.py:
    the top-p cut indexed -1 and killed the engine core), alone and beside a row that turns top-p on."""
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(3)) * 10
    for params in ([SamplingParams(**{"top_p": 0.5, **extreme})],
                   [SamplingParams(**extreme), SamplingParams(temperature=1.0, top_p=0.5)]):
        tokens = Sampler()(logits[:len(params)], build(params, outputs=[[1, 2]] * len(params))).token_ids
        assert ((tokens >= 0) & (tokens < 8)).all()


def grammar_case(device="cpu"):
    """Six rows (greedy and random) over a vocabulary of 70 (not a multiple of 32); rows 1 and 4 follow a grammar."""
    V = 70
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(8)) * 3
    params = [SamplingParams(temperature=t) for t in (0.0, 0.0, 1.0, 0.7, 1.0, 0.0)]
    allowed = torch.zeros(2, V, dtype=torch.bool)
    allowed[0, [3, 40, 69]] = True
    allowed[1, 33:38] = True
    mask = TokenMask(torch.tensor([1, 4], device=device), pack_allowed(allowed).to(device))
    return logits.to(device), params, allowed, mask


def test_grammar_bitmask_masks_its_rows_in_place_and_leaves_the_others_alone():
    logits, params, allowed, mask = grammar_case()
    assert torch.equal(allowed_tokens(mask.bitmask, 70), allowed)
    masked = logits.clone()
    assert apply_token_bitmask_(masked, mask) is masked
    free = [0, 2, 3, 5]
    assert torch.equal(masked[free], logits[free])
    for row, want in zip((1, 4), allowed):
        assert torch.equal(masked[row][want], logits[row][want])
        assert torch.isneginf(masked[row][~want]).all()
    leading = TokenMask(torch.tensor([0, 1]), mask.bitmask, leading=True)    # the fully constrained batch's form
    first_two = apply_token_bitmask_(logits[:2].clone(), leading)
    assert torch.equal(first_two, apply_token_bitmask_(logits[:2].clone(), TokenMask(leading.rows, mask.bitmask)))
    assert torch.equal(first_two[1][allowed[1]], logits[1][allowed[1]])
    assert torch.isneginf(first_two[1][~allowed[1]]).all()
    for positions in ([5] * 6, [9] * 6, [123] * 6):
        plain = Sampler()(logits, build(params, positions=positions, vocab=70)).token_ids
        guided = Sampler()(logits.clone(), build(params, positions=positions, vocab=70, token_mask=mask)).token_ids
        assert torch.equal(guided[free], plain[free])
        assert all(allowed[i, guided[row]] for i, row in enumerate((1, 4)))
    assert guided[1] == max((3, 40, 69), key=lambda t: logits[1, t])     # greedy: the best allowed token


def test_logit_bias_is_added_to_its_rows_only():
    V = 12
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(9))
    top = logits.argmax(-1)
    params = [SamplingParams(temperature=0.0, logit_bias={int(top[0]): -100.0}),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias={7: 100.0, int(top[2]): -0.0}),
              SamplingParams(temperature=1.0, logit_bias={t: -100.0 for t in range(V) if t != 5})]
    batch = build(params, vocab=V)
    tokens = Sampler()(logits, batch).token_ids.tolist()
    assert tokens[0] != top[0] and tokens[0] == logits[0].topk(2).indices[1]
    assert tokens[1] == top[1] and tokens[2] == 7 and tokens[3] == 5
    assert batch.logit_bias.index[0].tolist() == [0, 2, 2] + [3] * (V - 1)
    assert build([SamplingParams(temperature=0.0)] * 2, vocab=V).logit_bias is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_grammar_bitmask_and_logit_bias_equal_cpu():
    cpu_logits, params, _, cpu_mask = grammar_case()
    gpu_logits, _, _, gpu_mask = grammar_case("cuda")
    params = [SamplingParams(temperature=p.temperature, logit_bias={3: -5.0, 60: 2.5}) for p in params]
    cpu = Sampler()(cpu_logits.clone(), build(params, vocab=70, token_mask=cpu_mask)).token_ids
    gpu = Sampler()(gpu_logits.clone(), build(params, vocab=70, device="cuda", token_mask=gpu_mask)).token_ids
    assert torch.equal(cpu, gpu.cpu())
    assert torch.equal(apply_token_bitmask_(cpu_logits, cpu_mask), apply_token_bitmask_(gpu_logits, gpu_mask).cpu())


def test_fused_gumbel_kernel_equals_the_torch_sample():
    """replicas/kernels/gumbel.py (Triton; on the GPU where there is one, else on the CPU under TRITON_INTERPRET)
    picks the token the torch path picks from the same scores, seeds and positions (the row key hashed in the
    kernel): several vocabulary blocks, a row of -inf, a row masked past a prefix, a row with NaNs (the first NaN,
    as torch.argmax), seeds of any value; and with the division by temperature done in the kernel."""
    from replicas.kernels.gumbel import BLOCK, gumbel_argmax
    g = torch.Generator().manual_seed(11)
    rows, vocab = 24, 2 * BLOCK + 77
    scores = torch.randn(rows, vocab, generator=g) * 4
    scores[3] = float("-inf")
    scores[4, 100:] = float("-inf")
    scores[5, 17], scores[5, 900] = float("nan"), float("nan")
    seed_lo, seed_hi = torch.randint(0, 2**32, (2, rows), generator=g)
    positions = torch.randint(0, 100_000, (rows,), generator=g)
    noise = gumbel_noise(row_keys(seed_lo, seed_hi, positions), vocab_codes(vocab, "cpu"))
    want = first_max_index(noise + scores)
    got = gumbel_argmax(*on(scores, seed_lo, seed_hi, positions), _SALTS).cpu()
    assert torch.equal(got, want) and got[3] == 0 and got[5] == 17 and got[4] < 100
    temperature = torch.rand(rows, generator=g) * 2 + 0.05
    want = first_max_index(noise + scores / temperature.unsqueeze(1))
    got = gumbel_argmax(*on(scores, seed_lo, seed_hi, positions), _SALTS, temperature.to(KERNEL_DEVICE)).cpu()
    assert torch.equal(got, want)


def test_fused_token_bitmask_kernel_equals_the_torch_ops():
    """replicas/kernels/token_bitmask.py (Triton; on the GPU where there is one, else on the CPU under
    TRITON_INTERPRET) masks exactly what the torch path masks: several column blocks, a vocabulary not a multiple
    of 32, words with bit 31 set (negative int32), rows given by index (the others untouched) and the leading
    form."""
    from replicas.kernels.token_bitmask import BLOCK, apply_token_bitmask_kernel_
    g = torch.Generator().manual_seed(12)
    rows, vocab = 7, 2 * BLOCK + 77
    logits = torch.randn(rows, vocab, generator=g)
    allowed = torch.rand(3, vocab, generator=g) < 0.3
    allowed[0] = False
    allowed[0, [31, 63, vocab - 1]] = True                  # bit 31 of words 0 and 1
    allowed[2] = True
    bitmask = pack_allowed(allowed)
    assert (bitmask < 0).any()
    picked = torch.tensor([1, 4, 6])
    want = apply_token_bitmask_(logits.clone(), TokenMask(picked, bitmask))
    assert torch.equal(apply_token_bitmask_kernel_(*on(logits, bitmask, picked)).cpu(), want)
    want = apply_token_bitmask_(logits.clone(), TokenMask(None, bitmask, leading=True))
    assert torch.equal(apply_token_bitmask_kernel_(*on(logits, bitmask), None).cpu(), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_sampling_equals_the_torch_ops():
    """The fused kernel (CUDA's default) against the torch ops, on a batch of every kind of random row (top-k,
    top-p, min-p, penalties) and on one of temperature alone, at a real vocabulary width."""
    V = 49152
    logits = torch.randn(len(REQUESTS) * 8, V, generator=torch.Generator().manual_seed(7)).cuda() * 3
    params, seeds, positions = zip(*(REQUESTS * 8))
    seeds = [s + 7919 * i for i, s in enumerate(seeds)]
    outputs, prompts = [[1, 2, 3]] * len(params), [[4, 5]] * len(params)

    def batch():
        return build(list(params), seeds, list(positions), outputs, prompts, vocab=V, device="cuda")
    torch_ops = Sampler(fused=False)(logits.clone(), batch()).token_ids
    fused = Sampler(fused=True)(logits.clone(), batch()).token_ids
    assert torch.equal(torch_ops, fused)
    # temperature alone (no cut): the kernel divides by it itself
    plain = build([SamplingParams(temperature=0.3 + 0.2 * (i % 7)) for i in range(len(params))], seeds,
                  list(positions), vocab=V, device="cuda")
    assert not (plain.use_top_k or plain.use_top_p or plain.use_min_p)
    assert torch.equal(Sampler(fused=False)(logits.clone(), plain).token_ids,
                       Sampler(fused=True)(logits.clone(), plain).token_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_samples_equal_cpu_samples():
    V = 32000
    logits = torch.randn(len(REQUESTS), V, generator=torch.Generator().manual_seed(5))
    params, seeds, positions = zip(*REQUESTS)
    outputs, prompts = [[1, 2, 3]] * len(REQUESTS), [[4, 5]] * len(REQUESTS)
    cpu = Sampler()(logits, build(list(params), list(seeds), list(positions), outputs, prompts, vocab=V))
    gpu = Sampler()(logits.cuda(), build(list(params), list(seeds), list(positions), outputs, prompts,
                                         vocab=V, device="cuda"))
    assert torch.equal(cpu.token_ids, gpu.token_ids.cpu())
