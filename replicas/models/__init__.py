"""Model registry: architecture name (ModelConfig.architecture) -> causal LM class."""
from replicas.models.llama import LlamaForCausalLM
from replicas.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}


def model_class(architecture: str):
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"no model for architecture {architecture!r}; supported: {sorted(MODEL_REGISTRY)}") from None
