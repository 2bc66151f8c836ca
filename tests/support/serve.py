"""A real `tidal serve` process for the tests: starting one, finding its processes, waiting until it serves."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import psutil
import requests

from cluster.local_server import LocalServer

START_TIMEOUT_S = 600.0


def start_tidal_serve(log_path: Path, *flags: str) -> LocalServer:
    """`tidal serve --device cpu *flags` (a later `--device` wins), once it serves."""
    server = LocalServer(["--device", "cpu", *flags], log_path)
    server.wait_ready(START_TIMEOUT_S)
    return server


def processes_titled(server: LocalServer, title: str) -> list[int]:
    """The server's live processes whose command line holds `title` (a Ray worker's is `ray::<Actor>...`)."""
    pids = []
    for proc in psutil.Process(server.process.pid).children(recursive=True):
        try:
            if title in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                pids.append(proc.pid)
        except psutil.Error:
            continue
    return pids


def wait_serving(server: LocalServer, model: str, within_s: float, headers: Optional[dict] = None) -> None:
    """Until a one-token completion succeeds (a replacement replica serves); fails past `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            r = requests.post(f"{server.url}/v1/completions", headers=headers, timeout=60,
                              json={"model": model, "prompt": "Hi", "max_tokens": 1})
            if r.status_code == 200:
                return
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, f"not serving within {within_s} s:\n{server.log_tail()}"
        time.sleep(0.5)


def burst_completion_tokens(server: LocalServer, model: str, requests_at_once: int, max_tokens: int) -> list[int]:
    """`requests_at_once` completions sent together with the openai SDK (no retries); each one's
    completion_tokens, in order. A refusal raises."""
    import asyncio

    import openai

    async def burst() -> list[int]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=600, max_retries=0)

        async def one(i: int) -> int:
            out = await client.completions.create(model=model, prompt=f"Question {i}:", max_tokens=max_tokens,
                                                  temperature=0, extra_body={"ignore_eos": True})
            return out.usage.completion_tokens
        try:
            return await asyncio.gather(*(one(i) for i in range(requests_at_once)))
        finally:
            await client.close()

    return asyncio.run(burst())
