"""`rocforge http` (and `python -m rocforge_rt.server.http`): run the HTTP front.

    rocforge http --daemon tcp://127.0.0.1:5555 --listen 127.0.0.1:8000 [--api-key KEY]
                  [--curve-keys DIR] [--model-name NAME] [--allowed-hosts HOSTS]
                  [--cors-origins ORIGINS] [--max-connections N] [--log-level L]
                  [--log-format F]

The API key may come from the environment (ROCFORGE_API_KEY) instead, where `ps` does not
show it; `rocforge serve --http` hands its key to the front that way. Listening beyond
loopback without a key is refused before anything starts. `--exit-with-parent` (what
`serve --http` passes) stops the front when the process that started it is gone, so a
daemon killed without a chance to stop its front leaves none behind. The connections'
bounds (head timeout and size, the connection cap) are transport.py's; the Host check and
CORS, middleware.py's.
"""

import argparse
import asyncio
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rocforge_rt.errors import UsageError
from rocforge_rt.server.command_line import Parser, positive_int, run
from rocforge_rt.server.logs import add_log_options, configure_logging
from rocforge_rt.server.security import API_KEY_ENV, check_http_listen, client_keys

log = logging.getLogger("rocforge.http")

DEFAULT_DAEMON = "tcp://127.0.0.1:5555"
DEFAULT_LISTEN = "127.0.0.1:8000"
PARENT_POLL_S = 0.5
DEFAULT_MAX_CONNECTIONS = 1000  # transport.py's MAX_CONNECTIONS (not imported: uvicorn's slow)


def add_http_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--daemon", default=DEFAULT_DAEMON, help="the daemon's ZeroMQ address")
    parser.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help="where to serve HTTP (beyond loopback needs --api-key)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"/v1/* requests need `Authorization: Bearer KEY` (default: ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--curve-keys",
        metavar="DIR",
        help="folder with client.key_secret and server.key, for a CURVE daemon (default: none)",
    )
    parser.add_argument(
        "--model-name",
        metavar="NAME",
        help="the model's id in the API (default: the GGUF file name's stem)",
    )
    parser.add_argument(
        "--allowed-hosts",
        type=comma_list,
        metavar="HOSTS",
        help="the Host names served, comma-separated (`*`: any; `*.example.com`: its"
        " subdomains); others get 421 (default: on loopback, localhost, 127.0.0.1 and [::1];"
        " on 0.0.0.0 or [::], any; otherwise the --listen host)",
    )
    parser.add_argument(
        "--cors-origins",
        type=comma_list,
        default=(),
        metavar="ORIGINS",
        help="the origins browsers may call the API from, comma-separated (`*`: any)"
        " (default: none, no CORS headers)",
    )
    parser.add_argument(
        "--max-connections",
        type=positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help="open connections at most (fewer if the descriptor limit leaves less room); past"
        " it the oldest one still sending its request head is closed"
        f" (default: {DEFAULT_MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--exit-with-parent", action="store_true", help="stop when the parent process is gone"
    )
    add_log_options(parser)


def add_http_command(sub: Any) -> None:
    """Register `rocforge http` on the CLI's subparsers."""
    http = sub.add_parser(
        "http", help="serve the OpenAI-compatible HTTP API in front of a running daemon"
    )
    add_http_options(http)
    http.set_defaults(func=run_http)


def run_http(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; a UsageError for a listen address refused or a malformed
    daemon address."""
    from rocforge_rt.server.http.app import FrontConfig, create_app
    from rocforge_rt.server.http.transport import FrontServer, TransportLimits
    from rocforge_rt.server.http.transport import server_config as transport_config

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    host, port = check_http_listen(args.listen, api_key)
    curve_keys = Path(args.curve_keys) if args.curve_keys else None
    if curve_keys is not None:
        client_keys(curve_keys)  # a missing or unreadable key file, named before serving
    configure_logging(args.log_level, args.log_format)
    config = FrontConfig(
        daemon=args.daemon,
        api_key=api_key,
        curve_keys=curve_keys,
        model_name=args.model_name,
        listen_host=host,
        allowed_hosts=args.allowed_hosts,
        cors_origins=args.cors_origins,
    )
    try:
        app = create_app(config)
    except ValueError as exc:  # a malformed daemon address
        raise UsageError(str(exc)) from None
    limits = TransportLimits(max_connections=args.max_connections)
    server = FrontServer(transport_config(app, host, port, limits))
    asyncio.run(_serve(server, args.exit_with_parent))
    return 0 if server.started else 1


def server_config(app: Any, host: str, port: int) -> Any:
    """transport.py's `server_config`, with the default limits (imported when called)."""
    from rocforge_rt.server.http.transport import server_config as transport_config

    return transport_config(app, host, port)


def comma_list(text: str) -> tuple[str, ...]:
    """A comma-separated option: its items, stripped, empty ones dropped."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


async def _serve(server: Any, exit_with_parent: bool) -> None:
    watch = asyncio.create_task(_watch_parent(server)) if exit_with_parent else None
    try:
        await server.serve()
    finally:
        if watch is not None:
            watch.cancel()


async def _watch_parent(server: Any) -> None:
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_POLL_S)
    log.warning("the process that started this front (pid %d) is gone: stopping", parent)
    server.should_exit = True


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m rocforge_rt.server.http`; the exit status as server/command_line.py says."""
    parser = Parser(prog="python -m rocforge_rt.server.http", description=__doc__)
    add_http_options(parser)
    return run(lambda: run_http(parser.parse_args(argv)), "rocforge http")
