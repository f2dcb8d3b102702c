"""Launch handles: one kernel call site with its packed arguments cached.

A `LaunchHandle` owns, for its whole life, the argument bytes of its kernel in
C layout (each argument aligned to its size, padding and tail zeroed) and the
``void*[]`` kernelParams array pointing into them; both are allocated once, and
the driver binds that address into a prepared launch call (`prepare_launch`),
so `launch()` packs and converts nothing. `set_args` packs into a scratch
buffer and compares: equal bytes are a hit (nothing written), different bytes a
miss (copied in, `version` bumped). Values equal to the last ones are a hit
without packing, unless an f32 argument was zero (+0.0 and -0.0 compare equal
but differ in bytes).

The driver copies the arguments at launch and at capture, so caching them is
safe only under these rules, each enforced here or in `StepGraph`:
- a handle belongs to one stream: launching it on another raises;
- two handles never share argument storage, and a changed argument repacks
  (and invalidates) only its own handle;
- a graph remembers each captured handle's `version` and re-captures when one
  moved, instead of replaying the old bytes;
- one executor thread: `set_args` and `launch` from another thread raise.

`set_arg_cache_enabled(False)` turns the comparison off for A/B measurement:
every `set_args` then repacks and counts as a change.

The GPU backend's launcher types each handle by its kernel's C declaration
(`CodeObject.signatures`, read by the kernel library); values that do not fit those
types, or too few or too many of them, are refused naming the kernel.
"""

from __future__ import annotations

import ctypes
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rocforge_rt.backends.gpu.driver import Driver
from rocforge_rt.errors import BackendError
from rocforge_rt.profiling.launch_tracker import LaunchOverheadTracker

# struct codes of the argument types; each is aligned to its own size.
ARG_TYPES = {"ptr": "Q", "i32": "i", "u32": "I", "f32": "f", "i64": "q"}

_get_ident = threading.get_ident
_perf_ns = time.perf_counter_ns


@dataclass
class ArgCacheStats:
    """Argument-cache counters: process-wide (ARG_CACHE_STATS), or of the handles of one
    kernel name (`reset` clears all but `epoch`)."""

    hits: int = 0
    misses: int = 0
    bytes_repacked: int = 0
    epoch: int = 0  # repacks since start, never reset: graphs skip their check when unchanged

    def snapshot(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if k != "epoch"}

    def reset(self) -> None:
        self.hits = self.misses = self.bytes_repacked = 0


ARG_CACHE_STATS = ArgCacheStats()
_cache_enabled = True


def set_arg_cache_enabled(enabled: bool) -> None:
    """Turn the per-handle comparison on (default) or off (every `set_args` repacks)."""
    global _cache_enabled
    _cache_enabled = bool(enabled)


def arg_cache_enabled() -> bool:
    return _cache_enabled


@dataclass(frozen=True)
class ArgLayout:
    """Where each argument lives in the packed bytes (C layout)."""

    types: tuple[str, ...]
    offsets: tuple[int, ...]
    size: int  # rounded up to the largest alignment, as a C struct
    format: str  # struct format writing every byte, padding as zeros

    @classmethod
    def of(cls, arg_types: Sequence[str]) -> ArgLayout:
        types = tuple(arg_types)
        unknown = [t for t in types if t not in ARG_TYPES]
        if unknown:
            raise ValueError(f"unknown argument types {unknown}; known: {', '.join(ARG_TYPES)}")
        fmt, offsets, pos, align = "<", [], 0, 1
        for t in types:
            size = struct.calcsize("<" + ARG_TYPES[t])
            pad = -pos % size
            fmt += f"{pad}x{ARG_TYPES[t]}" if pad else ARG_TYPES[t]
            offsets.append(pos + pad)
            pos += pad + size
            align = max(align, size)
        tail = -pos % align
        if tail:
            fmt += f"{tail}x"
        return cls(types, tuple(offsets), pos + tail, fmt)


class LaunchHandle:
    """One kernel launch site: function, geometry, stream and its own packed arguments.

    `overlap` launches with programmatic dependent launch where the driver supports
    it (the kernel waits for its predecessor itself; see rf_pdl_wait); `cluster` > 1 in
    thread block clusters of that many blocks.
    """

    def __init__(
        self,
        driver: Driver,
        function: Any,
        *,
        name: str,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_bytes: int = 0,
        stream: Any,
        arg_types: Sequence[str],
        tracker: LaunchOverheadTracker | None = None,
        overlap: bool = False,
        cluster: int = 1,
        kernel_stats: ArgCacheStats | None = None,
    ) -> None:
        self.name = name
        # Shared by the kernel's handles, so a per-kernel report need not walk them all.
        self.kernel_stats = kernel_stats if kernel_stats is not None else ArgCacheStats()
        self.tracker = tracker  # told of every launch while it is enabled
        self.function = function
        self.grid = _dims("grid", grid)
        self.block = _dims("block", block)
        self.shared_bytes = int(shared_bytes)
        self.cluster = cluster
        self.stream = stream
        self.layout = ArgLayout.of(arg_types)
        self._driver = driver
        self._struct = struct.Struct(self.layout.format)
        size = self.layout.size
        # The bytes the driver reads, and the scratch new values are packed into. The
        # ctypes view pins the bytearray (it cannot be resized, so its address is fixed).
        self._storage = bytearray(size)
        self._scratch = bytearray(size)
        self._storage_view = (ctypes.c_char * size).from_buffer(self._storage)
        base = ctypes.addressof(self._storage_view)
        self._pointers = (ctypes.c_void_p * len(self.layout.offsets))(
            *(base + offset for offset in self.layout.offsets)
        )
        self.params_ptr = ctypes.addressof(self._pointers)
        self.storage_address = base
        self._f32_slots = tuple(i for i, t in enumerate(self.layout.types) if t == "f32")
        self._last_values: tuple | None = None  # values known to pack to the stored bytes
        function.allow_dynamic_shared(self.shared_bytes)
        self._launch = driver.prepare_launch(
            function,
            self.grid,
            self.block,
            self.shared_bytes,
            stream,
            self.params_ptr,
            overlap,
            cluster,
        )
        self.version = 0  # bumped by every repack; graphs compare it
        self.hits = 0
        self.misses = 0
        self.bytes_repacked = 0
        self.launches = 0
        self.launch_ns = 0  # host time spent in launch()
        self._packed = False

    @property
    def packed_bytes(self) -> bytes:
        """A copy of the argument bytes the next launch passes."""
        return bytes(self._storage)

    def set_args(self, *values: int | float) -> bool:
        """Make the next launch pass `values`; True when they equal the cached bytes (a hit)."""
        if _get_ident() != self._driver.owner_thread:
            self._driver.check_thread()
        if values == self._last_values and _cache_enabled:
            self.hits += 1
            self.kernel_stats.hits += 1
            ARG_CACHE_STATS.hits += 1
            return True
        scratch = self._scratch
        try:
            self._struct.pack_into(scratch, 0, *values)
        except struct.error as exc:
            types = self.layout.types
            count = len(values) != len(types)
            reason = f"it takes {len(types)} arguments, got {len(values)}" if count else exc
            raise ValueError(
                f"{self.name}: arguments {values} do not fit {types}: {reason}"
            ) from None
        zero_f32 = any(values[i] == 0 for i in self._f32_slots)
        self._last_values = None if zero_f32 else values
        stats, kernel = ARG_CACHE_STATS, self.kernel_stats
        if self._packed and _cache_enabled and scratch == self._storage:
            self.hits += 1
            kernel.hits += 1
            stats.hits += 1
            return True
        self._storage[:] = scratch
        self._packed = True
        size = len(scratch)
        self.version += 1
        self.misses += 1
        self.bytes_repacked += size
        kernel.misses += 1
        kernel.bytes_repacked += size
        stats.misses += 1
        stats.bytes_repacked += size
        stats.epoch += 1
        return False

    def launch(self, stream: Any = None) -> None:
        """Launch with the cached arguments on this handle's stream (`stream` must be it)."""
        if stream is not None and stream is not self.stream:
            raise BackendError(
                f"launch handle {self.name!r} belongs to one stream; launching it on another "
                "would let two streams race on its buffers: make a handle per stream"
            )
        if not self._packed:
            raise BackendError(f"launch handle {self.name!r} launched before set_args()")
        start = _perf_ns()
        self._launch()
        end = _perf_ns()
        self.launch_ns += end - start
        self.launches += 1
        tracker = self.tracker
        if tracker is not None and tracker.enabled:
            tracker.launched(self.name, start, end)

    def reset_stats(self) -> None:
        """Zero the counters (hits, misses, bytes, launches, launch time); `version` stays."""
        self.hits = self.misses = self.bytes_repacked = self.launches = self.launch_ns = 0

    def stats(self) -> dict[str, int | str]:
        """This handle's counters, for the overhead report."""
        return {
            "name": self.name,
            "hits": self.hits,
            "misses": self.misses,
            "bytes_repacked": self.bytes_repacked,
            "version": self.version,
            "launches": self.launches,
            "launch_ns": self.launch_ns,
        }

    def __repr__(self) -> str:
        return f"LaunchHandle({self.name!r}, version={self.version})"


def _dims(what: str, dims: Sequence[int]) -> tuple[int, int, int]:
    x, y, z = (int(d) for d in dims) if len(dims) == 3 else (0, 0, 0)
    if min(x, y, z) < 1:
        raise ValueError(f"{what} must be three positive ints, got {tuple(dims)}")
    return x, y, z
