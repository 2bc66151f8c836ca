"""One model replica: the engine, its scheduler, models, attention backends, loaders and ranks."""
from replicas.config import EngineConfig, ModelConfig
from replicas.outputs import CompletionOutput, RequestOutput
from replicas.sampling_params import SamplingParams, SamplingParamsError

__all__ = ["LLM", "SamplingParams", "SamplingParamsError", "EngineConfig", "ModelConfig", "RequestOutput",
           "CompletionOutput"]


def __getattr__(name):
    if name == "LLM":   # lazy: importing the package must not pull the model stack
        from replicas.llm import LLM
        return LLM
    raise AttributeError(name)
