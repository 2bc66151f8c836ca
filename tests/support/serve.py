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
