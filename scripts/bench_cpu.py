#!/usr/bin/env python3
"""Our CPU backend beside llama.cpp's CPU build: same GGUF, same thread count, one run.

Decode tokens/s: batch-1 greedy generation of --n-decode tokens after a 1-token prompt
(llama-bench's tg). Prompt tokens/s and TTFT: the prefill of a --n-prompt token prompt up to
and including its first (greedy) token (llama-bench's pp). Both sides get the same random
token ids. Resident memory (RSS, from /proc) of each side's process after its load, and
its peak at the end.

llama.cpp is llama-cpp-python run by another interpreter (--llamacpp-python) in a
subprocess (scripts/llamacpp_cpu_peer.py) that loads the model once and answers each
request over stdin/stdout as a JSON line. Both sides load and warm up once; then each of
--rounds rounds times --repeats runs of each figure on ours, then on llama.cpp. Figures
are medians over all runs; a table and the ratios (ours / llama.cpp) go to stderr, the
results to --out as JSON.

--threads T (default: the physical cores) goes to llama.cpp as n_threads and
n_threads_batch, and to ours as Engine.load(threads=T) where the CPU backend takes it;
OMP/OPENBLAS/MKL_NUM_THREADS are set to T before numpy is imported, either way.
"""

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import rocforge_rt  # noqa: F401 - its import sets OpenBLAS's thread timeout before numpy loads

PEER_SCRIPT = Path(__file__).resolve().with_name("llamacpp_cpu_peer.py")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
FIGURES = ("decode_tokens_per_s", "prompt_tokens_per_s", "ttft_ms")
COMPARED = (*FIGURES, "rss_after_load_bytes", "peak_rss_bytes")


def physical_cores() -> int:
    """Distinct (package, core) pairs among the CPUs this process may run on."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            return len(cpus)
        cores.add((package, core))
    return len(cores) or 1


def memory_of(pid: int) -> dict[str, int | None]:
    """VmRSS and VmHWM (peak) of a process in bytes; None where /proc does not say."""
    figures: dict[str, int | None] = {"rss_bytes": None, "peak_rss_bytes": None}
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return figures
    for line in lines:
        key, _, value = line.partition(":")
        name = {"VmRSS": "rss_bytes", "VmHWM": "peak_rss_bytes"}.get(key)
        if name and value.strip().endswith("kB"):
            figures[name] = int(value.split()[0]) * 1024
    return figures


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the system has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def cpu_ticks(pids: list[int]) -> tuple[int, int, int] | None:
    """The machine's busy and total clock ticks (/proc/stat) and those the processes `pids`
    have run (all their threads); None where /proc does not say."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        own = 0
        for pid in pids:
            stat = Path(f"/proc/{pid}/stat").read_text()
            after_name = stat[stat.rindex(")") + 2 :].split()
            own += int(after_name[11]) + int(after_name[12])  # utime, stime
    except (OSError, ValueError, IndexError):
        return None
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
    return total - fields[3] - fields[4], total, own


def other_cpu_share(before: tuple | None, after: tuple | None) -> float | None:
    """The share of the machine's CPU time that processes other than the two sides used
    between two cpu_ticks() (0: the benchmark had the machine to itself)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    busy, total, own = (a - b for a, b in zip(after, before, strict=True))
    return round(max(0.0, busy - own) / total, 3)


class PeerError(RuntimeError):
    """The llama.cpp peer could not be started, died, timed out, or answered a failure."""


class Peer:
    """llama-cpp-python in another interpreter, speaking JSON lines (llamacpp_cpu_peer.py)."""

    def __init__(self, python: str, timeout: float) -> None:
        self.python = python
        self.timeout = timeout
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed by close()
        try:
            self.process = subprocess.Popen(
                [python, "-u", str(PEER_SCRIPT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.stderr,
                text=True,
            )
        except OSError as e:
            raise PeerError(f"cannot run the llama.cpp peer {python!r}: {e.strerror or e}") from e
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _stderr_tail(self) -> str:
        self.stderr.seek(0)
        tail = self.stderr.read().strip().splitlines()[-5:]
        return ":\n  " + "\n  ".join(tail) if tail else ""

    def request(self, **message: Any) -> dict[str, Any]:
        """Send one request and wait for its answer; PeerError when it fails."""
        what = f"the llama.cpp peer {self.python!r}"
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
        except OSError:
            pass  # it has exited: the answer below is the end of its output
        try:
            line = self.lines.get(timeout=self.timeout)
        except queue.Empty:
            self.close()
            raise PeerError(
                f"{what} did not answer {message['op']!r} in {self.timeout:g} s"
            ) from None
        if line is None:
            code = self.process.wait()
            raise PeerError(f"{what} exited with code {code}" + self._stderr_tail())
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            raise PeerError(f"{what} answered a line that is not JSON: {line.strip()!r}") from None
        if not isinstance(reply, dict) or not reply.get("ok"):
            error = reply.get("error") if isinstance(reply, dict) else reply
            raise PeerError(f"{what} failed {message['op']!r}: {error}")
        return reply

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.close()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.stderr.close()


class Side:
    """One side's runs: tokens/s of each decode and prompt run, and each prompt's TTFT."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.runs: dict[str, list[float]] = {k: [] for k in FIGURES}
        self.memory: dict[str, int | None] = {}

    def add_decode(self, n_decode: int, seconds: float) -> None:
        self.runs["decode_tokens_per_s"].append(n_decode / seconds)

    def add_prompt(self, n_prompt: int, seconds: float) -> None:
        self.runs["prompt_tokens_per_s"].append(n_prompt / seconds)
        self.runs["ttft_ms"].append(seconds * 1e3)

    def result(self) -> dict[str, Any]:
        medians = {k: statistics.median(v) for k, v in self.runs.items() if v}
        runs = {f"{k}_runs": v for k, v in self.runs.items()}
        return {**medians, **runs, **self.memory}


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    """ours / llama.cpp of each figure both have (above 1: ours is higher: faster for tokens/s,
    slower for TTFT, larger for memory)."""
    return {k: ours[k] / theirs[k] for k in COMPARED if ours.get(k) and theirs.get(k)}


def table(ours: dict[str, Any], theirs: dict[str, Any] | None, ratio: dict[str, float]) -> str:
    def cell(figures: dict[str, Any], key: str, scale: float = 1.0) -> str:
        value = figures.get(key)
        return "-" if value is None else f"{value / scale:,.1f}"

    mib = 1 << 20
    lines = ["| side | decode tok/s | prompt tok/s | TTFT ms | RSS after load MiB | peak RSS MiB |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    sides = [("ours", ours)] + ([("llama.cpp", theirs)] if theirs else [])
    for name, figures in sides:
        lines.append(
            f"| {name} | {cell(figures, 'decode_tokens_per_s')}"
            f" | {cell(figures, 'prompt_tokens_per_s')} | {cell(figures, 'ttft_ms')}"
            f" | {cell(figures, 'rss_after_load_bytes', mib)}"
            f" | {cell(figures, 'peak_rss_bytes', mib)} |"
        )
    if ratio:
        cells = " | ".join(f"{ratio[k]:.3f}x" if k in ratio else "-" for k in COMPARED)
        lines.append(f"| ours / llama.cpp | {cells} |")
    return "\n".join(lines)


def set_thread_environment(threads: int) -> dict[str, Any]:
    """OMP/OPENBLAS/MKL_NUM_THREADS = threads, for a numpy imported after this."""
    before = {k: os.environ.get(k) for k in THREAD_VARIABLES}
    for name in THREAD_VARIABLES:
        os.environ[name] = str(threads)
    return {
        "environment": {k: str(threads) for k in THREAD_VARIABLES},
        "environment_before": before,
        # Set after numpy's import (a caller in the same process) it changes nothing.
        "numpy_imported_before": "numpy" in sys.modules,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument(
        "--llamacpp-python",
        help="an interpreter with llama-cpp-python, to run llama.cpp beside ours",
    )
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for both sides (default: the physical cores)")  # fmt: skip
    parser.add_argument("--n-decode", type=int, default=128)
    parser.add_argument("--n-prompt", type=int, default=512)
    parser.add_argument("--n-batch", type=int, default=512, help="llama.cpp's n_batch")
    parser.add_argument("--flash-attn", action="store_true", help="llama.cpp's flash_attn")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of ours, then llama.cpp (figures: medians)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1, help="runs of each figure a round")
    parser.add_argument("--peer-timeout", type=float, default=600.0,
                        help="seconds to wait for each of the peer's answers")  # fmt: skip
    parser.add_argument("--out", default="bench-results/cpu.json")
    args = parser.parse_args()
    threads = args.threads or physical_cores()
    threading_info = {"threads": threads, **set_thread_environment(threads)}

    import inspect

    import numpy as np
    from bench_harness import decode_tokens_per_s, prompt_tokens_per_s

    from rocforge_rt.backends.cpu import CpuBackend
    from rocforge_rt.engine.engine import Engine

    n_ctx = max(args.n_prompt, 1 + args.n_decode) + 8
    report: dict[str, Any] = {
        "model": args.model, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": cpu_model(), "logical_cpus": os.cpu_count(), "physical_cores": physical_cores(),
        "threads": threads, "n_decode": args.n_decode, "n_prompt": args.n_prompt,
        "n_ctx": n_ctx, "rounds": args.rounds, "repeats": args.repeats,
        "load_average_at_start": load_average(),
    }  # fmt: skip
    status = 0
    peer: Peer | None = None
    peer_pid = 0
    theirs = Side("llama.cpp")
    if args.llamacpp_python:
        load = {"op": "load", "model": str(Path(args.model).resolve()), "threads": threads,
                "n_ctx": n_ctx, "n_batch": args.n_batch, "flash_attn": args.flash_attn}  # fmt: skip
        try:
            peer = Peer(args.llamacpp_python, args.peer_timeout)
            loaded = peer.request(**load)
        except PeerError as e:
            print(f"error: {e}", file=sys.stderr)
            report["llamacpp_error"] = str(e)
            if peer:
                peer.close()
            status, peer = 1, None
        else:
            # Its own pid: the interpreter given may be a wrapper that starts it.
            peer_pid = int(loaded.get("pid") or peer.process.pid)
            theirs.memory["rss_after_load_bytes"] = memory_of(peer_pid)["rss_bytes"]
            report["llamacpp"] = {"python": args.llamacpp_python,
                                  **{k: v for k, v in load.items() if k != "op"},
                                  **{k: v for k, v in loaded.items() if k != "ok"}}  # fmt: skip

    options: dict[str, Any] = {}
    if "threads" in inspect.signature(CpuBackend.__init__).parameters:
        options["threads"] = threads
    threading_info["ours_set_by"] = (
        "Engine.load(threads=T) and the environment" if options else "the environment"
    )
    report["threading"] = threading_info
    engine = Engine.load(args.model, backend="cpu", n_ctx=n_ctx, **options)
    ours = Side("ours")
    after_load = memory_of(os.getpid())
    ours.memory["rss_after_load_bytes"] = after_load["rss_bytes"]
    n_vocab = engine.hparams.n_vocab
    report["ours"] = {"device": engine.backend.device_info()}

    def ids(seed: int, n: int) -> list[int]:
        """The same random token ids on both sides (as the workloads draw them)."""
        return np.random.default_rng(seed).integers(0, n_vocab, n).tolist()

    def run_ours(kind: str, seed: int, n: int) -> float:
        rng = np.random.default_rng(seed)
        if kind == "decode":
            return n / decode_tokens_per_s(engine, n, rng)
        return n / prompt_tokens_per_s(engine, n, rng)

    def run_theirs(kind: str, seed: int, n: int) -> float:
        if kind == "decode":
            return peer.request(op="decode", tokens=ids(seed, 1), n_decode=n)["seconds"]
        return peer.request(op="prompt", tokens=ids(seed, n))["seconds"]

    def run_peer(kind: str, seed: int, n: int) -> float | None:
        """A peer's run; None (and the peer closed) when it fails."""
        nonlocal peer, status
        try:
            return run_theirs(kind, seed, n)
        except PeerError as e:
            print(f"error: {e}", file=sys.stderr)
            peer.close()
            peer, status = None, 1
            report["llamacpp_error"] = str(e)
            return None

    # Warm-up, not counted: first touches of the weights, caches, thread pools.
    run_ours("decode", 0, 8)
    run_ours("prompt", 0, args.n_prompt)
    if peer:
        run_peer("decode", 0, 8)
        if peer:
            run_peer("prompt", 0, args.n_prompt)

    def sides_ticks() -> tuple[int, int, int] | None:
        return cpu_ticks([os.getpid()] + ([peer_pid] if peer else []))

    # Other work on the machine takes cores from whichever side runs: each round says how much.
    report["other_cpu_share"] = {"ours": [], "llamacpp": []}
    for r in range(args.rounds):  # ours, then llama.cpp, in turn
        seeds = [1 + r * args.repeats + i for i in range(args.repeats)]
        start = sides_ticks()
        for seed in seeds:
            ours.add_decode(args.n_decode, run_ours("decode", seed, args.n_decode))
        for seed in seeds:
            ours.add_prompt(args.n_prompt, run_ours("prompt", seed, args.n_prompt))
        middle = sides_ticks()
        report["other_cpu_share"]["ours"].append(other_cpu_share(start, middle))
        for kind, n, add in (("decode", args.n_decode, theirs.add_decode),
                             ("prompt", args.n_prompt, theirs.add_prompt)):  # fmt: skip
            for seed in seeds:
                seconds = run_peer(kind, seed, n) if peer else None
                if seconds is not None:
                    add(n, seconds)
        shares = report["other_cpu_share"]
        if peer:
            shares["llamacpp"].append(other_cpu_share(middle, sides_ticks()))
        print(f"round {r + 1}/{args.rounds} done (other processes' share of the CPU: ours"
              f" {shares['ours'][-1]}, llama.cpp {(shares['llamacpp'] or [None])[-1]})",
              file=sys.stderr)  # fmt: skip

    report["load_average_at_end"] = load_average()
    ours.memory["peak_rss_bytes"] = memory_of(os.getpid())["peak_rss_bytes"]
    report["ours"].update(ours.result())
    peer_figures = None
    if peer:
        theirs.memory["peak_rss_bytes"] = memory_of(peer_pid)["peak_rss_bytes"]
        peer.close()
        peer_figures = theirs.result()
        report["llamacpp"].update(peer_figures)
        report["ratios"] = ratios(report["ours"], peer_figures)
    print(table(report["ours"], peer_figures, report.get("ratios", {})), file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
