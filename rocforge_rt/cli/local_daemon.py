"""`rocforge serve` in a subprocess on a free loopback port (`LocalDaemon`), ready once it
answers health: for `rocforge demo`, scripts/bench_ttft.py and the tests."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rocforge_rt.cli.progress import TerminalProgress
from rocforge_rt.profiling.load_progress import LoadProgress
from rocforge_rt.server.config import ServerError


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_ready(
    addr: str, process: subprocess.Popen, timeout: float, progress: LoadProgress | None = None
) -> None:
    """Ask the daemon `process` serves at `addr` for `health` until it is ready, telling
    `progress` of the load's stages as health does; ServerError when the process exits first
    or `timeout` passes."""
    from rocforge_client import Timeout, connect

    limit = time.monotonic() + timeout
    with connect(addr) as client:
        while time.monotonic() < limit:
            if process.poll() is not None:
                raise ServerError(f"the daemon exited with code {process.returncode}")
            try:
                health = client.health(timeout=0.5)
            except Timeout:
                continue
            if health["ready"]:
                return
            loading = health.get("loading")
            if progress is not None and loading is not None:
                progress(loading["stage"], loading["done"], loading["total"])
            time.sleep(0.1)
    raise ServerError(f"the daemon was not ready within {timeout:.0f} s")


class LocalDaemon:
    """`rocforge serve` in a subprocess on a free loopback port; stopped with SIGTERM."""

    def __init__(
        self,
        model: Path,
        serve_args: Sequence[str] = (),
        *,
        ready_timeout: float = 300.0,
        progress: TerminalProgress | None = None,
    ):
        """`progress` draws the daemon's load as its `health` tells it, until it is ready."""
        self.addr = f"tcp://127.0.0.1:{free_loopback_port()}"
        self.command = [
            sys.executable,
            "-m",
            "rocforge_rt.cli",
            "serve",
            "--model",
            str(model),
            "--bind",
            self.addr,
            *serve_args,
        ]
        self.ready_timeout = ready_timeout
        self.progress = progress
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "LocalDaemon":
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.stop()

    def start(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # so the child imports this checkout
        path = os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))
        self.process = subprocess.Popen(self.command, env={**os.environ, "PYTHONPATH": path})
        try:
            with self.progress if self.progress is not None else contextlib.nullcontext():
                wait_until_ready(self.addr, self.process, self.ready_timeout, self.progress)
        except ServerError:
            self.stop()
            raise

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait, and return the exit code (SIGKILL after `timeout`)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
