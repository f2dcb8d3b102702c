"""`FakeDriver`: a `Driver` over host memory for tests without a GPU.

`FakeDriver` is the real `Driver` base with itself as the binding module: its
`api_names` table maps every primitive to one of its ``fake*`` functions,
which return ``(status, *values)`` as cuda-bindings and hip-python do, so
failures go through `check` like a vendor's. A launch reads its arguments
through the kernelParams pointer array, as the CUDA/HIP driver does, and a
graph keeps copies of the argument bytes it captured. Its device clock
(`clock_us`) stands still except where a kernel runs (a launch advances it by
that kernel's `durations_us` entry) or a test moves it; timing events record
it, so elapsed times are exact.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Callable, Sequence
from typing import Any

from rocforge_rt.backends.gpu.driver import Driver
from rocforge_rt.backends.gpu.driver_types import DeviceInfo


class FakeStatus(enum.IntEnum):
    OUT_OF_MEMORY = 2
    INVALID_IMAGE = 200
    NOT_FOUND = 500
    BAD = 719


SIZES = {"ptr": 8, "i32": 4, "u32": 4, "f32": 4, "i64": 8}
KERNELS = {"k": ("ptr", "i32", "f32", "ptr"), "copy": ("ptr", "ptr", "i32")}
INFO = DeviceInfo("fake", "Fake", "sm_0", 32, 4, 1 << 30, 1 << 20, 48 << 10)


class FakeDriver(Driver):
    """Host memory for device memory; launches log (kernel, argument bytes) as the GPU would see."""

    api_names = {
        "alloc": "fakeMalloc",
        "free": "fakeFree",
        "host_alloc": "fakeMalloc",
        "host_device_pointer": "fakeHostGetDevicePointer",
        "host_free": "fakeFree",
        "copy_htod": "fakeMemcpy",
        "copy_htod_async": "fakeMemcpy",
        "copy_dtoh": "fakeMemcpy",
        "copy_dtoh_async": "fakeMemcpy",
        "memset": "fakeMemsetD8Async",
        "stream_create": "fakeStreamCreate",
        "event_create": "fakeEventCreate",
        "event_record": "fakeEventRecord",
        "event_elapsed": "fakeEventElapsedTime",
        "module_load": "fakeModuleLoadData",
        "module_function": "fakeModuleGetFunction",
        "occupancy": "fakeOccupancy",
        "begin_capture": "fakeStreamBeginCapture",
        "end_capture": "fakeStreamEndCapture",
        "graph_instantiate": "fakeGraphInstantiate",
        "graph_launch": "fakeGraphLaunch",
        **dict.fromkeys(
            (
                "synchronize",
                "stream_destroy",
                "stream_synchronize",
                "event_destroy",
                "event_synchronize",
                "module_unload",
                "graph_destroy",
                "graph_exec_destroy",
            ),
            "fakeSuccess",
        ),
    }

    def __init__(self, kernels: dict[str, Sequence[str]] = KERNELS) -> None:
        self._kernels = kernels
        self._memory: dict[int, ctypes.Array] = {}
        self._capturing: dict[int, list[tuple[str, bytes]]] = {}
        self._streams = 0
        self.log: list[tuple[str, str, bytes]] = []  # ('launch' | 'replay', kernel, arg bytes)
        self.prepared: list[tuple] = []  # _launcher calls (their arguments, overlap aside)
        self.shared_opt_ins: list[tuple[Any, int]] = []  # _allow_dynamic_shared calls
        self.occupancy_queries: list[tuple[Any, int, int]] = []  # fakeOccupancy calls
        self.launch_status = 0  # what launches return; nonzero makes them fail
        self.refused_code: set[bytes] = set()  # code objects module loads refuse
        self.clock_us = 0.0
        self.durations_us: dict[str, float] = {}  # device time of each kernel's launch
        super().__init__(
            INFO,
            self,
            stream_flags=0,
            event_no_timing_flags=1,
            host_alloc_flags=0,
            mapped_host_alloc_flags=2,
            capture_mode=0,
        )

    # --- the fake binding: (status, *values) like cuda-bindings and hip-python ---------------
    def fakeSuccess(self, *args: Any) -> tuple[int]:
        return (0,)

    def fakeMalloc(self, nbytes: int, flags: int = 0) -> tuple[int, int]:
        if nbytes > self.info.total_memory:
            return (FakeStatus.OUT_OF_MEMORY, 0)
        block = ctypes.create_string_buffer(nbytes)
        self._memory[ctypes.addressof(block)] = block
        return (0, ctypes.addressof(block))

    def fakeHostGetDevicePointer(self, ptr: int, flags: int) -> tuple[int, int]:
        return (0, ptr)  # one address space

    def fakeFree(self, ptr: int) -> tuple[int]:
        del self._memory[ptr]
        return (0,)

    def fakeMemcpy(self, dst: int, src: int, nbytes: int, stream: Any = None) -> tuple[int]:
        ctypes.memmove(dst, src, nbytes)
        return (0,)

    def fakeMemsetD8Async(self, dst: int, byte: int, nbytes: int, stream: Any) -> tuple[int]:
        ctypes.memset(dst, byte, nbytes)
        return (0,)

    def fakeStreamCreate(self, flags: int) -> tuple[int, int]:
        self._streams += 1
        return (0, self._streams)

    def fakeEventCreate(self, flags: int) -> tuple[int, list[float]]:
        return (0, [0.0])  # the device clock when last recorded

    def fakeEventRecord(self, event: list[float], stream: Any) -> tuple[int]:
        event[0] = self.clock_us
        return (0,)

    def fakeEventElapsedTime(self, start: list[float], end: list[float]) -> tuple[int, float]:
        return (0, (end[0] - start[0]) / 1e3)

    def fakeModuleLoadData(self, code: bytes) -> tuple[int, bytes | None]:
        if code in self.refused_code:
            return (FakeStatus.INVALID_IMAGE, None)
        return (0, code)

    def fakeModuleGetFunction(self, module: bytes, name: bytes) -> tuple[int, str | None]:
        if name.decode() not in self._kernels:
            return (FakeStatus.NOT_FOUND, None)
        return (0, name.decode())

    def fakeOccupancy(self, function: str, threads: int, shared_bytes: int) -> tuple[int, int]:
        """A multiprocessor of 2048 threads and 64 KiB of shared memory."""
        self.occupancy_queries.append((function, threads, shared_bytes))
        return (0, min(2048 // threads, (64 << 10) // max(1, shared_bytes)))

    def fakeStreamBeginCapture(self, stream: int, mode: int) -> tuple[int]:
        self._capturing[stream] = []
        return (0,)

    def fakeStreamEndCapture(self, stream: int) -> tuple[int, tuple[tuple[str, bytes], ...]]:
        return (0, tuple(self._capturing.pop(stream)))

    def fakeGraphInstantiate(self, graph: Any, flags: int) -> tuple[int, Any]:
        return (0, graph)

    def fakeGraphLaunch(self, exe: Any, stream: int) -> tuple[int]:
        self.log.extend(("replay", name, args) for name, args in exe)
        self.clock_us += sum(self.durations_us.get(name, 0.0) for name, _ in exe)
        return (0,)

    # --- what differs per vendor -------------------------------------------------------------
    def _bind_thread(self) -> None:
        pass

    def _release_device(self) -> None:
        pass

    def _allow_dynamic_shared(self, function: Any, nbytes: int) -> None:
        self.shared_opt_ins.append((function, nbytes))

    def _launcher(
        self, function, grid, block, shared_bytes, stream, params_ptr, overlap, cluster
    ) -> tuple[str, Callable[[], tuple[int]]]:
        self.prepared.append((function, grid, block, shared_bytes, stream, params_ptr, cluster))
        types = self._kernels[function]
        pointers = (ctypes.c_void_p * len(types)).from_address(params_ptr)

        def launch() -> tuple[int]:
            if self.launch_status:
                return (self.launch_status,)
            args = b"".join(
                ctypes.string_at(p, SIZES[t]) for p, t in zip(pointers, types, strict=True)
            )
            if stream in self._capturing:
                self._capturing[stream].append((function, args))  # a copy, as CUDA keeps
            else:
                self.log.append(("launch", function, args))
                self.clock_us += self.durations_us.get(function, 0.0)
            return (0,)

        return "fakeLaunchKernel", launch
