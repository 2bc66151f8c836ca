"""Batch-aware tree budget: how many draft nodes per request pay off at a given batch size.

A speculative round at batch b with budget n costs one drafter pass plus tree build (`draft_seconds[b]`) and one
target forward over b x (1+n) tokens (`step_seconds[b][n]`), and emits 1 + E[accepted | n] tokens per request.
Plain decoding emits 1 token per `step_seconds[b][0]`. The policy picks, per measured batch size, the budget
with the most tokens per second, and 0 (no speculation) unless some budget is strictly faster. Verify cost
grows with b x n (and tree logits take b x (1+n) x V memory), so the budget shrinks as the batch grows.
Latency between measured node counts is interpolated linearly; budgets beyond the measured range are not
considered. A batch size between measured rows uses the next larger row (its costs are an upper bound).

The start-up profile times the parts of a round (verify forward, draft and tree build), not the engine's whole
round (acceptance, KV compaction, bookkeeping, synchronizations), nor the whole plain step. So the policy is also
fed the engine's measured steps (`BudgetPolicy.observe`): per batch row it keeps the recent speculative rounds
(seconds, tokens emitted per sequence) and plain steps, running a few plain steps now and then where it
speculates so that both sides are measured, and turns speculation off at a row whose measured rounds emit fewer
tokens per second than its measured plain steps. It only ever turns speculation down.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence


@dataclass(frozen=True)
class VerifyProfile:
    step_seconds: Mapping[int, Mapping[int, float]]      # batch -> {draft nodes per request: seconds}; 0 = plain
    draft_seconds: Mapping[int, float] = field(default_factory=dict)   # batch -> drafter + tree build seconds
    graphed: frozenset = frozenset()      # (batch, nodes) whose step was timed replaying a CUDA graph

    def __post_init__(self):
        for b, row in self.step_seconds.items():
            if 0 not in row:
                raise ValueError(f"batch {b}: the plain decoding step (0 nodes) must be measured")

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(self.step_seconds)

    def batch_row(self, batch: int) -> int:
        sizes = self.batch_sizes
        return sizes[min(bisect_left(sizes, batch), len(sizes) - 1)]

    def step_time(self, batch: int, nodes: int) -> Optional[float]:
        row = self.step_seconds[self.batch_row(batch)]
        xs = sorted(row)
        if nodes in row:
            return row[nodes]
        if nodes > xs[-1] or nodes < xs[0]:
            return None
        i = bisect_left(xs, nodes)
        x0, x1 = xs[i - 1], xs[i]
        return row[x0] + (row[x1] - row[x0]) * (nodes - x0) / (x1 - x0)

    def draft_time(self, batch: int) -> float:
        return self.draft_seconds.get(self.batch_row(batch), 0.0)


@dataclass(frozen=True)
class AcceptanceProfile:
    accepted: Mapping[int, float]     # budget -> mean accepted draft tokens per round

    @staticmethod
    def from_rounds(rounds: Mapping[int, Sequence[int]]) -> "AcceptanceProfile":
        """budget -> accepted-token counts of measured rounds (Acceptance.num_accepted)."""
        return AcceptanceProfile({n: sum(c) / len(c) for n, c in rounds.items() if len(c) > 0})


@dataclass(frozen=True)
class BudgetChoice:
    budget: int
    tokens_per_second: float          # per request
    speedup: float                    # over plain decoding at the same batch size


def choose_budget(batch: int, verify: VerifyProfile, acceptance: AcceptanceProfile,
                  vocab_size: Optional[int] = None, max_logits_bytes: Optional[int] = None,
                  bytes_per_logit: int = 4) -> BudgetChoice:
    plain = 1.0 / verify.step_time(batch, 0)
    best = BudgetChoice(0, plain, 1.0)
    for budget, accepted in sorted(acceptance.accepted.items()):
        step = verify.step_time(batch, budget)
        if budget <= 0 or step is None:
            continue
        if max_logits_bytes is not None and vocab_size is not None \
                and batch * (1 + budget) * vocab_size * bytes_per_logit > max_logits_bytes:
            continue
        rate = (1.0 + accepted) / (step + verify.draft_time(batch))
        if rate > best.tokens_per_second:
            best = BudgetChoice(budget, rate, rate / plain)
    return best


class MeasuredSteps:
    """One batch row's recent engine steps: speculative rounds at the chosen budget and plain steps."""

    def __init__(self, window: int, probe_steps: int):
        self.rounds: deque[tuple[float, float]] = deque(maxlen=window)     # (seconds, tokens per sequence)
        self.plain: deque[float] = deque(maxlen=window)
        self.since_probe = 0            # rounds since the last plain steps
        self.probe_left = probe_steps   # plain steps still to run before the next round (first: measure plain)

    @staticmethod
    def rate(samples) -> float:
        seconds = sum(s for s, _ in samples)
        return sum(t for _, t in samples) / seconds if seconds > 0 else 0.0


class BudgetPolicy:
    """Budget per batch size, decided from the profiles at start-up and turned down where the engine's measured
    rounds lose to its measured plain steps: `policy.budget(batch_size)` on the hot path."""

    def __init__(self, verify: VerifyProfile, acceptance: AcceptanceProfile, *, window: int = 64,
                 min_rounds: int = 32, probe_every: int = 256, probe_steps: int = 8, **limits):
        self.verify, self.acceptance, self.limits = verify, acceptance, limits
        self.choices = {b: choose_budget(b, verify, acceptance, **limits) for b in verify.batch_sizes}
        self.top_budget = max((c.budget for c in self.choices.values()), default=0)   # 0: never speculates
        self.min_rounds, self.probe_every, self.probe_steps = min_rounds, probe_every, probe_steps
        self.measured = {b: MeasuredSteps(window, probe_steps) for b in verify.batch_sizes}
        self.turned_off: dict[int, str] = {}       # batch row -> why its measured rounds lost

    def budget(self, batch_size: int) -> int:
        """Above the largest measured batch: 0 (verify cost only grows with the batch; nothing says it pays)."""
        if batch_size > self.verify.batch_sizes[-1]:
            return 0
        row = self.verify.batch_row(batch_size)
        n = self.choices[row].budget
        return 0 if n and self.measured[row].probe_left > 0 else n     # plain steps measure plain here too

    def observe(self, batch_size: int, nodes: int, seconds: float, tokens_per_seq: float) -> None:
        """One decode step the engine ran at this batch size with `nodes` draft nodes per sequence (0: plain),
        timed end to end, and the tokens it emitted per sequence."""
        if batch_size > self.verify.batch_sizes[-1] or seconds <= 0:
            return
        row = self.verify.batch_row(batch_size)
        m, n = self.measured[row], self.choices[row].budget
        if nodes == 0:
            m.plain.append(seconds)
            m.probe_left = max(0, m.probe_left - 1)
            return
        if nodes != n:
            return
        m.rounds.append((seconds, tokens_per_seq))
        m.since_probe += 1
        if m.since_probe >= self.probe_every:
            m.since_probe, m.probe_left = 0, self.probe_steps
        if len(m.rounds) >= self.min_rounds and len(m.plain) >= max(1, self.probe_steps):
            plain = len(m.plain) / sum(m.plain)
            spec = MeasuredSteps.rate(m.rounds)
            if spec < plain:
                self.choices[row] = BudgetChoice(0, plain, 1.0)
                self.turned_off[row] = (f"measured rounds of {n} nodes emit {spec:.1f} tokens/s per request, "
                                        f"plain steps {plain:.1f}")
                self.top_budget = max((c.budget for c in self.choices.values()), default=0)

    def describe(self) -> dict:
        """What the policy saw and chose, per measured batch size, in ms and tokens per round (for reports)."""
        rows = {}
        for b in self.verify.batch_sizes:
            plain, draft = self.verify.step_time(b, 0), self.verify.draft_time(b)
            ms_per_token = {}
            for n, accepted in sorted(self.acceptance.accepted.items()):
                step = self.verify.step_time(b, n)
                if n > 0 and step is not None:
                    ms_per_token[n] = 1e3 * (step + draft) / (1.0 + accepted)
            choice = self.choices[b]
            best = min(ms_per_token, key=ms_per_token.get, default=None)
            if choice.budget:
                reason = f"{choice.budget} nodes: {ms_per_token[choice.budget]:.3f} ms/token < plain {1e3 * plain:.3f}"
            elif best is None:
                reason = "no budget measured at this batch size (over the token budget)"
            elif ms_per_token[best] < 1e3 * plain:
                reason = f"{best} nodes would pay but their logits exceed the memory cap"
            else:
                reason = (f"plain {1e3 * plain:.3f} ms/token beats the best round ({best} nodes: verify "
                          f"{1e3 * self.verify.step_time(b, best):.3f} + draft {1e3 * draft:.3f} ms for "
                          f"{1 + self.acceptance.accepted[best]:.2f} tokens = {ms_per_token[best]:.3f} ms/token)")
            if b in self.turned_off:
                reason = "turned off: " + self.turned_off[b]
            m = self.measured[b]
            rows[f"b{b}"] = dict(plain_ms=1e3 * plain, draft_ms=1e3 * draft,
                                 measured_round_ms=1e3 * sum(s for s, _ in m.rounds) / len(m.rounds) if m.rounds
                                 else None,
                                 measured_plain_ms=1e3 * sum(m.plain) / len(m.plain) if m.plain else None,
                                 verify_ms={str(n): 1e3 * t for n, t in sorted(self.verify.step_seconds[b].items())
                                            if n},
                                 verify_graphed=sorted(n for bb, n in self.verify.graphed if bb == b and n),
                                 round_ms_per_token={str(n): v for n, v in ms_per_token.items()},
                                 budget=choice.budget, reason=reason)
        return dict(kind="measured", accepted_per_round={str(n): a for n, a in self.acceptance.accepted.items()},
                    largest_measured_batch=self.verify.batch_sizes[-1], by_batch=rows)


@dataclass(frozen=True)
class FixedBudgetPolicy:
    """The same budget at every batch size, bypassing the cost model (benchmarks measuring acceptance)."""
    nodes: int

    @property
    def top_budget(self) -> int:
        return self.nodes

    def budget(self, batch_size: int) -> int:
        return self.nodes

    def describe(self) -> dict:
        return dict(kind="fixed", budget=self.nodes)


# A verify forward over up to this many tokens costs about one plain decode step on a datacenter GPU: decoding is
# bound by reading the weights and KV, and a GEMM's time stays flat until its token count reaches the GPU's
# FLOP-to-byte ratio (H100/H200 bf16: ~990 TFLOP/s over 3.4-4.8 TB/s, i.e. 200-300 FLOP per byte, and a weight
# byte does 1 FLOP per token). We take the lower end, 128, so extra tree nodes are close to free below it.
KNEE_TOKENS = 128
MIN_NODES = 4


@dataclass(frozen=True)
class KneeBudgetPolicy:
    """Without a measured profile: at batch b, n = min(budget, knee / b - 1) nodes per request, and no
    speculation when that leaves fewer than `min_nodes` (a round also pays a drafter pass and the tree build,
    which a tree of 1-3 nodes does not earn back at the acceptance our drafters reach, tau ~1.3-2). With the
    defaults: batch 1-7 gets 16 nodes, 8 gets 15, 16 gets 7, 25 gets 4, 26 and above 0."""
    max_budget: int
    knee_tokens: int = KNEE_TOKENS
    min_nodes: int = MIN_NODES

    def budget(self, batch_size: int) -> int:
        n = min(self.max_budget, self.knee_tokens // max(1, batch_size) - 1)
        return n if n >= min(self.min_nodes, self.max_budget) else 0

    @property
    def top_budget(self) -> int:
        """The largest budget it ever picks (at batch 1; 0: never speculates)."""
        return self.budget(1)

    def describe(self) -> dict:
        return dict(kind="knee", knee_tokens=self.knee_tokens, max_budget=self.max_budget, min_nodes=self.min_nodes)
