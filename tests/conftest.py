"""Shared fixtures: a real `tidal serve` (Ray Serve on CPU) for the whole session.

    tidal_server          base URL of `tidal serve --device cpu --replicas 2` (default model; elastic KV and the fleet
                          controller on), e.g. http://127.0.0.1:PORT
    tidal_metrics_port    the Ray cluster's Prometheus export port of that server
    tidal_metrics_url     http://127.0.0.1:{tidal_metrics_port}/metrics
    tidal_server_factory  start(*flags) -> ServeProcess: more servers (own Ray cluster each), stopped at session end
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

# Triton reads TRITON_INTERPRET when a kernel module is first imported, and collecting tests/gpu/ imports the
# kernels before the CPU kernel tests run: without a GPU, every kernel runs in Triton's interpreter.
import torch  # noqa: E402

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tidal_command() -> list[str]:
    """`tidal serve` from this interpreter's environment; `python -m cluster.serve_cmd` before `pip install -e .`."""
    script = Path(sys.executable).with_name("tidal")
    return [str(script), "serve"] if script.exists() else [sys.executable, "-m", "cluster.serve_cmd"]


@dataclass
class ServeProcess:
    url: str
    metrics_port: int
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self) -> int:
        """SIGTERM, as a supervisor would; returns the exit code (the server drains, then exits 0)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode


def start_tidal_serve(log_path: Path, *flags: str) -> ServeProcess:
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)
    cmd = [*tidal_command(), "--device", "cpu", "--port", str(port), "--metrics-port", str(metrics_port), *flags]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    server = ServeProcess(f"http://127.0.0.1:{port}", metrics_port, proc, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode}:\n{server.log_tail()}")
        if "tidal: serving" in log_path.read_text(errors="replace") and _healthy(server.url):
            return server
        time.sleep(1.0)
    server.stop()
    raise RuntimeError(f"`{' '.join(cmd)}` was not healthy within {START_TIMEOUT_S:.0f}s:\n{server.log_tail()}")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            return r.status == 200 and "model" in json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return False


@pytest.fixture(scope="session")
def tidal_server_factory(tmp_path_factory):
    started: list[ServeProcess] = []

    def start(*flags: str) -> ServeProcess:
        log_path = tmp_path_factory.mktemp("tidal-serve") / "serve.log"
        server = start_tidal_serve(log_path, *flags)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def tidal_serve_process(tidal_server_factory) -> ServeProcess:
    # Elastic lending (CPU logical reserve) and the fleet controller run too, so the whole serving stack,
    # their metrics and their dashboards are exercised; the controller's first round restores the budget.
    return tidal_server_factory("--replicas", "2", "--elastic", "elastic", "--reserve-blocks", "128",
                                "--controller", "--controller-interval", "2",
                                "--knob", "max_num_batched_tokens=4096")


@pytest.fixture(scope="session")
def tidal_server(tidal_serve_process) -> str:
    return tidal_serve_process.url


@pytest.fixture(scope="session")
def tidal_metrics_port(tidal_serve_process) -> int:
    return tidal_serve_process.metrics_port


@pytest.fixture(scope="session")
def tidal_metrics_url(tidal_metrics_port) -> str:
    return f"http://127.0.0.1:{tidal_metrics_port}/metrics"
