"""Shared fixtures: a real `tidal serve` (Ray Serve on CPU) for the whole session.

    tidal_server          base URL of `tidal serve --device cpu --replicas 2` (default model; elastic KV and the fleet
                          controller on), e.g. http://127.0.0.1:PORT
    tidal_metrics_port    the Ray cluster's Prometheus export port of that server
    tidal_metrics_url     http://127.0.0.1:{tidal_metrics_port}/metrics
    tidal_server_factory  start(*flags) -> LocalServer: more servers (own Ray cluster each), stopped at session end
"""
from __future__ import annotations

import os

import pytest

# Triton reads TRITON_INTERPRET when a kernel module is first imported, and collecting tests/gpu/ imports the
# kernels before the CPU kernel tests run: without a GPU, every kernel runs in Triton's interpreter.
import torch  # noqa: E402

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from cluster.local_server import LocalServer  # noqa: E402
from tests.support.serve import start_tidal_serve  # noqa: E402



@pytest.fixture(scope="session")
def tidal_server_factory(tmp_path_factory):
    started: list[LocalServer] = []

    def start(*flags: str) -> LocalServer:
        log_path = tmp_path_factory.mktemp("tidal-serve") / "serve.log"
        server = start_tidal_serve(log_path, *flags)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def tidal_serve_process(tidal_server_factory) -> LocalServer:
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
