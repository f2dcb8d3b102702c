"""The `rocforge` command (`python -m rocforge_rt`, or `python -m rocforge_rt.cli`): its
parser and `main`. One module a command group: generate, models (convert, models default),
kernels, serve, client_commands (client, trace), keys, demo; options.py holds the options
they share; `http` is the HTTP front's own (server/http/command.py)."""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import rocforge_rt
from rocforge_rt.cli.client_commands import add_client_commands
from rocforge_rt.cli.demo import add_demo_command
from rocforge_rt.cli.generate import add_generate_command
from rocforge_rt.cli.kernels import add_kernels_command
from rocforge_rt.cli.keys import add_keys_command
from rocforge_rt.cli.models import add_model_commands
from rocforge_rt.cli.options import export_locations
from rocforge_rt.cli.serve import add_serve_command
from rocforge_rt.dirs import cache_dir, downloads_dir, models_dir
from rocforge_rt.server.command_line import Parser, run
from rocforge_rt.server.http.command import add_http_command

DESCRIPTION = """\
Run GGUF Q4_0 llama-family models on a CUDA or HIP GPU, or on the CPU: generate text,
convert models, serve them over ZeroMQ and an OpenAI-compatible HTTP API."""


def version() -> str:
    """The installed distribution's version (the package's own on a bare PYTHONPATH)."""
    import importlib.metadata  # ~70 ms: not on every command's way (serve's socket waits)

    try:
        return importlib.metadata.version("rocforge-rt")
    except importlib.metadata.PackageNotFoundError:
        return rocforge_rt.__version__


def _epilog() -> str:
    return f"""\
files:
  models     {models_dir()}
             ($ROCFORGE_MODELS_DIR, --models-dir)
  downloads  {downloads_dir()}
             (the default model's source)
  cache      {cache_dir()}
             ($ROCFORGE_CACHE_DIR, --cache-dir): compiled kernels, numba's cache

environment:
  serve reads each option the command line does not give from ROCFORGE_<OPTION>
  (ROCFORGE_BIND, ROCFORGE_CTX_SIZE, ...: see `rocforge serve --help`);
  ROCFORGE_API_KEY is the HTTP API's key (serve --http, http)

exit status:
  0 success, 1 error, 2 usage error, 130 interrupted"""


class _VersionAction(argparse.Action):
    """--version: the version, where it runs from, and the Python; looked up when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **_kwargs: object) -> None:
        super().__init__(
            option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show the version"
        )

    def __call__(self, parser: argparse.ArgumentParser, *_args: object) -> None:
        where = Path(rocforge_rt.__file__).parent
        print(f"{parser.prog} {version()} from {where} (Python {sys.version.split()[0]})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="rocforge", description=DESCRIPTION, epilog=_epilog())
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")

    add_generate_command(sub)
    add_model_commands(sub)  # convert, models
    add_kernels_command(sub)
    add_serve_command(sub)
    add_client_commands(sub)  # client, trace
    add_keys_command(sub)
    add_demo_command(sub)
    add_http_command(sub)  # http: the OpenAI-compatible front (server/http/)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `rocforge`; the exit status (0, 1, 2, 130) as server/command_line.py says."""

    def command() -> int:
        args = build_parser().parse_args(argv)
        export_locations(args)
        return args.func(args)

    return run(command, "rocforge")
