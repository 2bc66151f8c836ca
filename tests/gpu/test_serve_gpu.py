"""`tidal serve` end to end on GPUs, through the official openai SDK: the default model at TP=1 (greedy equal
to the offline engine on the same GPU), and a TP=2 replica with NCCL ranks on two GPUs equal to TP=1.

Ray and nccl4py come from ../shared/device/make-ray-bundle on the GPU machine; the default model is the
GGUF that TIDAL_DEFAULT_MODEL points at (staged there)."""
from __future__ import annotations

import gc

import pytest
import torch
from tests.support.checkpoints import make_tiny_llama
from tests.support.serve import start_tidal_serve

from replicas import LLM, SamplingParams

openai = pytest.importorskip("openai")
pytest.importorskip("ray")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = ["Once upon a time", "The three primary colors are", "def fibonacci(n):", "Paris is the capital of"]


def _greedy_offline(n_tokens: int, **llm_kw) -> list[str]:
    """In this process, after the server is gone; the memory is given back before the next server sizes its KV
    cache (the engine sizes from what the GPU has free, other processes included)."""
    llm = LLM(**llm_kw)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True))
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return [o.outputs[0].text for o in outs]


def _greedy_served(url: str, model: str, n_tokens: int) -> list[str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
    return [client.completions.create(model=model, prompt=p, max_tokens=n_tokens, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]


def test_default_model_served_on_gpu(tmp_path):
    server = start_tidal_serve(tmp_path / "serve.log", "--device", "cuda", "--gpu-memory-utilization", "0.3")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=600, max_retries=0)
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, max_tokens=16, temperature=0,
                                              messages=[{"role": "user", "content": "What is 2 + 2?"}])
        assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
        chunks = list(client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        assert chunks[-1].usage.completion_tokens == 24
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        two = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=12, n=2, seed=7,
                                        temperature=1.0)
        assert len(two.choices) == 2
        again = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=12, n=2, seed=7,
                                          temperature=1.0)
        assert [c.text for c in again.choices] == [c.text for c in two.choices]
        served = _greedy_served(server.url, model, 24)
    finally:
        assert server.stop() == 0, server.log_tail()
    offline = _greedy_offline(24, device="cuda", gpu_memory_utilization=0.3)
    assert served == offline
    assert streamed == offline[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_nccl_replica_equals_tp1(tmp_path):
    folder = make_tiny_llama(str(tmp_path / "tiny"), num_attention_heads=8, num_key_value_heads=2, hidden_size=256,
                             intermediate_size=512, num_hidden_layers=4)
    server = start_tidal_serve(tmp_path / "serve.log", "--device", "cuda", "--model", folder, "--tp", "2",
                               "--served-model-name", "tiny", "--dtype", "float32", "--gpu-memory-utilization", "0.3")
    try:
        served = _greedy_served(server.url, "tiny", 32)      # ranks on CUDA talk NCCL (distributed_backend auto)
    finally:
        assert server.stop() == 0, server.log_tail()
    assert served == _greedy_offline(32, model=folder, device="cuda", dtype="float32", gpu_memory_utilization=0.3)
