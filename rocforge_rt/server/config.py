"""The daemon's configuration: its options checked before anything binds, then against the
model while the daemon loads.

`check_options` checks a DaemonConfig's ranges (no model needed: the daemon does it before
it binds). `plan`, on the engine thread while the socket already answers `health`, reads
the model and checks the configuration against it (the model's trained context, the memory
budget of the weights and the KV pool), and returns a Plan: the engine factory and the
per-daemon limits. The KV slot allocator, the one count of session slots, shared by the
engine and the job board, needs only --max-sessions: the daemon makes it before it binds.
"""

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rocforge_rt.backends import (
    device_memory_bytes,
    resolve_backend_name,
    weights_memory_bytes,
)
from rocforge_rt.engine.engine import DEFAULT_PREFILL_CHUNK, Engine
from rocforge_rt.engine.kv_cache import SlotAllocator, kv_bytes_per_token, kv_pool_bytes
from rocforge_rt.errors import RocforgeError, UsageError
from rocforge_rt.model.gguf_file import load_model_file
from rocforge_rt.profiling.load_progress import LoadProgress
from rocforge_rt.server.jobs import Limits
from rocforge_rt.step.forward import held_together
from rocforge_rt.step.kv_format import KV_DTYPES

log = logging.getLogger("rocforge.server")

DEFAULT_BIND = "tcp://127.0.0.1:5555"
DEFAULT_MAX_QUEUE = 128  # requests waiting for a session slot
DEFAULT_MAX_QUEUE_TIME_S = 60.0
DEFAULT_MAX_REFUSALS_PER_CLIENT = 1000  # a second (refusals.py)


class ServerError(RocforgeError):
    """The daemon cannot start as configured (memory budget, bind address, engine start-up),
    or its engine thread failed."""


class OptionError(ServerError, UsageError):
    """A configuration value out of range; the message names its option."""


@dataclass(frozen=True)
class DaemonConfig:
    model: Path
    backend: str = "auto"
    bind: str = DEFAULT_BIND
    ctx_size: int = 2048
    max_sessions: int = 4
    memory_limit: int | None = None  # bytes for weights + KV pool; None: the device (or host RAM)
    kv_dtype: str = "f16"  # the KV pool's elements: "f16" or "fp8" (step/kv_format.py)
    threads: int | None = None  # the CPU backend's threads; None: the physical cores
    idle_timeout_s: float = 300.0
    max_prompt_tokens: int | None = None  # None: the context size - 1
    max_new_tokens: int | None = None  # None: the context size
    max_request_bytes: int = 1 << 20
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    batch_invariant: bool = False  # GPU: every prompt chunk on the int8 GEMM (slower, exact)
    pipelined_decode: bool = True  # GPU: the next decode step issued before one is read back
    curve_keys: Path | None = None
    max_sessions_per_client: int | None = None  # None: --max-sessions (no extra limit)
    operator_key: str | None = None  # stats reset, trace, profile off loopback; None: refused
    max_queue: int = DEFAULT_MAX_QUEUE  # requests waiting for a slot; 0: busy at once
    max_queue_time_s: float = DEFAULT_MAX_QUEUE_TIME_S  # longest wait for a slot; 0: no limit
    # a client's protocol refusals a second before its messages are dropped; 0: no limit
    max_refusals_per_client: int = DEFAULT_MAX_REFUSALS_PER_CLIENT


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def check_memory(
    *,
    kv_bytes: int,
    weights_bytes: int,
    max_sessions: int,
    n_ctx: int,
    limit: int,
    kv_dtype: str = "f16",
) -> None:
    """Fail fast when the weights and the KV pool (of `kv_dtype`) do not fit the memory
    limit."""
    need = kv_bytes + weights_bytes
    if need > limit:
        smaller = " or --kv-cache-dtype fp8" if kv_dtype == "f16" else ""
        raise ServerError(
            f"the {kv_dtype} KV pool for --max-sessions {max_sessions} x --ctx-size {n_ctx}"
            f" needs {_mib(kv_bytes)} ({kv_bytes} bytes) and the weights"
            f" {_mib(weights_bytes)}: {_mib(need)} in all, over the memory limit of"
            f" {_mib(limit)} ({limit} bytes); lower --ctx-size or --max-sessions{smaller},"
            " or raise --gpu-memory-limit"
        )


@dataclass(frozen=True)
class Plan:
    """What `plan` found: how to build the engine, and the limits."""

    # (should_stop, progress) -> the engine (LoadCancelled when should_stop says so)
    build: Callable[[Callable[[], bool], LoadProgress], Engine]
    limits: Limits


def check_options(config: DaemonConfig) -> None:
    """OptionError naming the first option out of range."""
    checks = (
        (config.ctx_size >= 2, f"--ctx-size must be >= 2, got {config.ctx_size}"),
        (config.max_sessions >= 1, f"--max-sessions must be >= 1, got {config.max_sessions}"),
        (
            config.kv_dtype in KV_DTYPES,
            f"--kv-cache-dtype must be one of {', '.join(KV_DTYPES)}, got {config.kv_dtype!r}",
        ),
        (config.idle_timeout_s > 0, f"--idle-timeout must be > 0, got {config.idle_timeout_s}"),
        (config.prefill_chunk >= 1, f"prefill chunk must be >= 1, got {config.prefill_chunk}"),
        (config.max_request_bytes >= 1024, "max request bytes must be >= 1024"),
        (
            config.max_sessions_per_client is None or config.max_sessions_per_client >= 1,
            f"--max-sessions-per-client must be >= 1, got {config.max_sessions_per_client}",
        ),
        (config.operator_key != "", "--operator-key must not be empty"),
        (
            config.max_queue >= 0,
            f"--max-queue must be >= 0 (0: no queue, a full daemon answers busy), got"
            f" {config.max_queue}",
        ),
        (
            config.max_refusals_per_client >= 0,
            "--max-refusals-per-client must be >= 0 (0: no limit), got"
            f" {config.max_refusals_per_client}",
        ),
        (
            math.isfinite(config.max_queue_time_s) and config.max_queue_time_s >= 0,
            "--max-queue-time must be a finite number of seconds >= 0 (0: no limit), got"
            f" {config.max_queue_time_s}",
        ),
    )
    for ok, message in checks:
        if not ok:
            raise OptionError(message)


def plan(
    config: DaemonConfig,
    engine_hook: Callable[[Engine], None] | None = None,
    *,
    slots: SlotAllocator | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> Plan:
    """Validate the configuration against the model; return the Plan. `slots`: the
    allocator the engine shares (a new one of --max-sessions slots by default); `should_stop`
    stops the model's reading (LoadCancelled)."""
    check_options(config)
    model = load_model_file(config.model, should_stop)
    hp = model.hparams
    n_ctx = min(config.ctx_size, hp.n_ctx_train)
    if n_ctx < config.ctx_size:
        log.warning(
            "--ctx-size %d lowered to the model's trained context %d", config.ctx_size, n_ctx
        )
    kv = kv_pool_bytes(hp, config.max_sessions, n_ctx, config.kv_dtype)
    limit = config.memory_limit
    resolved = resolve_backend_name(config.backend)
    if limit is None:
        limit = device_memory_bytes(resolved)
    # What the backend allocates for them (the CPU: the quantized blocks as in the file).
    weights = weights_memory_bytes(resolved, held_together(model))
    check_memory(
        kv_bytes=kv,
        weights_bytes=weights,
        max_sessions=config.max_sessions,
        n_ctx=n_ctx,
        limit=limit,
        kv_dtype=config.kv_dtype,
    )
    log.info(
        "KV pool: %d sessions x %d tokens x %d bytes (%s) = %s",
        config.max_sessions,
        n_ctx,
        kv_bytes_per_token(hp, config.kv_dtype),
        config.kv_dtype,
        _mib(kv),
    )
    limits = Limits(
        n_ctx=n_ctx,
        max_sessions=config.max_sessions,
        max_prompt_tokens=min(config.max_prompt_tokens or n_ctx - 1, n_ctx - 1),
        max_new_tokens=min(config.max_new_tokens or n_ctx, n_ctx),
        idle_timeout_s=config.idle_timeout_s,
        max_queue=config.max_queue,
        max_queue_time_s=config.max_queue_time_s,
    )
    shared_slots = slots if slots is not None else SlotAllocator(config.max_sessions)

    def build(should_stop: Callable[[], bool], progress: LoadProgress) -> Engine:
        engine = Engine.load(
            model,  # read once, here
            backend=config.backend,
            n_slots=config.max_sessions,
            n_ctx=n_ctx,
            prefill_chunk=config.prefill_chunk,
            batch_invariant=config.batch_invariant,
            lookahead=config.pipelined_decode,
            threads=config.threads,
            kv_dtype=config.kv_dtype,
            slots=shared_slots,
            should_stop=should_stop,
            progress=progress,
        )
        if engine_hook is not None:
            engine_hook(engine)
        return engine

    return Plan(build, limits)
