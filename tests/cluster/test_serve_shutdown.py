"""However `tidal serve` ends, nothing of it outlives it: an idle server exits within 5 s of Ctrl-C (SIGINT to its
process group, as a terminal sends it) or SIGTERM; after SIGKILL of the CLI, or when its Ray cluster dies under
it (`ray stop`), no process and no listening port of the server is left 10 s later. With `--host 127.0.0.1` no
listener of the server is on every interface.

Each server runs a tiny random Llama (a fast start) with HAProxy in front; each test stops its own."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster.haproxy_binds import bind_to_host
from cluster.local_server import REPO, LocalServer
from cluster.loopback_binds import on_loopback_node
from cluster.reaper import descendants, naming, still_alive
from tests.support.checkpoints import make_tiny_llama
from tests.support.serve import start_tidal_serve

IDLE_EXIT_S = 5.0
NOTHING_LEFT_AFTER_S = 10.0
ALL_INTERFACES = ("0.0.0.0", "::", "*")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model")


@dataclass
class Listener:
    host: str
    port: int
    pid: int


def listeners() -> list[Listener]:
    """Every listening TCP socket of the processes this user can see, with its owner."""
    try:
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30, check=True).stdout
    except FileNotFoundError:
        return proc_net_listeners()
    found = []
    for line in out.splitlines():
        fields = line.split()
        host, _, port = fields[3].rpartition(":")
        for pid in re.findall(r"pid=(\d+)", line):
            found.append(Listener(host.strip("[]"), int(port), int(pid)))
    return found


def proc_net_listeners() -> list[Listener]:
    """`listeners()` from /proc/net/tcp{,6} and /proc/PID/fd, where iproute2's `ss` is missing."""
    inodes = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":                                        # TCP_LISTEN
                continue
            address, port = fields[1].split(":")
            host = "0.0.0.0" if width == 8 and int(address, 16) == 0 else "::" if int(address, 16) == 0 else address
            inodes[fields[9]] = (host, int(port, 16))
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for link in links:
            inode = link[len("socket:["):-1] if link.startswith("socket:[") else None
            if inode in inodes:
                found.append(Listener(*inodes[inode], pid))
    return found


def command_line(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@dataclass
class ServerFootprint:
    """What a running server consists of: its processes (pid -> start time), its state folder, its listeners."""
    processes: dict[int, int]
    state_dir: str
    listeners: list[Listener]

    @classmethod
    def of(cls, server: LocalServer) -> "ServerFootprint":
        processes = descendants(server.process.pid)
        reaper = next(pid for pid in processes if b"cluster.reaper" in command_line(pid))
        args = command_line(reaper).decode().split("\0")
        state_dir = args[args.index("--state-dir") + 1]
        processes.update(naming(state_dir))
        return cls(processes, state_dir, [lst for lst in listeners() if lst.pid in processes])

    def leftovers(self) -> list[str]:
        alive = {**still_alive(self.processes), **naming(self.state_dir)}
        left = [f"process {pid}: {command_line(pid)[:120]!r}" for pid in alive]
        ports = {lst.port for lst in self.listeners}
        left += [f"listener {lst}" for lst in listeners() if lst.port in ports and lst.pid in alive]
        if os.path.exists(self.state_dir):
            left.append(f"state folder {self.state_dir}")
        return left

    def assert_gone_within(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert not left, "\n".join(left)


def start(tmp_path: Path, tiny_llama: str, *flags: str) -> tuple[LocalServer, ServerFootprint]:
    server = start_tidal_serve(tmp_path / "serve.log", "--model", tiny_llama, "--ingress", "haproxy", *flags)
    return server, ServerFootprint.of(server)


def wait_exit(server: LocalServer, timeout_s: float) -> float:
    """Seconds until the CLI exits; it is killed (and the test fails) past `timeout_s`."""
    began = time.monotonic()
    try:
        server.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        server.stop(timeout_s=0)
        pytest.fail(f"the server did not exit within {timeout_s:.0f} s:\n{server.log_tail()}")
    return time.monotonic() - began


def assert_idle_server_exits_on(tmp_path: Path, tiny_llama: str, send_signal, *flags: str) -> ServerFootprint:
    server, footprint = start(tmp_path, tiny_llama, *flags)
    try:
        send_signal(server.process.pid)
        took = wait_exit(server, 60)
        assert server.process.returncode == 0, server.log_tail()
        assert took <= IDLE_EXIT_S, f"exited after {took:.1f} s:\n{server.log_tail()}"
        assert "tidal: shutting down" in server.log_path.read_text(errors="replace")
        footprint.assert_gone_within(NOTHING_LEFT_AFTER_S)
        return footprint
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_the_reaper_ends_what_its_process_started_once_it_is_killed(tmp_path):
    state_dir = tmp_path / "tidal-state"
    state_dir.mkdir()
    sleeper = "import sys, time; time.sleep(300)"
    # A stand-in for the CLI: starts the reaper, a child in a session of its own (as Ray's workers and HAProxy
    # leave the CLI's process group) and a process that only names the state folder, then waits to be killed.
    cli = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
from cluster.reaper import start_reaper
start_reaper({str(state_dir)!r})
subprocess.Popen([sys.executable, "-c", {sleeper!r}], start_new_session=True)
subprocess.Popen([sys.executable, "-c", {sleeper!r}, {str(state_dir / "log")!r}], start_new_session=True).wait()
"""], cwd=REPO, stdin=subprocess.DEVNULL)
    started: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 30
        while len(descendants(cli.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        started = descendants(cli.pid)
        assert len(started) == 3
        time.sleep(1.0)                                # the reaper's walk has seen them all
        cli.kill()
        cli.wait()
        deadline = time.monotonic() + NOTHING_LEFT_AFTER_S
        while (still_alive(started) or state_dir.exists()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not still_alive(started) and not state_dir.exists()
    finally:
        for pid in still_alive({**descendants(cli.pid), **started}):
            os.kill(pid, signal.SIGKILL)
        cli.kill()
        cli.wait()


@pytest.mark.timeout(30)
def test_haproxy_stats_and_metrics_listeners_bind_to_the_host():
    config = ("frontend prometheus\n    bind :9101\n"           # the lines Serve's HAProxy template writes
              "frontend http_frontend\n    bind 127.0.0.1:8000\n"
              "listen stats\n  bind *:8404\n")
    bound = bind_to_host(config, "127.0.0.1")
    assert re.findall(r"bind (\S+)", bound) == ["127.0.0.1:9101", "127.0.0.1:8000", "127.0.0.1:8404"]
    assert on_loopback_node("[::]:0", "127.0.0.1") == "127.0.0.1:0"
    assert on_loopback_node("[::]:0", "10.0.0.5") == "[::]:0"


def ctrl_c(pid: int) -> None:
    os.killpg(pid, signal.SIGINT)                  # a terminal's Ctrl-C: the whole foreground process group


@pytest.mark.timeout(240)
def test_idle_server_exits_on_ctrl_c_and_listens_on_host_only(tmp_path, tiny_llama):
    footprint = assert_idle_server_exits_on(tmp_path, tiny_llama, ctrl_c, "--host", "127.0.0.1")
    # the front door, HAProxy's stats and metrics, the replica's port, Ray's GCS, raylet, workers, metrics, ...
    assert len({lst.port for lst in footprint.listeners}) >= 8, footprint.listeners
    on_every_interface = [lst for lst in footprint.listeners if lst.host in ALL_INTERFACES]
    assert not on_every_interface, on_every_interface


@pytest.mark.timeout(240)
def test_idle_server_exits_on_sigterm(tmp_path, tiny_llama):
    assert_idle_server_exits_on(tmp_path, tiny_llama, lambda pid: os.kill(pid, signal.SIGTERM))


@pytest.mark.timeout(240)
def test_nothing_outlives_a_killed_cli(tmp_path, tiny_llama):
    server, footprint = start(tmp_path, tiny_llama)
    try:
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=30)
        footprint.assert_gone_within(NOTHING_LEFT_AFTER_S)
    finally:
        server.stop()


@pytest.mark.timeout(240)
def test_the_cli_exits_when_its_ray_cluster_dies(tmp_path, tiny_llama):
    server, footprint = start(tmp_path, tiny_llama)
    try:
        ray_core = [pid for pid in footprint.processes if command_line(pid).split(b"\0")[0].endswith(
            (b"/gcs_server", b"/raylet"))]
        assert len(ray_core) == 2
        for pid in ray_core:                       # `ray stop --force` (`ray stop` ends with it after a grace period)
            os.kill(pid, signal.SIGKILL)
        wait_exit(server, 30)
        assert "the Ray cluster stopped" in server.log_path.read_text(errors="replace")
        footprint.assert_gone_within(NOTHING_LEFT_AFTER_S)
    finally:
        server.stop()
