"""`rocforge keys`: CURVE key pairs for a daemon and a client (server/security.py)."""

import argparse
from pathlib import Path
from typing import Any


def _cmd_keys(args: argparse.Namespace) -> int:
    from rocforge_rt.server.security import generate_keys

    paths = generate_keys(Path(args.dir))
    print(
        f"server key pair: {paths.server_secret} (keep it on the daemon's machine)\n"
        f"client key pair: {paths.client_secret} (give it and {paths.server_public} to a client)\n"
        f"authorized clients: {paths.authorized_dir}\n"
        f"serve with: rocforge serve --curve-keys {args.dir} --bind tcp://0.0.0.0:5555\n"
        f"connect with: rocforge client health --curve-keys {args.dir} --addr tcp://HOST:5555"
    )
    return 0


def add_keys_command(sub: Any) -> None:
    """Register `keys` on the `rocforge` subparsers."""
    keys = sub.add_parser("keys", help="make CURVE keys for a daemon and a client")
    keys.add_argument("dir", help="folder to write the keys into")
    keys.set_defaults(func=_cmd_keys)
