"""Shared fixtures: a real `tidal serve` (Ray Serve on CPU) for the whole session.

    tidal_server          base URL of `tidal serve --device cpu --replicas 2` (default model; elastic KV and the fleet
                          controller on), e.g. http://127.0.0.1:PORT
    tidal_metrics_port    the Ray cluster's Prometheus export port of that server
    tidal_metrics_url     http://127.0.0.1:{tidal_metrics_port}/metrics
    tidal_server_factory  start(*flags) -> LocalServer: more servers (own Ray cluster each), stopped when the test
                          module that started them ends
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



class ServerPool:
    """Servers started for one scope, stopped when it ends: an idle server still costs its Ray cluster's
    background work and its engines' memory, so none outlives the tests that use it."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.started: list[LocalServer] = []

    def start(self, *flags: str) -> LocalServer:
        server = start_tidal_serve(self.tmp_path_factory.mktemp("tidal-serve") / "serve.log", *flags)
        self.started.append(server)
        return server

    def stop_all(self) -> None:
        for server in self.started:
            server.stop()


@pytest.fixture(scope="module")
def tidal_server_factory(tmp_path_factory):
    pool = ServerPool(tmp_path_factory)
    yield pool.start
    pool.stop_all()


SESSION_SERVER = "tidal_serve_process"
_session_pool: list[ServerPool] = []
_last_session_server_user: list[pytest.Item] = []


@pytest.fixture(scope="session")
def tidal_serve_process(tmp_path_factory) -> LocalServer:
    # Elastic lending (CPU logical reserve) and the fleet controller (auto, the policy CUDA servers run) too, so
    # the whole serving stack, their metrics and their dashboards are exercised.
    pool = ServerPool(tmp_path_factory)
    _session_pool.append(pool)
    yield pool.start("--replicas", "2", "--elastic", "elastic", "--reserve-blocks", "128",
                     "--controller", "auto", "--controller-interval", "2", "--knob", "max_num_batched_tokens=4096")
    pool.stop_all()


def pytest_collection_finish(session):
    users = [item for item in session.items if SESSION_SERVER in getattr(item, "fixturenames", ())]
    _last_session_server_user[:] = users[-1:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The session's server stops right after the last test that uses it, not at the end of the session."""
    yield
    if _last_session_server_user and item is _last_session_server_user[0]:
        for pool in _session_pool:
            pool.stop_all()


@pytest.fixture(scope="session")
def tidal_server(tidal_serve_process) -> str:
    return tidal_serve_process.url


@pytest.fixture(scope="session")
def tidal_metrics_port(tidal_serve_process) -> int:
    return tidal_serve_process.metrics_port


@pytest.fixture(scope="session")
def tidal_metrics_url(tidal_metrics_port) -> str:
    return f"http://127.0.0.1:{tidal_metrics_port}/metrics"
