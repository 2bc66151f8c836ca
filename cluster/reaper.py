"""The reaper of `tidal serve`'s local cluster: a small process, in a session of its own, that outlives the CLI by
a few seconds. However the CLI ends (a clean exit, a signal, SIGKILL), the reaper then ends every process the
server started and removes the server's state folder.

What it ends: the CLI's descendants as last seen (it walks /proc while the CLI lives, so processes that Ray
reparents, such as HAProxy when its manager dies, are still known), and every process whose command line names
the state folder (Ray's temp folder and HAProxy's config live there, so a process started after the last walk is
found too). A known pid counts only with the start time it had when seen: a reused pid is left alone.

    python -m cluster.reaper --watch PID --state-dir DIR
"""
from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from typing import Iterable, Optional

WALK_INTERVAL_S = 1.0
TERM_GRACE_S = 3.0


def proc_stat(pid: int) -> Optional[tuple[int, int]]:
    """(parent pid, start time in clock ticks) of a live process, else None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()     # the name in parentheses may hold spaces
    if fields[0] == b"Z":
        return None
    return int(fields[1]), int(fields[19])


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live descendant of `root`."""
    children: dict[int, list[tuple[int, int]]] = {}
    for pid in all_pids():
        stat = proc_stat(pid)
        if stat is not None:
            children.setdefault(stat[0], []).append((pid, stat[1]))
    found, todo = {}, [root]
    while todo:
        for pid, start in children.get(todo.pop(), ()):
            if pid not in found:
                found[pid] = start
                todo.append(pid)
    return found


def naming(text: str) -> dict[int, int]:
    """pid -> start time of every live process whose command line contains `text`."""
    needle, found = text.encode(), {}
    for pid in all_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle not in f.read():
                    continue
        except OSError:
            continue
        stat = proc_stat(pid)
        if stat is not None:
            found[pid] = stat[1]
    return found


def still_alive(known: dict[int, int]) -> dict[int, int]:
    alive = {}
    for pid, start in known.items():
        stat = proc_stat(pid)
        if stat is not None and stat[1] == start:
            alive[pid] = start
    return alive


def signal_all(known: dict[int, int], signum: int) -> None:
    for pid in still_alive(known):
        try:
            os.kill(pid, signum)
        except OSError:
            pass


def end_processes(known: dict[int, int], state_dir: str, spare: Iterable[int] = (),
                  grace_s: float = TERM_GRACE_S) -> None:
    """End `known` and every process whose command line contains `state_dir` but this one and `spare`: SIGTERM,
    `grace_s`, then SIGKILL; twice, for what a dying process started meanwhile."""
    spare = {os.getpid(), *spare}
    for _ in range(2):
        targets = {pid: start for pid, start in {**known, **naming(state_dir)}.items() if pid not in spare}
        if not still_alive(targets):
            return
        signal_all(targets, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while still_alive(targets) and time.monotonic() < deadline:
            time.sleep(0.1)
        signal_all(targets, signal.SIGKILL)
        known = {}


def wait_for_exit(pid: int, on_tick) -> None:
    """Block until `pid` exits, calling `on_tick()` every WALK_INTERVAL_S meanwhile."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    try:
        while True:
            on_tick()
            if fd is not None:
                if select.select([fd], [], [], WALK_INTERVAL_S)[0]:
                    return
            else:
                if proc_stat(pid) is None:
                    return
                time.sleep(WALK_INTERVAL_S)
    finally:
        if fd is not None:
            os.close(fd)


def reap(watch: int, state_dir: str) -> None:
    known: dict[int, int] = {}

    def walk() -> None:
        known.update(descendants(watch))

    wait_for_exit(watch, walk)
    end_processes(known, state_dir + os.sep)
    shutil.rmtree(state_dir, ignore_errors=True)


_reapers: list[subprocess.Popen] = []


def start_reaper(state_dir: str) -> subprocess.Popen:
    """The reaper of this process and `state_dir`, detached: its own session (a signal to this process's group
    does not reach it) and no inherited descriptors (it holds no caller's pipe open)."""
    reaper = subprocess.Popen([sys.executable, "-m", "cluster.reaper", "--watch", str(os.getpid()),
                               "--state-dir", state_dir],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              close_fds=True, start_new_session=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _reapers.append(reaper)
    return reaper


def end_server_processes(state_dir: str) -> None:
    """In the CLI, once Ray is shut down: end what is left of the server (HAProxy's draining workers, ...) now,
    sparing the reaper, so that nothing of it outlives the CLI's exit."""
    end_processes(descendants(os.getpid()), state_dir + os.sep, spare=[r.pid for r in _reapers], grace_s=1.0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.reaper", description=__doc__.split("\n\n")[0])
    p.add_argument("--watch", type=int, required=True, help="the pid whose exit ends its processes")
    p.add_argument("--state-dir", required=True, help="the server's state folder: its processes name it; removed")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C goes to the CLI; the reaper acts when it is gone
    reap(args.watch, os.path.abspath(args.state_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
