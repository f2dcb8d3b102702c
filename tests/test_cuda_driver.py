"""The CUDA driver, launch handles and step graphs on a real NVIDIA GPU (skipped without one).

The kernel is ``rf_embed_q8_0`` from kernels/embedding.hip: it reads its token
ids through a device pointer, so it also stands in for the step-state rule.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import numpy as np
import pytest

from rocforge_rt.backends.gpu import cuda
from rocforge_rt.backends.gpu.cuda import CudaDriver, NvrtcCompiler
from rocforge_rt.backends.gpu.driver_types import DeviceBuffer, Function, Module
from rocforge_rt.backends.gpu.graph import StepGraph
from rocforge_rt.backends.gpu.kernel_library import KernelLibrary
from rocforge_rt.backends.gpu.launch import LaunchHandle
from rocforge_rt.errors import BackendError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(cuda.device_count() == 0, reason="no CUDA device"),
]

EMBED_ARGS = ("ptr", "i64", "i32", "i32", "ptr", "i32", "ptr")
EMBED_THREADS = 256
N_ROWS, N_EMBD = 100, 512
Q8_BLOCK = 34


@pytest.fixture(scope="module")
def embedding(gpu_driver: CudaDriver, tmp_path_factory: pytest.TempPathFactory) -> Module:
    library = KernelLibrary(
        NvrtcCompiler(gpu_driver.info.arch), cache_dir=tmp_path_factory.mktemp("kernels")
    )
    return gpu_driver.load_module(library.load("embedding.hip").code)


@pytest.fixture(scope="module")
def embed(embedding: Module) -> Function:
    return embedding.function("rf_embed_q8_0")


@pytest.fixture(scope="module")
def table(gpu_driver: CudaDriver) -> tuple[DeviceBuffer, np.ndarray]:
    """A Q8_0 embedding table on the device and its dequantized rows on the host."""
    rng = np.random.default_rng(3)
    blocks = N_EMBD // 32
    d = rng.uniform(0.01, 0.1, (N_ROWS, blocks)).astype(np.float16)
    q = rng.integers(-128, 128, (N_ROWS, blocks, 32), dtype=np.int8)
    raw = np.empty((N_ROWS, blocks, Q8_BLOCK), dtype=np.uint8)
    raw[..., :2] = d.view(np.uint8).reshape(N_ROWS, blocks, 2)
    raw[..., 2:] = q.view(np.uint8)
    buf = gpu_driver.alloc(raw.nbytes)
    gpu_driver.copy_htod(buf, raw)
    rows = (d.astype(np.float32)[..., None] * q.astype(np.float32)).reshape(N_ROWS, N_EMBD)
    return buf, rows


def expected(rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    out = np.zeros((len(tokens), N_EMBD), dtype=np.float32)
    valid = (tokens >= 0) & (tokens < N_ROWS)
    out[valid] = rows[tokens[valid]]
    return out


def embed_handle(driver: CudaDriver, function: Function, stream, n_tokens: int) -> LaunchHandle:
    return LaunchHandle(
        driver,
        function,
        name="rf_embed_q8_0",
        grid=(math.ceil(N_EMBD / EMBED_THREADS), n_tokens, 1),
        block=(EMBED_THREADS, 1, 1),
        stream=stream,
        arg_types=EMBED_ARGS,
    )


def embed_args(table: DeviceBuffer, tokens: DeviceBuffer, n: int, out: DeviceBuffer) -> tuple:
    return (table.ptr, N_EMBD // 32 * Q8_BLOCK, N_ROWS, N_EMBD, tokens.ptr, n, out.ptr)


def read(driver: CudaDriver, buf: DeviceBuffer, n_tokens: int) -> np.ndarray:
    out = np.empty((n_tokens, N_EMBD), dtype=np.float32)
    driver.copy_dtoh(out, buf)
    return out


def test_device_info(gpu_driver: CudaDriver) -> None:
    info = gpu_driver.info
    assert info.vendor == "cuda" and info.arch.startswith("sm_") and info.warp_size == 32
    assert info.multiprocessors > 0 and info.total_memory > 1 << 30
    assert info.l2_bytes > 0 and info.max_shared_per_block >= 48 << 10


def test_alloc_copy_round_trip(gpu_driver: CudaDriver) -> None:
    data = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    buf = gpu_driver.alloc(data.nbytes)
    syncs = gpu_driver.counters.syncs
    gpu_driver.copy_htod(buf, data)
    back = np.empty_like(data)
    gpu_driver.copy_dtoh(back, buf)
    assert np.array_equal(back, data)
    part = np.empty(16, dtype=np.float32)
    gpu_driver.copy_dtoh(part, buf, src_offset=400)
    assert np.array_equal(part, data[100:116])
    assert gpu_driver.counters.syncs == syncs + 3  # synchronous copies count as syncs
    buf.free()


def test_pinned_async_copies_and_memset(gpu_driver: CudaDriver) -> None:
    stream = gpu_driver.create_stream()
    src, dst = gpu_driver.alloc_pinned(1 << 20), gpu_driver.alloc_pinned(1 << 20)
    values = np.arange(1 << 18, dtype=np.int32)
    src.view(np.int32, values.shape)[:] = values
    buf = gpu_driver.alloc(1 << 20)
    syncs = gpu_driver.counters.syncs
    gpu_driver.copy_htod(buf, src, stream)
    gpu_driver.copy_dtoh(dst, buf, stream)
    stream.synchronize()
    assert gpu_driver.counters.syncs == syncs + 1
    assert np.array_equal(dst.view(np.int32, values.shape), values)
    gpu_driver.memset(buf, 0xFF, stream)
    gpu_driver.copy_dtoh(dst, buf, stream, nbytes=64)
    stream.synchronize()
    assert (dst.view(np.int32, 16) == -1).all()


def test_events_time_device_work(gpu_driver: CudaDriver) -> None:
    stream = gpu_driver.create_stream()
    start, end = gpu_driver.create_event(), gpu_driver.create_event()
    buf = gpu_driver.alloc(64 << 20)
    start.record(stream)
    gpu_driver.memset(buf, 1, stream)
    end.record(stream)
    end.synchronize()
    assert start.elapsed_ms(end) > 0.0
    with pytest.raises(BackendError, match="timing=True"):
        start.elapsed_ms(gpu_driver.create_event(timing=False))


def test_embedding_kernel_through_a_launch_handle(gpu_driver, embed, table) -> None:
    stream = gpu_driver.create_stream()
    tokens = np.array([0, 5, 99, -1, 100, 42, 5], dtype=np.int32)
    tokens_buf, out = gpu_driver.alloc(tokens.nbytes), gpu_driver.alloc(len(tokens) * N_EMBD * 4)
    gpu_driver.copy_htod(tokens_buf, tokens)
    handle = embed_handle(gpu_driver, embed, stream, len(tokens))
    handle.set_args(*embed_args(table[0], tokens_buf, len(tokens), out))
    handle.launch()
    stream.synchronize()
    assert np.array_equal(read(gpu_driver, out, len(tokens)), expected(table[1], tokens))


def _step(handle: LaunchHandle, args: Callable[[], tuple]) -> Callable[[], list[LaunchHandle]]:
    def record() -> list[LaunchHandle]:
        handle.set_args(*args())
        handle.launch()
        return [handle]

    return record


def test_graph_replay_equals_eager_and_follows_a_new_pointer(gpu_driver, embed, table) -> None:
    stream = gpu_driver.create_stream()
    tokens = np.array([7, 3, 64, 1], dtype=np.int32)
    tokens_buf = gpu_driver.alloc(tokens.nbytes)
    gpu_driver.copy_htod(tokens_buf, tokens)
    size = len(tokens) * N_EMBD * 4
    eager_out, graph_out, moved_out = (gpu_driver.alloc(size) for _ in range(3))
    for buf in (graph_out, moved_out):
        gpu_driver.memset(buf, 0)
    handle = embed_handle(gpu_driver, embed, stream, len(tokens))
    state = {"out": eager_out}
    record = _step(handle, lambda: embed_args(table[0], tokens_buf, len(tokens), state["out"]))
    record()
    stream.synchronize()
    eager = read(gpu_driver, eager_out, len(tokens))
    assert np.array_equal(eager, expected(table[1], tokens))

    state["out"] = graph_out
    graph = StepGraph(gpu_driver, stream)
    graph.capture(record)
    graph.replay()
    stream.synchronize()
    assert np.array_equal(read(gpu_driver, graph_out, len(tokens)), eager)

    state["out"] = moved_out  # the pointer changes: set_args repacks, the graph is stale
    handle.set_args(*embed_args(table[0], tokens_buf, len(tokens), moved_out))
    gpu_driver.memset(graph_out, 0, stream)
    graph.replay()
    stream.synchronize()
    assert graph.recaptures == 1
    assert np.array_equal(read(gpu_driver, moved_out, len(tokens)), eager)
    assert not read(gpu_driver, graph_out, len(tokens)).any()  # the old pointer was not used
    graph.destroy()


def test_step_state_copied_in_stream_order_is_seen_by_the_replay(gpu_driver, embed, table) -> None:
    stream = gpu_driver.create_stream()
    n = 8
    tokens_buf, out = gpu_driver.alloc(n * 4), gpu_driver.alloc(n * N_EMBD * 4)
    staging, host_out = gpu_driver.alloc_pinned(n * 4), gpu_driver.alloc_pinned(n * N_EMBD * 4)
    gpu_driver.memset(tokens_buf, 0)
    handle = embed_handle(gpu_driver, embed, stream, n)
    graph = StepGraph(gpu_driver, stream)
    graph.capture(_step(handle, lambda: embed_args(table[0], tokens_buf, n, out)))
    rng = np.random.default_rng(1)
    syncs = gpu_driver.counters.syncs
    for _ in range(5):
        tokens = rng.integers(0, N_ROWS, n, dtype=np.int32)
        staging.view(np.int32, n)[:] = tokens
        gpu_driver.copy_htod(tokens_buf, staging, stream)  # same stream, before the replay
        graph.replay()
        gpu_driver.copy_dtoh(host_out, out, stream)
        stream.synchronize()  # the step's one sync; staging is free again after it
        assert np.array_equal(host_out.view(np.float32, (n, N_EMBD)), expected(table[1], tokens))
    assert gpu_driver.counters.syncs == syncs + 5
    assert (graph.captures, graph.recaptures) == (1, 0)
    graph.destroy()


def test_a_second_thread_gets_the_executor_error(gpu_driver, embed, table) -> None:
    stream = gpu_driver.create_stream()
    handle = embed_handle(gpu_driver, embed, stream, 1)
    tokens, out = gpu_driver.alloc(4), gpu_driver.alloc(N_EMBD * 4)
    handle.set_args(*embed_args(table[0], tokens, 1, out))
    errors: list[BaseException] = []

    def intrude() -> None:
        for call in (lambda: gpu_driver.alloc(16), handle.launch, stream.synchronize):
            try:
                call()
            except BackendError as exc:
                errors.append(exc)

    thread = threading.Thread(target=intrude)
    thread.start()
    thread.join()
    assert len(errors) == 3 and all("executor thread" in str(e) for e in errors)
    assert handle.launches == 0


def test_errors_name_the_api_and_code(gpu_driver, embedding, embed, table) -> None:
    with pytest.raises(BackendError, match=r"cuModuleLoadData failed: CUDA_ERROR_\w+ \(\d+\)"):
        gpu_driver.load_module(b"\x7fELF not really a cubin")
    with pytest.raises(BackendError, match=r"cuModuleGetFunction failed: .*kernel 'rf_nope'"):
        embedding.function("rf_nope")
    with pytest.raises(BackendError, match=r"cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY"):
        gpu_driver.alloc(1 << 50)
    too_big = LaunchHandle(
        gpu_driver,
        embed,
        name="too_big",
        grid=(1, 1, 1),
        block=(4096, 1, 1),  # past the 1024 threads a block may have
        stream=gpu_driver.create_stream(),
        arg_types=EMBED_ARGS,
    )
    out = gpu_driver.alloc(N_EMBD * 4)
    too_big.set_args(*embed_args(table[0], out, 0, out))
    with pytest.raises(BackendError, match=r"cuLaunchKernel failed: CUDA_ERROR_\w+ \(\d+\)"):
        too_big.launch()


def test_a_synchronous_copy_inside_capture_fails_loudly(gpu_driver, embed, table) -> None:
    stream = gpu_driver.create_stream()
    buf = gpu_driver.alloc(64)

    def unsafe() -> list[LaunchHandle]:
        gpu_driver.copy_htod(buf, np.zeros(16, dtype=np.float32))  # pageable: not capturable
        return []

    with pytest.raises(BackendError, match="cuMemcpyHtoD failed"):
        StepGraph(gpu_driver, stream).capture(unsafe)
    gpu_driver.memset(buf, 0, stream)  # the stream is usable again
    stream.synchronize()
