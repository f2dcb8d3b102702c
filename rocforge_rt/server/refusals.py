"""Refused requests: each client's held to a budget a second, all of them summed up in the log.

A correct client is refused now and then (a session that expired, a field out of range);
one refused thousands of times a second is broken or hostile, and each refusal costs the
daemon's threads the parsing and the reply, time the engine thread then waits for. So:

- Past `max_per_client_s` refusals in one second (`counted` codes only: a malformed
  request, an unknown op or session, a wrong token, a field out of range: what a correct
  client never sends at that rate; never `busy`, a limit or a state of the daemon), the
  client's messages are dropped unread until that second is over. The first one dropped
  is answered `rate_limited`, once a second (no request id: the message went unread).
- Every refusal is a line at debug level; at info, a summary at most every
  SUMMARY_INTERVAL_S: how many, by code, and the client refused most. A flood cannot
  flood the log.

Thread-safe: the I/O thread refuses at the socket, the engine thread when a request
reaches it (a session busy, a turn finished).
"""

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

from rocforge_rt.server.fields import ErrorCode

log = logging.getLogger("rocforge.server")

SUMMARY_INTERVAL_S = 10.0
WINDOW_S = 1.0  # the budget's period
MAX_CLIENTS_TRACKED = 65_536  # past it, the clients whose second is over are forgotten
COUNTED = frozenset(
    {
        ErrorCode.BAD_REQUEST,
        ErrorCode.UNKNOWN_OP,
        ErrorCode.UNKNOWN_SESSION,
        ErrorCode.SESSION_BUSY,
        ErrorCode.TURN_FINISHED,
        ErrorCode.TOO_LARGE,
        ErrorCode.FORBIDDEN,
    }
)


@dataclass
class _Window:
    """A client's refusals in its current second."""

    started: float
    refused: int = 0
    dropped: int = 0  # messages dropped unread since the budget ran out


class Refusals:
    """Counts refusals per client and by code (see the module docstring)."""

    def __init__(self, max_per_client_s: int) -> None:
        self.max_per_client_s = max_per_client_s  # 0: no budget
        self._lock = threading.Lock()
        self._windows: dict[bytes, _Window] = {}
        self._by_code: Counter[str] = Counter()
        self._by_client: Counter[bytes] = Counter()
        self._dropped = 0
        self._since: float | None = None  # the first refusal the next summary counts

    def note(self, peer: bytes, code: ErrorCode, now: float | None = None) -> None:
        """A request of `peer` was refused with `code`."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._since is None:
                self._since = now
            self._by_code[code] += 1
            self._by_client[peer] += 1
            if self.max_per_client_s and code in COUNTED:
                self._window(peer, now).refused += 1
            summary = self._summary(now)
        if summary is not None:
            log.info(*summary)

    def drop(self, peer: bytes, now: float) -> int:
        """0 when `peer`'s next message is to be read; else it is dropped unread, and this is
        how many of its messages this second were (1: the first, which is answered)."""
        if not self.max_per_client_s:
            return 0
        with self._lock:
            window = self._windows.get(peer)
            if window is None or window.refused < self.max_per_client_s:
                return 0
            if now - window.started >= WINDOW_S:
                del self._windows[peer]
                return 0
            window.dropped += 1
            self._dropped += 1
            return window.dropped

    def forget(self, peer: bytes) -> None:
        """The client is gone."""
        with self._lock:
            self._windows.pop(peer, None)

    def _window(self, peer: bytes, now: float) -> _Window:
        window = self._windows.get(peer)
        if window is None or now - window.started >= WINDOW_S:
            if len(self._windows) >= MAX_CLIENTS_TRACKED:
                self._windows = {
                    p: w for p, w in self._windows.items() if now - w.started < WINDOW_S
                }
            window = self._windows[peer] = _Window(now)
        return window

    def _summary(self, now: float) -> tuple[object, ...] | None:
        """The summary line's arguments when one is due (the counts start again)."""
        elapsed = now - (self._since or now)
        if elapsed < SUMMARY_INTERVAL_S:
            return None
        codes = ", ".join(f"{code} {n}" for code, n in self._by_code.most_common())
        peer, most = self._by_client.most_common(1)[0]
        dropped = f"; {self._dropped} messages dropped unread" if self._dropped else ""
        args = (
            "refused %d requests in the last %.0f s (%s), %d of them client %s's%s;"
            " a line each at --log-level debug",
            sum(self._by_code.values()),
            elapsed,
            codes,
            most,
            peer.hex(),
            dropped,
        )
        self._by_code.clear()
        self._by_client.clear()
        self._dropped = 0
        self._since = None
        return args
