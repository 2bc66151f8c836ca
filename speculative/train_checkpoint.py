"""Training checkpoints that travel: safetensors shards of at most `shard_bytes` each plus a JSON manifest.

A checkpoint is a folder `step-00001200/` under a parent folder: `manifest.json` (step, the tensors' shapes and
dtypes and where their pieces are, and any JSON metadata) and `shard-00000.safetensors`, ... A tensor larger
than a shard is cut into pieces of its flattened storage. The folder is written under a temporary name and
renamed when complete, so a folder named `step-*` is always whole; older ones are deleted after the rename.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

MANIFEST = "manifest.json"
FORMAT = "tidal-train-checkpoint/1"
SHARD_BYTES = 16 * 2**20
STEP_DIR = re.compile(r"^step-(\d+)$")
_HEADER_BYTES_PER_TENSOR = 160         # safetensors header: key, dtype, shape, offsets (JSON) plus alignment
_HEADER_BYTES_FIXED = 64


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _plan_shards(tensors: dict[str, Tensor], shard_bytes: int) -> tuple[list[dict[str, Tensor]], dict]:
    """Pack the tensors' flattened storage into shards whose files stay within `shard_bytes`, filling each
    shard before starting the next (a tensor that does not fit is cut at the shard boundary), so a checkpoint
    takes as few files as its size allows."""
    if shard_bytes < _HEADER_BYTES_FIXED + 2 * _HEADER_BYTES_PER_TENSOR + 64:
        raise ValueError(f"shard_bytes {shard_bytes} is too small for a safetensors file")
    shards: list[dict[str, Tensor]] = [{}]
    used = [_HEADER_BYTES_FIXED]
    index = {}
    for name, tensor in tensors.items():
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        size, parts, start = flat.element_size(), [], 0
        while start < flat.numel() or not parts:
            key = name if start == 0 else f"{name}@{start}"
            room = (shard_bytes - used[-1] - _HEADER_BYTES_PER_TENSOR - len(key.encode())) // size
            if room < min(flat.numel() - start, 64) and shards[-1]:
                shards.append({})
                used.append(_HEADER_BYTES_FIXED)
                continue
            piece = flat[start:start + room].clone()
            shards[-1][key] = piece
            used[-1] += piece.numel() * size + _HEADER_BYTES_PER_TENSOR + len(key.encode())
            parts.append([len(shards) - 1, key])
            start += piece.numel()
        index[name] = {"dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape), "parts": parts}
    return shards, index


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def write_checkpoint(parent: str, step: int, tensors: dict[str, Tensor], meta: dict,
                     shard_bytes: int = SHARD_BYTES, keep: int = 1) -> str:
    """Write `parent/step-<step>/` atomically and keep the newest `keep` checkpoints; returns the folder."""
    os.makedirs(parent, exist_ok=True)
    final = os.path.join(parent, step_dir_name(step))
    tmp = os.path.join(parent, f".{step_dir_name(step)}.tmp-{os.getpid()}")
    for name in os.listdir(parent):               # a writer that died mid-way left its temporary folder
        if name.startswith(".step-") and ".tmp-" in name:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    os.makedirs(tmp)
    shards, index = _plan_shards(tensors, shard_bytes)
    files = []
    for i, shard in enumerate(shards):
        name = f"shard-{i:05d}.safetensors"
        path = os.path.join(tmp, name)
        save_file(shard, path)
        if os.path.getsize(path) > shard_bytes:
            raise RuntimeError(f"{name} is {os.path.getsize(path)} bytes, over the {shard_bytes} byte limit")
        files.append(name)
    manifest = {"format": FORMAT, "step": step, "shard_bytes": shard_bytes, "files": files,
                "tensors": {name: {**entry, "parts": [[files[s], key] for s, key in entry["parts"]]}
                            for name, entry in index.items()},
                "meta": meta}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    for name in files + [MANIFEST]:
        with open(os.path.join(tmp, name), "rb") as f:
            os.fsync(f.fileno())
    if os.path.exists(final):                     # the same step written again (a resumed run's last step)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(parent)
    for old in list_checkpoints(parent)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(parent: str) -> list[str]:
    """Complete checkpoint folders under `parent`, oldest first."""
    if not os.path.isdir(parent):
        return []
    found = sorted((int(m.group(1)), name) for name in os.listdir(parent) if (m := STEP_DIR.match(name))
                   and os.path.exists(os.path.join(parent, name, MANIFEST)))
    return [os.path.join(parent, name) for _, name in found]


def find_checkpoint(path: str) -> Optional[str]:
    """The checkpoint `path` names: a checkpoint folder itself, or the newest one under `path` or under
    `path/checkpoints` (a training output folder)."""
    if os.path.exists(os.path.join(path, MANIFEST)):
        return path
    for parent in (path, os.path.join(path, "checkpoints")):
        found = list_checkpoints(parent)
        if found:
            return found[-1]
    return None


def read_manifest(folder: str) -> dict:
    with open(os.path.join(folder, MANIFEST)) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{folder}: not a {FORMAT} checkpoint")
    return manifest


def read_checkpoint(folder: str) -> tuple[dict[str, Tensor], dict]:
    """(tensors, manifest) of a checkpoint folder; the tensors are on the CPU."""
    manifest = read_manifest(folder)
    shards = {name: load_file(os.path.join(folder, name)) for name in manifest["files"]}
    tensors = {}
    for name, entry in manifest["tensors"].items():
        pieces = [shards[file][key] for file, key in entry["parts"]]
        flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        tensors[name] = flat.reshape(entry["shape"])
    return tensors, manifest


def optimizer_tensors(state_dict: dict, prefix: str = "optimizer.") -> tuple[dict[str, Tensor], dict]:
    """An optimizer's state_dict as flat tensors (`optimizer.<param index>.<key>`) plus JSON metadata."""
    tensors, scalars = {}, {}
    for index, entries in state_dict["state"].items():
        for key, value in entries.items():
            if isinstance(value, Tensor):
                tensors[f"{prefix}{index}.{key}"] = value
            else:
                scalars[f"{index}.{key}"] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def optimizer_state_dict(tensors: dict[str, Tensor], meta: dict, prefix: str = "optimizer.") -> dict:
    """The inverse of `optimizer_tensors`."""
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith(prefix):
            index, key = name[len(prefix):].split(".", 1)
            state.setdefault(int(index), {})[key] = value
    for name, value in meta["scalars"].items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
              for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}
