"""`rocforge serve`: the ZeroMQ daemon, and with `--http` the OpenAI-compatible HTTP front
beside it as a child process (server/front_process.py); each option also from a
ROCFORGE_<OPTION> variable."""

import argparse
import os
import re
from pathlib import Path
from typing import Any

from rocforge_rt.backends import BACKEND_NAMES
from rocforge_rt.cli.options import (
    BACKEND_HELP,
    BATCH_INVARIANT_HELP,
    MODEL_HELP,
    THREADS_HELP,
    add_kv_cache_dtype_option,
    add_location_options,
    default_model,
)
from rocforge_rt.engine.engine import DEFAULT_PREFILL_CHUNK
from rocforge_rt.server.command_line import positive_int
from rocforge_rt.server.config import (
    DEFAULT_BIND,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_QUEUE_TIME_S,
    DEFAULT_MAX_REFUSALS_PER_CLIENT,
    DaemonConfig,
)
from rocforge_rt.server.front_process import FrontProcess, connect_address, front_command
from rocforge_rt.server.logs import add_log_options, configure_logging
from rocforge_rt.server.security import API_KEY_ENV, check_http_listen

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '123456', '512M', '8GiB', '1.5G' (K, M, G, T are powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512M, 8GiB, 1048576)")
    number, unit = match.groups()
    return int(float(number) * 1024 ** "_kmgt".index(unit.lower() or "_"))


SERVE_DESCRIPTION = f"""\
Run the ZeroMQ daemon (and, with --http, the OpenAI-compatible HTTP API beside it).

Each option may come from the environment instead: ROCFORGE_<OPTION>, the option's
name in capitals with - as _ (--ctx-size: ROCFORGE_CTX_SIZE; a switch takes 1 or 0).
An option on the command line wins. The HTTP API's key is ${API_KEY_ENV}."""


def _cmd_serve(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    _serve(args)
    return 0


def _serve(args: argparse.Namespace) -> None:
    from rocforge_rt.server.daemon import Daemon

    config = DaemonConfig(
        model=default_model(args.model),
        backend=args.backend,
        bind=args.bind,
        ctx_size=args.ctx_size,
        max_sessions=args.max_sessions,
        kv_dtype=args.kv_cache_dtype,
        memory_limit=args.gpu_memory_limit,
        threads=args.threads,
        idle_timeout_s=args.idle_timeout,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        max_request_bytes=args.max_request_bytes,
        prefill_chunk=args.prefill_chunk,
        batch_invariant=args.batch_invariant,
        pipelined_decode=not args.no_pipelined_decode,
        curve_keys=Path(args.curve_keys) if args.curve_keys else None,
        max_sessions_per_client=args.max_sessions_per_client,
        operator_key=args.operator_key,
        max_queue=args.max_queue,
        max_queue_time_s=args.max_queue_time,
        max_refusals_per_client=args.max_refusals_per_client,
    )
    api_key = args.http_api_key or os.environ.get(API_KEY_ENV) or None
    if args.http is not None:
        check_http_listen(args.http, api_key, "--http-api-key")  # before the model loads
    daemon = Daemon(config)
    front = None
    try:  # a SIGTERM before `run` installs its handler still closes the daemon (Terminated)
        if args.http is not None:
            front = FrontProcess(
                front_command(_front_args(args, connect_address(daemon.endpoint))),
                where=f"http://{args.http}",
                env={**os.environ, API_KEY_ENV: api_key} if api_key else None,
            )
            front.start_when_ready(daemon.wait_ready)
        daemon.run(before_close=front.stop if front is not None else None)
    finally:
        if front is not None:
            front.stop()  # a no-op once the daemon stopped it
        daemon.close()  # likewise


def _front_args(args: argparse.Namespace, daemon: str) -> list[str]:
    """The HTTP front's options for `serve --http` (the API key goes in its environment)."""
    front = ["--daemon", daemon, "--listen", args.http, "--exit-with-parent"]
    if args.curve_keys:
        front += ["--curve-keys", args.curve_keys]
    if args.http_model_name:
        front += ["--model-name", args.http_model_name]
    if args.http_allowed_hosts is not None:
        front += ["--allowed-hosts", args.http_allowed_hosts]
    if args.http_cors_origins:
        front += ["--cors-origins", args.http_cors_origins]
    if args.http_max_connections is not None:
        front += ["--max-connections", str(args.http_max_connections)]
    return [*front, "--log-level", args.log_level, "--log-format", args.log_format]


def add_serve_command(sub: Any) -> None:
    """Register `serve` on the `rocforge` subparsers."""
    serve = sub.add_parser(
        "serve",
        help="run the ZeroMQ daemon (options also from ROCFORGE_* variables)",
        description=SERVE_DESCRIPTION,
        environment=True,
        environment_skip=("http_api_key",),  # ROCFORGE_API_KEY, as `rocforge http`'s
    )
    serve.add_argument("--model", metavar="PATH", help=MODEL_HELP)
    serve.add_argument("--backend", choices=BACKEND_NAMES, default="auto", help=BACKEND_HELP)
    serve.add_argument(
        "--bind",
        default=DEFAULT_BIND,
        metavar="ENDPOINT",
        help="ZeroMQ endpoint (beyond loopback: --curve-keys)",
    )
    serve.add_argument("--ctx-size", type=int, default=2048, metavar="N", help="tokens per session")
    serve.add_argument(
        "--max-sessions", type=int, default=4, metavar="N", help="sessions (KV slots)"
    )
    add_kv_cache_dtype_option(serve)
    serve.add_argument("--threads", type=positive_int, metavar="N", help=THREADS_HELP)
    serve.add_argument(
        "--gpu-memory-limit",
        type=parse_size,
        metavar="SIZE",
        help="weights + KV pool budget, e.g. 8GiB (default: device memory; CPU: host RAM)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="seconds before an unused session is closed",
    )
    serve.add_argument(
        "--max-prompt-tokens",
        type=int,
        metavar="N",
        help="per turn (default: the context size - 1)",
    )
    serve.add_argument(
        "--max-new-tokens", type=int, metavar="N", help="per turn (default: the context size)"
    )
    serve.add_argument(
        "--max-request-bytes",
        type=parse_size,
        default=1 << 20,
        metavar="SIZE",
        help="the largest request message, e.g. 1MiB",
    )
    serve.add_argument(
        "--prefill-chunk",
        type=int,
        default=DEFAULT_PREFILL_CHUNK,
        metavar="N",
        help="prompt tokens per forward pass",
    )
    serve.add_argument("--batch-invariant", action="store_true", help=BATCH_INVARIANT_HELP)
    serve.add_argument(
        "--no-pipelined-decode",
        action="store_true",
        help="GPU: read each decode step back before issuing the next (for A/B runs)",
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        metavar="N",
        help="requests (open, one-shot generate) that wait, first come first served, for a"
        " session slot when every one is in use; past N they get `busy`; 0: no queue, busy at"
        f" once (default: {DEFAULT_MAX_QUEUE})",
    )
    serve.add_argument(
        "--max-queue-time",
        type=float,
        default=DEFAULT_MAX_QUEUE_TIME_S,
        metavar="SECONDS",
        help="the longest a request waits for a session slot, then it gets `busy`; 0: no limit"
        f" (default: {DEFAULT_MAX_QUEUE_TIME_S:g})",
    )
    serve.add_argument(
        "--curve-keys",
        metavar="DIR",
        help="folder made by `rocforge keys`, needed off loopback (default: none, plaintext)",
    )
    serve.add_argument(
        "--max-sessions-per-client",
        type=int,
        metavar="N",
        help="sessions one client (routing id; with CURVE, client key) may hold or be opening"
        " (default: --max-sessions)",
    )
    serve.add_argument(
        "--max-refusals-per-client",
        type=int,
        default=DEFAULT_MAX_REFUSALS_PER_CLIENT,
        metavar="N",
        help="malformed or unknown-session requests a client may send a second before its"
        " messages are dropped for the rest of that second (0: no limit)",
    )
    serve.add_argument(
        "--operator-key",
        metavar="KEY",
        help="needed by stats --reset, trace and profile when bound beyond loopback"
        " (default: none: refused there)",
    )
    serve.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="also serve the OpenAI-compatible HTTP API there (a child process, started once"
        " the daemon is ready; beyond loopback it needs --http-api-key) (default: off)",
    )
    serve.add_argument(
        "--http-api-key",
        metavar="KEY",
        help=f"the HTTP API's key: `Authorization: Bearer KEY` (default: ${API_KEY_ENV})",
    )
    serve.add_argument(
        "--http-model-name",
        metavar="NAME",
        help="the model's id in the HTTP API (default: the GGUF file name's stem)",
    )
    serve.add_argument(
        "--http-allowed-hosts",
        metavar="HOSTS",
        help="the Host names the HTTP API serves, comma-separated (`*`: any); others get 421"
        " (default: on loopback its names, on 0.0.0.0 or [::] any, else the --http host)",
    )
    serve.add_argument(
        "--http-cors-origins",
        metavar="ORIGINS",
        help="the origins browsers may call the HTTP API from, comma-separated (`*`: any)"
        " (default: none, no CORS headers)",
    )
    serve.add_argument(
        "--http-max-connections",
        type=positive_int,
        metavar="N",
        help="the HTTP API's open connections at most; past it the oldest one still sending"
        " its request head is closed (default: 1000, fewer under a low descriptor limit)",
    )
    add_log_options(serve)
    add_location_options(serve)
    serve.set_defaults(func=_cmd_serve)
