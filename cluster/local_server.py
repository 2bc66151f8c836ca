"""`tidal serve` as a child process in its own session (so its own local Ray cluster): start it, wait until
it serves, stop it the way a supervisor would. Tests and benchmarks start servers through this."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from replicas.distributed.launch import free_port

REPO = Path(__file__).resolve().parent.parent


def tidal_command() -> list[str]:
    """`tidal serve` from this interpreter's environment; `python -m cluster.serve_cmd` before `pip install -e .`."""
    script = Path(sys.executable).with_name("tidal")
    return [str(script), "serve"] if script.exists() else [sys.executable, "-m", "cluster.serve_cmd"]


class LocalServer:
    """One `tidal serve --port P --metrics-port M *flags`; its output goes to `log_path` (a temporary file,
    removed at stop, when none is given)."""

    def __init__(self, flags: list[str], log_path: Optional[Path] = None):
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._own_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="tidal-serve-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = Path(log_path)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        env.pop("RAY_ADDRESS", None)
        self.cmd = [*tidal_command(), "--port", str(self.port), "--metrics-port", str(self.metrics_port), *flags]
        with open(self.log_path, "wb") as log:
            # No descriptor of the caller's (stdin included) reaches the server or what it starts.
            self.process = subprocess.Popen(self.cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def healthy_model(self) -> Optional[str]:
        """The served model id once /health answers, else None."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=10) as r:
                return json.loads(r.read()).get("model") if r.status == 200 else None
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def wait_ready(self, timeout_s: float = 600.0) -> str:
        """The served model id, once the server says it is serving and /health answers; RuntimeError if it
        exits or is not healthy in time (then it is stopped)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"`{' '.join(self.cmd)}` exited with {self.process.returncode}:\n{self.log_tail()}")
            if "tidal: serving" in self.log_path.read_text(errors="replace"):
                model = self.healthy_model()
                if model is not None:
                    return model
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"`{' '.join(self.cmd)}` was not healthy within {timeout_s:.0f}s:\n{self.log_tail()}")

    def replica_urls(self) -> list[str]:
        """The replicas' direct-ingress URLs the server printed (`tidal: replica direct ingress at URL/v1`)."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [line.split(" at ", 1)[1].removesuffix("/v1") for line in lines
                if line.startswith("tidal: replica direct ingress at ")]

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM (the server drains, deletes the app and shuts its Ray down, exit code 0); SIGKILL to the
        whole session if it hangs or the wait is interrupted (the server's reaper then ends what it started).
        Returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._kill()
            except BaseException:             # interrupted while it drains: leave no cluster behind
                self._kill()
                raise
        if self._own_log:
            self.log_path.unlink(missing_ok=True)
        return self.process.returncode

    def _kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
