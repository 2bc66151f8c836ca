"""Start and stop a real Prometheus server for tests, and query it.

`scripts/install-prometheus.sh` installs the binary (Debian's `prometheus`); tests skip when it is
missing. The config is written as JSON (a subset of YAML), one job per target list, scraped every
second.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from replicas.distributed.launch import free_port  # noqa: F401  (re-exported for the tests)


def prometheus_binary() -> Optional[str]:
    return shutil.which("prometheus")


@dataclass(frozen=True)
class ScrapeJob:
    name: str
    targets: tuple[str, ...]                 # "host:port"
    metric_relabel_configs: tuple[dict, ...] = ()


@dataclass
class PrometheusServer:
    url: str
    process: subprocess.Popen
    workdir: Path
    log_path: Path
    _log_file: object = field(repr=False, default=None)

    def api(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query: a list of {"metric": labels, "value": [ts, "v"]} (empty when nothing matches)."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def value(self, expr: str) -> Optional[float]:
        """The single value of a scalar-like expression, None when it returns nothing."""
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else None

    def series(self, match: str) -> list[dict]:
        return self.api("series", **{"match[]": match})

    def label_values(self, label: str, match: str) -> list[str]:
        return self.api(f"label/{label}/values", **{"match[]": match})

    def metric_names(self) -> list[str]:
        return self.api("label/__name__/values")

    def wait_until(self, check: Callable[[], object], timeout: float, what: str, poll_s: float = 0.5):
        """Poll `check` until it returns something truthy; returns it."""
        deadline = time.monotonic() + timeout
        while True:
            got = check()
            if got:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.log_tail()}")
            time.sleep(poll_s)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        if self._log_file is not None:
            self._log_file.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def write_config(path: Path, jobs: list[ScrapeJob], scrape_interval: str = "1s") -> None:
    config = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": [
            {"job_name": job.name, "scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
             "static_configs": [{"targets": list(job.targets)}],
             **({"metric_relabel_configs": list(job.metric_relabel_configs)} if job.metric_relabel_configs else {})}
            for job in jobs
        ],
    }
    path.write_text(json.dumps(config, indent=2))


def start_prometheus(jobs: list[ScrapeJob], scrape_interval: str = "1s", ready_timeout: float = 60) -> PrometheusServer:
    binary = prometheus_binary()
    if binary is None:
        raise FileNotFoundError("prometheus is not installed (run scripts/install-prometheus.sh)")
    workdir = Path(tempfile.mkdtemp(prefix="tidal-prometheus-"))
    config = workdir / "prometheus.yml"
    write_config(config, jobs, scrape_interval)
    port = free_port()
    log_path = workdir / "prometheus.log"
    log_file = open(log_path, "w")
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle"],
        stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = PrometheusServer(f"http://127.0.0.1:{port}", process, workdir, log_path, log_file)
    deadline = time.monotonic() + ready_timeout
    while True:
        if process.poll() is not None:
            tail = server.log_tail()
            server.stop()
            raise RuntimeError(f"prometheus exited with {process.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if time.monotonic() > deadline:
            tail = server.log_tail()
            server.stop()
            raise RuntimeError(f"prometheus not ready after {ready_timeout}s:\n{tail}")
        time.sleep(0.2)
