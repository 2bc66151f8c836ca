"""The start-up heap moved out of the garbage collector's reach, in the serving processes.

What a process builds before it serves (the model and its graphs, compiled kernels, the tokenizer, Ray and Serve)
lives as long as the process: hundreds of thousands of tracked objects that every full collection walks again,
while no stream gets a token (tens of milliseconds on the engine core's start-up heap). Frozen (`gc.freeze`), they
are skipped, so a full collection walks only what serving allocated since. At exit they are unfrozen, so the
interpreter's last collection still finalizes them (extension types check for leaks there).
"""
from __future__ import annotations

import atexit
import gc

_registered = False


def freeze_startup_heap() -> int:
    """Collect, then freeze every object that survived; returns how many are frozen now."""
    global _registered
    gc.collect()
    gc.freeze()
    if not _registered:
        atexit.register(gc.unfreeze)
        _registered = True
    return gc.get_freeze_count()
