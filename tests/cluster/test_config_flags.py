"""EngineConfig is the one source of the engine's settings: every field, walked from the dataclasses (a new field
is covered without touching this file), round-trips with a non-default value through `tidal serve`'s generated
flags, `LLM(...)`'s keywords and the Serve app's args, each giving the same EngineConfig; unknown names are
refused by name; and every flag `tidal serve` had before the flags were generated still parses."""
from __future__ import annotations

import argparse
import dataclasses

import pytest
from pydantic import ValidationError

from cluster.app import CUDA_API_SERVER_COUNT, PROMOTED, AppArgs, api_server_count, engine_config
from cluster.serve_cmd import add_serve_parser, serve_app_args
from replicas.config import EngineConfig, Setting
from replicas.llm import llm_engine_config

BASE = {"device": "cpu"}      # "auto" would resolve on this machine (serve, app) but not in LLM(...)


def leaf_fields(cls=EngineConfig, prefix=()) -> list[tuple[str, ...]]:
    """Every leaf field's attribute path, straight from the dataclasses (independent of config.settings())."""
    out = []
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name)
        if dataclasses.is_dataclass(value):
            out += leaf_fields(type(value), prefix + (f.name,))
        else:
            out.append(prefix + (f.name,))
    return out


SETTINGS = {s.path: s for s in EngineConfig.settings()}


def other_value(s: Setting):
    """A valid value that is not the default (nor BASE's)."""
    if s.choices is not None:
        return next(c for c in reversed(s.choices) if c != s.default and c != BASE.get(s.flat))
    if s.type is bool:
        return not s.default
    if s.type is int:
        return (s.default or 0) + 3
    if s.type is float:
        return 2.5 if s.default is None else (s.default / 2 if s.default else 1.5)
    return f"/models/{s.flat}"


def argv(flat: dict) -> list[str]:
    """`tidal serve` flags for flat settings, written from each setting's flag name and type."""
    out = []
    for name, value in flat.items():
        s = EngineConfig.settings()[[x.flat for x in EngineConfig.settings()].index(name)]
        if s.type is bool:
            out.append(s.flag if value else "--no-" + s.flag[2:])
        else:
            out += [s.flag, str(value)]
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal")
    add_serve_parser(p.add_subparsers(dest="command"))
    return p


def via_serve(flat: dict) -> EngineConfig:
    """What `tidal serve` builds: its parser, its app args, the app's engine config."""
    return engine_config(serve_app_args(parser().parse_args(["serve", *argv(flat)])))


def via_llm(flat: dict) -> EngineConfig:
    return llm_engine_config(**flat)


def via_app(flat: dict) -> EngineConfig:
    return engine_config(AppArgs(engine_kwargs=flat))


def test_every_dataclass_field_is_a_setting():
    assert list(SETTINGS) == leaf_fields()
    for s in SETTINGS.values():
        assert s.help and "\n" not in s.help, s.flat


@pytest.mark.parametrize("path", leaf_fields(), ids=".".join)
@pytest.mark.parametrize("route", [via_serve, via_llm, via_app], ids=["serve", "llm", "app"])
def test_each_setting_round_trips(route, path):
    s = SETTINGS[path]
    value = other_value(s)
    flat = {**BASE, s.flat: value}
    want = EngineConfig.from_flat(**flat)
    assert s.get(want) == value != s.get(EngineConfig())
    got = route(flat)
    assert got == want
    assert got.to_flat() == {**EngineConfig(**BASE).to_flat(), s.flat: value}


@pytest.mark.parametrize("route", [via_serve, via_llm, via_app], ids=["serve", "llm", "app"])
def test_all_settings_at_once_round_trip(route):
    flat = {s.flat: other_value(s) for s in EngineConfig.settings()}
    want = EngineConfig.from_flat(**flat)
    assert all(s.get(want) != s.get(EngineConfig()) for s in EngineConfig.settings())
    assert route(flat) == want
    assert EngineConfig.from_flat(**want.to_flat()) == want
    assert EngineConfig().with_(**flat) == want


@pytest.mark.parametrize("route", [via_serve, via_llm, via_app], ids=["serve", "llm", "app"])
def test_nothing_given_is_the_engine_default(route):
    assert route(dict(BASE)) == EngineConfig(**BASE)


def test_promoted_app_args_are_settings_too():
    for name in PROMOTED:
        s = next(x for x in EngineConfig.settings() if x.flat == name)
        value = other_value(s)
        assert engine_config(AppArgs(**{**BASE, name: value})) == EngineConfig.from_flat(**{**BASE, name: value})
    # the top-level arg wins over the same key in engine_kwargs
    assert engine_config(AppArgs(device="cpu", max_num_seqs=3, engine_kwargs={"max_num_seqs": 5})) \
        .scheduling.max_num_seqs == 3


def test_unknown_settings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown engine setting 'max_num_seq' \(did you mean 'max_num_seqs'\?\)"):
        EngineConfig.from_flat(max_num_seq=4)
    with pytest.raises(ValueError, match="unknown engine settings 'bogus', 'other'"):
        llm_engine_config(bogus=1, other=2)
    with pytest.raises(ValueError, match="unknown engine setting 'bogus'"):
        EngineConfig().with_(bogus=1)
    with pytest.raises(ValidationError, match="engine_kwargs: unknown engine setting 'bogus'"):
        AppArgs(engine_kwargs={"bogus": 1})
    with pytest.raises(ValidationError):          # a non-engine app arg stays refused at the top level
        AppArgs(bogus=1)
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--bogus", "1"])


def test_bad_values_are_refused_with_the_setting_name():
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        EngineConfig.from_flat(max_num_seqs=0)
    with pytest.raises(ValueError, match="elastic='sometimes': choose one of off, elastic, static"):
        EngineConfig.from_flat(elastic="sometimes")
    with pytest.raises(ValueError, match="spec_budget must be an integer"):
        EngineConfig.from_flat(spec_budget="4")
    with pytest.raises(ValidationError, match="tensor_parallel_size must be >= 1"):
        AppArgs(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="is a group"):
        EngineConfig(elastic="elastic")


def test_api_server_count_defaults_by_device_and_refuses_autoscaling():
    """4 ingress replicas per engine replica on CUDA, none (the replica serves HTTP) on CPU or with autoscaling;
    a count given wins; a fixed count with autoscaling is refused."""
    assert api_server_count(AppArgs(), "cuda") == CUDA_API_SERVER_COUNT == 4
    assert api_server_count(AppArgs(), "cpu") == 1
    assert api_server_count(AppArgs(api_server_count=2), "cpu") == 2
    assert api_server_count(AppArgs(autoscaling_config={"min_replicas": 1}), "cuda") == 1
    with pytest.raises(ValidationError, match="api_server_count > 1"):
        AppArgs(api_server_count=2, autoscaling_config={"min_replicas": 1})
    with pytest.raises(ValidationError):
        AppArgs(api_server_count=0)
    args = parser().parse_args(["serve", "--device", "cpu", "--api-server-count", "3"])
    assert serve_app_args(args).api_server_count == 3


# `tidal serve --help` before its engine flags were generated from EngineConfig (flag, a value it takes or None
# for a switch, the parsed attribute and its default when the flag is left out, None: the engine's default).
TODAYS_FLAGS = [
    ("--model", "/m.gguf", "model", None),
    ("--served-model-name", "m", "served_model_name", None),
    ("--tp", "2", "tensor_parallel_size", None),
    ("--replicas", "2", "replicas", 1),
    ("--host", "0.0.0.0", "host", "127.0.0.1"),
    ("--port", "9000", "port", 8000),
    ("--ingress", "proxy", "ingress", "auto"),
    ("--metrics-port", "9090", "metrics_port", 8080),
    ("--api-key", "k", "api_key", None),
    ("--device", "cpu", "device", None),
    ("--load-format", "dummy", "load_format", None),
    ("--dtype", "float32", "dtype", None),
    ("--gpu-memory-utilization", "0.5", "gpu_memory_utilization", None),
    ("--max-num-batched-tokens", "512", "max_num_batched_tokens", None),
    ("--max-num-seqs", "8", "max_num_seqs", None),
    ("--max-model-len", "256", "max_model_len", None),
    ("--enforce-eager", None, "enforce_eager", None),
    ("--mixed-graph-tokens", "0", "mixed_graph_tokens", None),
    ("--max-ongoing-requests", "4", "max_ongoing_requests", None),
    ("--max-queued-requests", "16", "max_queued_requests", 4096),
    ("--elastic", "elastic", "elastic", None),
    ("--reserve-blocks", "8", "reserve_blocks", None),
    ("--speculative", "dominotree", "speculative", None),
    ("--drafter", "/d", "drafter", None),
    ("--spec-budget", "4", "spec_budget", None),
    ("--allow-random-drafter", None, "allow_random_drafter", None),
    ("--knob", "max_num_batched_tokens=1024", "knob", []),
    ("--controller", None, "controller", None),
    ("--controller", "chunk", "controller", None),
    ("--controller-interval", "2.5", "controller_interval", 5.0),
    ("--controller-advisory", None, "controller_advisory", False),
    ("--ttft-slo-ms", "250", "ttft_slo_ms", 1000.0),
    ("--itl-slo-ms", "40", "itl_slo_ms", 100.0),
]
TODAYS_CHOICES = {"--ingress": ("auto", "haproxy", "proxy"), "--device": ("auto", "cpu", "cuda"),
                  "--load-format": ("auto", "dummy"), "--elastic": ("off", "elastic", "static"),
                  "--speculative": ("dominotree", "chain", "ddtree"),
                  "--controller": ("static", "chunk", "elastic", "auto")}


@pytest.mark.parametrize("flag,value,dest,default", TODAYS_FLAGS, ids=[f[0] for f in TODAYS_FLAGS])
def test_todays_flags_still_parse(flag, value, dest, default, monkeypatch):
    monkeypatch.delenv("TIDAL_API_KEY", raising=False)
    given = parser().parse_args(["serve", flag] + ([value] if value is not None else []))
    left_out = parser().parse_args(["serve"])
    assert getattr(left_out, dest) == default
    assert getattr(given, dest) != default
    if value is not None and flag != "--knob":
        assert str(getattr(given, dest)) == value or float(getattr(given, dest)) == float(value)


def test_todays_choices_are_kept():
    p = parser()
    serve = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    actions = {opt: a for a in serve._actions for opt in a.option_strings}
    for flag, choices in TODAYS_CHOICES.items():
        assert tuple(actions[flag].choices) == choices, flag


def test_engine_flags_reach_the_replica_unchanged():
    """The values `tidal serve` hands the app are the flat settings it parsed (plus the resolved device)."""
    ns = parser().parse_args(["serve", "--device", "cpu", "--tp", "2", "--elastic", "static", "--spec-budget", "3",
                              "--no-enable-prefix-caching", "--stream-item-ms", "0"])
    assert serve_app_args(ns).engine_kwargs == {"device": "cpu", "tensor_parallel_size": 2, "elastic": "static",
                                                "spec_budget": 3, "enable_prefix_caching": False,
                                                "stream_item_ms": 0.0}
