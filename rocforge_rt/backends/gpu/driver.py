"""The GPU driver interface and its vendor-neutral implementation.

Holds `Driver`, the interface the runtime uses (memory, copies, streams, events,
modules, launches, stream capture -> graph -> replay). The records it hands out
(`DeviceBuffer`, `PinnedBuffer`, `Stream`, `Event`, `Module`, `Function`,
`Graph`, `GraphExec`: plain Python objects holding the vendor handle), its
`DeviceInfo` and `DriverCounters`, `PRIMITIVES` and `check`, which turns a
binding's status into a `BackendError`, are in driver_types.py.

One call path for both vendors: every primitive in `PRIMITIVES` (an allocation,
a copy, a stream or graph call...) runs as ``check(name, api.<name>(*args))``,
where `api` is the vendor's binding module (cuda-bindings' ``driver``,
hip-python's ``hip``) and `name` comes from the vendor's `Driver.api_names`
table (``"alloc": "cuMemAlloc"`` / ``"alloc": "hipMalloc"``), so that errors
name the vendor call and its status. A vendor module (``cuda.py``, ``hip.py``)
supplies that table, its flag values and what truly differs: device selection,
the launcher, thread binding, the shared-memory opt-in and the release of the
device. Whatever is not released explicitly is released by `Driver.close()`.

Executor contract: a driver belongs to one thread, the engine's executor (the
thread that made it, or one that called `claim_executor_thread`). Every call
from any other thread raises `BackendError` before touching the device: the
runtime's per-handle argument bytes, the step-state buffer and stream order are
only race-free when one thread issues all the work.

Copy semantics: a `PinnedBuffer` source or destination gives an asynchronous
copy on the given stream (the legacy/null stream when None); the host must not
touch that pinned memory until the copy has executed. A numpy array gives a
synchronous copy: host-blocking, ordered after the work already queued on the
driver's streams (they are created blocking, i.e. ordered with the null
stream), counted as a sync, and illegal during stream capture.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

from rocforge_rt.backends.gpu.driver_types import (
    PRIMITIVES,
    DeviceBuffer,
    DeviceInfo,
    DriverCounters,
    Event,
    Function,
    Graph,
    GraphExec,
    Module,
    PinnedBuffer,
    Stream,
    check,
)
from rocforge_rt.errors import BackendError

_get_ident = threading.get_ident

# Release order at close: graph execs, graphs, events, streams, modules, memory.
_EXEC, _GRAPH, _EVENT, _STREAM, _MODULE, _PINNED, _DEVICE = range(7)


def _host_span(array: np.ndarray, writable: bool) -> tuple[int, int]:
    if not array.flags.c_contiguous:
        raise ValueError("host arrays for device copies must be C-contiguous")
    if writable and not array.flags.writeable:
        raise ValueError("the destination array is read-only")
    return array.ctypes.data, array.nbytes


def _device_span(buf: DeviceBuffer, offset: int, nbytes: int) -> int:
    if not buf.ptr:
        raise BackendError("device buffer used after free()")
    if offset < 0 or nbytes < 0 or offset + nbytes > buf.nbytes:
        raise ValueError(f"{nbytes} bytes at offset {offset} overrun a {buf.nbytes}-byte buffer")
    return buf.ptr + offset


class Driver(ABC):
    """One device, driven from one executor thread, through a vendor's binding module.

    A subclass declares `api_names` (each name in `PRIMITIVES` -> the function of
    its binding module that does it) and implements the abstract hooks, what
    differs per vendor. Its ``__init__`` initializes the API, makes the device
    current on the calling thread and then calls ``super().__init__`` with the
    device info, the binding module and the values its functions take:
    `stream_flags` for blocking streams (ordered with the null stream),
    `event_no_timing_flags`, `host_alloc_flags` for plain page-locked memory,
    `mapped_host_alloc_flags` for page-locked memory mapped into the device's address
    space and `capture_mode` for thread-local stream capture.
    """

    api_names: ClassVar[Mapping[str, str]]
    # Whether kernels may be launched to overlap the previous kernel's tail (programmatic
    # dependent launch; the kernels wait for it themselves, kernels/rf_portability.h).
    supports_overlap = False
    # Whether kernels may copy from global into shared memory with the copy engine (bulk
    # copies completing on a shared-memory barrier, kernels/rf_portability.h).
    supports_bulk_copy = False
    # Whether kernels may be launched in thread block clusters whose blocks read and write
    # each other's shared memory (kernels/rf_portability.h, rf_cluster_*).
    supports_clusters = False

    def __init__(
        self,
        info: DeviceInfo,
        api: Any,
        *,
        stream_flags: Any,
        event_no_timing_flags: Any,
        host_alloc_flags: Any,
        mapped_host_alloc_flags: Any,
        capture_mode: Any,
    ) -> None:
        if differ := set(PRIMITIVES) ^ set(self.api_names):
            raise TypeError(f"{type(self).__name__}.api_names differs from PRIMITIVES in {differ}")
        try:
            self._calls = {p: (name, getattr(api, name)) for p, name in self.api_names.items()}
        except AttributeError as exc:
            raise BackendError(f"the {info.vendor} binding lacks a function: {exc}") from None
        self._stream_flags = stream_flags
        self._event_no_timing_flags = event_no_timing_flags
        self._host_alloc_flags = host_alloc_flags
        self._mapped_host_alloc_flags = mapped_host_alloc_flags
        self._capture_mode = capture_mode
        self.info = info
        self.counters = DriverCounters()
        self.owner_thread: int | None = threading.get_ident()
        self._owner_name = threading.current_thread().name
        self._owned: dict[int, tuple[int, Callable[[], None]]] = {}

    def _call(self, primitive: str, *args: Any) -> Any:
        """Run one of `PRIMITIVES` through the vendor's function; `check` names it on failure."""
        name, function = self._calls[primitive]
        return check(name, function(*args))

    # --- executor thread ---------------------------------------------------------------------
    def check_thread(self) -> None:
        """Raise `BackendError` unless called from the executor thread of an open driver."""
        if threading.get_ident() == self.owner_thread:
            return
        if self.owner_thread is None:
            raise BackendError(f"{self.info.vendor} driver is closed")
        raise BackendError(
            f"{self.info.vendor} driver called from thread "
            f"{threading.current_thread().name!r}, but it belongs to its executor thread "
            f"{self._owner_name!r}: one thread issues all device work (hand it over "
            "with claim_executor_thread())"
        )

    def claim_executor_thread(self) -> None:
        """Make the calling thread the executor; the previous one must have stopped using it."""
        if self.owner_thread is None:
            raise BackendError(f"{self.info.vendor} driver is closed")
        self._bind_thread()
        self.owner_thread = threading.get_ident()
        self._owner_name = threading.current_thread().name

    # --- memory ------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> DeviceBuffer:
        """Uninitialized device memory."""
        self.check_thread()
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        buf = DeviceBuffer(self, int(self._call("alloc", nbytes)), nbytes)
        self._own(buf, _DEVICE, lambda: self._free_device(buf))
        return buf

    def alloc_pinned(self, nbytes: int, *, mapped: bool = False) -> PinnedBuffer:
        """Page-locked host memory; `mapped`: also in the device's address space, so that
        kernels write it directly (the host reads it once the stream's work is done)."""
        self.check_thread()
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        flags = self._mapped_host_alloc_flags if mapped else self._host_alloc_flags
        ptr = int(self._call("host_alloc", nbytes, flags))
        buf = PinnedBuffer(self, ptr, nbytes)
        self._own(buf, _PINNED, lambda: self._free_pinned(buf))
        if mapped:
            buf.device_ptr = int(self._call("host_device_pointer", ptr, 0))
        return buf

    def free(self, buf: DeviceBuffer | PinnedBuffer) -> None:
        """Release a buffer now; freeing twice is harmless."""
        self.check_thread()
        self.release(buf)

    def copy_htod(
        self,
        dst: DeviceBuffer,
        src: np.ndarray | PinnedBuffer,
        stream: Stream | None = None,
        dst_offset: int = 0,
        nbytes: int | None = None,
    ) -> None:
        """Copy `src` (all of it, or its first `nbytes`) into `dst` at `dst_offset`."""
        self.check_thread()
        if isinstance(src, PinnedBuffer):
            count = src.nbytes if nbytes is None else nbytes
            if count > src.nbytes:
                raise ValueError(f"{count} bytes requested from a {src.nbytes}-byte pinned buffer")
            target = _device_span(dst, dst_offset, count)
            self._call("copy_htod_async", target, src.ptr, count, _handle(stream))
            return
        host, size = _host_span(src, writable=False)
        count = size if nbytes is None else nbytes
        if count > size:
            raise ValueError(f"{count} bytes requested from a {size}-byte host array")
        self._call("copy_htod", _device_span(dst, dst_offset, count), host, count)
        self.counters.syncs += 1

    def copy_dtoh(
        self,
        dst: np.ndarray | PinnedBuffer,
        src: DeviceBuffer,
        stream: Stream | None = None,
        src_offset: int = 0,
        nbytes: int | None = None,
    ) -> None:
        """Copy `nbytes` (default: all of `dst`) from `src` at `src_offset` into `dst`."""
        self.check_thread()
        if isinstance(dst, PinnedBuffer):
            host, size = dst.ptr, dst.nbytes
        else:
            host, size = _host_span(dst, writable=True)
        count = size if nbytes is None else nbytes
        if count > size:
            raise ValueError(f"{count} bytes do not fit a {size}-byte host destination")
        source = _device_span(src, src_offset, count)
        if isinstance(dst, PinnedBuffer):
            self._call("copy_dtoh_async", host, source, count, _handle(stream))
            return
        self._call("copy_dtoh", host, source, count)
        self.counters.syncs += 1

    def memset(self, dst: DeviceBuffer, byte: int, stream: Stream | None = None) -> None:
        """Set every byte of `dst` to `byte`, asynchronously on `stream`."""
        self.check_thread()
        target = _device_span(dst, 0, dst.nbytes)
        self._call("memset", target, byte, dst.nbytes, _handle(stream))

    # --- streams and events ------------------------------------------------------------------
    def create_stream(self) -> Stream:
        """A blocking stream: ordered with the null stream, hence with synchronous copies."""
        self.check_thread()
        stream = Stream(self, self._call("stream_create", self._stream_flags))
        self._own(stream, _STREAM, lambda: self._call("stream_destroy", stream.handle))
        return stream

    def stream_synchronize(self, stream: Stream) -> None:
        self.check_thread()
        self._call("stream_synchronize", stream.handle)
        self.counters.syncs += 1

    def create_event(self, timing: bool = True) -> Event:
        self.check_thread()
        flags = 0 if timing else self._event_no_timing_flags
        event = Event(self, self._call("event_create", flags), timing)
        self._own(event, _EVENT, lambda: self._call("event_destroy", event.handle))
        return event

    def event_record(self, event: Event, stream: Stream) -> None:
        self.check_thread()
        self._call("event_record", event.handle, stream.handle)

    def event_synchronize(self, event: Event) -> None:
        self.check_thread()
        self._call("event_synchronize", event.handle)
        self.counters.syncs += 1

    def event_elapsed_ms(self, start: Event, end: Event) -> float:
        self.check_thread()
        if not (start.timing and end.timing):
            raise BackendError("elapsed time needs two events created with timing=True")
        return float(self._call("event_elapsed", start.handle, end.handle))

    def synchronize(self) -> None:
        """Block until all work on the device has run (counted as a sync)."""
        self.check_thread()
        self._call("synchronize")
        self.counters.syncs += 1

    # --- modules and launches ----------------------------------------------------------------
    def load_module(self, code: bytes) -> Module:
        """Load a code object compiled for this device (see `KernelLibrary`)."""
        self.check_thread()
        module = Module(self, self._call("module_load", code), code)
        self._own(module, _MODULE, lambda: self._call("module_unload", module.handle))
        return module

    def module_function(self, module: Module, name: str) -> Function:
        self.check_thread()
        try:
            handle = self._call("module_function", module.handle, name.encode())
        except BackendError as exc:
            raise BackendError(f"{exc}: kernel {name!r} is not in this module") from None
        return Function(self, handle, name)

    def blocks_per_multiprocessor(
        self, function: Function, threads: int, shared_bytes: int = 0
    ) -> int:
        """How many blocks of `threads` threads (and `shared_bytes` of dynamic shared memory)
        of `function` one multiprocessor runs at once."""
        self.check_thread()
        return int(self._call("occupancy", function.handle, threads, shared_bytes))

    def set_max_dynamic_shared(self, function: Function, nbytes: int) -> None:
        self.check_thread()
        if nbytes > self.info.max_shared_per_block:
            raise BackendError(
                f"{function.name}: {nbytes} bytes of shared memory exceed the device's "
                f"{self.info.max_shared_per_block} per block"
            )
        self._allow_dynamic_shared(function.handle, nbytes)

    def prepare_launch(
        self,
        function: Function,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_bytes: int,
        stream: Stream,
        params_ptr: int,
        overlap: bool = False,
        cluster: int = 1,
    ) -> Callable[[], None]:
        """A zero-argument launcher with every API argument bound once (the hot path).

        `params_ptr` is the address of the kernel's ``void*[]`` parameters; the
        driver copies what it points at on each call (and a captured launch keeps
        its copy), so that memory may be rewritten between calls. `overlap` asks for
        programmatic dependent launch where the device supports it (`supports_overlap`):
        the kernel must then call rf_pdl_wait() before it touches anything an earlier
        kernel wrote. `cluster` > 1 launches the grid in clusters of that many blocks
        (`supports_clusters` only; the grid a multiple of it).
        """
        self.check_thread()
        overlap = overlap and self.supports_overlap
        if cluster > 1 and (not self.supports_clusters or grid[0] % cluster):
            raise BackendError(f"no clusters of {cluster} blocks for a grid of {grid[0]} here")
        api, call = self._launcher(
            function.handle,
            grid,
            block,
            shared_bytes,
            stream.handle,
            params_ptr,
            overlap,
            cluster,
        )
        counters = self.counters

        def launch() -> None:
            if _get_ident() != self.owner_thread:
                self.check_thread()
            result = call()
            if result[0]:
                check(api, result)
            counters.launches += 1

        return launch

    def launch(
        self,
        function: Function,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_bytes: int,
        stream: Stream,
        params_ptr: int,
    ) -> None:
        """Launch `function` once (see `prepare_launch`, which repeated launches should use)."""
        self.prepare_launch(function, grid, block, shared_bytes, stream, params_ptr)()

    # --- graphs ------------------------------------------------------------------------------
    def begin_capture(self, stream: Stream) -> None:
        """Start recording `stream`'s work into a graph (thread-local capture mode).

        Thread-local mode makes the capturing (executor) thread's own unsafe calls
        (synchronous copies, allocations, syncs) fail loudly instead of silently
        breaking the capture, without constraining other threads of the process.
        """
        self.check_thread()
        self._call("begin_capture", stream.handle, self._capture_mode)

    def end_capture(self, stream: Stream) -> Graph:
        """Stop recording `stream`; the graph holds copies of every captured launch's arguments."""
        self.check_thread()
        graph = Graph(self, self._call("end_capture", stream.handle))
        self._own(graph, _GRAPH, lambda: self._call("graph_destroy", graph.handle))
        self.counters.captures += 1
        return graph

    def graph_instantiate(self, graph: Graph) -> GraphExec:
        self.check_thread()
        exe = GraphExec(self, self._call("graph_instantiate", graph.handle, 0))
        self._own(exe, _EXEC, lambda: self._call("graph_exec_destroy", exe.handle))
        return exe

    def graph_launch(self, exe: GraphExec, stream: Stream) -> None:
        self.check_thread()
        self._call("graph_launch", exe.handle, stream.handle)
        self.counters.graph_replays += 1

    # --- lifetime ----------------------------------------------------------------------------
    def release(self, record: object) -> None:
        """Destroy one record made by this driver (buffer, stream, event, module, graph)."""
        self.check_thread()
        entry = self._owned.pop(id(record), None)
        if entry is not None:
            entry[1]()

    def close(self) -> None:
        """Wait for the device, release everything not yet released, let go of the device.

        Keeps going past failures (a faulted context fails every call) and raises
        the first one at the end. Closing twice is harmless.
        """
        if self.owner_thread is None:
            return
        self.check_thread()
        first: BackendError | None = None
        steps = [lambda: self._call("synchronize")]
        steps += [release for _, release in sorted(self._owned.values(), key=lambda e: e[0])]
        steps.append(self._release_device)
        self._owned.clear()
        for step in steps:
            try:
                step()
            except BackendError as exc:
                first = first or exc
        self.owner_thread = None
        if first is not None:
            raise first

    def __enter__(self) -> Driver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _own(self, record: object, rank: int, release: Callable[[], None]) -> None:
        self._owned[id(record)] = (rank, release)

    def _free_device(self, buf: DeviceBuffer) -> None:
        if buf.ptr:
            self._call("free", buf.ptr)
            buf.ptr = 0

    def _free_pinned(self, buf: PinnedBuffer) -> None:
        if buf.ptr:
            self._call("host_free", buf.ptr)
            buf.ptr, buf._bytes = 0, np.empty(0, dtype=np.uint8)

    # --- what differs per vendor -------------------------------------------------------------
    @abstractmethod
    def _bind_thread(self) -> None:
        """Make the device current on the calling thread (the new executor)."""

    @abstractmethod
    def _release_device(self) -> None:
        """Let go of the device, last step of `close` (a context, where the vendor has one)."""

    @abstractmethod
    def _allow_dynamic_shared(self, function: Any, nbytes: int) -> None:
        """Let `function` launch with `nbytes` of dynamic shared memory (an opt-in, or nothing)."""

    @abstractmethod
    def _launcher(
        self,
        function: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_bytes: int,
        stream: Any,
        params_ptr: int,
        overlap: bool,
        cluster: int,
    ) -> tuple[str, Callable[[], Any]]:
        """The launch API's name and its call with all arguments bound, returning the raw result.

        `overlap` (only passed True where `supports_overlap`): launch with programmatic
        dependent launch, so the kernel may start before the previous one finishes.
        `cluster` (above 1 only where `supports_clusters`): blocks a thread block cluster.
        """


def _handle(stream: Stream | None) -> Any:
    """The vendor handle of `stream`; None selects the null (legacy default) stream."""
    return None if stream is None else stream.handle
