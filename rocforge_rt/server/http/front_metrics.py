"""The HTTP front's own Prometheus metrics, served at `/metrics` after the daemon's.

Per route (the front's route templates, e.g. `/v1/models/{model:path}`, and `other` for
any other path, so a client cannot grow the label set):
`rocforge:http_requests_total{method, route, status}` and
`rocforge:http_request_duration_seconds{route}` (to a stream's last event), and
`rocforge:daemon_up`, whether the daemon answered this scrape's `metrics` op, and
`rocforge:http_daemon_requests_pending`, the requests sent to the daemon whose last reply
has not come (a request the front refused or finished holds none).
"""

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rocforge_rt.server.metrics import E2E_BUCKETS, PREFIX

OTHER_ROUTE = "other"


class FrontMetrics:
    """One front's registry (see the module docstring)."""

    def __init__(self, routes: Iterable[str], pending: Callable[[], int]) -> None:
        routes = list(routes)
        self._exact = frozenset(r for r in routes if "{" not in r)
        # a template's fixed part before its first parameter
        self._prefixes = [(r[: r.index("{")], r) for r in routes if "{" in r]
        self.registry = CollectorRegistry()
        self.requests = Counter(
            PREFIX + "http_requests",
            "HTTP requests answered, by method, route and status (499: the client went away).",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            PREFIX + "http_request_duration_seconds",
            "Time from an HTTP request's arrival to the end of its response.",
            ["route"],
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.daemon_up = Gauge(
            PREFIX + "daemon_up",
            "Whether the daemon answered the last scrape (1) or not (0).",
            registry=self.registry,
        )
        Gauge(
            PREFIX + "http_daemon_requests_pending",
            "Requests sent to the daemon whose last reply has not come.",
            registry=self.registry,
        ).set_function(pending)

    def route(self, path: str) -> str:
        """The route template a path takes, else OTHER_ROUTE."""
        if path in self._exact:
            return path
        return next((r for prefix, r in self._prefixes if path.startswith(prefix)), OTHER_ROUTE)

    def observe(self, method: str, path: str, status: int, duration_s: float) -> None:
        route = self.route(path)
        self.requests.labels(method, route, str(status)).inc()
        self.duration.labels(route).observe(duration_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
