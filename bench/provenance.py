"""The provenance block every benchmark's JSON carries: when, which commit (and whether the tree differed from it),
on what machine, with which command and seed. Each benchmark adds its own `warm_up` and `counted`."""
from __future__ import annotations

import os
import platform
import subprocess
from datetime import datetime, timezone

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git(*cmd: str) -> str:
    try:
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine(device: str) -> str:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    host = f"{platform.machine()}, {os.cpu_count()} CPU cores, {memory / 2**30:.0f} GiB"
    if device.startswith("cuda"):
        import torch
        host = f"{torch.cuda.get_device_name()}; {host}"
    return host


def source() -> dict:
    """Which commit the code is: `TIDAL_COMMIT` where the one who ran it says so (a working tree copied to another
    machine, whose own .git may be an older commit's; whether that tree differed is then theirs to say, null here),
    else git's HEAD and whether the tracked files differ from it."""
    given = os.environ.get("TIDAL_COMMIT")
    if given:
        return {"commit": given, "tree_dirty": None}
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "tree_dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def provenance(module: str, argv: list[str], device: str, seed: int, **extra) -> dict:
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), **source(), "machine": machine(device),
            "command": " ".join([f"python -m {module}", *argv]), "seed": seed, **extra}


def repo_path(path: str) -> str:
    """A path as a result file keeps it: relative to the repository when inside it, else absolute."""
    path = os.path.abspath(path)
    return os.path.relpath(path, REPO) if path.startswith(REPO + os.sep) else path
