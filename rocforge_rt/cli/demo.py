"""`rocforge demo`: a daemon on the default model (a `LocalDaemon`), one streamed chat reply,
the daemon's stats, and a clean stop."""

import argparse
import sys
from typing import Any

from rocforge_rt.backends import BACKEND_NAMES
from rocforge_rt.cli.client_commands import format_generation, stream_generation
from rocforge_rt.cli.local_daemon import LocalDaemon
from rocforge_rt.cli.options import (
    BACKEND_HELP,
    MODEL_HELP,
    add_kv_cache_dtype_option,
    add_location_options,
    default_model,
    prompt_argument,
)
from rocforge_rt.cli.progress import TerminalProgress
from rocforge_rt.cli.stats_report import format_stats
from rocforge_rt.server.config import ServerError

DEMO_PROMPT = "Write one sentence about the sea."


def _cmd_demo(args: argparse.Namespace) -> int:
    from rocforge_client import connect

    model = default_model(args.model)
    serve_args = [
        "--backend",
        args.backend,
        "--ctx-size",
        "1024",
        "--max-sessions",
        "2",
        "--kv-cache-dtype",
        args.kv_cache_dtype,
        "--log-level",
        "warning",
    ]
    print(f"starting the daemon on {model.name} ...", file=sys.stderr)
    with LocalDaemon(model, serve_args, progress=TerminalProgress()) as daemon:
        with connect(daemon.addr) as client:
            turn = {
                "messages": [{"role": "user", "content": args.prompt}],
                "max_tokens": args.max_tokens,
            }
            result = stream_generation(client, turn, sys.stdout)
            stats = client.stats()
        code = daemon.stop()
    print(format_generation(result), file=sys.stderr)
    print(format_stats(stats), file=sys.stderr)
    if code != 0:
        raise ServerError(f"the daemon exited with code {code} after SIGTERM (expected 0)")
    print("daemon stopped cleanly (SIGTERM, exit code 0)", file=sys.stderr)
    return 0


def add_demo_command(sub: Any) -> None:
    """Register `demo` on the `rocforge` subparsers."""
    demo = sub.add_parser(
        "demo", help="start a daemon on the default model, stream a chat reply, print stats"
    )
    demo.add_argument("--model", metavar="PATH", help=MODEL_HELP)
    demo.add_argument(
        "--prompt",
        type=prompt_argument,
        default=DEMO_PROMPT,
        metavar="TEXT",
        help="the user's message; - reads it from stdin",
    )
    demo.add_argument(
        "--max-tokens", type=int, default=48, metavar="N", help="tokens to generate at most"
    )
    demo.add_argument("--backend", choices=BACKEND_NAMES, default="auto", help=BACKEND_HELP)
    add_kv_cache_dtype_option(demo)
    add_location_options(demo)
    demo.set_defaults(func=_cmd_demo)
