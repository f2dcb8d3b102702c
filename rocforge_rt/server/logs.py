"""The daemon's log lines: their format, one line per finished request, throughput under load.

Lines are timestamped and levelled; `--log-format json` writes each as one JSON object
(`time`, `level`, `logger`, `message`, and the line's fields, such as a finished
request's figures) for log shippers. Anything a client chose (a request id) is logged as
a Python literal, so it cannot forge a line of its own. A request gets its line when the
engine thread ends it (lifecycle.py), with the time it waited for a session slot when it
needed one. A refused request (by the I/O thread up front, or by the engine thread before
it started) gets its line at debug level only, and a summary of them all at info every
few seconds (refusals.py), so a flood of them cannot flood the log.
"""

import argparse
import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

log = logging.getLogger("rocforge.server")

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
THROUGHPUT_INTERVAL_S = 10.0  # how often a line sums up the tokens processed, while there are


class JsonFormatter(logging.Formatter):
    """One JSON object a line; a record's `fields` (logging's `extra`) join it."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def add_log_options(parser: argparse.ArgumentParser) -> None:
    """--log-level and --log-format, as every long-running command takes them."""
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="the least severe messages logged",
    )
    parser.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text lines, or one JSON object a line",
    )


def configure_logging(level: str, log_format: str) -> None:
    """Send every log line to stderr, as text or JSON (`LOG_FORMATS`)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def request_fields(
    op: str, request_id: Any, reply: dict[str, Any], wait_ms: float | None = None
) -> dict[str, Any]:
    """What a finished request's line says, from its final reply (and `wait_ms`, how long it
    waited for a session slot; None: it needed none)."""
    fields: dict[str, Any] = {"request_id": request_id, "op": op}
    if "error" in reply:
        fields["error"] = reply["error"]["code"]
    if wait_ms is not None:
        fields["wait_ms"] = round(wait_ms, 3)
    usage, timings = reply.get("usage", {}), reply.get("timings", {})
    for key in ("prompt_tokens", "completion_tokens"):
        if key in usage:
            fields[key] = usage[key]
    for key in ("ttft_ms", "e2e_ms", "queue_ms"):
        if key in timings:
            fields[key] = round(timings[key], 3)
    generated = fields.get("completion_tokens", 0)
    ttft, e2e = timings.get("ttft_ms"), timings.get("e2e_ms")
    if generated > 1 and ttft is not None and e2e is not None and e2e > ttft:
        fields["decode_tokens_per_s"] = round((generated - 1) / ((e2e - ttft) / 1000.0), 1)
    if reply.get("finish_reason") is not None:
        fields["finish_reason"] = reply["finish_reason"]
    return fields


def log_request_end(
    op: str,
    request_id: Any,
    reply: dict[str, Any],
    *,
    wait_ms: float | None = None,
    level: int = logging.INFO,
) -> None:
    """One line for a request that ended, whatever ended it (at `level`: a refusal's is
    debug, refusals.py sums them up)."""
    if not log.isEnabledFor(level):
        return
    f = request_fields(op, request_id, reply, wait_ms)
    parts = []
    if "error" in f:
        parts.append(f"failed ({f['error']})")
    if "wait_ms" in f:
        parts.append(f"waited {f['wait_ms']:.1f} ms for a slot")
    if "prompt_tokens" in f:
        parts.append(
            f"{f['prompt_tokens']} prompt + {f.get('completion_tokens', 0)} generated tokens"
        )
    if "ttft_ms" in f:
        parts.append(f"TTFT {f['ttft_ms']:.1f} ms")
    if "decode_tokens_per_s" in f:
        parts.append(f"{f['decode_tokens_per_s']:.1f} tok/s")
    if "e2e_ms" in f:
        parts.append(f"{f['e2e_ms']:.1f} ms in all")
    if "finish_reason" in f:
        parts.append(f"finish {f['finish_reason']}")
    log.log(level, "request %r (%s): %s", request_id, op, ", ".join(parts), extra={"fields": f})


class ThroughputLog:
    """Tokens processed since the last line; a line every THROUGHPUT_INTERVAL_S while any were."""

    def __init__(self, now: float) -> None:
        self._since = now
        self._prompt_tokens = 0
        self._generated_tokens = 0

    def add(self, prompt_tokens: int, generated_tokens: int) -> None:
        self._prompt_tokens += prompt_tokens
        self._generated_tokens += generated_tokens

    def maybe_log(self, now: float, usage: dict[str, Any]) -> None:
        """The line, once the interval has passed (`usage`: the `stats` reply's usage map)."""
        elapsed = now - self._since
        if elapsed < THROUGHPUT_INTERVAL_S:
            return
        if self._prompt_tokens or self._generated_tokens:
            sessions, kv = usage["sessions"], usage["kv"]
            fields = {
                "prompt_tokens_per_s": round(self._prompt_tokens / elapsed, 1),
                "generation_tokens_per_s": round(self._generated_tokens / elapsed, 1),
                "generating": sessions["generating"],
                "prefilling": sessions["prefilling"],
                "kv_use": round(kv["use"], 4),
            }
            log.info(
                "throughput: prompt %.1f tok/s, generation %.1f tok/s, %d generating,"
                " %d prefilling, KV %.1f%% used",
                fields["prompt_tokens_per_s"],
                fields["generation_tokens_per_s"],
                fields["generating"],
                fields["prefilling"],
                100.0 * fields["kv_use"],
                extra={"fields": fields},
            )
        self._since, self._prompt_tokens, self._generated_tokens = now, 0, 0
