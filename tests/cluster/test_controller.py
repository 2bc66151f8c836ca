"""The fleet controller: its policy, its loop over real engines, and `tidal serve --controller` end to end."""
import json
import time
import urllib.request
from dataclasses import replace

import pytest

from tests.support.checkpoints import make_tiny_llama
from cluster.controller import Controller, ControllerConfig, Decision, ReplicaView, decide
from replicas import LLM, SamplingParams
from replicas.stats import EngineStats

CFG = ControllerConfig(kv_pressure=0.9, queue_backlog=4, min_budget=64)


def view(**kw) -> ReplicaView:
    stats = EngineStats(kv_blocks_total=100, max_num_batched_tokens=kw.pop("budget", 256))
    for k, v in kw.items():
        setattr(stats, k, v)
    return ReplicaView("r0", stats, budget_limit=1024, elastic_available=True)


def test_policy_rules():
    assert decide(view(kv_blocks_used=95), None, CFG) == Decision("elastic", "elastic", "kv_pressure")
    busy = view(num_waiting=6, num_running=2, kv_blocks_used=10)
    assert decide(busy, None, CFG) == Decision("max_num_batched_tokens", 512, "queue_backlog")
    lent = view(num_running=3, preemptions=5, budget=512, elastic_mode="elastic")
    assert decide(lent, replace(lent.stats, preemptions=2), CFG) == Decision("max_num_batched_tokens", 256,
                                                                                 "preemptions")
    assert decide(view(budget=128), None, CFG) == Decision("max_num_batched_tokens", 1024, "idle_reset")
    assert decide(view(budget=1024, num_running=1), None, CFG) is None
    capped = view(num_waiting=9, num_running=1, budget=768)
    assert decide(capped, None, CFG).value == 1024        # never above what the engine reserved memory for


class LocalFleet:
    """Engines in this process; Serve's broadcast transport is covered by the end-to-end test below."""

    def __init__(self, engines):
        self.engines = engines

    def views(self):
        return [ReplicaView(f"r{i}", replace(e.get_stats()), e.config.scheduling.max_num_batched_tokens,
                            e.elastic is not None) for i, e in enumerate(self.engines)]

    def apply(self, decisions):
        for rid, ds in decisions.items():
            for d in ds:
                self.engines[int(rid[1:])].reconfigure(**{d.knob: d.value})
        return decisions


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("ctl")), num_attention_heads=4, num_key_value_heads=2)


def test_controller_loop_on_real_engines(tiny):
    llm = LLM(model=tiny, max_num_seqs=2, max_num_batched_tokens=512, num_kv_blocks=100, reserve_blocks=60,
              elastic="elastic", max_model_len=512)
    engine = llm.engine
    engine.reconfigure(elastic="off", max_num_batched_tokens=64)
    ctl = Controller(LocalFleet([engine]), CFG)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i in range(10):
        engine.add_request(f"q{i}", [5 + i] * 20, params)
    engine.step()
    assert ctl.step() == {"r0": [Decision("max_num_batched_tokens", 128, "queue_backlog")]}
    assert engine.scheduler.max_num_batched_tokens == 128
    while engine.has_unfinished:
        engine.step()
    assert ctl.step() == {"r0": [Decision("max_num_batched_tokens", 512, "idle_reset")]}
    for i in range(2):                                            # fill the 40 base blocks past 90%
        engine.add_request(f"big{i}", [7 + i] * 300, params)
    engine.step()
    engine.step()
    assert ctl.step()["r0"] == [Decision("elastic", "elastic", "kv_pressure")]
    assert engine.elastic.mode == "elastic"
    while engine.has_unfinished:
        engine.step()
    llm.shutdown()


def test_tidal_serve_controller_restores_the_budget(tidal_server_factory):
    server = tidal_server_factory("--replicas", "2", "--max-num-batched-tokens", "1024",
                                  "--knob", "max_num_batched_tokens=128", "--controller", "--controller-interval", "1")
    deadline = time.monotonic() + 120
    budgets = []
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{server.url}/stats", timeout=30) as r:
            budgets = [d["stats"]["max_num_batched_tokens"] for d in json.load(r)["data"]]
        if budgets and all(b == 1024 for b in budgets):
            break
        time.sleep(1)
    assert budgets == [1024, 1024], f"the idle fleet was not restored to its budget: {budgets}\n{server.log_tail()}"
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30) as r:
        text = r.read().decode()
    deadline = time.monotonic() + 30
    while "controller_decisions" not in text and time.monotonic() < deadline:
        time.sleep(2)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30) as r:
            text = r.read().decode()
    assert 'reason="idle_reset"' in text and "ray_tidal_controller_decisions" in text
