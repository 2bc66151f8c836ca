"""The grammar backend interface: what the engine needs from a grammar library, and how it loads one.

A backend compiles a `GrammarSpec` for one tokenizer, makes matchers (one per sequence: the grammar's state after
that sequence's output tokens), fills the packed token bitmask of many matchers at once (replicas/structured/
bitmask.py: bit t % 32 of word t // 32 set = token t allowed; stop tokens are allowed once the grammar is complete)
and advances them by one token each. Everything else (the cache, the per-step bitmask, resync after preemption) is
the engine's (replicas/structured/guided.py), so another library (llguidance) needs only this module's `create`.

Backends are loaded by module name (`BACKENDS`): nothing imports a grammar library until a request needs one.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

from torch import Tensor

if TYPE_CHECKING:
    from replicas.structured.spec import GrammarSpec
    from replicas.tokenizer import Tokenizer

# name -> module whose `create(tokenizer, vocab_size, stop_token_ids, threads)` returns the GrammarBackend
BACKENDS = {"xgrammar": "replicas.structured.xgrammar_backend"}


class GrammarError(ValueError):
    """A grammar the backend cannot build (an unsupported or inconsistent schema); the message is for the client."""


class GrammarBackend(Protocol):
    def compile(self, spec: "GrammarSpec") -> Any:
        """The compiled grammar (opaque to the engine; shared by every matcher of it), or GrammarError."""

    def new_matcher(self, compiled: Any) -> Any:
        """A matcher at the grammar's start."""

    def fill_bitmask(self, matchers: Sequence[Any], bitmask: Tensor, rows: Optional[Sequence[int]] = None) -> None:
        """Row rows[i] (i when `rows` is None) of the host int32 bitmask [rows, words] := the tokens matchers[i]
        allows next."""

    def accept(self, matchers: Sequence[Any], tokens: Sequence[int]) -> list[bool]:
        """Advance matchers[i] by tokens[i]; False where the token does not match (that matcher is unchanged)."""

    def is_terminated(self, matcher: Any) -> bool:
        """The matcher accepted a stop token: the grammar is complete and has no next bitmask row."""

    def rollback(self, matcher: Any, num_tokens: int) -> None:
        """Undo the matcher's last `num_tokens` accepted tokens."""


def load_backend(name: str, tokenizer: "Tokenizer", vocab_size: int, stop_token_ids: Sequence[int],
                 threads: int) -> GrammarBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown grammar backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name]).create(tokenizer, vocab_size, stop_token_ids, threads)
