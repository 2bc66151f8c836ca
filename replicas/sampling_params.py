"""Per-request sampling parameters, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Real
from typing import Optional, Sequence

from replicas.structured.spec import GrammarSpec

GREEDY_TEMPERATURE = 1e-5    # a lower temperature samples the argmax anyway
MAX_LOGIT_BIAS = 300         # entries of logit_bias (OpenAI's bound)


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `param` names it (mapped to an HTTP 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                   # -1 or 0: disabled
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: Optional[int] = 16    # None: up to the model length
    min_tokens: int = 0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: Optional[int] = None    # number of top alternatives besides the sampled token
    skip_special_tokens: bool = True
    detokenize: bool = True           # False: token ids only (benchmarks); stop strings need text
    grammar: Optional[GrammarSpec] = None         # the output must match it (docs/structured_outputs.md)
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit, in [-100, 100]

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop or ())
        self.stop_token_ids = tuple(self.stop_token_ids or ())
        self.validate()

    def validate(self) -> None:
        """Every parameter in range (SamplingParamsError naming the first that is not). The engine checks again at
        admission, with its configurable limits (replicas.request.check_params)."""
        def need(ok: bool, param: str, msg: str):
            if not ok:
                raise SamplingParamsError(param, msg)

        need(isinstance(self.n, int) and 1 <= self.n <= 128, "n", f"n must be an integer in [1, 128], got {self.n}")
        need(0.0 <= self.temperature <= 2.0, "temperature", f"temperature must be in [0, 2], got {self.temperature}")
        need(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        need(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0), "top_k",
             f"top_k must be -1 (disabled) or a non-negative integer, got {self.top_k}")
        need(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
             f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1), "max_tokens",
             f"max_tokens must be a positive integer, got {self.max_tokens}")
        need(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "min_tokens must be >= 0")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "stop must be non-empty strings")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "stop_token_ids must be non-negative integers")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "logprobs",
             f"logprobs must be an integer in [0, 20], got {self.logprobs}")
        need(self.seed is None or isinstance(self.seed, int), "seed", "seed must be an integer")
        need(self.detokenize or not self.stop, "stop", "stop strings need detokenize=True")
        self._validate_constraints(need)

    def _validate_constraints(self, need) -> None:
        g = self.grammar
        if g is not None:
            need(isinstance(g, GrammarSpec), "response_format", "grammar must be a GrammarSpec")
            need(self.min_tokens == 0, "min_tokens", "min_tokens cannot be combined with response_format or forced "
                 "tool calls: the grammar decides where the output may end")
            need(not self.ignore_eos, "ignore_eos", "ignore_eos cannot be combined with response_format or forced "
                 "tool calls: the grammar decides where the output may end")
        bias = self.logit_bias
        if bias is None:
            return
        need(isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS, "logit_bias",
             f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases")
        need(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in bias), "logit_bias",
             "logit_bias keys must be token ids (non-negative integers)")
        need(all(isinstance(v, Real) and not isinstance(v, bool) and -100.0 <= v <= 100.0 for v in bias.values()),
             "logit_bias", "logit_bias values must be numbers in [-100, 100]")

    @property
    def constrained(self) -> bool:
        """The logits are processed beyond plain sampling's (a grammar or logit_bias): such requests do not
        speculate (docs/structured_outputs.md)."""
        return self.grammar is not None or bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        """Below GREEDY_TEMPERATURE (a tiny temperature overflows the float32 logits it divides): the argmax."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """A repetition, presence or frequency penalty applies."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def argmax_only(self) -> bool:
        """Greedy with nothing that changes the logits (penalties, logit_bias, min_tokens) and no logprobs asked:
        the sampler's whole work for this row is one argmax."""
        return (self.greedy and not self.penalized and not self.logit_bias and self.min_tokens == 0
                and self.logprobs is None)
