"""What a GPU `Driver` (driver.py) runs and hands out: `PRIMITIVES`, the vendor calls it makes
through its one generic call; `check`, which turns a binding's status into a `BackendError`;
`DeviceInfo` and `DriverCounters`; and the records (`DeviceBuffer`, `PinnedBuffer`, `Stream`,
`Event`, `Module`, `Function`, `Graph`, `GraphExec`: plain Python objects holding the vendor
handle, which call back on their driver through `RecordOwner`).
"""

from __future__ import annotations

import ctypes
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

from rocforge_rt.errors import BackendError

# What `Driver` runs through its one generic call (`Driver._call`), with the
# arguments it passes, in the order both vendors' functions take them; each
# vendor's `Driver.api_names` maps every one to its binding function.
PRIMITIVES = (
    "synchronize",  # () waits for the whole device
    "alloc",  # (nbytes) -> device pointer
    "free",  # (ptr)
    "host_alloc",  # (nbytes, flags) -> page-locked host pointer
    "host_device_pointer",  # (host pointer of mapped page-locked memory, 0) -> device pointer
    "host_free",  # (ptr)
    "copy_htod",  # (dst, src, nbytes), synchronous
    "copy_htod_async",  # (dst, src, nbytes, stream)
    "copy_dtoh",  # (dst, src, nbytes), synchronous
    "copy_dtoh_async",  # (dst, src, nbytes, stream)
    "memset",  # (dst, byte, nbytes, stream)
    "stream_create",  # (flags) -> stream
    "stream_destroy",  # (stream)
    "stream_synchronize",  # (stream)
    "event_create",  # (flags) -> event
    "event_destroy",  # (event)
    "event_record",  # (event, stream)
    "event_synchronize",  # (event)
    "event_elapsed",  # (start, end) -> milliseconds
    "module_load",  # (code) -> module
    "module_unload",  # (module)
    "module_function",  # (module, name as bytes) -> function
    "occupancy",  # (function, block threads, dynamic shared bytes) -> blocks a multiprocessor
    "begin_capture",  # (stream, capture mode)
    "end_capture",  # (stream) -> graph
    "graph_instantiate",  # (graph, 0) -> executable graph
    "graph_launch",  # (exec, stream)
    "graph_destroy",  # (graph)
    "graph_exec_destroy",  # (exec)
)


@dataclass(frozen=True)
class DeviceInfo:
    """What the runtime needs to know about a device."""

    vendor: str  # 'cuda' | 'hip'
    name: str
    arch: str  # compile target, e.g. 'sm_90' or 'gfx90a'
    warp_size: int
    multiprocessors: int  # SMs (NVIDIA) or CUs (AMD)
    total_memory: int  # bytes
    l2_bytes: int
    max_shared_per_block: int  # bytes one block may use (CUDA: past 48 KiB after opt-in)


@dataclass
class DriverCounters:
    """What the overhead stats read: host-blocking waits, launches, graph replays."""

    syncs: int = 0  # stream/event/device synchronizations and synchronous copies
    launches: int = 0  # kernel launch calls, including those recorded into a graph
    captures: int = 0  # stream captures ended (graphs made)
    graph_replays: int = 0  # graph launches

    def snapshot(self) -> dict[str, int]:
        return asdict(self)

    def reset(self) -> None:
        self.syncs = self.launches = self.captures = self.graph_replays = 0


def check(api_name: str, result: Any) -> Any:
    """Unwrap a cuda-bindings or hip-python return value, raising `BackendError` on failure.

    Both return a tuple ``(status, *values)`` whose status is an int enum, 0 on
    success. Returns None for no value, the value itself for one, else the tuple.
    """
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        name = getattr(status, "name", str(status))
        raise BackendError(f"{api_name} failed: {name} ({int(status)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class RecordOwner(Protocol):
    """What the records call back on the driver that made them (driver.py's `Driver`)."""

    def free(self, buf: DeviceBuffer | PinnedBuffer) -> None: ...
    def stream_synchronize(self, stream: Stream) -> None: ...
    def event_record(self, event: Event, stream: Stream) -> None: ...
    def event_synchronize(self, event: Event) -> None: ...
    def event_elapsed_ms(self, start: Event, end: Event) -> float: ...
    def set_max_dynamic_shared(self, function: Function, nbytes: int) -> None: ...
    def module_function(self, module: Module, name: str) -> Function: ...
    def graph_instantiate(self, graph: Graph) -> GraphExec: ...
    def graph_launch(self, exe: GraphExec, stream: Stream) -> None: ...
    def release(self, record: object) -> None: ...


class DeviceBuffer:
    """Device memory: `ptr` (an int, 0 once freed) and `nbytes`."""

    __slots__ = ("_driver", "nbytes", "ptr")

    def __init__(self, driver: RecordOwner, ptr: int, nbytes: int) -> None:
        self._driver = driver
        self.ptr = ptr
        self.nbytes = nbytes

    def free(self) -> None:
        """Release the memory now (otherwise `Driver.close` does); `ptr` becomes 0."""
        self._driver.free(self)

    def __repr__(self) -> str:
        return f"DeviceBuffer(ptr={self.ptr:#x}, nbytes={self.nbytes})"


class PinnedBuffer:
    """Page-locked host memory, the source or target of asynchronous copies; mapped memory
    also has a `device_ptr` (0 where not mapped) through which kernels read and write it."""

    __slots__ = ("_bytes", "_driver", "device_ptr", "nbytes", "ptr")

    def __init__(self, driver: RecordOwner, ptr: int, nbytes: int) -> None:
        self._driver = driver
        self.ptr = ptr
        self.nbytes = nbytes
        self.device_ptr = 0  # Driver.alloc_pinned sets it once the memory is owned
        self._bytes = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))

    def view(self, dtype: Any, shape: int | tuple[int, ...]) -> np.ndarray:
        """A numpy array over the first bytes of this memory (no copy; invalid once freed)."""
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes > self.nbytes:
            raise ValueError(
                f"a {dtype} view of shape {shape} needs {nbytes} bytes of {self.nbytes}"
            )
        return self._bytes[:nbytes].view(dtype).reshape(shape)

    def free(self) -> None:
        """Release the memory now (otherwise `Driver.close` does); views become invalid."""
        self._driver.free(self)


class Stream:
    """An in-order work queue on the device."""

    __slots__ = ("_driver", "handle")

    def __init__(self, driver: RecordOwner, handle: Any) -> None:
        self._driver = driver
        self.handle = handle

    def synchronize(self) -> None:
        """Block until everything queued so far has run (counted as a sync)."""
        self._driver.stream_synchronize(self)


class Event:
    """A marker in a stream, for ordering and timing."""

    __slots__ = ("_driver", "handle", "timing")

    def __init__(self, driver: RecordOwner, handle: Any, timing: bool) -> None:
        self._driver = driver
        self.handle = handle
        self.timing = timing

    def record(self, stream: Stream) -> None:
        self._driver.event_record(self, stream)

    def synchronize(self) -> None:
        """Block until the recorded work has run (counted as a sync)."""
        self._driver.event_synchronize(self)

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to `end`; both must have completed."""
        return self._driver.event_elapsed_ms(self, end)


DEFAULT_DYNAMIC_SHARED = 48 << 10  # dynamic shared memory a launch may take without opt-in


class Function:
    """A kernel in a loaded module."""

    __slots__ = ("_driver", "dynamic_shared_limit", "handle", "name")

    def __init__(self, driver: RecordOwner, handle: Any, name: str) -> None:
        self._driver = driver
        self.handle = handle
        self.name = name
        self.dynamic_shared_limit = DEFAULT_DYNAMIC_SHARED

    def allow_dynamic_shared(self, nbytes: int) -> None:
        """Let launches take up to `nbytes` of dynamic shared memory (past 48 KiB an opt-in
        the driver records per kernel: the limit only grows, so no launch loses it)."""
        if nbytes > self.dynamic_shared_limit:
            self._driver.set_max_dynamic_shared(self, nbytes)
            self.dynamic_shared_limit = nbytes

    def __repr__(self) -> str:
        return f"Function({self.name!r})"


class Module:
    """A loaded code object (CUBIN or AMD HSACO)."""

    __slots__ = ("_code", "_driver", "_functions", "handle")

    def __init__(self, driver: RecordOwner, handle: Any, code: bytes) -> None:
        self._driver = driver
        self.handle = handle
        self._code = code  # kept alive as long as the module
        self._functions: dict[str, Function] = {}

    def function(self, name: str) -> Function:
        """The kernel called `name`; raises `BackendError` naming it when the module lacks it."""
        if name not in self._functions:
            self._functions[name] = self._driver.module_function(self, name)
        return self._functions[name]


class Graph:
    """A captured sequence of device work, not yet executable."""

    __slots__ = ("_driver", "handle")

    def __init__(self, driver: RecordOwner, handle: Any) -> None:
        self._driver = driver
        self.handle = handle

    def instantiate(self) -> GraphExec:
        return self._driver.graph_instantiate(self)

    def destroy(self) -> None:
        self._driver.release(self)


class GraphExec:
    """An executable graph; each `launch` replays the captured work with the captured arguments."""

    __slots__ = ("_driver", "handle")

    def __init__(self, driver: RecordOwner, handle: Any) -> None:
        self._driver = driver
        self.handle = handle

    def launch(self, stream: Stream) -> None:
        self._driver.graph_launch(self, stream)

    def destroy(self) -> None:
        self._driver.release(self)
