"""A `Driver` over host memory for tests without a GPU.

`FakeDriver` is the real `Driver` base over host memory: a launch reads its
arguments through the kernelParams pointer array, as the CUDA/HIP driver does,
and a graph keeps copies of the argument bytes it captured. Its device clock
(`clock_us`) stands still except where a kernel runs (a launch advances it by
that kernel's `durations_us` entry) or a test moves it; timing events record
it, so elapsed times are exact.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Sequence
from typing import Any

from rocforge_rt.backends.gpu.driver import DeviceInfo, Driver
from rocforge_rt.errors import BackendError


class FakeStatus(enum.IntEnum):
    BAD = 719


SIZES = {"ptr": 8, "i32": 4, "u32": 4, "f32": 4, "i64": 8}
KERNELS = {"k": ("ptr", "i32", "f32", "ptr"), "copy": ("ptr", "ptr", "i32")}


class FakeDriver(Driver):
    """Host memory for device memory; launches log (kernel, argument bytes) as the GPU would see."""

    def __init__(self, kernels: dict[str, Sequence[str]] = KERNELS) -> None:
        self._kernels = kernels
        self._memory: dict[int, ctypes.Array] = {}
        self._capturing: dict[int, list[tuple[str, bytes]]] = {}
        self._streams = 0
        self.log: list[tuple[str, str, bytes]] = []  # ('launch' | 'replay', kernel, arg bytes)
        self.prepared: list[tuple] = []  # _api_launcher calls
        self.clock_us = 0.0
        self.durations_us: dict[str, float] = {}  # device time of each kernel's launch
        super().__init__(DeviceInfo("fake", "Fake", "sm_0", 32, 4, 1 << 30, 1 << 20, 48 << 10))

    def _raw(self, nbytes: int) -> int:
        block = ctypes.create_string_buffer(nbytes)
        self._memory[ctypes.addressof(block)] = block
        return ctypes.addressof(block)

    def _unraw(self, ptr: int) -> None:
        del self._memory[ptr]

    _api_alloc = _api_host_alloc = _raw
    _api_free = _api_host_free = _unraw

    def _api_copy_htod(self, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    _api_copy_dtoh = _api_copy_htod

    def _api_copy_htod_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        ctypes.memmove(dst, src, nbytes)

    _api_copy_dtoh_async = _api_copy_htod_async

    def _api_memset(self, dst: int, byte: int, nbytes: int, stream: Any) -> None:
        ctypes.memset(dst, byte, nbytes)

    def _api_stream_create(self) -> int:
        self._streams += 1
        return self._streams

    def _api_event_create(self, timing: bool) -> list[float]:
        return [0.0]  # the device clock when last recorded

    def _api_event_record(self, event: Any, stream: Any) -> None:
        event[0] = self.clock_us

    def _api_event_elapsed_ms(self, start: Any, end: Any) -> float:
        return (end[0] - start[0]) / 1e3

    def _api_module_load(self, code: bytes) -> bytes:
        return code

    def _api_module_function(self, module: Any, name: str) -> str:
        if name not in self._kernels:
            raise BackendError("fakeModuleGetFunction failed: NOT_FOUND (500)")
        return name

    def _api_launcher(self, function, grid, block, shared_bytes, stream, params_ptr, overlap):
        self.prepared.append((function, grid, block, shared_bytes, stream, params_ptr))
        types = self._kernels[function]
        pointers = (ctypes.c_void_p * len(types)).from_address(params_ptr)

        def launch() -> tuple[int]:
            args = b"".join(
                ctypes.string_at(p, SIZES[t]) for p, t in zip(pointers, types, strict=True)
            )
            if stream in self._capturing:
                self._capturing[stream].append((function, args))  # a copy, as CUDA keeps
            else:
                self.log.append(("launch", function, args))
                self.clock_us += self.durations_us.get(function, 0.0)
            return (0,)

        return launch

    def _api_begin_capture(self, stream: Any) -> None:
        self._capturing[stream] = []

    def _api_end_capture(self, stream: Any) -> tuple[tuple[str, bytes], ...]:
        return tuple(self._capturing.pop(stream))

    def _api_graph_instantiate(self, graph: Any) -> Any:
        return graph

    def _api_graph_launch(self, exe: Any, stream: Any) -> None:
        self.log.extend(("replay", name, args) for name, args in exe)

    def _nothing(self, *args: Any) -> None:
        pass

    _api_bind_thread = _api_close = _api_synchronize = _nothing
    _api_stream_destroy = _api_stream_synchronize = _nothing
    _api_event_destroy = _api_event_synchronize = _nothing
    _api_module_unload = _api_set_max_dynamic_shared = _nothing
    _api_graph_destroy = _api_graph_exec_destroy = _nothing
