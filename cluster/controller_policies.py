"""The fleet controller's policies: what one replica's knobs should be, judged from its own recent traffic.

A policy's `decide(view, state, now)` returns the decisions for one replica and may update `state`, a plain dict
that the replica keeps for the controller (so a restarted controller carries on where it stopped). The
controller bounds what a policy decides (`Controller.bounded`) and rate-limits it (`cooldown_rounds` after a
change), and the policies keep a hysteresis band of their own.

- `static`: changes nothing.
- `chunk`: the smallest `max_num_batched_tokens` that keeps TTFT within the SLO while KV is short or decodes are slow.
  A lower budget pays in KV blocks (the activation memory it frees) and in inter-token latency (a smaller prefill
  chunk stalls the decodes beside it for less), and costs prefill throughput: the queue's prompts get fewer tokens per
  step. So it halves the budget only while KV is short (usage at or above `kv_pressure`, or preemptions, or admissions
  that waited for free blocks since its last round) or the p90 of the requests' mean inter-token latency is over the
  ITL SLO, and the p90 TTFT of the requests that arrived under the budget in force (at most `window_s` back) stays
  under `headroom` x SLO, or within the SLO when it has not measured the lower budget worse (a lower budget can
  shorten TTFT too, so closeness to the SLO alone is no reason to hold). With KV to spare (usage below
  `kv_pressure` - `kv_band`, none of those), the p90 ITL under `headroom` x ITL SLO and prompts waiting, it doubles
  a lowered budget back, unless it measured the higher budget worse. Otherwise it holds. Over the TTFT SLO with KV
  short it lowers all the same unless it measured the lower budget worse: a larger budget would take back from the
  KV pool the activation memory a lower one granted. Over the TTFT SLO without KV short it climbs on what it
  measured, since TTFT is not monotone in the budget (a large step stalls the short prompts queued behind a long
  one): with KV to spare it doubles (up to the budget the engine reserved activation memory for) into a budget not
  yet measured or measured better than the one in force, else it halves into one such (at the engine's limit too),
  else holds; no pressure says which way pays there, so a neighbour that showed no difference is no reason to move.
  A budget's evidence is every request that arrived while it was in force (`budget_spans`) in the last
  `remember_s`, over all its visits, counted once when it finishes (`evidence`): how many met both SLOs and how
  close to them they ran. One budget measured better or worse than another when its requests met both SLOs more or
  less often by more than `evidence_z` standard errors of the difference (attainment, because the p90 can be set by
  prompts too long to meet the SLO at any budget, whose own prefill a smaller budget lengthens while it shortens
  every other prompt's wait); where neither's differ (all met, or none did), by how close to the SLOs they ran. A
  verdict drawn from a few requests is thus no verdict; a neighbour's evidence grows with each visit, and the
  present's while it is in force, so a present that turns worse re-opens a neighbour.
- `elastic`: lending the prefill reserve on or off by prefill pressure. On under KV pressure (usage at or above
  `kv_pressure`, or preemptions) while prompts are not waiting; off when reclaims preempt decodes while prompts
  wait (each prompt then pays a reclaim, and lending costs more prefill latency than its KV gains).
- `auto`: per replica, measures both (a round of trials of `trial_rounds` rounds each, with the other knob at its
  neutral setting: lending off under `chunk`, the full budget under `elastic`), keeps the one whose requests met both
  SLOs more often by more than `arm_evidence_z` standard errors of the difference, corrected for continuity
  (`attainment_compared`: trials' few dozen requests differing by two or three, long prompts a little past the ITL
  SLO, is noise, not a verdict), and measures again after `exploit_rounds`, or sooner once the requests arriving
  under the arm in force (over `window_s`) measure worse than the other arm's did in its trials (by `retrial_z`
  standard errors: that check repeats every round), the exploit phase having lasted as long as the round of trials
  (the traffic has changed: only a new round measures both arms on the same traffic, and at most half the time goes
  to trials). A round of trials runs the arms in cycles A B B A, up to `trial_cycles` of them: the first led by the
  arm in force (for the first round `elastic`, whose neutral setting, the full budget, is the state an engine starts
  in), each later one by the arm that leads so far, so the round ends on the leader (the backlog the trials leave is
  the leader's to clear, and each arm's trials follow the other's about as often), and none later once one arm
  measured better than the other by `retrial_z` standard errors. It pools each arm's trials, whole cycles only:
  traffic that drifts across the round (a backlog building, a busy stretch) then weighs on both arms alike instead of
  favouring whichever ran first or in the quiet part. A request counts for the arm in force when it arrived, whenever
  it finishes (each request once, at the first trial's end that sees it finished): its wait and first token were set
  by that arm, and judging only those that finished within their trial would keep mostly the short ones. For the same
  reason the verdict waits `trial_rounds` rounds after the last trial (phase `judge`): the last trial's slow
  requests, the misses, finish last, and a verdict at once would judge that arm by its fast ones. Requests arriving
  while it waits count for neither arm, so the arm that leads on what was measured so far serves them (by the same
  rules, against the arm in force when the round began, which the verdict also weighs against). A replica's first
  round of trials waits `trial_rounds` rounds (phase `settle`): an engine that just started is filling up, and what
  it serves then would favour the first arm. Where attainment shows no difference (both met the SLOs for every
  request, the common case away from overload, or differ by less than that), the prompts waiting for admission under
  each arm (one sample a trial round, `waiting`) decide next: an arm under which fewer waited on average, by more
  than `switch_margin` and `arm_evidence_z` standard errors, while its requests ran no closer to either SLO, wins
  (one under which more waited does not). Below capacity no prompt waits long under either arm; where one arm leaves
  the engine short (a KV pool too small for the load, a step budget too small for the prompts) its queue grows, and
  the backlog reaches the SLOs only after the trials, in first tokens that come late to the prompts that arrive
  later. Failing that, the arm whose requests kept further from one SLO and no closer to the other wins: its mean
  TTFT / TTFT SLO or mean inter-token latency / ITL SLO lower than the arm in force's by more than `switch_margin`
  (relatively) and by more than `arm_evidence_z` standard errors, and the other mean not higher by as much; otherwise
  the arm in force stays. Each SLO on its own, because a backlog building under one arm shows in its first tokens
  while its decodes' inter-token latency stays put: the larger of the two ratios per request would hide it for as
  long as the decodes ran closer to their SLO. It decides from what it measured, never from a default belief about
  which knob pays. `chunk` re-entering resumes at the budget it left, and its evidence counts only the requests that
  arrived while it was in force, across its trials, so its trials measure its setting and carry its descent to it on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Protocol

from replicas.stats import EngineStats

POLICIES = ("static", "chunk", "elastic", "auto")
ARMS = ("elastic", "chunk")          # the first round of trials, in this order
TALLY_LEN = 6                        # an arm's trial tally: Window.arm_tally


@dataclass(frozen=True)
class ControllerConfig:
    policy: str = "static"
    interval_s: float = 5.0
    advisory: bool = False              # decide and log (and export), apply nothing
    ttft_slo_ms: float = 1000.0
    itl_slo_ms: float = 100.0
    min_budget: int = 256               # chunk never goes below (nor below what the engine allows)
    kv_pressure: float = 0.90
    kv_band: float = 0.20               # chunk raises a lowered budget only while KV usage < kv_pressure - kv_band
    min_requests: int = 4               # finished requests a latency judgment needs
    window_s: float = 60.0              # a judgment looks at most this far back
    remember_s: float = 300.0           # chunk: how long a budget's requests count as evidence for it
    evidence_z: float = 0.5             # chunk's budgets: one is worse than another when its requests met the
                                        # SLOs less often by more than this many standard errors of the difference
    arm_evidence_z: float = 2.0         # auto's arms, likewise, and for how far from each SLO their requests ran
                                        # (a verdict stands for `exploit_rounds`: the usual 95% two-sided level)
    retrial_z: float = 3.0              # auto: likewise, for the arm in force falling behind the other's trials
                                        # (stricter: that check repeats every round of the exploit phase)
    headroom: float = 0.5               # chunk lowers the budget only while p90 TTFT < headroom x SLO
    cooldown_rounds: int = 2            # rounds after a change during which a replica's knobs stay put
    trial_rounds: int = 6               # auto: rounds of one trial (each arm has two in each A B B A cycle)
    trial_cycles: int = 1               # auto: A B B A cycles in a round of trials
    exploit_rounds: int = 60            # auto: rounds on the better knob before measuring both again
    switch_margin: float = 0.1          # auto, equal attainment: how much further from an SLO (relatively) another
                                        # arm's requests must have run


@dataclass(frozen=True)
class Decision:
    knob: str                 # "max_num_batched_tokens" | "elastic"
    value: object
    reason: str


@dataclass(frozen=True)
class Window:
    """The requests a replica finished in a span of time."""
    ttft_s: list[float]
    itl_s: list[float]
    prompt_tokens: list[int]

    def __len__(self) -> int:
        return len(self.ttft_s)

    def ttft_quantile(self, q: float) -> float:
        return quantile(self.ttft_s, q)

    def itl_quantile(self, q: float) -> float:
        return quantile(self.itl_s, q)

    def totals(self, cfg: ControllerConfig) -> tuple[int, int, float]:
        """How many requests met both the TTFT and the inter-token SLO, how many there are, and their summed SLO
        load: per request max(TTFT / TTFT SLO, ITL / ITL SLO), how close to the SLOs it ran (below 1: within both).
        Totals, so that a policy's evidence adds up across windows."""
        ttft, itl, met = self._over_slo(cfg)
        return met, len(ttft), sum(max(t, i) for t, i in zip(ttft, itl))

    def arm_tally(self, cfg: ControllerConfig) -> tuple[int, int, float, float, float, float]:
        """`auto`'s evidence for an arm: how many requests met both SLOs, how many there are, then the sums of TTFT /
        TTFT SLO and of its square and of inter-token latency / ITL SLO and of its square. Totals that add up across
        windows, from which `slo_distance_compared` takes means and their standard errors."""
        ttft, itl, met = self._over_slo(cfg)
        return met, len(ttft), sum(ttft), sum(x * x for x in ttft), sum(itl), sum(x * x for x in itl)

    def _over_slo(self, cfg: ControllerConfig) -> tuple[list[float], list[float], int]:
        """Each request's TTFT / TTFT SLO and inter-token latency / ITL SLO, and how many kept both within 1."""
        ttft = [t * 1e3 / cfg.ttft_slo_ms for t in self.ttft_s]
        itl = [i * 1e3 / cfg.itl_slo_ms for i in self.itl_s]
        return ttft, itl, sum(1 for t, i in zip(ttft, itl) if t <= 1.0 and i <= 1.0)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class ReplicaView:
    replica_id: str
    stats: EngineStats
    budget_limit: int                   # the max_num_batched_tokens the replica's engine was sized for
    elastic_available: bool
    recent: dict[str, list] = field(default_factory=dict)     # RecentRequests.since columns
    state: dict = field(default_factory=dict)                 # what the controller left on the replica

    def arrived_within(self, spans: list[list], finished_after: float = float("-inf")) -> Window:
        """The requests that arrived within one of `spans` ([start, end]; end None: still open) and finished after
        `finished_after`."""
        r = self.recent
        keep = [i for i, t in enumerate(r.get("arrived_at", [])) if r["finished_at"][i] > finished_after
                and any(a <= t and (b is None or t < b) for a, b in spans)]
        return Window([r["ttft_s"][i] for i in keep], [r["itl_s"][i] for i in keep],
                      [r["prompt_tokens"][i] for i in keep])


def increases(s: EngineStats, state: dict, key: str, counters: tuple[str, ...]) -> dict[str, int]:
    """How much each of the engine's `counters` grew since this policy last looked (kept in `state[key]`; 0 the
    first time)."""
    seen = state.get(key, {})
    state[key] = {c: getattr(s, c) for c in counters}
    return {c: getattr(s, c) - seen.get(c, getattr(s, c)) for c in counters}


def attainment_compared(mine: tuple, theirs: tuple, z: float, continuity: bool = False) -> Optional[int]:
    """How often the requests of evidence `theirs` (met, requests, ...) met both SLOs against those of `mine`: 1
    more often, -1 less often, by more than `z` standard errors of the difference; 0 no difference shown; None no
    spread to judge by (all met, or none did, on both sides). With `continuity`, the difference is first moved
    half a request of each side towards zero (Yates): the normal approximation of a few misses among dozens of
    requests overstates their significance, and a test that claims its level needs the correction."""
    (met_a, n_a), (met_b, n_b) = mine[:2], theirs[:2]
    pooled = (met_a + met_b) / (n_a + n_b)
    se = math.sqrt(pooled * (1.0 - pooled) * (1.0 / n_a + 1.0 / n_b))
    if se == 0.0:
        return None
    diff = met_b / n_b - met_a / n_a
    if continuity:
        diff = math.copysign(max(0.0, abs(diff) - 0.5 * (1.0 / n_a + 1.0 / n_b)), diff)
    return 1 if diff > z * se else -1 if diff < -z * se else 0


def mean_and_se2(n: int, total: float, squares: float) -> tuple[float, float]:
    """A sample's mean and its squared standard error, from its size, sum and sum of squares."""
    mean = total / n
    return mean, max(0.0, squares / n - mean * mean) / max(1, n - 1)


def shifted(mine: tuple, theirs: tuple, margin: float, z: float) -> int:
    """Two samples (size, sum, sum of squares): 1 where `theirs`' mean is higher than `mine`'s by more than
    `margin` of it and by more than `z` standard errors of the difference, -1 lower by as much, 0 neither."""
    (mean_a, se2_a), (mean_b, se2_b) = mean_and_se2(*mine), mean_and_se2(*theirs)
    if abs(mean_b - mean_a) <= z * math.sqrt(se2_a + se2_b):
        return 0
    return 1 if mean_b > (1.0 + margin) * mean_a else -1 if mean_b < (1.0 - margin) * mean_a else 0


def slo_distance_compared(mine: tuple, theirs: tuple, margin: float, z: float) -> int:
    """How far from the SLOs the requests of evidence `theirs` (`Window.arm_tally`) ran
    against those of `mine`, each SLO on its own: 1 further from one (the mean of latency / SLO lower by more than
    `margin` of `mine`'s and by more than `z` standard errors of the difference) and not closer to the other
    (higher by as much), -1 the reverse, 0 neither (why each SLO on its own: the module's `auto`)."""
    verdicts = {-shifted((mine[1], *mine[k:k + 2]), (theirs[1], *theirs[k:k + 2]), margin, z) for k in (2, 4)}
    return 1 if verdicts <= {0, 1} and 1 in verdicts else -1 if verdicts <= {0, -1} and -1 in verdicts else 0


def compared(mine: Optional[tuple], theirs: Optional[tuple], cfg: ControllerConfig) -> Optional[int]:
    """How one budget's evidence `theirs` (met, requests, summed SLO load) measured against `mine`: 1 better, -1
    worse, 0 no difference shown, None not measured (fewer than `min_requests` requests on either side). Better or
    worse: its requests met both SLOs more or less often (`attainment_compared`); where neither's differ (all met,
    or none did), they ran further from the SLOs (lower mean SLO load), or not."""
    if mine is None or theirs is None or min(mine[1], theirs[1]) < cfg.min_requests:
        return None
    verdict = attainment_compared(mine, theirs, cfg.evidence_z)
    if verdict is not None:
        return verdict
    return 1 if theirs[2] / theirs[1] < mine[2] / mine[1] else -1


class Policy(Protocol):
    name: str

    def decide(self, view: ReplicaView, state: dict, now: float) -> list[Decision]: ...


class ConfiguredPolicy:
    name: str

    def __init__(self, cfg: ControllerConfig):
        self.cfg = cfg


class StaticPolicy(ConfiguredPolicy):
    name = "static"

    def decide(self, view: ReplicaView, state: dict, now: float) -> list[Decision]:
        return []


class ChunkPolicy(ConfiguredPolicy):
    name = "chunk"

    def decide(self, view: ReplicaView, state: dict, now: float) -> list[Decision]:
        cfg = self.cfg
        budget, limit = view.stats.max_num_batched_tokens, view.budget_limit
        floor = min(cfg.min_budget, limit)
        self.track(view, state, budget, now, since=state.get("changed_at", 0.0))
        window = view.arrived_within(self._spans(state, budget, now - cfg.window_s))
        if len(window) < cfg.min_requests:
            return []
        p90_ms = window.ttft_quantile(0.9) * 1e3
        evidence = self.evidence(state)

        def vs(other: int) -> Optional[int]:
            return compared(evidence.get(str(budget)), evidence.get(str(other)), cfg)

        def worse(other: int) -> bool:
            return vs(other) == -1

        def promising(other: int) -> bool:
            """Not measured, or measured better."""
            return vs(other) in (None, 1)

        s = view.stats
        kv_short = self._kv_short(s, state)
        itl_p90_ms = window.itl_quantile(0.9) * 1e3
        kv_spare = not kv_short and s.kv_cache_usage < cfg.kv_pressure - cfg.kv_band
        higher, lower = min(limit, 2 * budget), max(floor, budget // 2)
        if p90_ms > cfg.ttft_slo_ms and not kv_short:
            if budget < limit and kv_spare and promising(higher):
                return [Decision("max_num_batched_tokens", higher, "ttft_over_slo")]
            if budget > floor and promising(lower):
                return [Decision("max_num_batched_tokens", lower, "ttft_over_slo_lower")]
            return []
        if kv_short or itl_p90_ms > cfg.itl_slo_ms:
            if budget > floor and (p90_ms < cfg.headroom * cfg.ttft_slo_ms or not worse(lower)):
                reason = ("itl_over_slo" if not kv_short else "ttft_within_slo" if p90_ms <= cfg.ttft_slo_ms
                          else "kv_short_over_slo")
                return [Decision("max_num_batched_tokens", lower, reason)]
        elif (budget < limit and s.num_waiting > 0 and kv_spare and itl_p90_ms < cfg.headroom * cfg.itl_slo_ms
              and not worse(higher)):
            return [Decision("max_num_batched_tokens", higher, "prompts_waiting_kv_spare")]
        return []

    def track(self, view: ReplicaView, state: dict, budget: Optional[int], now: float, since: float) -> None:
        """Keep `budget_spans`, when each budget was in force under this policy (budget None: it is not now), and
        credit each budget with the requests that arrived in its spans, once, when they finish (`evidence`, in
        buckets over `remember_s`). A span of the budget in force opens at `since` (when it was put in force);
        a budget changed within the policy closes the old span and opens the new one at `changed_at`."""
        cfg, spans = self.cfg, state.setdefault("budget_spans", {})
        open_key = next((b for b, sp in spans.items() if sp and sp[-1][1] is None), None)
        key = None if budget is None else str(budget)
        if open_key is not None and open_key != key:
            spans[open_key][-1][1] = now if key is None else max(state.get("changed_at", 0.0), spans[open_key][-1][0])
        if key is not None and open_key != key:
            start = since if open_key is None else spans[open_key][-1][1]
            spans.setdefault(key, []).append([start, None])
        evidence = state.setdefault("evidence", {})
        for b, sp in spans.items():
            done = view.arrived_within(sp, finished_after=state.get("evidence_at", float("-inf")))
            if not len(done):
                continue
            buckets = evidence.setdefault(b, [])
            if not buckets or now - buckets[-1][0] >= cfg.remember_s / 10:
                buckets.append([now, 0.0, 0, 0.0])
            buckets[-1][1:] = [x + y for x, y in zip(buckets[-1][1:], done.totals(cfg))]
        state["evidence_at"] = now
        state["budget_spans"] = {b: kept for b, sp in spans.items()
                                 if (kept := [x for x in sp if x[1] is None or x[1] > now - cfg.window_s])}
        state["evidence"] = {b: kept for b, bk in evidence.items()
                             if (kept := [x for x in bk if x[0] > now - cfg.remember_s])}

    @staticmethod
    def evidence(state: dict) -> dict[str, tuple[float, int, float]]:
        """Per budget, over `remember_s` as `track` last kept it: how many of its requests met both SLOs, how many,
        their summed SLO load."""
        return {b: (sum(x[1] for x in bk), sum(x[2] for x in bk), sum(x[3] for x in bk))
                for b, bk in state.get("evidence", {}).items()}

    @classmethod
    def evidence_report(cls, state: dict) -> dict[str, dict]:
        """The evidence as reports show it, by budget: {"met": ..., "requests": ...}."""
        return {b: {"met": round(met, 1), "requests": n}
                for b, (met, n, _) in sorted(cls.evidence(state).items(), key=lambda kv: int(kv[0]))}

    @staticmethod
    def _spans(state: dict, budget: int, start: float) -> list[list]:
        """The spans of `budget` from `start` on."""
        return [[max(a, start), b] for a, b in state.get("budget_spans", {}).get(str(budget), [])
                if b is None or b > start]

    def _kv_short(self, s: EngineStats, state: dict) -> bool:
        """KV usage at or above `kv_pressure` now, or preemptions or admissions that waited for free blocks since
        the last round."""
        grew = increases(s, state, "kv_counters", ("preemptions", "kv_admission_waits"))
        return s.kv_cache_usage >= self.cfg.kv_pressure or any(grew.values())


class ElasticPolicy(ConfiguredPolicy):
    name = "elastic"

    def decide(self, view: ReplicaView, state: dict, now: float) -> list[Decision]:
        s = view.stats
        grew = increases(s, state, "counters", ("preemptions", "elastic_preemptions"))
        preempted, reclaim_preempted = grew["preemptions"], grew["elastic_preemptions"]
        if not view.elastic_available:
            return []
        if s.elastic_mode == "off" and s.num_waiting == 0 and (s.kv_cache_usage >= self.cfg.kv_pressure
                                                              or preempted > 0):
            return [Decision("elastic", "elastic", "kv_pressure")]
        if s.elastic_mode != "off" and reclaim_preempted > 0 and s.num_waiting > 0:
            return [Decision("elastic", "off", "prefill_pressure")]
        return []


class AutoPolicy(ConfiguredPolicy):
    name = "auto"

    def __init__(self, cfg: ControllerConfig):
        super().__init__(cfg)
        self.arms = {"chunk": ChunkPolicy(cfg), "elastic": ElasticPolicy(cfg)}

    def decide(self, view: ReplicaView, state: dict, now: float) -> list[Decision]:
        cfg = self.cfg
        arms = list(ARMS) if view.elastic_available else ["chunk"]
        if state.get("arm") not in arms or "slots" not in state or any(    # new, or state of an earlier version
                len(t) != TALLY_LEN for t in state["tally"].values()):
            self._start_trials(state, arms[0], arms, now, settle=True)
        state["arm_rounds"] = state.get("arm_rounds", 0) + 1
        arm = state["arm"]
        self._sample_queue(view, state)
        if state["phase"] == "settle" and state["arm_rounds"] >= cfg.trial_rounds:
            self._start_trials(state, arm, arms, now)
        elif state["phase"] == "trial" and state["arm_rounds"] >= cfg.trial_rounds:
            state["slots"].append([state["entered_at"], now, arm])
            self._tally(view, state, now)
            if len(state["slots"]) == len(state["order"]):
                self._next_cycle(state, arms)
            if len(state["slots"]) < len(state["order"]):
                self._switch(view, state, state["order"][len(state["slots"])], "trial", now)
            elif (lead := self._best(state, state["order"][0])) != arm:    # it serves while the last trials'
                self._switch(view, state, lead, "judge", now)               # requests finish
            else:
                state.update(phase="judge", arm_rounds=0)
        elif state["phase"] == "judge" and state["arm_rounds"] >= cfg.trial_rounds:
            self._tally(view, state, now)
            state["scores"] = {a: (t[0] / t[1] if t[1] else None) for a, t in state["tally"].items()}
            state["loads"] = {a: ({"ttft": t[2] / t[1], "itl": t[4] / t[1]} if t[1] else None)
                              for a, t in state["tally"].items()}
            state["queue"] = {a: round(w[1] / w[0], 2) for a, w in state["waiting"].items()}
            self._switch(view, state, self._best(state, state["order"][0]), "exploit", now)
        elif state["phase"] == "exploit" and len(arms) > 1 and (
                state["arm_rounds"] >= cfg.exploit_rounds or self._fell_behind(view, state, now)):
            self._start_trials(state, arm, arms, now)
        neutral = self._neutral(view, state)
        in_force = None if neutral or state["arm"] != "chunk" else view.stats.max_num_batched_tokens
        since = max(state.get("changed_at", 0.0), state["entered_at"])
        self.arms["chunk"].track(view, state, in_force, now, since=since)
        return neutral or self.arms[state["arm"]].decide(view, state, now)

    def _start_trials(self, state: dict, in_force: str, arms: list[str], now: float, settle: bool = False) -> None:
        """A round of trials: its first cycle A B B A (A the arm in force; with `settle`, after `trial_rounds`
        rounds of A not counted; `_next_cycle` adds the others), or the one arm there is, kept."""
        order = self._cycle(in_force, arms)
        state.update(tally={}, waiting={}, scores={}, loads={}, queue={}, order=order, slots=[], tallied_at=now)
        self._enter(state, in_force, ("settle" if settle else "trial") if len(order) > 1 else "exploit", now)

    @staticmethod
    def _cycle(lead: str, arms: list[str]) -> list[str]:
        others = [a for a in arms if a != lead]
        return [lead, *others, *reversed(others), lead] if others else [lead]

    def _next_cycle(self, state: dict, arms: list[str]) -> None:
        """After a cycle of trials, the next of `trial_cycles`, led by the arm that leads so far, unless one arm
        already measured better than the other by `retrial_z` standard errors (stricter than the verdict: the look
        repeats each cycle). Whole cycles keep the pooled trials balanced against drift."""
        cycles = len(state["order"]) // (2 * len(arms))          # a cycle runs each arm twice
        z = self.cfg.retrial_z
        if cycles >= self.cfg.trial_cycles or any(self._best(state, a, z) != a for a in arms):
            return
        state["order"] += self._cycle(self._best(state, state["order"][0]), arms)

    def _tally(self, view: ReplicaView, state: dict, now: float) -> None:
        """Credit each arm with the requests that arrived in its trials and finished since the last tally (so each
        request once, whenever it finishes): `Window.arm_tally`."""
        for arm in dict.fromkeys(a for _, _, a in state["slots"]):
            spans = [[start, end] for start, end, a in state["slots"] if a == arm]
            done = view.arrived_within(spans, finished_after=state["tallied_at"])
            state["tally"][arm] = tuple(x + y for x, y in zip(state["tally"].get(arm, (0,) * TALLY_LEN),
                                                              done.arm_tally(self.cfg)))
        state["tallied_at"] = now

    @staticmethod
    def _sample_queue(view: ReplicaView, state: dict) -> None:
        """While an arm is on trial, each round adds the prompts waiting at its end (the round ran under the arm in
        force) to that arm's `waiting` (samples, sum, sum of squares)."""
        if state["phase"] == "trial":
            w = view.stats.num_waiting
            n, total, squares = state.setdefault("waiting", {}).get(state["arm"], (0, 0, 0))
            state["waiting"][state["arm"]] = (n + 1, total + w, squares + w * w)

    def _switch(self, view: ReplicaView, state: dict, arm: str, phase: str, now: float) -> None:
        """Put `arm` in force; `chunk` leaving keeps its budget for its return (`_neutral` restores it)."""
        if state["arm"] == "chunk" and arm != "chunk":
            state["resume_budget"] = view.stats.max_num_batched_tokens
        self._enter(state, arm, phase, now)

    def _best(self, state: dict, in_force: str, z: Optional[float] = None) -> str:
        """The arm in force, unless another measured better (`_better`, by `z` or `arm_evidence_z` standard errors)
        over the round of trials, each with at least `min_requests` requests: noise between two equally good arms
        changes nothing."""
        tally = {a: t for a, t in state["tally"].items() if t[1] >= self.cfg.min_requests}
        waiting = {a: w for a, w in state.get("waiting", {}).items() if w[0] >= 2}
        best, z = in_force, self.cfg.arm_evidence_z if z is None else z
        for arm, theirs in tally.items():
            mine = tally.get(best)
            if arm != best and mine is not None and self._better(mine, theirs, z, waiting.get(best), waiting.get(arm)):
                best = arm
        return best

    def _fell_behind(self, view: ReplicaView, state: dict, now: float) -> bool:
        """Whether the requests that arrived under the arm in force over the last `window_s` of its exploit phase
        measured worse than another arm's in the round of trials that chose it (as `_best` ranks them, by
        `retrial_z` standard errors), once the phase has lasted as long as that round (so at most half the time goes
        to trials): the traffic has changed since, and only a new round measures both arms on the same traffic."""
        cfg = self.cfg
        if state["arm_rounds"] < len(state["order"]) * cfg.trial_rounds:
            return False
        mine = view.arrived_within([[max(state["entered_at"], now - cfg.window_s), None]]).arm_tally(cfg)
        return mine[1] >= cfg.min_requests and any(
            self._better(mine, theirs, cfg.retrial_z) for arm, theirs in state["tally"].items()
            if arm != state["arm"] and theirs[1] >= cfg.min_requests)

    def _better(self, mine: tuple, theirs: tuple, z: float, waiting_mine: Optional[tuple] = None,
                waiting_theirs: Optional[tuple] = None) -> bool:
        """Whether tally `theirs` measured better than `mine`: its requests met both SLOs more often by more than
        `z` standard errors; or, with no difference in attainment, fewer prompts waited under it (`waiting`, where
        both arms have samples: by `switch_margin` and `z` standard errors) while its requests ran no closer to
        either SLO; or, with no difference in either, they ran further from one SLO and no closer to the other
        (`slo_distance_compared`, likewise)."""
        met = attainment_compared(mine, theirs, z, continuity=True)
        if met:
            return met == 1
        margin = self.cfg.switch_margin
        distance = slo_distance_compared(mine, theirs, margin, z)
        queue = -shifted(waiting_mine, waiting_theirs, margin, z) if waiting_mine and waiting_theirs else 0
        return queue == 1 and distance != -1 or not queue and distance == 1

    @staticmethod
    def _enter(state: dict, arm: str, phase: str, now: float) -> None:
        state.update(arm=arm, phase=phase, arm_rounds=0, entered_at=now)

    @staticmethod
    def _neutral(view: ReplicaView, state: dict) -> list[Decision]:
        """The other knob at its neutral setting while `state["arm"]` is the one in use, and a re-entered `chunk`
        at the budget it left (each re-issued until it holds)."""
        s, arm = view.stats, state["arm"]
        if arm == "chunk" and view.elastic_available and s.elastic_mode != "off":
            return [Decision("elastic", "off", "auto_chunk")]
        if arm == "chunk" and "resume_budget" in state:
            budget = min(state["resume_budget"], view.budget_limit)
            if s.max_num_batched_tokens != budget:
                return [Decision("max_num_batched_tokens", budget, "auto_chunk")]
            del state["resume_budget"]
        if arm == "elastic" and s.max_num_batched_tokens != view.budget_limit:
            return [Decision("max_num_batched_tokens", view.budget_limit, "auto_elastic")]
        return []


def make_policy(cfg: ControllerConfig) -> Policy:
    kinds = {"static": StaticPolicy, "chunk": ChunkPolicy, "elastic": ElasticPolicy, "auto": AutoPolicy}
    if cfg.policy not in kinds:
        raise ValueError(f"unknown controller policy {cfg.policy!r}; choose one of {POLICIES}")
    return kinds[cfg.policy](cfg)
