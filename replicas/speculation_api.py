"""The two interfaces through which speculative decoding plugs into the engine, and how the engine loads them.

A round, as the engine runs it (docs/speculative.md):

    proposer.budget(batch size)            draft nodes per decoding sequence this step (0: plain decoding)
    proposer.propose(seqs, nodes)          one draft tree per sequence -> DraftProposal (on the device: no wait)
    runner.execute(step)                   the target verifies every tree in one forward (tree attention mask)
    verifier.verify(seqs, proposal, ...)   the target's choice at every node and the walk -> VerifiedRound
    the engine applies the round itself    moves the accepted nodes' KV, then
    proposer.observe(...), flush()         the computed tokens' hidden states enter the drafter's context, and
                                           while that device work runs the engine emits the tokens, commits blocks

The engine owns these types and never imports `speculative/`: the implementation is loaded by module name
(`PROVIDER`) when a config asks for speculation, so the dependency runs one way, speculative -> replicas.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence as Seq

import numpy as np
from torch import Tensor

from replicas.step_input import DraftRows

if TYPE_CHECKING:
    from replicas.config import EngineConfig, ModelConfig
    from replicas.sampler import Sampler, SamplerOutput
    from replicas.scheduler import ScheduledBatch
    from replicas.sequence import Sequence
    from replicas.step_input import StepInput

# The module whose `create(config, model_config, runner, sampler, eos_token_ids)` returns (Proposer, Verifier).
PROVIDER = "speculative.plugin"


@dataclass
class DraftProposal:
    """One draft tree per sequence: the rows the step input verifies (device tensors: proposing enqueues the
    drafter's work and returns), and the proposer's own view of the trees (opaque to the engine; handed back to
    the verifier)."""
    rows: DraftRows
    trees: Any


@dataclass
class VerifiedRound:
    """What a verified round emits, per sequence b (host arrays, one device-to-host copy):

    num_emitted[b]     tokens b emits: its accepted draft tokens and the target's bonus token (>= 1)
    tokens[b, j]       the j-th emitted token (j < num_emitted[b])
    path_slots[b, j]   the tree slot whose logits chose token j (0 = the root, i = draft node i - 1); the
                       accepted nodes' K/V sit in the scratch slots root + path_slots[b, 1..k]
    sampled            the sampler's output over every slot (row b * width + slot): logprobs of the emitted tokens
    num_draft_tokens   valid draft nodes in the round (for the acceptance rate)
    """
    num_emitted: np.ndarray
    tokens: np.ndarray
    path_slots: np.ndarray
    sampled: "SamplerOutput"
    width: int
    num_draft_tokens: int


class Proposer(Protocol):
    aux_layers: tuple[int, ...]          # target layers whose hidden states the step returns for the drafter

    @property
    def enabled(self) -> bool:
        """False when the budget policy never speculates: the engine then runs exactly as a plain engine."""

    def budget(self, batch_size: int) -> int:
        """Draft nodes per decoding sequence for a batch of this size (0 = plain decoding)."""

    def propose(self, seqs: Seq["Sequence"], num_nodes: int) -> DraftProposal:
        """One tree of num_nodes nodes per sequence, rooted at its last (uncomputed) token."""

    def record_round(self, batch_size: int, nodes: int, seconds: float, tokens_per_seq: float) -> None:
        """A decode-only step as the engine ran it end to end (scheduling to outputs), with `nodes` draft nodes per
        sequence (0: plain) and the tokens it emitted per sequence: the budget policy weighs measured rounds."""

    def observe_step(self, batch: "ScheduledBatch", step: "StepInput", aux: list[Tensor]) -> None:
        """The step's rows that verified no tree: their computed tokens' hidden states (`aux`)."""

    def observe(self, aux: list[Tensor], rows: Optional[np.ndarray], seq_ids: np.ndarray,
                positions: np.ndarray) -> None:
        """Rows `rows` of `aux` (None: all) hold sequence seq_ids[i]'s computed token at positions[i]."""

    def flush(self) -> None:
        """Start the drafter-context work for the rows observed so far now (device work the engine overlaps with
        its host work at a round's end); `propose` does it otherwise."""

    def forget(self, seq: "Sequence") -> None:
        """The sequence finished or was aborted: drop its drafter context."""

    @property
    def num_tracked(self) -> int:
        """Sequences whose drafter context is held (0 once every request ended)."""


class Verifier(Protocol):
    def verify(self, seqs: Seq["Sequence"], proposal: DraftProposal, logits: Tensor) -> VerifiedRound:
        """logits: [len(seqs) * (1 + nodes), V], request-major, the rows of the verified trees."""


def load_speculation(config: "EngineConfig", model_config: "ModelConfig", runner, sampler: "Sampler",
                     eos_token_ids: tuple[int, ...]) -> tuple[Proposer, Verifier]:
    """The configured proposer and verifier, built by the speculative package over this engine's runner."""
    provider = importlib.import_module(PROVIDER)
    return provider.create(config, model_config, runner, sampler, eos_token_ids)
