"""HAProxy's stats and metrics listeners on `tidal serve --host`.

Ray Serve's HAProxy config binds its front door to the HTTP host, but its stats (`bind *:PORT`) and Prometheus
(`bind :PORT`) listeners to every interface, with no setting to change that (ray/serve/_private/haproxy_templates.py).
`tidal serve` therefore points RAY_SERVE_HAPROXY_BINARY_PATH at a launcher (`write_launcher`) that runs this module:
it rebinds those lines of the config file named by `-f` to the host, then execs the real HAProxy with the same
arguments (so Serve's manager still finds its process by the config path in its command line).

    python haproxy_binds.py HOST REAL_HAPROXY [haproxy args...]
"""
from __future__ import annotations

import fcntl
import os
import re
import shlex
import sys

# `bind :9101` and `bind *:8404`: the listeners with no address, i.e. on every interface.
_ANY_ADDRESS_BIND = re.compile(r"^(\s*bind\s+)\*?:(\d+)", re.MULTILINE)


def bind_to_host(config: str, host: str) -> str:
    """`config` with every address-less `bind` line bound to `host`."""
    return _ANY_ADDRESS_BIND.sub(lambda m: f"{m.group(1)}{host}:{m.group(2)}", config)


def config_path(haproxy_args: list[str]) -> str:
    return haproxy_args[haproxy_args.index("-f") + 1]


def write_launcher(path: str, host: str, real_haproxy: str) -> str:
    """An executable at `path` that Serve runs as HAProxy; returns `path`."""
    command = [sys.executable, "-I", os.path.abspath(__file__), host, real_haproxy]
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\nexec {shlex.join(command)} \"$@\"\n")
    os.chmod(path, 0o755)
    return path


def main(argv: list[str]) -> None:
    host, real_haproxy, haproxy_args = argv[0], argv[1], argv[2:]
    path = config_path(haproxy_args)
    with open(path + ".lock", "w") as lock:          # the lock Serve's manager writes the config under
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        with open(path) as f:
            config = f.read()
        bound = bind_to_host(config, host)
        if bound != config:
            with open(path, "w") as f:
                f.write(bound)
    os.execv(real_haproxy, [real_haproxy, *haproxy_args])


if __name__ == "__main__":
    main(sys.argv[1:])
