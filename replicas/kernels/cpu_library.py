"""C kernels of the CPU path (x86 with AVX2 and FMA): each source is built once with the system compiler (about a
second), cached under ~/.cache/tidal by the hash of its text, and loaded through ctypes. OpenMP loops run on
torch's own libgomp, so torch.set_num_threads applies to them and its thread pool stays warm between torch ops."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile

import torch

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]

# What every source starts with: headers, INLINE, and hsum (the sum of a vector's 8 lanes)
PRELUDE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
"""


def _build(source: str, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "kernel.c"), os.path.join(tmp, "kernel.so")
        with open(src, "w") as f:
            f.write(source)
        subprocess.run(["cc", *FLAGS, src, "-o", out], check=True, capture_output=True, timeout=120)
        os.replace(out, path)      # atomic: concurrent builders each install a complete file


def load(name: str, source: str, signatures: dict[str, list]) -> ctypes.CDLL | None:
    """The built library of PRELUDE + `source` with each function's argument types set (all return void), or None
    where it cannot be built (no AVX2, no compiler): the caller then takes its torch path."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    source = PRELUDE + source
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = os.path.join(os.path.expanduser("~"), ".cache", "tidal", f"{name}_{digest}.so")
    try:
        if not os.path.exists(path):
            _build(source, path)
        lib = ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("the CPU kernels %s could not be built (%s); the torch path runs instead", name, e)
        return None
    for fn, argtypes in signatures.items():
        getattr(lib, fn).argtypes = argtypes
        getattr(lib, fn).restype = None
    return lib
