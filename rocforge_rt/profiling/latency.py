"""Per-request latency records: queue wait, TTFT, inter-token latency, end-to-end; percentiles.

Times are `time.perf_counter()` seconds, taken by the daemon: the queue wait runs
from the receipt of a request that needs a session slot (open, one-shot generate)
to the moment it has one (at once when one is free and nobody waits; else when the
queue gives it one, or it ends without one); TTFT runs from the request's receipt
to the moment its first token's reply is handed to the socket thread; inter-token
latency is the gap between two streamed tokens of one request. Only client requests
are recorded: the start-up warm-up never is.
"""

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

PERCENTILES = (50, 90, 99)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, interpolated linearly (as numpy's)."""
    if not sorted_values:
        return 0.0
    rank = (len(sorted_values) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def distribution(values: Iterable[float]) -> dict[str, float]:
    """n, mean, p50, p90, p99 and max of some values."""
    ordered = sorted(values)
    n = len(ordered)
    summary = {"n": n, "mean": sum(ordered) / n if n else 0.0, "max": ordered[-1] if n else 0.0}
    summary.update({f"p{q}": percentile(ordered, q) for q in PERCENTILES})
    return summary


@dataclass(frozen=True)
class RequestRecord:
    """What one finished request took, in milliseconds (None where it does not apply)."""

    op: str
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    itl_ms_mean: float | None
    e2e_ms: float
    finish_reason: str | None
    wait_ms: float | None = None  # waiting for a session slot (None: the op needs none)


class RequestTimer:
    """Timestamps of one request; owned by the engine thread until `finish`."""

    def __init__(
        self,
        recorder: "LatencyRecorder",
        op: str,
        received: float,
        *,
        ttft: bool,
        wait_s: float | None = None,
    ) -> None:
        self._recorder = recorder
        self.op = op
        self.received = received
        self.wait_s = wait_s  # seconds it waited for a session slot (None: it needed none)
        self._measures_ttft = ttft
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.gaps: list[float] = []

    def token_sent(self, at: float, *, streamed: bool) -> None:
        """A reply with a token left; `streamed` gaps count as inter-token latency."""
        if self.first_token is None:
            self.first_token = at
        elif streamed and self.last_token is not None:
            self.gaps.append(at - self.last_token)
        self.last_token = at

    @property
    def ttft_ms(self) -> float | None:
        if not self._measures_ttft or self.first_token is None:
            return None
        return (self.first_token - self.received) * 1000.0

    @property
    def wait_ms(self) -> float | None:
        return None if self.wait_s is None else self.wait_s * 1000.0

    @property
    def itl_ms_mean(self) -> float | None:
        return sum(self.gaps) / len(self.gaps) * 1000.0 if self.gaps else None

    def finish(
        self, at: float, *, prompt_tokens: int, completion_tokens: int, finish_reason: str | None
    ) -> RequestRecord:
        record = RequestRecord(
            op=self.op,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            ttft_ms=self.ttft_ms,
            itl_ms_mean=self.itl_ms_mean,
            e2e_ms=(at - self.received) * 1000.0,
            finish_reason=finish_reason,
            wait_ms=self.wait_ms,
        )
        self._recorder.add(record, self.gaps)
        return record


class LatencyObserver(Protocol):
    """Told of every record and queue wait as they are added (the daemon's metrics)."""

    def observe_request(self, record: RequestRecord, gaps_s: Sequence[float]) -> None:
        """A finished request's record, with its inter-token gaps (seconds)."""

    def observe_wait(self, wait_s: float) -> None:
        """A request's wait for a session slot, in seconds."""


class LatencyRecorder:
    """Keeps recent request records and inter-token gaps; thread-safe to read and reset.

    An `observer` sees every record and wait as they are added (the daemon's Prometheus
    metrics), and is not reset with the records.
    """

    def __init__(
        self,
        *,
        max_records: int = 10_000,
        max_gaps: int = 100_000,
        observer: LatencyObserver | None = None,
    ) -> None:
        self._observer = observer
        self._lock = threading.Lock()
        self._records: deque[RequestRecord] = deque(maxlen=max_records)
        self._gaps_ms: deque[float] = deque(maxlen=max_gaps)
        self._waits_ms: deque[float] = deque(maxlen=max_records)
        self._requests = 0
        self._tokens = 0

    def begin(
        self, op: str, received: float, *, ttft: bool, wait_s: float | None = None
    ) -> RequestTimer:
        """Start timing a request; `ttft` says whether its first token follows a prefill,
        `wait_s` how long it waited for a session slot (None: it needed none)."""
        return RequestTimer(self, op, received, ttft=ttft, wait_s=wait_s)

    def add_wait(self, wait_s: float) -> None:
        """The queue wait of a request that needed a session slot, once it has ended: those
        that ended still waiting (over --max-queue-time, aborted, gone) count too."""
        with self._lock:
            self._waits_ms.append(wait_s * 1000.0)
        if self._observer is not None:
            self._observer.observe_wait(wait_s)

    def add(self, record: RequestRecord, gaps_s: Sequence[float]) -> None:
        with self._lock:
            self._records.append(record)
            self._gaps_ms.extend(g * 1000.0 for g in gaps_s)
            self._requests += 1
            self._tokens += record.completion_tokens
        if self._observer is not None:
            self._observer.observe_request(record, gaps_s)

    def summary(self) -> dict[str, object]:
        """Counts and distributions (ms) of TTFT, inter-token latency, end-to-end, and the
        queue wait of every request that needed a session slot."""
        with self._lock:
            records = list(self._records)
            gaps = list(self._gaps_ms)
            waits = list(self._waits_ms)
            requests, tokens = self._requests, self._tokens
        return {
            "requests": requests,
            "completion_tokens": tokens,
            "ttft_ms": distribution(r.ttft_ms for r in records if r.ttft_ms is not None),
            "itl_ms": distribution(gaps),
            "e2e_ms": distribution(r.e2e_ms for r in records),
            "wait_ms": distribution(waits),
        }

    def recent(self, n: int) -> list[dict[str, object]]:
        """The last n request records, oldest first."""
        with self._lock:
            records = list(self._records)[-n:] if n else []
        return [asdict(r) for r in records]

    def reset(self) -> None:
        with self._lock:
            self._records.clear()
            self._gaps_ms.clear()
            self._waits_ms.clear()
            self._requests = self._tokens = 0
