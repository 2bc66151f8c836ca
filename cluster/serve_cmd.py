"""`tidal serve`: start (or join) a Ray cluster, deploy the OpenAI app, serve until Ctrl-C/SIGTERM."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Optional

from pydantic import ValidationError

from cluster.admission import MAX_QUEUED_REQUESTS
from cluster.controller import ACTOR_NAME as CONTROLLER_ACTOR
from cluster.controller_policies import POLICIES
from cluster.local_cluster import (SERVE_ENV, cluster_alive, haproxy_available, haproxy_env, haproxy_replicas_up,
                                   is_loopback, keep_ray_on_loopback, ray_init_options)
from replicas import envs
from replicas.config import EngineConfig, add_engine_arguments, engine_kwargs_from_args
from replicas.device import resolve_device

logger = logging.getLogger("tidal.serve")

APP_NAME = "tidal"
READY_TIMEOUT_S = 900.0
DEFAULT_DRAIN_TIMEOUT_S = 30.0
# Beyond the drain: Serve and Ray stopping. A shutdown that overruns both exits at once; the reaper ends the rest.
SHUTDOWN_MARGIN_S = 30.0
LOST_CLUSTER_SHUTDOWN_S = 10.0
# Requests still running this long before the drain period ends get their 503 (`shutting_down`), ahead of Serve
# killing the replica at the end of it.
DRAIN_ANSWER_MARGIN_S = 2.0


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API on Ray Serve",
                              description="Serve a model (default: the embedded SmolLM2-135M-Instruct) on Ray "
                                          "Serve. Joins the cluster in RAY_ADDRESS if set, else starts a local one.")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the model's name)")
    p.add_argument("--replicas", type=int, default=1, help="number of replicas")
    p.add_argument("--api-server-count", type=int, default=None, metavar="N",
                   help="HTTP processes per replica, each streaming its requests from the replica's engine core "
                        "(1: the replica serves HTTP itself; default 4 on CUDA, 1 on CPU)")
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
    p.add_argument("--max-queued-requests", type=int, default=MAX_QUEUED_REQUESTS,
                   help="requests one replica holds beyond --max-ongoing-requests, a safety bound (-1: none); "
                        "beyond it, or beyond --max-queued-tokens, an OpenAI 503 with Retry-After")
    p.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE",
                   help="initial runtime knob (Serve user_config), e.g. max_num_batched_tokens=1024; repeatable")
    p.add_argument("--controller", nargs="?", const="auto", default=None, choices=POLICIES, metavar="POLICY",
                   help="the fleet controller's policy: static (changes nothing), chunk (the smallest "
                        "max_num_batched_tokens within the TTFT SLO), elastic (lending by prefill pressure), auto "
                        "(per replica, whichever of the two measured better); bare --controller: auto "
                        "(default: auto on CUDA, static on CPU)")
    p.add_argument("--controller-interval", type=float, default=5.0, help="seconds between controller rounds")
    p.add_argument("--controller-advisory", action="store_true",
                   help="the controller decides, logs and exports its decisions but applies none")
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0, help="the controller's time-to-first-token SLO")
    p.add_argument("--itl-slo-ms", type=float, default=100.0, help="the controller's inter-token latency SLO")
    p.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="a request still running this long is aborted: a 504, or an in-band error on a stream")
    p.add_argument("--drain-timeout-s", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="at Ctrl-C/SIGTERM, how long in-flight requests may run on before the replicas stop")
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
    from cluster.app import AppArgs, ControllerArgs      # imports Ray Serve: not for `tidal --help`

    engine = engine_kwargs_from_args(args)
    if engine.get("device", "auto") == "auto" and not os.environ.get("RAY_ADDRESS"):
        engine["device"] = resolve_device("auto").type
    device = engine.get("device", "auto")
    tp = EngineConfig.from_flat(**engine).tensor_parallel_size
    cpus_per_rank = max(1, (os.cpu_count() or 1) // (args.replicas * tp)) if device == "cpu" else 1
    policy = args.controller or ("auto" if device == "cuda" else "static")
    controller = ControllerArgs(policy=policy, interval_s=args.controller_interval, advisory=args.controller_advisory,
                                ttft_slo_ms=args.ttft_slo_ms, itl_slo_ms=args.itl_slo_ms, app_name=APP_NAME)
    return AppArgs(served_model_name=args.served_model_name, num_replicas=args.replicas,
                   api_server_count=args.api_server_count, api_key=args.api_key,
                   cpus_per_rank=cpus_per_rank, max_ongoing_requests=args.max_ongoing_requests,
                   max_queued_requests=args.max_queued_requests, engine_kwargs=engine, knobs=_knobs(args.knob),
                   graceful_shutdown_timeout_s=args.drain_timeout_s, request_timeout_s=args.request_timeout_s,
                   controller=controller)


def run_serve(args: argparse.Namespace) -> int:
    """`tidal serve`: serve until stopped, stop everything, then end the process with the exit code (after a
    started Ray, Python's own exit would spend seconds tearing down Ray's native core worker)."""
    code = serve_until_stopped(args)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve_until_stopped(args: argparse.Namespace) -> int:
    """Start (or join) the cluster, deploy, serve until a signal or the cluster's end, stop; the exit code."""
    import ray
    from ray import serve

    from cluster.app import api_server_count, build_app
    from cluster.reaper import start_reaper

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
    cluster_lost = threading.Event()
    state_dir = None
    routed_by_own_haproxy = False
    try:
        if joined:
            ray.init(address=os.environ["RAY_ADDRESS"])
        else:
            # Everything of this server lives under state_dir; the reaper ends what names it, and what this
            # process started, once this process is gone, however it ends.
            state_dir = tempfile.mkdtemp(prefix="tidal-")
            start_reaper(state_dir)
            env = dict(SERVE_ENV)
            if args.ingress == "haproxy" or (args.ingress == "auto" and haproxy_available()):
                env.update(haproxy_env(state_dir, args.host))
                routed_by_own_haproxy = os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") == "1"
            for key, value in env.items():            # read by Serve's processes, which inherit this environment
                os.environ.setdefault(key, value)
            if is_loopback(args.host):
                keep_ray_on_loopback()
            num_cpus = max(os.cpu_count() or 1, int(ranks * cpus_per_rank))
            with sigint_blocked():
                ray.init(**ray_init_options(args.host, num_cpus, args.metrics_port, state_dir))
        # After ray.init: Ray's core worker installs a SIGTERM handler that aborts the process.
        for s in old_handlers:
            signal.signal(s, on_signal)
        if not joined:
            watch_cluster(cluster_lost, stop)
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(app_args), name=APP_NAME, route_prefix="/")
        url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
        model = _wait_until_healthy(url, READY_TIMEOUT_S)
        if routed_by_own_haproxy:
            _wait_until_routed(args.replicas * api_server_count(app_args, device), READY_TIMEOUT_S)
        serving.set()
        metrics = "" if joined else f", Prometheus metrics on :{args.metrics_port}"
        for replica_url in replica_urls(APP_NAME, args.host):
            print(f"tidal: replica direct ingress at {replica_url}/v1", flush=True)
        front = "HAProxy" if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" else "Serve proxy"
        ingress = api_server_count(app_args, device)
        per_replica = f" with {ingress} ingress replicas each" if ingress > 1 else ""
        print(f"tidal: serving {model} at {url}/v1 ({front}; {args.replicas} replica(s) x TP{tp}{per_replica} on "
              f"{device}{metrics}, Ray at {ray.get_runtime_context().gcs_address}); Ctrl-C to stop", flush=True)
        while not stop.wait(1.0):
            pass
        if cluster_lost.is_set():
            print("tidal: the Ray cluster stopped (ray stop?); exiting", file=sys.stderr, flush=True)
            return 1
        print("tidal: shutting down (draining in-flight requests)", flush=True)
        return 0
    except KeyboardInterrupt:
        if cluster_lost.is_set():
            print("tidal: the Ray cluster stopped while starting (ray stop?)", file=sys.stderr, flush=True)
            return 1
        print("tidal: interrupted while starting", file=sys.stderr, flush=True)
        return 130
    except Exception as e:
        logger.exception("tidal serve failed")
        print(f"tidal serve: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop.set()     # however it ends: the cluster watch must not signal the shutdown below
        serving.set()  # a second signal during cleanup must not interrupt it
        _stop_within(args.drain_timeout_s, cluster_lost.is_set() or not (joined or cluster_alive()), state_dir)
        for s, h in old_handlers.items():
            signal.signal(s, h)


def watch_cluster(lost: threading.Event, stopping: threading.Event) -> None:
    """A thread that, once the local cluster's GCS or raylet has exited (`ray stop` under a running CLI), sets
    `lost` and sends this process SIGTERM: the CLI then stops without calling into the dead cluster. Once the CLI
    is `stopping` it shuts the cluster down itself, and the thread ends without a signal (one arriving after the
    CLI restored its old handlers would kill it)."""
    def watch():
        while cluster_alive():
            if stopping.wait(1.0):
                return
        if stopping.is_set():
            return
        lost.set()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="tidal-cluster-watch", daemon=True).start()


@contextlib.contextmanager
def sigint_blocked():
    """SIGINT blocked while Ray starts its processes: they inherit the mask, so a Ctrl-C at the terminal (sent to
    the whole process group) reaches only this process, which stops them in order. A SIGINT meanwhile is
    delivered here when the block ends."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


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


def _stop_within(drain_timeout_s: float, cluster_lost: bool, state_dir: Optional[str]) -> None:
    """Stop Serve, then the local Ray cluster (`state_dir`'s; None: a joined cluster, which stays) and what is left
    of it. A shutdown that overruns exits at once; the reaper ends the rest."""
    limit_s = LOST_CLUSTER_SHUTDOWN_S if cluster_lost else drain_timeout_s + SHUTDOWN_MARGIN_S

    def overran():
        print(f"tidal: shutdown did not finish within {limit_s:.0f}s; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    watchdog = threading.Timer(limit_s, overran)
    watchdog.daemon = True
    watchdog.start()
    try:
        _cleanup(cluster_lost, state_dir, drain_timeout_s)
    finally:
        watchdog.cancel()


def _cleanup(cluster_lost: bool, state_dir: Optional[str], drain_timeout_s: float) -> None:
    import ray
    from ray import serve

    from cluster.reaper import end_server_processes

    if ray.is_initialized() and not cluster_lost:     # Serve's calls would wait on a GCS that is gone
        try:
            try:
                ray.kill(ray.get_actor(CONTROLLER_ACTOR), no_restart=True)
            except ValueError:
                pass                                  # no controller was started
            _begin_drain(drain_timeout_s)
            # Deleting the app first lets its replicas drain in-flight requests (graceful_shutdown_timeout_s)
            # while the HTTP front door still carries them.
            serve.delete(APP_NAME, _blocking=False)
            _wait_until_deleted(APP_NAME, drain_timeout_s + SHUTDOWN_MARGIN_S / 2)
        except Exception:
            logger.exception("stopping Serve failed")
    if ray.is_initialized() and not cluster_lost:    # with the GCS gone, Ray's own shutdown would wait on it
        ray.shutdown()
    if state_dir is not None:
        end_server_processes(state_dir)


def _begin_drain(drain_timeout_s: float) -> None:
    """Tell every replica when its drain period ends (`EngineReplica.begin_drain`)."""
    from ray import serve

    within_s = drain_timeout_s - DRAIN_ANSWER_MARGIN_S if drain_timeout_s > 2 * DRAIN_ANSWER_MARGIN_S \
        else drain_timeout_s / 2
    try:
        ingress = serve.status().applications[APP_NAME].deployments
        name = "IngressReplica" if "IngressReplica" in ingress else "LLMReplica"    # whichever carries the streams
        handle = serve.get_deployment_handle(name, app_name=APP_NAME)
        try:
            handle.broadcast("begin_drain", within_s).results(timeout_s=10, return_exceptions=True)
        finally:
            _release_handle(handle)
    except Exception:  # noqa: BLE001 - without it the drain still ends, with Serve killing what still runs
        logger.warning("could not tell the replicas when the drain ends", exc_info=True)


def _release_handle(handle) -> None:
    """Stop what a used Serve handle left running in this driver: its router's metrics pusher and two long-poll
    clients (the router's and the process's shared one), which re-issue `listen_for_change` from Serve's router
    thread whenever a poll returns, as the app's deletion makes them do. A call issued after `ray.shutdown()` makes
    Ray's core worker end the process with status 1, whatever exit code the CLI chose. A stopped client issues
    no further poll; the one in flight returns when the controller stops."""
    from ray.serve._private.router import SharedRouterLongPollClient

    handle.shutdown()
    router = getattr(getattr(handle, "_router", None), "_asyncio_router", None)
    if router is None:
        return
    router.long_poll_client.stop()
    # get_or_create is cached per (controller, loop): these arguments return the client the router registered with
    SharedRouterLongPollClient.get_or_create(router._controller_handle, router._event_loop).long_poll_client.stop()


def _wait_until_deleted(app_name: str, timeout_s: float) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while app_name in serve.status().applications:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the application {app_name!r} was not deleted within {timeout_s:.0f}s")
        time.sleep(0.1)


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


def _wait_until_routed(replicas: int, timeout_s: float) -> None:
    """Poll HAProxy until it routes to every replica, so that "serving" means the whole fleet takes requests."""
    deadline = time.monotonic() + timeout_s
    while (up := haproxy_replicas_up(APP_NAME)) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"HAProxy routes to {up} of {replicas} replicas after {timeout_s:.0f}s")
        time.sleep(0.25)


def main(argv=None) -> int:
    """`python -m cluster.serve_cmd [serve flags]`, the same as `tidal serve`."""
    parser = argparse.ArgumentParser(prog="tidal")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
