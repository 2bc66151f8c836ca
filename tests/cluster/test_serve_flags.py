"""`tidal serve`'s engine flags reach the EngineConfig each replica builds; flags left out keep its defaults."""
import argparse

from cluster.app import engine_config
from cluster.serve_cmd import add_serve_parser, serve_app_args
from replicas.config import EngineConfig


def config_of(*flags: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return engine_config(serve_app_args(parser.parse_args(["serve", "--device", "cpu", *flags])))


def test_graph_and_engine_flags_reach_the_engine_config():
    cfg = config_of("--enforce-eager", "--mixed-graph-tokens", "256", "--dtype", "float32",
                    "--max-num-batched-tokens", "512", "--gpu-memory-utilization", "0.5")
    assert (cfg.graphs.enforce_eager, cfg.graphs.mixed_graph_tokens, cfg.dtype) == (True, 256, "float32")
    assert (cfg.scheduling.max_num_batched_tokens, cfg.cache.gpu_memory_utilization) == (512, 0.5)
    assert config_of("--mixed-graph-tokens", "0").graphs.mixed_graph_tokens == 0


def test_defaults_are_the_engine_defaults():
    assert config_of() == EngineConfig(device="cpu")
