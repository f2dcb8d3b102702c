"""`rocforge serve --http`: the HTTP front (server/http/) as a child process of the daemon's.

The front is started once the daemon is ready (before, it could only answer 503), with
the same interpreter (`python -m rocforge_rt.server.http`), and stopped when the daemon
stops: SIGTERM, then SIGKILL after `STOP_TIMEOUT_S`. It runs in a session of its own, so a
terminal's Ctrl-C reaches the daemon alone, which drains its requests (the front's streams
get their last replies) before it stops the front; the front also stops by itself when
its parent is gone (`--exit-with-parent`). A front that exits while the daemon runs is
logged as an error with its exit code; the daemon goes on serving ZeroMQ clients.

This module never imports the front (it is a package above this one): it only names it.
"""

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

log = logging.getLogger("rocforge.server")

FRONT_MODULE = "rocforge_rt.server.http"
STOP_TIMEOUT_S = 10.0  # past the front's own grace for open streams (transport.SHUTDOWN_GRACE_S)
READY_POLL_S = 0.1
_ANY_HOST = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]", "::": "[::1]"}


def connect_address(bound: str) -> str:
    """The address a local client connects to for a daemon bound at `bound` (a wildcard
    host is reached on loopback)."""
    transport, sep, rest = bound.partition("://")
    if transport != "tcp" or not sep:
        return bound
    host, _, port = rest.rpartition(":")
    return f"tcp://{_ANY_HOST.get(host, host)}:{port}"


def front_command(args: Sequence[str]) -> list[str]:
    """The command line of a front with these options (http/command.py's)."""
    return [sys.executable, "-m", FRONT_MODULE, *args]


class FrontProcess:
    """A child process started when the daemon is ready and stopped with it."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        where: str = "",
        env: Mapping[str, str] | None = None,
        stop_timeout_s: float = STOP_TIMEOUT_S,
    ) -> None:
        self.command = list(command)
        self.where = where  # for the log: where it serves
        root = str(Path(__file__).resolve().parents[2])  # so the child imports this checkout
        base = dict(os.environ if env is None else env)
        base["PYTHONPATH"] = os.pathsep.join(filter(None, (root, base.get("PYTHONPATH"))))
        self.env = base
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start_when_ready(self, ready: Callable[[float], bool]) -> None:
        """Start the child, from a thread of its own, once `ready(timeout)` says so."""
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="rocforge-http-front", daemon=True
        )
        self._thread.start()

    def _run(self, ready: Callable[[float], bool]) -> None:
        while not ready(READY_POLL_S):
            if self._stopping.is_set():
                return
        with self._lock:
            if self._stopping.is_set():
                return
            try:
                self.process = subprocess.Popen(self.command, env=self.env, start_new_session=True)
            except OSError as exc:
                log.error("cannot start the HTTP front (%s): %s", " ".join(self.command), exc)
                return
        process = self.process
        log.info("HTTP front started (pid %d)%s", process.pid, self.where and f" on {self.where}")
        code = process.wait()
        if not self._stopping.is_set():
            log.error(
                "the HTTP front (pid %d) exited with code %d; the daemon goes on without it",
                process.pid,
                code,
            )

    def stop(self) -> int | None:
        """Stop the child (SIGTERM, SIGKILL after the timeout); its exit code, None if it
        never started. Once stopped, a further call only returns that code."""
        if self._stopping.is_set():
            with self._lock:
                return None if self.process is None else self.process.returncode
        self._stopping.set()
        with self._lock:
            process = self.process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning(
                    "the HTTP front (pid %d) did not stop within %.0f s of SIGTERM: killed",
                    process.pid,
                    self.stop_timeout_s,
                )
                process.kill()
                process.wait()
        if self._thread is not None:
            self._thread.join()
        if process is not None:
            code = process.returncode
            how = "SIGTERM" if code == -signal.SIGTERM else f"exit code {code}"
            log.info("HTTP front stopped (pid %d, %s)", process.pid, how)
            return code
        return None
