"""Request arrivals and the streaming OpenAI client that times every SSE chunk."""
from __future__ import annotations

import asyncio
import json
import math
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Optional, Sequence

import aiohttp
import numpy as np
from tqdm import tqdm

from cluster.benchmark.datasets import BenchRequest


def arrival_offsets(num_requests: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send times in seconds from the start: the first at 0, then gamma-distributed gaps.

    Gaps have mean 1/rate and shape `burstiness` (1 = Poisson process); a smaller burstiness
    gives burstier traffic at the same mean rate (coefficient of variation 1/sqrt(burstiness)).
    An infinite rate sends everything at once.
    """
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(num_requests)
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=max(num_requests - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])[:num_requests]


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0             # dataset tokens, or the server's usage.prompt_tokens when the tokenizer is a proxy
    output_tokens: int = 0          # server's usage.completion_tokens, else the number of content chunks
    ttft: float = 0.0               # seconds, request sent -> first content chunk
    itl: list[float] = field(default_factory=list)   # seconds between successive content chunks
    latency: float = 0.0            # seconds, request sent -> end of stream (E2EL)
    error: str = ""


@dataclass(frozen=True)
class ApiTarget:
    base_url: str
    endpoint: str                   # /v1/completions or /v1/chat/completions
    model: str
    ignore_eos: bool = False
    timeout_s: float = 600.0

    @property
    def chat(self) -> bool:
        return "chat" in self.endpoint


def normalize_base_url(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def first_model_id(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model id the server lists at GET /v1/models."""
    with urllib.request.urlopen(f"{normalize_base_url(base_url)}/v1/models", timeout=timeout_s) as resp:
        models = json.load(resp).get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


class StreamingClient:
    """Sends one benchmark request as a streaming completion and times its chunks.

    Any failure (HTTP status, broken or truncated stream, timeout, an error event, no content)
    comes back as an unsuccessful `RequestResult` carrying the error text; nothing is raised.
    """

    def __init__(self, session: aiohttp.ClientSession, target: ApiTarget, prompt_lens_exact: bool):
        self.session = session
        self.target = target
        self.prompt_lens_exact = prompt_lens_exact
        self.url = normalize_base_url(target.base_url) + target.endpoint

    def body(self, request: BenchRequest) -> dict:
        body = {"model": self.target.model, "max_tokens": request.output_len, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.target.chat:
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        if self.target.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def send(self, request: BenchRequest) -> RequestResult:
        result = RequestResult(prompt_len=request.prompt_len)
        start = time.perf_counter()
        try:
            timeout = aiohttp.ClientTimeout(total=self.target.timeout_s)
            async with self.session.post(self.url, json=self.body(request), timeout=timeout) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    result.error = f"HTTP {resp.status}: {text[:200]}"
                    return result
                await self._read_stream(resp, result, start)
        except asyncio.TimeoutError:
            result.error = f"timeout after {self.target.timeout_s:g} s"
        except Exception as e:  # a broken stream or a malformed event must not crash the benchmark
            result.error = f"{type(e).__name__}: {e}"
        return result

    def _content(self, event: dict) -> str:
        choices = event.get("choices") or []
        if not choices:
            return ""
        if self.target.chat:
            return (choices[0].get("delta") or {}).get("content") or ""
        return choices[0].get("text") or ""

    async def _read_stream(self, resp: aiohttp.ClientResponse, result: RequestResult, start: float) -> None:
        chunk_times: list[float] = []
        usage: Optional[dict] = None
        done = False
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            now = time.perf_counter()
            if data == b"[DONE]":
                done = True
                break
            event = json.loads(data)
            if event.get("error"):
                raise RuntimeError(f"error event: {str(event['error'])[:200]}")
            usage = event.get("usage") or usage
            if self._content(event):
                chunk_times.append(now)
        end = time.perf_counter()
        if not done:
            raise ConnectionError("stream ended before [DONE]")
        if not chunk_times:
            raise RuntimeError("stream carried no content")
        result.ttft = chunk_times[0] - start
        result.itl = np.diff(chunk_times).tolist()
        result.latency = end - start
        result.output_tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage \
            else len(chunk_times)
        if not self.prompt_lens_exact and usage and "prompt_tokens" in usage:
            result.prompt_len = int(usage["prompt_tokens"])
        result.success = True


@dataclass(frozen=True)
class LoadSettings:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: Optional[int] = None
    seed: int = 0
    num_warmups: int = 1
    disable_tqdm: bool = False


@dataclass
class LoadOutcome:
    results: list[RequestResult]    # in dataset order
    duration: float                 # seconds, first send -> last completion (warm-up excluded)
    warmup_output_tokens: int


class WarmupError(RuntimeError):
    pass


async def run_load(target: ApiTarget, requests: Sequence[BenchRequest], settings: LoadSettings,
                   prompt_lens_exact: bool) -> LoadOutcome:
    """Warm up, then send `requests` at their arrival times, at most `max_concurrency` in flight."""
    offsets = arrival_offsets(len(requests), settings.request_rate, settings.burstiness, settings.seed)
    limit = settings.max_concurrency
    slots = asyncio.Semaphore(limit) if limit else None
    connector = aiohttp.TCPConnector(limit=limit or 0)
    async with aiohttp.ClientSession(connector=connector, trust_env=True) as session:
        client = StreamingClient(session, target, prompt_lens_exact)
        warmup_tokens = 0
        for _ in range(settings.num_warmups if requests else 0):
            warm = await client.send(requests[0])
            if not warm.success:
                raise WarmupError(f"warm-up request failed: {warm.error}")
            warmup_tokens += warm.output_tokens

        bar = tqdm(total=len(requests), disable=settings.disable_tqdm, desc="requests")

        async def one(request: BenchRequest) -> RequestResult:
            if slots is None:
                result = await client.send(request)
            else:
                async with slots:
                    result = await client.send(request)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for request, offset in zip(requests, offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return LoadOutcome(list(results), duration, warmup_tokens)
