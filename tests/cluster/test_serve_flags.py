"""`tidal serve`'s engine flags reach the EngineConfig each replica builds; flags left out keep its defaults."""
import argparse

from cluster.app import AppArgs, engine_config
from cluster.serve_cmd import _engine_kwargs, add_serve_parser
from replicas.config import EngineConfig


def config_of(*flags: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    ns = parser.parse_args(["serve", "--device", "cpu", *flags])
    return engine_config(AppArgs(device=ns.device, max_num_batched_tokens=ns.max_num_batched_tokens,
                                 engine_kwargs=_engine_kwargs(ns)))


def test_graph_and_engine_flags_reach_the_engine_config():
    cfg = config_of("--enforce-eager", "--mixed-graph-tokens", "256", "--dtype", "float32",
                    "--max-num-batched-tokens", "512", "--gpu-memory-utilization", "0.5")
    assert (cfg.enforce_eager, cfg.mixed_graph_tokens, cfg.dtype) == (True, 256, "float32")
    assert (cfg.max_num_batched_tokens, cfg.gpu_memory_utilization) == (512, 0.5)
    assert config_of("--mixed-graph-tokens", "0").mixed_graph_tokens == 0


def test_defaults_are_the_engine_defaults():
    cfg, default = config_of(), EngineConfig()
    assert (cfg.enforce_eager, cfg.mixed_graph_tokens, cfg.dtype) == \
        (default.enforce_eager, default.mixed_graph_tokens, default.dtype)
    assert (cfg.max_num_batched_tokens, cfg.gpu_memory_utilization) == \
        (default.max_num_batched_tokens, default.gpu_memory_utilization)
