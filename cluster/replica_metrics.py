"""A replica's metrics: every second the engine's stats, finished requests' timings and the replica's admission,
recorded through Ray's metrics path (`cluster.metrics.ReplicaMetrics`) by an actor of the replica's own, and the
finished requests handed to the replica's window of recent requests (what the fleet controller judges latency
from)."""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from cluster.admission import AdmissionSnapshot
from cluster.metrics import ReplicaMetrics
from replicas.async_engine import AsyncLLMEngine
from replicas.stats import EngineStats

logger = logging.getLogger("tidal.replica")

METRICS_PERIOD_S = 1.0


class MetricsRecorder:
    """`ReplicaMetrics` in a Ray actor of its own (num_cpus 0, owned by the replica, so it dies with it).
    `ray.util.metrics` costs a C++ call under the GIL per point, and the inter-token histogram takes a point per
    token, so a busy replica recording them itself would spend a real share of the serving process's time on
    them. Calls from one caller run in order on the actor, so the counters' increments stay ordered."""

    def __init__(self, model_name: str, replica_id: str):
        self.metrics = ReplicaMetrics(model_name, replica_id)

    def record(self, stats: EngineStats, timings: list, admission: Optional[AdmissionSnapshot] = None) -> None:
        self.metrics.record(stats, timings)
        if admission is not None:
            self.record_admission(admission)

    def record_admission(self, admission: AdmissionSnapshot) -> None:
        self.metrics.record_admission(admission.requests, admission.tokens, admission.token_limit, admission.refused)

    def record_controller_decision(self, knob: str, value: float, reason: str, applied: bool = True) -> None:
        self.metrics.record_controller_decision(knob, value, reason, applied)


class RemoteRecorder:
    """The replica's handle on its `MetricsRecorder` actor: same methods, sent without waiting."""

    def __init__(self, model_name: str, replica_id: str):
        import ray
        self.actor = ray.remote(num_cpus=0)(MetricsRecorder).remote(model_name, replica_id)
        self.last = None

    def record(self, stats: EngineStats, timings: list, admission: Optional[AdmissionSnapshot] = None) -> None:
        self.last = self.actor.record.remote(stats, timings, admission)

    def record_admission(self, admission: AdmissionSnapshot) -> None:
        self.last = self.actor.record_admission.remote(admission)

    def record_controller_decision(self, knob: str, value: float, reason: str, applied: bool = True) -> None:
        self.last = self.actor.record_controller_decision.remote(knob, value, reason, applied)

    def close(self) -> None:
        """Wait for what was sent (the final flush), then stop the actor."""
        import ray
        try:
            if self.last is not None:
                ray.get(self.last, timeout=30)
        finally:
            ray.kill(self.actor)


class MetricsPump(threading.Thread):
    """Feeds the replica's metrics from the engine every period: through a `MetricsRecorder` actor inside Ray, in
    this process otherwise (a replica class built outside Serve); the metrics are off when neither can start, the
    finished requests still go to `on_finished`. Without an engine (an ingress replica, whose engine another
    replica owns and records) it records only the admission."""

    def __init__(self, engine: Optional[AsyncLLMEngine], model_name: str, replica_id: str,
                 period_s: float = METRICS_PERIOD_S, on_finished: Optional[Callable[[list], None]] = None,
                 admission: Optional[Callable[[], AdmissionSnapshot]] = None):
        super().__init__(name="tidal-metrics", daemon=True)
        self.engine = engine
        self.period_s = period_s
        self.on_finished = on_finished
        self.admission = admission
        self.recorder = self._load_recorder(model_name, replica_id)
        self._halt = threading.Event()

    @staticmethod
    def _load_recorder(model_name: str, replica_id: str):
        import ray
        try:
            if ray.is_initialized():
                return RemoteRecorder(model_name, replica_id)
            return MetricsRecorder(model_name, replica_id)
        except Exception:
            logger.exception("replica metrics could not start; they are off")
            return None

    def run(self) -> None:
        while not self._halt.wait(self.period_s):
            self.flush()

    def flush(self) -> None:
        try:
            if self.engine is None:
                if self.recorder is not None and self.admission is not None:
                    self.recorder.record_admission(self.admission())
                return
            timings = self.engine.drain_finished_timings()
            if self.on_finished is not None:
                self.on_finished(timings)
            if self.recorder is not None:
                self.recorder.record(self.engine.stats(), timings,
                                     self.admission() if self.admission is not None else None)
        except Exception:
            logger.exception("recording replica metrics failed")

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=2 * self.period_s)
        self.flush()
        if isinstance(self.recorder, RemoteRecorder):
            try:
                self.recorder.close()
            except Exception:
                logger.exception("the metrics recorder did not finish cleanly")
