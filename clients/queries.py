"""The daemon queries beside generation: info, health (and waiting until ready), stats,
Prometheus metrics, a step trace, and the profiler switches (the operator ops)."""

import time
from typing import Any

from rocforge_client.connection import Connection
from rocforge_client.errors import Timeout


class OperatorQueries(Connection):
    """A connection's queries of the daemon's state; stats --reset, trace and profile need
    `operator_key` off loopback."""

    def info(self, *, timeout: float | None = None) -> dict[str, Any]:
        return self.call("info", timeout=timeout)

    def health(self, *, timeout: float | None = None) -> dict[str, Any]:
        return self.call("health", timeout=timeout)

    def wait_ready(self, timeout: float = 60.0, *, poll: float = 0.1) -> dict[str, Any]:
        """Ask `health` until the daemon is ready; Timeout when it is not ready in time."""
        limit = time.monotonic() + timeout
        while True:
            left = limit - time.monotonic()
            try:
                health = self.health(timeout=max(0.05, min(1.0, left)))
                if health["ready"]:
                    return health
            except Timeout:
                pass
            if time.monotonic() >= limit:
                raise Timeout(f"{self.addr} not ready within {timeout} s")
            time.sleep(poll)

    def stats(
        self,
        *,
        reset: bool = False,
        records: int = 0,
        operator_key: str | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """The daemon's stats; `reset` needs `operator_key` off loopback."""
        return self.call(
            "stats",
            timeout=timeout,
            reset=reset or None,
            records=records or None,
            operator_key=operator_key,
        )

    def metrics(self, *, timeout: float | None = None) -> str:
        """The daemon's Prometheus metrics, in the text exposition format."""
        return self.call("metrics", timeout=timeout)["text"]

    def trace(
        self,
        *,
        steps: int | None = None,
        operator_key: str | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Chrome/Perfetto trace JSON of the daemon's last steps (operator key off loopback)."""
        return self.call("trace", timeout=timeout, steps=steps, operator_key=operator_key)["trace"]

    def profile(
        self,
        *,
        launches: bool | None = None,
        kernels: bool | None = None,
        every: int | None = None,
        operator_key: str | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Switch the launch tracker and the kernel timer (None: unchanged); their state
        (operator key off loopback)."""
        return self.call(
            "profile",
            timeout=timeout,
            launches=launches,
            kernels=kernels,
            every=every,
            operator_key=operator_key,
        )
