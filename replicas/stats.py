"""Engine counters and per-request timings, the contract between the engine and the metrics layer.

The engine keeps one `EngineStats` (monotonic counters + current gauges) and appends one
`RequestTimings` per finished request to a bounded list that the metrics layer drains.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestTimings:
    request_id: str
    arrival_time: float            # time.monotonic() at add_request
    scheduled_time: float          # first time the scheduler gave it tokens (queue time = scheduled - arrival)
    first_token_time: float
    finish_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    finish_reason: str
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds between streamed tokens


@dataclass
class EngineStats:
    # gauges
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    max_num_batched_tokens: int = 0
    # counters (monotonic)
    num_steps: int = 0
    prefill_steps: int = 0                 # steps with a prompt chunk (more than decode/verify tokens)
    steps_ahead: int = 0                   # steps launched before the last one's tokens were read (async scheduling)
    prompt_tokens: int = 0                 # prompt tokens of requests that reached their first token (cache hits
                                           # included)
    generation_tokens: int = 0
    prefix_cache_queries: int = 0          # prompt tokens looked up
    prefix_cache_hits: int = 0             # prompt tokens served from cache
    preemptions: int = 0
    kv_admission_waits: int = 0            # admissions stopped because the queue's head did not fit in free KV blocks
    requests_finished: int = 0
    iteration_tokens_total: int = 0
    # elastic KV (filled by memory.elastic when enabled)
    elastic_mode: str = "off"
    reserve_bytes: int = 0
    reserve_lent_bytes: int = 0
    reserve_blocks_total: int = 0
    reserve_blocks_used: int = 0
    reserve_granted_blocks: int = 0        # reserve blocks made base KV for good while the step budget is lower
    lend_total: int = 0
    reclaim_total: int = 0
    blocks_migrated: int = 0
    elastic_preemptions: int = 0
    lend_refused: int = 0                  # lends given up: memory not free or a rank failed to map
    reserve_cache_evictions: int = 0       # prefix-cache entries dropped from the reserve at reclaim
    lend_latencies: list[float] = field(default_factory=list)     # seconds, the newest samples (bounded);
    reclaim_latencies: list[float] = field(default_factory=list)  # new ones = the totals' increase
    # speculative decoding
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_by_position: list[int] = field(default_factory=list)
    spec_constrained_plain: int = 0        # decode rows of constrained requests that would have drafted
    # structured outputs (docs/structured_outputs.md)
    constrained_requests: dict[str, int] = field(default_factory=dict)   # by kind: json_schema, json_object, tool,
                                                                         # logit_bias (admitted requests)
    grammar_compiles: int = 0              # grammar compiles finished (cache misses)
    grammar_cache_hits: int = 0
    grammar_compile_latencies: list[float] = field(default_factory=list)    # seconds, the newest samples (bounded);
    grammar_mask_steps: int = 0                                             # new ones = the totals' increase
    grammar_mask_latencies: list[float] = field(default_factory=list)       # host bitmask fill of one step
    # entries of the per-request maps, by map (the core's, then the client's): all 0 once idle
    bookkeeping: dict[str, int] = field(default_factory=dict)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
