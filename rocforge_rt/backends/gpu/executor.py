"""One step on the device: step state in, forward and sampler issued in the step mode, results out.

Modes (bit-identical results): `per-kernel-sync` (a sync after every launch, for A/B),
`deferred` (the step issued whole, one sync at the readback) and `graph` (each decode
batch shape and launch variant, `graph_key`, captured once into a graph and replayed as
one launch). Per-step values
(tokens, positions, KV slots, sampling rows) live in the workspace's step-state
buffers, which the kernels read through pointers, so a launch handle's arguments are
the same bytes from one decode step to the next; the sampler advances that state on
the device, so steady decode copies nothing to it.

Pipelined decode (graph mode): because the device already holds the next decode step's
state, a decode step may be followed, before it is read back, by the replay of the next
step of the same rows (`run_step(..., ahead=True)`, `take_ahead`). The host then reads
a step's tokens, checks stops and answers clients while the device runs the next one.
The sampling kernels write each step's tokens straight into one of two readback sets of
mapped host memory (workspace.py), the sets taken in turn, so a step issued ahead never
writes the set of the step before it; there is a decode graph for each set. Steps are
waited for through their set's event, never by synchronizing the stream. A step issued
ahead that the engine does not take (a row finished, new work arrived) is waited for and
dropped: its rows' KV entries lie past what their sessions hold, and are overwritten.
"""

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rocforge_rt.backends.gpu.driver import Driver
from rocforge_rt.backends.gpu.graph import StepGraph
from rocforge_rt.backends.gpu.kernel_constants import SAMPLE_MAX_TOP
from rocforge_rt.backends.gpu.launch import ARG_CACHE_STATS, LaunchHandle
from rocforge_rt.backends.gpu.launcher import Launcher
from rocforge_rt.backends.gpu.step_profiler import StepProfiler
from rocforge_rt.backends.gpu.workspace import Activation, Readback, Workspace
from rocforge_rt.errors import BackendError
from rocforge_rt.profiling.kernel_timer import KernelTimer
from rocforge_rt.profiling.launch_tracker import LaunchOverheadTracker
from rocforge_rt.step.batch import StepBatch
from rocforge_rt.step.forward import StepOutput
from rocforge_rt.step.sampling import RowSampling

STEP_MODES = ("per-kernel-sync", "deferred", "graph")


def check_mode(mode: str) -> None:
    if mode not in STEP_MODES:
        raise BackendError(f"unknown step mode {mode!r}; choose one of {', '.join(STEP_MODES)}")


@dataclass(frozen=True)
class IssuedStep:
    """A step on the device, not yet read back."""

    batch: StepBatch  # for a step issued ahead, its tokens are the device's (unknown here)
    readback: Readback
    top: int  # the most alternatives a row asked for
    want_logits: bool
    kernels: int  # kernels it ran (a replayed graph's, or those launched)


class StepExecutor:
    """Runs steps in a mode: step state, issue or graph replay, the gate, readback, stats."""

    def __init__(
        self,
        driver: Driver,
        stream: Any,
        launcher: Launcher,
        workspace: Workspace,
        sample: Callable[[Activation, RowSampling, int, Readback], None],
        *,
        n_vocab: int,
        max_tokens: int,
        n_ctx: int,
        mode: str,
        overlap: bool,
        lookahead: bool,
        launch_tracker: LaunchOverheadTracker,
        kernel_timer: KernelTimer,
        launch_variant: Callable[[StepBatch], Hashable],
    ) -> None:
        self.driver = driver
        self.stream = stream
        self.launcher = launcher
        self.ws = workspace
        self._sample = sample
        self.n_vocab = n_vocab
        self.max_tokens = max_tokens
        self.n_ctx = n_ctx
        self.mode = mode
        self.overlap = overlap
        self.lookahead = lookahead  # pipelined decode (the module docstring)
        self.launch_tracker = launch_tracker
        self.kernel_timer = kernel_timer
        self.profiler = StepProfiler(driver, launcher, workspace.gate, kernel_timer, launch_tracker)
        # What else than the batch's shape and sampler a step's launches depend on.
        self._launch_variant = launch_variant
        # Decode graphs by graph_key, one for each readback set.
        self._graphs: dict[tuple[int, bool, bool, Hashable], tuple[StepGraph, ...]] = {}
        self._device_state: tuple[bytes, ...] | None = None  # what the step state holds
        self._ahead: IssuedStep | None = None  # a decode step issued ahead, not yet read
        self._readback = 0  # the readback set the next step issued uses
        self.steps = 0
        self.kernels = 0  # kernels the steps read back ran
        self.host_ns = 0  # host time issuing steps, up to the final synchronization
        self.ahead_taken = 0  # steps issued ahead and read back
        self.ahead_dropped = 0  # steps issued ahead and dropped unread

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        check_mode(mode)
        self._mode = mode

    def graph_key(self, batch: StepBatch) -> tuple[int, bool, bool, Hashable]:
        """What a decode graph's launches depend on: rows, whether they sample beyond the
        argmax, whether any is penalized, and the launch variant (the attention's fold)."""
        sampling = batch.sampling
        return (batch.n_tokens, sampling.needs_sampler, sampling.penalized,
                self._launch_variant(batch))  # fmt: skip

    # --- step state ----------------------------------------------------------------------
    def write_step_state(self, batch: StepBatch) -> None:
        """Make the device step state hold this batch, copying only when it does not already.

        Steady greedy decode needs no copy: the previous step's argmax kernel already
        wrote each row's next token and advanced its position. The copy is issued on
        the step's stream, so it lands before the launches (or graph) that read it.
        """
        n, rows = batch.n_tokens, len(batch.logit_rows)
        if n > self.max_tokens:
            raise BackendError(f"{n} tokens in one step; this backend takes {self.max_tokens}")
        if rows > self.ws.max_logit_rows:
            raise BackendError(
                f"{rows} logits rows in one step; this backend takes {self.ws.max_logit_rows}"
            )
        wanted = self._state_bytes(batch)
        if wanted == self._device_state:
            return
        # Every step ends with a synchronization, so the staging areas are free to reuse.
        ws = self.ws
        for staging, buf, value in zip(ws.staging, ws.step_state, wanted, strict=True):
            if not value:
                continue
            staging.view(np.uint8, (buf.nbytes,))[: len(value)] = np.frombuffer(value, np.uint8)
            self.driver.copy_htod(buf, staging, self.stream, nbytes=len(value))
        self._device_state = wanted

    @staticmethod
    def _state_bytes(
        batch: StepBatch, tokens: np.ndarray | None = None, advance: int = 0
    ) -> tuple[bytes, ...]:
        """The step-state bytes of `batch` (tokens, positions, slots, sampling rows, recent
        tokens); with `tokens` and `advance`, those the next decode step of the same rows
        needs (the penalty kernel records each row's input token in its recent ones)."""
        positions = batch.positions + advance
        sampling = batch.sampling if tokens is None else batch.sampling.advanced(tokens, positions)
        values = (batch.tokens if tokens is None else tokens, positions, batch.slots)
        recent = b"" if sampling.recent is None else sampling.recent.astype(np.int32).tobytes()
        return (*(np.asarray(v, dtype=np.int32).tobytes() for v in values),
                sampling.params.tobytes(), recent)  # fmt: skip

    # --- steps ---------------------------------------------------------------------------
    def run_step(
        self,
        batch: StepBatch,
        forward: Callable[[StepBatch], Activation],
        want_logits: bool,
        ahead: bool = False,
    ) -> StepOutput:
        """One step in this mode; the only synchronization is the wait for its readback.

        A step the kernel timer samples is issued eagerly (step_profiler.py). `ahead`: a
        decode step replayed from its graph is followed by the next one (the module
        docstring); the output's `ahead` says whether it was.
        """
        self.discard_ahead()
        probe = self.profiler.begin(self.steps)
        decode_shape = batch.decode_shaped
        replay = self._mode == "graph" and decode_shape and not probe.timed
        overlap, sync_each = self.overlap and decode_shape, self._mode == "per-kernel-sync"
        with self.profiler.issuing(probe, overlap=overlap, sync_each=sync_each):
            launches_before = self.driver.counters.launches  # the step's own, past the gate
            readback = self._next_readback()
            self.write_step_state(batch)
            if replay:
                graph = self._graph(batch, forward, readback)
                self.profiler.replay(probe, graph)
                kernels = graph.kernels
            else:
                self._issue(batch, forward, readback)
                kernels = self.driver.counters.launches - launches_before
            step = self._queue_readback(batch, readback, want_logits, kernels)
        if ahead and self.lookahead and replay and not want_logits and not probe.tracked:
            self._issue_ahead(step)  # when its positions fit the slots
        self.host_ns += time.perf_counter_ns() - probe.start_ns
        step.readback.done.synchronize()
        self.profiler.end(probe)
        return self._read_back(step, decode_shape)

    def take_ahead(self, again: bool) -> StepOutput:
        """Read back the decode step issued ahead; `again`: first issue the one after it."""
        step, self._ahead = self._ahead, None
        if step is None:
            raise BackendError("no step was issued ahead")
        if again:  # when its positions fit the slots
            issue_start = time.perf_counter_ns()
            self._issue_ahead(step)
            self.host_ns += time.perf_counter_ns() - issue_start
        step.readback.done.synchronize()
        self.ahead_taken += 1
        return self._read_back(step, True)

    def discard_ahead(self) -> None:
        """Drop the step issued ahead, if any, once it has run: the step state it leaves
        is not one the host knows, so the next step writes its own."""
        step, self._ahead = self._ahead, None
        if step is not None:
            step.readback.done.synchronize()
            self._device_state = None
            self.ahead_dropped += 1

    def _issue_ahead(self, step: IssuedStep) -> None:
        """Replay the graph of the next decode step of `step`'s rows, which the device's step
        state already describes; nothing when a row's next position is past its slot, or
        when that step takes a graph not captured yet (run_step captures it)."""
        if not step.batch.next_decode_fits(self.n_ctx):
            return
        batch = step.batch.next_decode(step.batch.tokens)  # tokens: the device's
        graphs = self._graphs.get(self.graph_key(batch))
        if graphs is None:
            return
        readback = self._next_readback()
        graph = graphs[readback.index]
        graph.replay()
        self._ahead = self._queue_readback(batch, readback, False, graph.kernels)

    def _read_back(self, step: IssuedStep, decode_shape: bool) -> StepOutput:
        """A step's output from its readback set (the step has run)."""
        self.steps += 1
        self.kernels += step.kernels
        batch, readback, rows = step.batch, step.readback, len(step.batch.logit_rows)
        n = self.ws.max_logit_rows
        tokens = readback.tokens.view(np.int32, (n,))[:rows].copy()
        logprobs = readback.logprobs.view(np.float32, (n,))[:rows].copy()
        host_logits = None
        if step.want_logits:
            shape = (n, self.n_vocab)
            host_logits = self.ws.logits_host.view(np.float32, shape)[:rows].copy()
        # The sampler advanced the step state to the next decode step of these rows (or of
        # the step issued ahead: unknown until it is read back).
        follows = decode_shape and self._ahead is None
        self._device_state = self._state_bytes(batch, tokens, 1) if follows else None
        top = self._top_alternatives(batch, readback, step.top)
        return StepOutput(tokens, logprobs, top, host_logits, ahead=self._ahead is not None)

    def _top_alternatives(
        self, batch: StepBatch, readback: Readback, top: int
    ) -> tuple[tuple[tuple[int, float], ...], ...]:
        """Each row's best alternatives, as many as it asked for (read back after the sync)."""
        counts = batch.sampling.params["logprobs"]
        if not top:
            return ((),) * len(counts)
        shape = (self.ws.max_logit_rows, SAMPLE_MAX_TOP)
        ids = readback.top_tokens.view(np.int32, shape)
        values = readback.top_logprobs.view(np.float32, shape)
        return tuple(
            tuple(zip(ids[r, :n].tolist(), values[r, :n].tolist(), strict=True))
            for r, n in enumerate(counts.tolist())
        )

    def _graph(
        self, batch: StepBatch, forward: Callable[[StepBatch], Activation], readback: Readback
    ) -> StepGraph:
        """The decode graph of this batch's graph_key that samples into `readback`; on first
        use, that key's graphs of both readback sets are captured (a step issued ahead takes
        the other set's)."""
        key = self.graph_key(batch)
        graphs = self._graphs.get(key)
        if graphs is None:
            graphs = tuple(StepGraph(self.driver, self.stream) for _ in self.ws.readbacks)
            for graph, into in zip(graphs, self.ws.readbacks, strict=True):
                graph.capture(lambda into=into: self._record(batch, forward, into))
            self._graphs[key] = graphs
        return graphs[readback.index]

    def _next_readback(self) -> Readback:
        """The readback set a step issued now samples into (the sets are taken in turn)."""
        readback = self.ws.readbacks[self._readback]
        self._readback = (self._readback + 1) % len(self.ws.readbacks)
        return readback

    def _queue_readback(
        self, batch: StepBatch, readback: Readback, want_logits: bool, kernels: int
    ) -> IssuedStep:
        """Queue the logits' copy into pinned memory when asked for, and `readback`'s event
        after the step (which ran `kernels` and sampled into `readback`)."""
        rows = len(batch.logit_rows)
        top = int(batch.sampling.params["logprobs"].max(initial=0))
        if rows and want_logits:
            ws = self.ws
            nbytes = rows * self.n_vocab * 4
            self.driver.copy_dtoh(ws.logits_host, ws.logits, self.stream, nbytes=nbytes)
        readback.done.record(self.stream)
        return IssuedStep(batch, readback, top, want_logits, kernels)

    def _issue(
        self, batch: StepBatch, forward: Callable[[StepBatch], Activation], readback: Readback
    ) -> None:
        """Issue the forward and the sampler, which samples into `readback`."""
        first_row = int(batch.logit_rows[0]) if len(batch.logit_rows) else 0
        self._sample(forward(batch), batch.sampling, first_row, readback)

    def _record(
        self, batch: StepBatch, forward: Callable[[StepBatch], Activation], readback: Readback
    ) -> list[LaunchHandle]:
        """Issue the step, returning every handle launched (for capture)."""
        return self.launcher.record(lambda: self._issue(batch, forward, readback))

    # --- runtime statistics --------------------------------------------------------------
    def runtime_stats(self) -> dict[str, object]:
        """Launches (a graph replay is one) and the kernels they ran per step, syncs, graph
        replays, and the argument cache's counters."""
        counters = self.driver.counters.snapshot()
        steps = max(self.steps, 1)
        cache = ARG_CACHE_STATS.snapshot()
        return {
            "mode": self._mode,
            "overlap": self.overlap,
            "lookahead": self.lookahead,
            "steps": self.steps,
            "launches_per_step": counters["launches"] / steps,
            "kernels_per_step": self.kernels / steps,
            "host_us_per_step": self.host_ns / steps / 1000,
            "syncs_per_step": counters["syncs"] / steps,
            "graph_replay": self._mode == "graph",
            "graph_replays": counters["graph_replays"],
            "graph_captures": counters["captures"],
            "ahead_taken": self.ahead_taken,
            "ahead_dropped": self.ahead_dropped,
            "launch_handles": len(self.launcher.handles),
            "arg_cache_hits": cache["hits"],
            "arg_cache_misses": cache["misses"],
            "arg_bytes_repacked": cache["bytes_repacked"],
            "launch_tracking": self.launch_tracker.enabled,
            "kernel_timing": self.kernel_timer.enabled,
            **self.profile(),
        }

    def profile(self) -> dict[str, object]:
        """The launch tracker's step figures, the kernel timer's, and one row per kernel name.

        A kernel row merges its host launch statistics (while tracking is on), its
        handles' argument-cache counters (always) and its GPU time (timed steps).
        """
        launches = self.launch_tracker.snapshot()
        gpu = self.kernel_timer.snapshot()
        kernels: dict[str, dict[str, Any]] = launches.pop("kernels")
        for name, stats in self.launcher.kernel_stats.items():
            row = kernels.setdefault(name, {})
            row["arg_cache_hits"] = stats.hits
            row["arg_cache_misses"] = stats.misses
            row["arg_bytes_repacked"] = stats.bytes_repacked
        for name, row in gpu.pop("kernels").items():
            kernels.setdefault(name, {}).update(row)
        return {"launch_overhead": launches, "gpu_time": gpu, "kernels": kernels}

    def reset_runtime_stats(self) -> None:
        self.driver.counters.reset()
        ARG_CACHE_STATS.reset()
        self.launch_tracker.reset()
        self.kernel_timer.reset()
        for handle in self.launcher.handles.values():
            handle.reset_stats()
        for stats in self.launcher.kernel_stats.values():
            stats.reset()
        self.steps = 0
        self.kernels = 0
        self.host_ns = 0
        self.ahead_taken = 0
        self.ahead_dropped = 0
