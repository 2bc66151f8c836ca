"""CUDA virtual memory for the elastic KV cache, through the cuda-python driver API.

Per range of a few layers (memory/kv_layout.py: block-major inside a range) one virtual range [base |
reserve] is reserved once. The base handle is mapped at its start for the pool's whole life; the reserve
handle is mapped right after it only while the reserve is lent. The torch tensor over each range is made
once, so kernels and CUDA graphs always see the same address.

When a lower step budget needs less of the reserve, its first granules are mapped for good as "grants" (a stack
of mappings, each released whole: `map_grant` / `unmap_grant`), and the lendable reserve is what follows them.

Costs that matter (bench/elastic.py times them): per-call overhead dominates with small handles, so each
range's reserve is ONE handle; the driver calls are grouped by kind with everything prebuilt.
By default a handle is released right after it is mapped: the mapping keeps the memory alive and
`cuMemUnmap` alone returns it to the driver, so a reclaim (on the path of a prefill) makes one driver
call per range instead of two.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import torch

from memory.kv_layout import layer_views
from memory.kv_layout import layers_per_range as default_layers_per_range

try:
    from cuda.bindings import driver as cu
except ImportError:                     # CPU-only installs: the layout math still works
    cu = None


class VmmError(RuntimeError):
    def __init__(self, message: str, code=None):
        super().__init__(message)
        self.code = code


class VmmOutOfMemory(VmmError):
    pass


def _check(result, what: str):
    """cuda-python returns (CUresult, *values): raise on an error, return the value(s)."""
    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        text = cu.cuGetErrorString(err)[1]
        msg = f"{what} failed: {name.decode() if name else err} ({text.decode() if text else '?'})"
        raise (VmmOutOfMemory if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY else VmmError)(msg, err)
    return result[1] if len(result) == 2 else (result[1:] if len(result) > 2 else None)


@dataclass(frozen=True)
class VmmLayout:
    """Where the base/reserve boundary of every range lies. The boundary sits on a granule boundary
    (the base is a whole number of granules) and the reserve is one handle of whole granules."""
    block_bytes: int              # one KV block of one range (all its layers)
    granularity: int
    num_base_blocks: int
    num_reserve_blocks: int
    reserve_handle_bytes: int     # per range

    @property
    def base_bytes(self) -> int:
        return self.num_base_blocks * self.block_bytes

    @property
    def range_bytes(self) -> int:
        return self.base_bytes + self.reserve_handle_bytes

    @staticmethod
    def fit(block_bytes: int, granularity: int, max_base_blocks: int, max_reserve_blocks: int) -> "VmmLayout":
        """The largest layout within the given block counts (both rounded down)."""
        step = granularity // math.gcd(granularity, block_bytes)     # blocks per granule-aligned boundary
        base = max_base_blocks // step * step
        if base == 0:
            raise ValueError(f"the base region needs at least {step} blocks of {block_bytes} bytes "
                             f"(one {granularity}-byte granule); got {max_base_blocks}")
        handle = max(0, max_reserve_blocks) * block_bytes // granularity * granularity
        return VmmLayout(block_bytes, granularity, base, handle // block_bytes, handle)


class _DeviceBuffer:
    """A raw device range seen through __cuda_array_interface__ (bytes), for torch.as_tensor."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


def allocation_granularity(device_index: int) -> int:
    _require_driver()
    _check(cu.cuInit(0), "cuInit")
    return int(_check(cu.cuMemGetAllocationGranularity(
        _device_prop(device_index), cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity"))


def _require_driver() -> None:
    if cu is None:
        raise VmmError("the elastic KV cache needs cuda-python's driver bindings: pip install cuda-bindings")


def _device_prop(device_index: int):
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_index
    return prop


def access_desc(device_index: int):
    """Read-write access for the device: what cuMemSetAccess takes for every mapping here."""
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device_index
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


class VmmKVPool:
    """Range tensors [num_base + num_reserve, g, *block_shape] of g layers each (memory/kv_layout.py), each
    over a fixed virtual range; `caches` are the per-layer views. `layout.block_bytes` is one block of a
    whole range (g layers)."""

    def __init__(self, device: torch.device, layout: VmmLayout, num_layers: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype, release_after_map: bool = True, layers_per_range: Optional[int] = None):
        _require_driver()
        elem = torch.tensor([], dtype=dtype).element_size()
        g = layers_per_range or default_layers_per_range(num_layers)
        assert num_layers % g == 0
        assert math.prod(block_shape) * elem * g == layout.block_bytes, "block shape does not match the layout"
        assert layout.base_bytes % layout.granularity == 0 and layout.reserve_handle_bytes % layout.granularity == 0
        self.device, self.layout, self.num_layers = device, layout, num_layers
        self.release_after_map = release_after_map
        index = device.index if device.index is not None else torch.cuda.current_device()
        _check(cu.cuInit(0), "cuInit")
        self._dev = _check(cu.cuDeviceGet(index), "cuDeviceGet")
        self._ctx = _check(cu.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        self._make_current()
        self._prop = _device_prop(index)
        self._access = [access_desc(index)]
        self._ranges: list[int] = []
        self._reserve_handles: list = []
        self.grants: list[int] = []               # bytes per range of each grant mapping, bottom first
        self.mapped = False
        self.timings: dict[str, float] = {}       # seconds per phase of the last map/unmap
        try:
            for _ in range(num_layers // g):
                base = int(_check(cu.cuMemAddressReserve(layout.range_bytes, layout.granularity, 0, 0),
                                  "cuMemAddressReserve"))
                self._ranges.append(base)
                self._map_base(base, layout.base_bytes)
        except BaseException:
            self.close()
            raise
        num_blocks = layout.num_base_blocks + layout.num_reserve_blocks
        nbytes = num_blocks * layout.block_bytes
        shape = (num_blocks, g, *block_shape)
        self.storages = [torch.as_tensor(_DeviceBuffer(ptr, nbytes), device=device).view(dtype).view(shape)
                         for ptr in self._ranges]
        assert [s.data_ptr() for s in self.storages] == self._ranges
        self.caches = layer_views(self.storages)

    @property
    def granted_bytes(self) -> int:
        """Per range: the reserve's bytes mapped for good at its start."""
        return sum(self.grants)

    @property
    def reserve_span_bytes(self) -> int:
        """Per range: the lendable reserve, after the grants."""
        return self.layout.reserve_handle_bytes - self.granted_bytes

    @property
    def _reserve_ptrs(self) -> list:
        offset = self.layout.base_bytes + self.granted_bytes
        return [cu.CUdeviceptr(base + offset) for base in self._ranges]

    @property
    def reserve_bytes(self) -> int:
        """Physical bytes of the lendable reserve over all layers."""
        return self.reserve_span_bytes * len(self._ranges)

    def map_grant(self, nbytes: int) -> None:
        """Map `nbytes` (whole granules) of every range's reserve for good, right after the grants so far.
        Only while the reserve is unmapped."""
        assert not self.mapped and nbytes % self.layout.granularity == 0 and 0 < nbytes <= self.reserve_span_bytes
        self._make_current()
        done = []
        try:
            for base in self._ranges:
                ptr = base + self.layout.base_bytes + self.granted_bytes
                self._map_base(ptr, nbytes)
                done.append(ptr)
        except BaseException:
            for ptr in done:
                cu.cuMemUnmap(ptr, nbytes)
            raise
        self.grants.append(nbytes)

    def unmap_grant(self) -> int:
        """Unmap (and free) the last grant of every range; returns its bytes per range. The caller must have
        synchronized the device and moved any live KV out of it."""
        assert not self.mapped and self.grants
        self._make_current()
        nbytes = self.grants.pop()
        for base in self._ranges:
            _check(cu.cuMemUnmap(base + self.layout.base_bytes + self.granted_bytes, nbytes), "cuMemUnmap (grant)")
        return nbytes

    def _make_current(self) -> None:
        # Driver calls act on the calling thread's current context; the engine loop may run on any thread.
        _check(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def _map_base(self, ptr: int, size: int) -> None:
        # Released at once: the mapping holds the memory until close() unmaps it.
        handle = _check(cu.cuMemCreate(size, self._prop, 0), "cuMemCreate (base)")
        try:
            _check(cu.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap (base)")
            _check(cu.cuMemSetAccess(ptr, size, self._access, 1), "cuMemSetAccess (base)")
        finally:
            cu.cuMemRelease(handle)

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device, from the driver."""
        self._make_current()
        free, total = _check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def map_reserve(self) -> None:
        """Create and map every range's reserve handle. On failure everything mapped so far is undone."""
        assert not self.mapped
        if self.reserve_span_bytes == 0:
            self.mapped = True
            return
        self._make_current()
        size, prop, access, ptrs = self.reserve_span_bytes, self._prop, self._access, self._reserve_ptrs
        create, map_, set_access, release = cu.cuMemCreate, cu.cuMemMap, cu.cuMemSetAccess, cu.cuMemRelease
        ok = cu.CUresult.CUDA_SUCCESS
        handles, mapped = [], []
        t0 = time.perf_counter()
        try:
            for _ in ptrs:
                err, h = create(size, prop, 0)
                if err != ok:
                    _check((err,), "cuMemCreate (reserve)")
                handles.append(h)
            t1 = time.perf_counter()
            for ptr, h in zip(ptrs, handles):
                err, = map_(ptr, size, 0, h, 0)
                if err != ok:
                    _check((err,), "cuMemMap (reserve)")
                mapped.append(ptr)
            t2 = time.perf_counter()
            for ptr in ptrs:
                err, = set_access(ptr, size, access, 1)
                if err != ok:
                    _check((err,), "cuMemSetAccess (reserve)")
            t3 = time.perf_counter()
        except BaseException:
            for ptr in mapped:
                cu.cuMemUnmap(ptr, size)
            for h in handles:
                cu.cuMemRelease(h)
            raise
        if self.release_after_map:
            for h in handles:
                _check(release(h), "cuMemRelease (reserve)")
            handles = []
        t4 = time.perf_counter()
        self._reserve_handles = handles
        self.mapped = True
        self.timings = {"create": t1 - t0, "map": t2 - t1, "set_access": t3 - t2, "release": t4 - t3,
                        "total": t4 - t0}

    def unmap_reserve(self) -> None:
        """Unmap (and so free) every range's reserve. The caller must have synchronized the device:
        cuMemUnmap does not wait for kernels in flight."""
        assert self.mapped
        if self.reserve_span_bytes == 0:
            self.mapped = False
            return
        self._make_current()
        size, unmap, release, ok = self.reserve_span_bytes, cu.cuMemUnmap, cu.cuMemRelease, \
            cu.CUresult.CUDA_SUCCESS
        t0 = time.perf_counter()
        for ptr in self._reserve_ptrs:
            err, = unmap(ptr, size)
            if err != ok:
                _check((err,), "cuMemUnmap (reserve)")
        t1 = time.perf_counter()
        for h in self._reserve_handles:
            _check(release(h), "cuMemRelease (reserve)")
        t2 = time.perf_counter()
        self._reserve_handles = []
        self.mapped = False
        self.timings = {"unmap": t1 - t0, "release": t2 - t1, "total": t2 - t0}

    def close(self) -> None:
        """Give everything back (the caches must no longer be used)."""
        if cu is None or not hasattr(self, "_ctx"):
            return
        self._make_current()
        if getattr(self, "caches", None) is not None:
            torch.cuda.synchronize(self.device)
        self.caches, self.storages = [], []
        if self.mapped and self.reserve_span_bytes:
            for ptr in self._reserve_ptrs:
                cu.cuMemUnmap(ptr, self.reserve_span_bytes)
            for h in self._reserve_handles:
                cu.cuMemRelease(h)
        self.mapped = False
        self._reserve_handles = []
        for base in self._ranges:
            offset = self.layout.base_bytes
            for nbytes in self.grants:
                cu.cuMemUnmap(base + offset, nbytes)
                offset += nbytes
            cu.cuMemUnmap(base, self.layout.base_bytes)
            cu.cuMemAddressFree(base, self.layout.range_bytes)
        self._ranges = []
        self.grants = []
        cu.cuDevicePrimaryCtxRelease(self._dev)
        del self._ctx
