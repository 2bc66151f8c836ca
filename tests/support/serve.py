"""A real `tidal serve` process for the tests."""
from __future__ import annotations

from pathlib import Path

from cluster.local_server import LocalServer

START_TIMEOUT_S = 600.0


def start_tidal_serve(log_path: Path, *flags: str) -> LocalServer:
    """`tidal serve --device cpu *flags` (a later `--device` wins), once it serves."""
    server = LocalServer(["--device", "cpu", *flags], log_path)
    server.wait_ready(START_TIMEOUT_S)
    return server
