"""The measured workloads the benchmark scripts share: batch-1 decode and one prompt's prefill,
and llama.cpp's llama-bench and llama-batched-bench run as the peers they are compared with;
and the lever flags' settings as the tunings an engine is loaded with.

Both follow llama-bench: decode tokens/s is generation after a 1-token prompt
(its tg; greedy unless sampling parameters are given), or after a prompt of `depth`
tokens (its tg at -d depth), prompt tokens/s is the
prefill of random token ids, up to and including the first sampled token (its
pp). Random-weight models may sample an end-of-generation id, so decode ignores
those ids.
"""

import argparse
import dataclasses
import json
import math
import re
import subprocess
import time
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from rocforge_rt.backends.gpu.attention_plan import AttentionTuning
from rocforge_rt.backends.gpu.matmul_plan import MatmulTuning
from rocforge_rt.engine.engine import Engine
from rocforge_rt.step.sampling import SamplingParams

Levers = tuple[tuple[str, float], ...]  # ATTR=VALUE settings of a lever flag, in order
Tuning = TypeVar("Tuning")  # a frozen tuning dataclass (MatmulTuning, AttentionTuning)

# The sampled decode the benchmarks time beside greedy decode (bench_decode's
# "decode_sampled", decode_timeline --sampled): a drawn token under common cuts.
BENCH_SAMPLING = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=0)


def decode_tokens_per_s(
    engine: Engine,
    n_decode: int,
    rng: np.random.Generator,
    sampling: SamplingParams = SamplingParams(),
    depth: int = 0,
) -> float:
    """Batch-1 decode of `n_decode` tokens after a prompt of `depth` random tokens (one when
    0; the prefill is not timed), greedy by default."""
    prompt = rng.integers(0, engine.hparams.n_vocab, max(1, depth)).tolist()
    session = engine.open_session(prompt, sampling=sampling, max_tokens=n_decode + 1)
    engine.prefill(session)
    session.eog_ids = frozenset()  # keep going past a sampled end-of-generation id
    start = time.perf_counter()
    for _ in range(n_decode):
        engine.decode([session])
    elapsed = time.perf_counter() - start
    engine.close_session(session)
    return n_decode / elapsed


def prompt_tokens_per_s(engine: Engine, n_prompt: int, rng: np.random.Generator) -> float:
    """Prefill of `n_prompt` random token ids (in the engine's chunks) and the first token."""
    prompt = rng.integers(0, engine.hparams.n_vocab, n_prompt).tolist()
    session = engine.open_session(prompt, max_tokens=1)
    start = time.perf_counter()
    engine.prefill(session)
    elapsed = time.perf_counter() - start
    engine.close_session(session)
    return n_prompt / elapsed


# The fields of a llama-bench result row that say what was measured with what.
LLAMA_BENCH_BUILD_FIELDS = ("build_commit", "build_number", "backends", "cpu_info", "gpu_info")

# llama.cpp's tools log "build: NUMBER (COMMIT) with COMPILER for TARGET" to stderr at start.
LLAMA_BUILD_LINE = re.compile(r"^build: (?P<number>\d+) \((?P<commit>[0-9a-f]+)\)", re.MULTILINE)


class LlamaBenchError(RuntimeError):
    """A llama.cpp benchmark tool could not be started, failed, or printed results that
    cannot be read."""


@dataclass(frozen=True)
class LlamaBenchRun:
    command: list[str]
    rows: list[dict[str, Any]]  # one per test (pp, tg) as its JSON output has them

    def build(self) -> dict[str, Any]:
        """The build and device fields of its output (commit, backends, CPU and GPU)."""
        first = self.rows[0] if self.rows else {}
        return {k: first[k] for k in LLAMA_BENCH_BUILD_FIELDS if k in first}


@dataclass(frozen=True)
class LlamaBatchedBenchRun:
    command: list[str]
    rows: dict[int, dict[str, Any]]  # by parallel sequences (its pl): one JSONL row each
    build: dict[str, Any]  # build_number and build_commit from its log, where it printed them


def run_llama_tool(tool: str, command: Sequence[str]) -> subprocess.CompletedProcess:
    """Run a llama.cpp tool (`tool` names it in errors; command[0] is its binary) to the end.
    LlamaBenchError, naming the tool and binary, when it cannot be started or exits non-zero
    (with the last lines of its stderr)."""
    binary = command[0]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except OSError as e:  # not there, not executable
        raise LlamaBenchError(f"cannot run {tool} {binary!r}: {e.strerror or e}") from e
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-5:]
        raise LlamaBenchError(
            f"{tool} {binary!r} exited with code {done.returncode}"
            + (":\n  " + "\n  ".join(tail) if tail else "")
        )
    return done


def llama_bench(
    binary: str,
    model: str,
    *,
    n_prompt: int,
    n_gen: int,
    repetitions: int = 3,
    n_gpu_layers: int = 99,
    extra_args: Sequence[str] = (),
) -> LlamaBenchRun:
    """Run llama-bench on the same GGUF with flash attention on: its pp test of `n_prompt`
    tokens and tg test of `n_gen` (a 0 leaves that test out), `repetitions` each after its
    own warm-up. `n_gpu_layers` is -ngl (99: all on the GPU; 0 for a CPU comparison);
    `extra_args` go last. LlamaBenchError, naming the binary, when it cannot be run,
    fails, or prints no result rows."""
    command = [binary, "-m", model, "-p", str(n_prompt), "-n", str(n_gen),
               "-ngl", str(n_gpu_layers), "-fa", "1", "-r", str(repetitions), "-o", "json",
               *extra_args]  # fmt: skip
    done = run_llama_tool("llama-bench", command)
    try:
        rows = json.loads(done.stdout)
    except json.JSONDecodeError as e:
        raise LlamaBenchError(f"llama-bench {binary!r} printed no JSON ({e})") from e
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise LlamaBenchError(f"llama-bench {binary!r} printed no result rows")
    return LlamaBenchRun(command, rows)


def llama_batched_bench(
    binary: str,
    model: str,
    *,
    n_prompt: int,
    n_gen: int,
    n_parallel: Sequence[int],
    n_ctx: int | None = None,
    n_gpu_layers: int = 99,
    extra_args: Sequence[str] = (),
) -> LlamaBatchedBenchRun:
    """Run llama-batched-bench on the same GGUF with flash attention on: for each count B in
    `n_parallel`, B sequences of their own `n_prompt`-token prompt prefilled together
    (T_PP), then `n_gen` decode steps of one token for each of the B (T_TG; S_TG = B x
    n_gen / T_TG, its aggregate decode tokens/s). -c is `n_ctx`, by default the largest B x
    (n_prompt + n_gen) (it skips a B whose prompts and tokens do not fit); -b 2048 -ub 512;
    -ngl `n_gpu_layers`; `--output-format jsonl` (one JSON object a line on stdout, keys pp,
    tg, pl, n_kv, t_pp, speed_pp, t_tg, speed_tg, t, speed in seconds and tokens/s: the
    build of tools/batched-bench/batched-bench.cpp where -fa takes on|off|auto);
    `extra_args` go last. LlamaBenchError, naming the binary, when it cannot be run,
    fails, or gives no row for some B."""
    counts = list(dict.fromkeys(n_parallel))
    if n_ctx is None:
        n_ctx = max(counts) * (n_prompt + n_gen)
    command = [binary, "-m", model, "-c", str(n_ctx), "-b", "2048", "-ub", "512",
               "-npp", str(n_prompt), "-ntg", str(n_gen), "-npl", ",".join(map(str, counts)),
               "-ngl", str(n_gpu_layers), "-fa", "on", "--output-format", "jsonl",
               *extra_args]  # fmt: skip
    done = run_llama_tool("llama-batched-bench", command)
    rows: dict[int, dict[str, Any]] = {}
    for line in done.stdout.splitlines():
        if not line.startswith("{"):
            continue  # the blank lines around its rows
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise LlamaBenchError(
                f"llama-batched-bench {binary!r} printed a line that is not JSON ({e}): {line}"
            ) from e
        if row.get("pp") == n_prompt and row.get("tg") == n_gen and "pl" in row:
            rows[row["pl"]] = row
    missing = [b for b in counts if b not in rows]
    if missing:
        raise LlamaBenchError(
            f"llama-batched-bench {binary!r} gave no result for"
            f" {', '.join(map(str, missing))} parallel sequences of {n_prompt} + {n_gen} tokens"
            " (is -c large enough, and is it a build with --output-format jsonl?)"
        )
    found = LLAMA_BUILD_LINE.search(done.stderr)
    build = {"build_number": int(found["number"]), "build_commit": found["commit"]} if found else {}
    return LlamaBatchedBenchRun(command, {b: rows[b] for b in counts}, build)


def positive_ints(text: str) -> list[int]:
    """A benchmark's comma-separated counts ("128,512"), sorted, without repeats (an argparse
    type: a bad list is an ArgumentTypeError)."""
    try:
        values = sorted({int(n) for n in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None
    if values[0] < 1:
        raise argparse.ArgumentTypeError(f"every value must be >= 1: {text!r}")
    return values


def lever_settings(text: str) -> Levers:
    """ATTR=VALUE[,ATTR=VALUE...] of a benchmark's --matmul-lever or --attention-lever, each
    VALUE a number (an argparse type)."""
    settings = []
    for item in text.split(","):
        attr, sep, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not sep or not attr.isidentifier() or math.isnan(number):
            raise argparse.ArgumentTypeError(f"expected ATTR=NUMBER[,ATTR=NUMBER...], got {text!r}")
        settings.append((attr, int(number) if number.is_integer() else number))
    return tuple(settings)


# What a tuning field of each type takes from the command line.
LEVER_KINDS = {
    bool: "0 or 1",
    int: "a whole number",
    int | None: "a whole number",
    float: "a number",
}


def tuned(tuning: Tuning, settings: Levers) -> Tuning:
    """A frozen tuning dataclass with each ATTR=VALUE of `settings` in its place: a bool
    field takes 0 or 1, an int field a whole number (or None where it may be None), a float
    field any number. ValueError naming the attribute where the tuning has no such field or
    the value is not of its kind."""
    owner = type(tuning).__name__
    kinds = typing.get_type_hints(type(tuning))
    levers = [f.name for f in dataclasses.fields(tuning)]
    changes = {}
    for attr, value in settings:
        if attr not in levers:
            raise ValueError(f"{owner} has no lever {attr!r} (its levers: {', '.join(levers)})")
        kind = kinds[attr]
        if kind is bool and value in (0, 1):
            changes[attr] = bool(value)
        elif kind in (int, int | None) and isinstance(value, int):
            changes[attr] = value
        elif kind is float:
            changes[attr] = float(value)
        else:
            raise ValueError(f"{owner}.{attr} takes {LEVER_KINDS.get(kind, kind)}, not {value!r}")
    return dataclasses.replace(tuning, **changes)


# The tuning each lever flag changes (--matmul-lever: "matmul", --attention-lever:
# "attention"): the backend option (BackendOptions' field) that takes it, and its default.
LEVER_TUNINGS: dict[str, tuple[str, Any]] = {
    "matmul": ("matmul_tuning", MatmulTuning()),
    "attention": ("attention_tuning", AttentionTuning()),
}


def lever_options(part: str, settings: Levers) -> dict[str, Any]:
    """The backend options (`Engine.load`'s, `BackendOptions`' fields) that load an engine
    with a lever flag's settings: `part`'s tuning with them in place, {} for none.
    ValueError naming a lever the tuning lacks (`tuned`)."""
    if not settings:
        return {}
    option, default = LEVER_TUNINGS[part]
    return {option: tuned(default, settings)}


def lever_label(settings: Levers) -> str:
    """The settings as a label suffix (" [a=1,b=2]", "" for none)."""
    return f" [{','.join(f'{attr}={value}' for attr, value in settings)}]" if settings else ""
