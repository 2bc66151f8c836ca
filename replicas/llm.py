"""Offline API: `LLM().generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import inspect
import itertools
from typing import Any, Optional, Sequence, Union

from tqdm import tqdm

from replicas.config import EngineConfig
from replicas.engine import LLMEngine, Prompt
from replicas.outputs import RequestOutput
from replicas.sampling_params import SamplingParams


def llm_engine_config(model: Optional[str] = None, **engine_kwargs: Any) -> EngineConfig:
    """The EngineConfig `LLM(model, **engine_kwargs)` runs: its keywords are EngineConfig's flat names."""
    return EngineConfig.from_flat(model=model, **engine_kwargs)


class LLM:
    def __init__(self, model: Optional[str] = None, **engine_kwargs: Any):
        self.engine = LLMEngine(llm_engine_config(model, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        order = []
        for prompt, p in zip(prompts, plist):
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, prompt, p, stream=False)
            order.append(rid)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Generating", disable=not use_tqdm)
        while self.engine.has_unfinished:
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        failed = self.engine.take_failed()          # requests the engine ended with an error (a failed step)
        if failed:
            raise failed[0][1]
        return [done[rid] for rid in order]

    def chat(self, conversations, params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """`conversations`: one list of {"role", "content"} messages, or a list of them."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.encode_chat(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, params, use_tqdm)

    def shutdown(self) -> None:
        """Stop the engine and give its device memory back (a second LLM in this process can use it)."""
        self.engine.shutdown()
        self.engine.runner.release_memory()


def _keyword_signature() -> inspect.Signature:
    """LLM(...)'s keywords as EngineConfig declares them (for help(LLM) and editors): `model` first, positional."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for s in EngineConfig.settings():
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if s.flat == "model" else inspect.Parameter.KEYWORD_ONLY
        params.append(inspect.Parameter(s.flat, kind, default=s.default))
    return inspect.Signature(params)


LLM.__init__.__signature__ = _keyword_signature()
LLM.__init__.__doc__ = "Keywords (EngineConfig's flat names; replicas/config.py):\n" + "\n".join(
    f"  {s.flat}: {s.help}" for s in EngineConfig.settings())
