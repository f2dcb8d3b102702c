"""Launch handles, the per-handle argument cache, the driver base and graph staleness (no GPU).

`FakeDriver` (tests/fake_driver.py) is the real `Driver` base over host memory, so
the hazards of cached launch arguments (stale replay, shared storage, foreign
streams, a second thread) show up here exactly as they would on a device.
"""

from __future__ import annotations

import ctypes
import dataclasses
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from fake_driver import KERNELS, FakeDriver, FakeStatus

from rocforge_rt.backends.gpu.graph import MIN_GRAPH_LAUNCHES, StepGraph, replay_us_per_launch
from rocforge_rt.backends.gpu.launch import (
    ARG_CACHE_STATS,
    ArgCacheStats,
    ArgLayout,
    LaunchHandle,
    arg_cache_enabled,
    set_arg_cache_enabled,
)
from rocforge_rt.errors import BackendError


@pytest.fixture
def driver() -> Iterator[FakeDriver]:
    with FakeDriver() as fake:
        yield fake


@pytest.fixture(autouse=True)
def _cache_on() -> Iterator[None]:
    """Each test starts with the cache on and leaves it on."""
    set_arg_cache_enabled(True)
    yield
    set_arg_cache_enabled(True)


def make_handle(
    driver: FakeDriver,
    stream: Any,
    kernel: str = "k",
    name: str = "k",
    kernel_stats: ArgCacheStats | None = None,
) -> LaunchHandle:
    function = driver.load_module(b"fake").function(kernel)
    return LaunchHandle(
        driver,
        function,
        name=name,
        grid=(1, 1, 1),
        block=(32, 1, 1),
        stream=stream,
        arg_types=KERNELS[kernel],
        kernel_stats=kernel_stats,
    )


def in_thread(fn: Callable[[], Any]) -> BaseException | None:
    """Run `fn` in a new thread; the exception it raised, if any."""
    errors: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=body, name="intruder")
    thread.start()
    thread.join()
    return errors[0] if errors else None


# --- packing layout ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("types", "offsets", "size"),
    [
        (("ptr", "i32", "f32", "ptr"), (0, 8, 12, 16), 24),
        (("i32", "ptr"), (0, 8), 16),
        (("ptr", "i32"), (0, 8), 16),
        (("i32", "i64", "u32"), (0, 8, 16), 24),
        (("i32", "f32", "u32"), (0, 4, 8), 12),
        ((), (), 0),
    ],
)
def test_c_layout(types: tuple[str, ...], offsets: tuple[int, ...], size: int) -> None:
    layout = ArgLayout.of(types)
    assert layout.offsets == offsets
    assert layout.size == size
    assert struct.calcsize(layout.format) == size


def test_a_kernel_opts_in_past_48_kib_of_shared_memory_and_never_back(driver: FakeDriver) -> None:
    """A handle past the default dynamic shared memory raises its kernel's limit; a later
    handle asking less leaves it, so the first handle's launches keep their room; past the
    device's most, it fails."""
    driver.info = dataclasses.replace(driver.info, max_shared_per_block=227 << 10)
    function = driver.load_module(b"m").function("k")

    def handle(shared_bytes: int) -> LaunchHandle:
        return LaunchHandle(
            driver, function, name="k", grid=(1, 1, 1), block=(1, 1, 1),
            shared_bytes=shared_bytes, stream=driver.create_stream(), arg_types=KERNELS["k"],
        )  # fmt: skip

    for shared_bytes in (1024, 96 << 10, 64 << 10, 96 << 10, 100 << 10):
        handle(shared_bytes)
    assert driver.shared_opt_ins == [(function.handle, 96 << 10), (function.handle, 100 << 10)]
    assert function.dynamic_shared_limit == 100 << 10
    with pytest.raises(BackendError, match="exceed the device's 232448 per block"):
        handle(228 << 10)


def test_unknown_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="f16"):
        ArgLayout.of(("ptr", "f16"))


def test_packed_bytes_and_zeroed_padding(driver: FakeDriver) -> None:
    handle = LaunchHandle(
        driver,
        driver.load_module(b"m").function("k"),
        name="pad",
        grid=(1, 1, 1),
        block=(1, 1, 1),
        stream=driver.create_stream(),
        arg_types=("i32", "ptr", "u32"),
    )
    handle.set_args(-1, 2**64 - 1, 2**32 - 1)
    packed = handle.packed_bytes
    assert len(packed) == 24
    assert packed[0:4] == b"\xff" * 4 and packed[4:8] == b"\0" * 4  # padding zeroed
    assert packed[8:16] == b"\xff" * 8
    assert packed[16:20] == b"\xff" * 4 and packed[20:24] == b"\0" * 4  # tail zeroed


def test_params_array_points_into_storage(driver: FakeDriver) -> None:
    handle = make_handle(driver, driver.create_stream())
    handle.set_args(0x1234_5678_9ABC, -7, 1.5, 42)
    pointers = (ctypes.c_void_p * 4).from_address(handle.params_ptr)
    assert [p - handle.storage_address for p in pointers] == [0, 8, 12, 16]
    assert ctypes.c_uint64.from_address(pointers[0]).value == 0x1234_5678_9ABC
    assert ctypes.c_int32.from_address(pointers[1]).value == -7
    assert ctypes.c_float.from_address(pointers[2]).value == 1.5
    assert ctypes.c_uint64.from_address(pointers[3]).value == 42


def test_bad_values_name_the_handle(driver: FakeDriver) -> None:
    handle = make_handle(driver, driver.create_stream(), name="gemv_q")
    with pytest.raises(ValueError, match="gemv_q"):
        handle.set_args(1, 2, 3.0)  # one argument short
    with pytest.raises(ValueError, match="gemv_q"):
        handle.set_args(-1, 2, 3.0, 4)  # a negative pointer


def test_bad_geometry_is_rejected(driver: FakeDriver) -> None:
    function = driver.load_module(b"m").function("k")
    with pytest.raises(ValueError, match="grid"):
        LaunchHandle(
            driver, function, name="k", grid=(0, 1, 1), block=(1, 1, 1), stream=None, arg_types=()
        )


# --- the cache -----------------------------------------------------------------------------------
def test_hits_misses_bytes_and_version(driver: FakeDriver) -> None:
    handle = make_handle(driver, driver.create_stream())
    before = ARG_CACHE_STATS.snapshot()
    assert handle.set_args(1, 2, 3.0, 4) is False  # first pack: a miss
    assert handle.set_args(1, 2, 3.0, 4) is True
    assert handle.set_args(1, 2, 3.0, 4) is True
    assert handle.set_args(1, 2, 3.5, 4) is False
    assert (handle.hits, handle.misses, handle.bytes_repacked, handle.version) == (2, 2, 48, 2)
    after = ARG_CACHE_STATS.snapshot()
    assert after["hits"] - before["hits"] == 2
    assert after["misses"] - before["misses"] == 2
    assert after["bytes_repacked"] - before["bytes_repacked"] == 48


def test_handles_of_one_kernel_add_up_in_their_shared_kernel_stats(driver: FakeDriver) -> None:
    shared = ArgCacheStats()
    stream = driver.create_stream()
    first, second = (make_handle(driver, stream, kernel_stats=shared) for _ in range(2))
    first.set_args(1, 2, 3.0, 4)
    first.set_args(1, 2, 3.0, 4)
    second.set_args(5, 6, 7.0, 8)
    assert (shared.hits, shared.misses, shared.bytes_repacked) == (1, 2, 48)
    assert shared.hits == first.hits + second.hits
    assert shared.misses == first.misses + second.misses


def test_f32_compares_as_packed_bytes(driver: FakeDriver) -> None:
    handle = make_handle(driver, driver.create_stream())
    handle.set_args(1, 2, 0.1, 4)
    assert handle.set_args(1, 2, float(np.float32(0.1)), 4)  # same float32 bytes: a hit
    for zero in (0.0, -0.0, 0.0, 0, -0.0):  # equal as values, not always as bytes
        wanted = struct.pack("<f", zero)
        was_equal = handle.packed_bytes[12:16] == wanted
        assert handle.set_args(1, 2, zero, 4) is was_equal
        assert handle.packed_bytes[12:16] == wanted


def test_unchanged_values_hit_without_repacking(driver: FakeDriver) -> None:
    handle = make_handle(driver, driver.create_stream())
    handle.set_args(1, 2, 3.0, 4)
    handle._scratch[:] = bytes(len(handle._scratch))  # a repack would leave a trace here
    assert handle.set_args(1, 2, 3.0, 4)
    assert handle._scratch == bytes(len(handle._scratch))


def test_cache_off_repacks_every_call(driver: FakeDriver) -> None:
    handle = make_handle(driver, driver.create_stream())
    set_arg_cache_enabled(False)
    assert not arg_cache_enabled()
    for _ in range(3):
        assert handle.set_args(1, 2, 3.0, 4) is False
    assert (handle.hits, handle.misses, handle.version, handle.bytes_repacked) == (0, 3, 3, 72)
    set_arg_cache_enabled(True)
    assert handle.set_args(1, 2, 3.0, 4) is True


def test_stats_reset_keeps_the_epoch(driver: FakeDriver) -> None:
    make_handle(driver, driver.create_stream()).set_args(1, 2, 3.0, 4)
    epoch = ARG_CACHE_STATS.epoch
    ARG_CACHE_STATS.reset()
    assert ARG_CACHE_STATS.snapshot() == {"hits": 0, "misses": 0, "bytes_repacked": 0}
    assert ARG_CACHE_STATS.epoch == epoch


# --- launching -----------------------------------------------------------------------------------
def test_launch_passes_the_cached_params(driver: FakeDriver) -> None:
    stream = driver.create_stream()
    handle = make_handle(driver, stream)
    handle.set_args(16, 3, 0.5, 32)
    handle.launch()
    handle.set_args(16, 3, 0.5, 32)
    handle.launch(stream)
    # The API call was prepared once, at construction, with the handle's params array.
    assert driver.prepared == [("k", (1, 1, 1), (32, 1, 1), 0, stream.handle, handle.params_ptr, 1)]
    expected = struct.pack("<QifQ", 16, 3, 0.5, 32)
    assert driver.log == [("launch", "k", expected)] * 2
    assert handle.launches == 2 and handle.launch_ns > 0
    assert driver.counters.launches == 2


def test_driver_launch_names_the_failing_api(driver: FakeDriver) -> None:
    handle = make_handle(driver, driver.create_stream())
    driver.launch_status = FakeStatus.BAD
    with pytest.raises(BackendError, match=r"fakeLaunchKernel failed: BAD \(719\)"):
        driver.launch(handle.function, (1, 1, 1), (1, 1, 1), 0, handle.stream, handle.params_ptr)
    assert driver.counters.launches == 0 and driver.log == []


def test_launch_before_set_args_raises(driver: FakeDriver) -> None:
    with pytest.raises(BackendError, match="before set_args"):
        make_handle(driver, driver.create_stream()).launch()


def test_a_handle_belongs_to_one_stream(driver: FakeDriver) -> None:
    handle = make_handle(driver, driver.create_stream())
    handle.set_args(1, 2, 3.0, 4)
    with pytest.raises(BackendError, match="one stream"):
        handle.launch(driver.create_stream())
    assert driver.log == []


def test_two_handles_never_share_storage(driver: FakeDriver) -> None:
    stream = driver.create_stream()
    a, b = make_handle(driver, stream, name="a"), make_handle(driver, stream, name="b")
    spans = sorted((h.storage_address, h.storage_address + h.layout.size) for h in (a, b))
    assert spans[0][1] <= spans[1][0]
    assert a.params_ptr != b.params_ptr
    a.set_args(1, 1, 1.0, 1)
    b.set_args(2, 2, 2.0, 2)
    assert a.packed_bytes == struct.pack("<QifQ", 1, 1, 1.0, 1)


def test_a_changed_argument_invalidates_that_handle_only(driver: FakeDriver) -> None:
    stream = driver.create_stream()
    a, b = make_handle(driver, stream, name="a"), make_handle(driver, stream, name="b")
    a.set_args(1, 1, 1.0, 1)
    b.set_args(2, 2, 2.0, 2)
    versions = (a.version, b.version)
    assert not a.set_args(9, 1, 1.0, 1)
    assert b.set_args(2, 2, 2.0, 2)
    assert (a.version, b.version) == (versions[0] + 1, versions[1])
    assert b.packed_bytes == struct.pack("<QifQ", 2, 2, 2.0, 2)


def test_a_kernels_blocks_per_multiprocessor_come_from_the_vendors_occupancy_call(
    driver: FakeDriver,
) -> None:
    """The driver asks the vendor's occupancy function for the kernel's handle, block size and
    dynamic shared memory, and gives back its count (the attention's decode wave)."""
    function = driver.load_module(b"m").function("k")
    assert driver.blocks_per_multiprocessor(function, 128) == 16
    assert driver.blocks_per_multiprocessor(function, 256, 16 << 10) == 4
    assert driver.occupancy_queries == [("k", 128, 0), ("k", 256, 16 << 10)]
    error = in_thread(lambda: driver.blocks_per_multiprocessor(function, 128))
    assert isinstance(error, BackendError) and "executor thread" in str(error)


# --- executor thread -----------------------------------------------------------------------------
def test_a_second_thread_gets_the_executor_error(driver: FakeDriver) -> None:
    handle = make_handle(driver, driver.create_stream())
    handle.set_args(1, 2, 3.0, 4)
    for call in (lambda: driver.alloc(16), lambda: handle.set_args(5, 6, 7.0, 8), handle.launch):
        error = in_thread(call)
        assert isinstance(error, BackendError) and "executor thread" in str(error)
    assert handle.version == 1 and driver.log == []


def test_the_executor_can_be_handed_over(driver: FakeDriver) -> None:
    stream = driver.create_stream()
    assert in_thread(lambda: (driver.claim_executor_thread(), driver.alloc(16))) is None
    with pytest.raises(BackendError, match="executor thread"):
        driver.create_stream()
    driver.claim_executor_thread()
    make_handle(driver, stream).set_args(1, 2, 3.0, 4)


# --- the driver base -----------------------------------------------------------------------------
def test_counters_and_close_release_everything() -> None:
    driver = FakeDriver()
    stream = driver.create_stream()
    buf = driver.alloc(64)
    pinned = driver.alloc_pinned(64)
    pinned.view(np.float32, 16)[:] = np.arange(16)
    driver.copy_htod(buf, pinned, stream)  # async: no sync
    out = np.zeros(16, dtype=np.float32)
    driver.copy_dtoh(out, buf)  # pageable: synchronous, a sync
    stream.synchronize()
    assert np.array_equal(out, np.arange(16))
    assert driver.counters.snapshot() == {
        "syncs": 2,
        "launches": 0,
        "captures": 0,
        "graph_replays": 0,
    }
    driver.alloc(8).free()
    driver.close()
    assert driver._memory == {}  # every buffer freed
    assert buf.ptr == 0 and pinned.ptr == 0
    with pytest.raises(BackendError, match="closed"):
        driver.alloc(8)
    driver.close()  # twice is harmless


def test_copy_bounds_and_offsets(driver: FakeDriver) -> None:
    buf = driver.alloc(16)
    driver.copy_htod(buf, np.arange(2, dtype=np.int32), dst_offset=8)
    out = np.zeros(2, dtype=np.int32)
    driver.copy_dtoh(out, buf, src_offset=8)
    assert out.tolist() == [0, 1]
    with pytest.raises(ValueError, match="overrun"):
        driver.copy_htod(buf, np.zeros(4, dtype=np.int32), dst_offset=4)
    with pytest.raises(ValueError, match="fit"):
        driver.copy_dtoh(out, buf, nbytes=12)
    buf.free()
    with pytest.raises(BackendError, match="after free"):
        driver.copy_htod(buf, out)


def test_pinned_view_is_zero_copy(driver: FakeDriver) -> None:
    pinned = driver.alloc_pinned(32)
    pinned.view(np.int32, (2, 4))[1, 3] = 7
    assert pinned.view(np.int32, 8)[7] == 7
    assert pinned.view(np.uint8, 32).ctypes.data == pinned.ptr
    with pytest.raises(ValueError, match="needs 36 bytes"):
        pinned.view(np.int32, 9)


def test_missing_kernel_is_named(driver: FakeDriver) -> None:
    with pytest.raises(
        BackendError, match=r"fakeModuleGetFunction failed: NOT_FOUND \(500\): kernel 'nope'"
    ):
        driver.load_module(b"m").function("nope")


def test_a_failing_call_names_the_vendor_function_and_status(driver: FakeDriver) -> None:
    with pytest.raises(BackendError, match=r"fakeMalloc failed: OUT_OF_MEMORY \(2\)"):
        driver.alloc(1 << 50)
    assert driver._memory == {} and driver._owned == {}  # nothing half-made


def test_an_incomplete_name_table_is_refused() -> None:
    class Incomplete(FakeDriver):
        api_names = {k: v for k, v in FakeDriver.api_names.items() if k != "memset"}

    with pytest.raises(TypeError, match="memset"):
        Incomplete()


# --- graphs --------------------------------------------------------------------------------------
def recorder(handles: list[LaunchHandle], args: dict[str, tuple]) -> Callable[[], list]:
    """A step: set each handle's current args and launch it."""

    def record() -> list[LaunchHandle]:
        for handle in handles:
            handle.set_args(*args[handle.name])
            handle.launch()
        return list(handles)

    return record


def replayed(driver: FakeDriver) -> list[tuple[str, bytes]]:
    return [(name, args) for how, name, args in driver.log if how == "replay"]


def test_replay_equals_eager(driver: FakeDriver) -> None:
    stream = driver.create_stream()
    handles = [make_handle(driver, stream, name="a"), make_handle(driver, stream, name="b")]
    args = {"a": (1, 2, 3.0, 4), "b": (5, 6, 7.0, 8)}
    record = recorder(handles, args)
    record()
    eager = [(name, a) for _, name, a in driver.log]
    graph = StepGraph(driver, stream)
    graph.capture(record)
    graph.replay()
    graph.replay()
    assert replayed(driver) == eager * 2
    assert (graph.captures, graph.recaptures, graph.replays) == (1, 0, 2)
    assert driver.counters.graph_replays == 2 and driver.counters.captures == 1


def test_a_micro_benchmark_times_a_launch_as_a_share_of_its_graphs_replays(
    driver: FakeDriver,
) -> None:
    stream = driver.create_stream()
    driver.durations_us = {"k": 4.0, "copy": 2.0}  # device time of each launch
    k, copy = make_handle(driver, stream), make_handle(driver, stream, "copy", "copy")
    k.set_args(1, 2, 3.0, 4)
    copy.set_args(1, 2, 3)

    def issue(i: int) -> None:
        (copy if i % 2 else k).launch()

    owned = len(driver._owned)
    assert replay_us_per_launch(driver, stream, issue, 2, reps=5) == pytest.approx(3.0)
    # Rounds over the 2 copies up to MIN_GRAPH_LAUNCHES launches; 3 warm replays, 5 timed.
    assert [name for name, _ in replayed(driver)] == ["k", "copy"] * (MIN_GRAPH_LAUNCHES // 2) * 8
    assert driver.counters.captures == 1 and driver.counters.graph_replays == 8
    assert len(driver._owned) == owned  # its events, graph and instance are released


def test_a_repacked_handle_is_recaptured_never_replayed_stale(driver: FakeDriver) -> None:
    stream = driver.create_stream()
    handles = [make_handle(driver, stream, name="a"), make_handle(driver, stream, name="b")]
    args = {"a": (1, 2, 3.0, 4), "b": (5, 6, 7.0, 8)}
    graph = StepGraph(driver, stream)
    graph.capture(recorder(handles, args))
    args["b"] = (500, 6, 7.0, 8)  # e.g. its output buffer moved
    handles[1].set_args(*args["b"])
    graph.replay()
    assert graph.recaptures == 1 and "'b'" in (graph.last_recapture_reason or "")
    assert replayed(driver)[-1] == ("k", struct.pack("<QifQ", 500, 6, 7.0, 8))
    graph.replay()
    assert graph.recaptures == 1  # up to date again


def test_an_unrelated_repack_does_not_recapture(driver: FakeDriver) -> None:
    stream = driver.create_stream()
    mine, other = make_handle(driver, stream, name="a"), make_handle(driver, stream, name="x")
    graph = StepGraph(driver, stream)
    graph.capture(recorder([mine], {"a": (1, 2, 3.0, 4)}))
    other.set_args(9, 9, 9.0, 9)
    graph.replay()
    assert graph.recaptures == 0 and graph.stale_reason() is None


def test_capture_rejects_foreign_streams_and_hidden_launches(driver: FakeDriver) -> None:
    stream, elsewhere = driver.create_stream(), driver.create_stream()
    foreign = make_handle(driver, elsewhere, name="foreign")
    with pytest.raises(BackendError, match="another stream"):
        StepGraph(driver, stream).capture(recorder([foreign], {"foreign": (1, 2, 3.0, 4)}))
    hidden = make_handle(driver, stream, name="hidden")

    def forgetful() -> list[LaunchHandle]:
        recorder([hidden], {"hidden": (1, 2, 3.0, 4)})()
        return []

    with pytest.raises(BackendError, match="launched 1 kernels but returned 0"):
        StepGraph(driver, stream).capture(forgetful)
    assert driver._capturing == {}  # every capture was ended


def test_a_failing_record_ends_the_capture(driver: FakeDriver) -> None:
    stream = driver.create_stream()

    def broken() -> list[LaunchHandle]:
        raise RuntimeError("boom")

    graph = StepGraph(driver, stream)
    with pytest.raises(RuntimeError, match="boom"):
        graph.capture(broken)
    assert driver._capturing == {}
    with pytest.raises(BackendError, match="before capture"):
        graph.replay()


def test_graph_replay_from_another_thread_is_refused(driver: FakeDriver) -> None:
    stream = driver.create_stream()
    graph = StepGraph(driver, stream)
    graph.capture(recorder([make_handle(driver, stream)], {"k": (1, 2, 3.0, 4)}))
    error = in_thread(graph.replay)
    assert isinstance(error, BackendError) and "executor thread" in str(error)
    assert replayed(driver) == []
