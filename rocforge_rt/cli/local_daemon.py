"""`rocforge serve` in a subprocess on a free loopback port (`LocalDaemon`), ready once it
answers health: for `rocforge demo`, scripts/bench_ttft.py and the tests."""

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rocforge_rt.server.config import ServerError


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_ready(addr: str, process: subprocess.Popen, timeout: float) -> None:
    """Ask the daemon `process` serves at `addr` for `health` until it is ready; ServerError
    when the process exits first or `timeout` passes."""
    from rocforge_client import Timeout, connect

    limit = time.monotonic() + timeout
    with connect(addr) as client:
        while time.monotonic() < limit:
            if process.poll() is not None:
                raise ServerError(f"the daemon exited with code {process.returncode}")
            try:
                if client.health(timeout=0.5)["ready"]:
                    return
            except Timeout:
                continue
            time.sleep(0.1)
    raise ServerError(f"the daemon was not ready within {timeout:.0f} s")


class LocalDaemon:
    """`rocforge serve` in a subprocess on a free loopback port; stopped with SIGTERM."""

    def __init__(
        self, model: Path, serve_args: Sequence[str] = (), *, ready_timeout: float = 300.0
    ):
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
            wait_until_ready(self.addr, self.process, self.ready_timeout)
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
