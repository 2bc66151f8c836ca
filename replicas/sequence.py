"""One generation stream: prompt + output tokens and how many of them the KV cache holds."""
from __future__ import annotations

import itertools
from enum import Enum, auto
from typing import Optional

from replicas.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_ids = itertools.count()


class Sequence:
    """The scheduler reasons in tokens: `num_computed_tokens` catches up with `num_tokens`.

    A prefill chunk, a prefix-cache hit, a decode and a recompute after preemption are all the
    same thing: computing tokens [num_computed_tokens, num_tokens)."""

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 seed: int, arrival_time: float):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0           # prompt tokens served from the prefix cache at first admission
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.params = params
        self.seed = seed
        self.arrival_time = arrival_time
        self.first_scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.inter_token_latencies: list[float] = []
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict] = []
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[object] = None
        self.num_preemptions = 0
        self.grammar = None                  # replicas.structured.guided.GrammarState when params.grammar is set

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def ends_by_length(self, max_model_len: int, more: int = 0) -> bool:
        """Whether the sequence is at its max_tokens or the context length once `more` tokens are added (the
        engine ends it by length there; async scheduling asks one token ahead)."""
        p = self.params
        return ((p.max_tokens is not None and self.num_output_tokens + more >= p.max_tokens)
                or self.num_tokens + more >= max_model_len)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}#{self.index}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, {self.status.name})")
