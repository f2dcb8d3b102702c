"""The daemon's Prometheus metrics, through prometheus_client, in a registry of its own.

Names follow vLLM's where it has one, under the `rocforge:` prefix (a vLLM dashboard
needs only the prefix changed): `time_to_first_token_seconds`,
`inter_token_latency_seconds`, `e2e_request_latency_seconds`,
`request_queue_time_seconds`, `prompt_tokens_total`, `generation_tokens_total`,
`request_success_total{finished_reason}`, `num_requests_running`,
`num_requests_waiting`, `kv_cache_usage_perc`. Ours beside them: the decode batch size
of each step, and from a GPU backend launches per step, graph replays and the argument
cache's hits and misses.

Requests, queue waits and steps are observed as they end (the engine thread: this is the
LatencyRecorder's observer, and `observe_step` the engine loop's); gauges and the backend's
counters are read when scraped (`exposition`, from the I/O thread) from what the engine
thread publishes, so a scrape never waits on the engine. The backend's counters restart
when an operator resets `stats`, which Prometheus takes as a counter reset.
"""

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rocforge_rt.profiling.latency import RequestRecord

PREFIX = "rocforge:"
# Seconds: decode on a GPU is about a millisecond a token, a prompt up to seconds.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
               0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)  # fmt: skip
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
               320.0, 640.0)  # fmt: skip
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                 120.0, 300.0)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# Read at scrape time: the engine loop's published `usage` map, the backend's runtime
# statistics (None on the CPU), the number of requests waiting for a session slot.
Usage = Callable[[], Mapping[str, Any]]
Runtime = Callable[[], Mapping[str, Any] | None]
Waiting = Callable[[], int]


class DaemonMetrics:
    """The metrics of one daemon (see the module docstring)."""

    def __init__(self, usage: Usage, runtime: Runtime, waiting: Waiting) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from a request's receipt to its first token's reply.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between two streamed tokens of a request.",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from a request's receipt to its final reply.",
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Time a request waited for a session slot.",
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )
        self.batch_size = Histogram(
            PREFIX + "decode_batch_size",
            "Sessions given a token by one engine step that decodes.",
            buckets=BATCH_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens",
            "Prompt tokens of finished requests.",
            registry=registry,
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens",
            "Tokens generated for finished requests.",
            registry=registry,
        )
        self.finished = Counter(
            PREFIX + "request_success",
            "Requests that ended, by finish reason (none: an open, step or append whose"
            " turn goes on).",
            ["finished_reason"],
            registry=registry,
        )
        registry.register(_ScrapedMetrics(usage, runtime, waiting))

    def observe_request(self, record: RequestRecord, gaps_s: Sequence[float]) -> None:
        """A request that ended."""
        if record.ttft_ms is not None:
            self.ttft.observe(record.ttft_ms / 1000.0)
        for gap in gaps_s:
            self.itl.observe(gap)
        self.e2e.observe(record.e2e_ms / 1000.0)
        self.prompt_tokens.inc(record.prompt_tokens)
        self.generation_tokens.inc(record.completion_tokens)
        self.finished.labels(record.finish_reason or "none").inc()

    def observe_wait(self, wait_s: float) -> None:
        """A request's wait for a session slot (0: it took a free one at once)."""
        self.queue_time.observe(wait_s)

    def observe_step(self, decoded: int) -> None:
        """An engine step that gave `decoded` sessions a token (none: not observed)."""
        if decoded:
            self.batch_size.observe(decoded)

    def exposition(self) -> bytes:
        """Every metric in Prometheus' text format."""
        return generate_latest(self.registry)


class _ScrapedMetrics(Collector):
    """Gauges and backend counters read from what the engine thread publishes."""

    def __init__(self, usage: Usage, runtime: Runtime, waiting: Waiting) -> None:
        self._usage = usage
        self._runtime = runtime
        self._waiting = waiting

    def collect(self) -> Iterator[Metric]:
        usage = self._usage()
        sessions = usage.get("sessions", {})
        running = sessions.get("prefilling", 0) + sessions.get("generating", 0)
        yield _gauge("num_requests_running", "Requests prefilling or generating.", running)
        yield _gauge(
            "num_requests_waiting", "Requests waiting for a session slot.", self._waiting()
        )
        kv = usage.get("kv", {})
        yield _gauge(
            "kv_cache_usage_perc",
            "Share of the KV pool holding tokens (1 = full).",
            kv.get("use", 0.0),
        )
        yield _gauge("kv_cache_slots_in_use", "Session slots of the KV pool taken.",
                     kv.get("slots_in_use", 0))  # fmt: skip
        runtime = self._runtime()
        if runtime is None:  # the CPU backend: no launches
            return
        yield _gauge(
            "launches_per_step",
            "Launches per engine step (a replayed step graph is one).",
            runtime["launches_per_step"],
        )
        yield _gauge(
            "kernels_per_step",
            "Kernels run per engine step (a replayed graph's count them all).",
            runtime["kernels_per_step"],
        )
        for name, key, text in (
            ("graph_replays", "graph_replays", "Step graphs replayed."),
            ("arg_cache_hits", "arg_cache_hits", "Launches that reused their packed arguments."),
            ("arg_cache_misses", "arg_cache_misses", "Launches that packed their arguments."),
        ):
            counter = CounterMetricFamily(PREFIX + name, text)
            counter.add_metric([], float(runtime[key]))
            yield counter


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, documentation, value=float(value))
