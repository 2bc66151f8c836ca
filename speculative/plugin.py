"""The speculative package's entry point for the engine (replicas.speculation_api.PROVIDER)."""
from __future__ import annotations

from replicas.config import EngineConfig, ModelConfig
from replicas.sampler import Sampler
from speculative.speculator import Speculator
from speculative.verifier import TreeVerifier


def create(config: EngineConfig, model_config: ModelConfig, runner, sampler: Sampler,
           eos_token_ids: tuple[int, ...]) -> tuple[Speculator, TreeVerifier]:
    """The proposer (drafter, tree builder, budget policy measured on the runner's device) and the verifier."""
    return (Speculator.create(config, model_config, runner),
            TreeVerifier(sampler, eos_token_ids, model_config.vocab_size))
