"""`rocforge convert` (requantize a GGUF to Q4_0) and `rocforge models default` (build the
default model)."""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rocforge_rt.cli.options import add_location_options


def _cmd_convert(args: argparse.Namespace) -> int:
    from rocforge_rt.model.convert import convert_to_q4_0

    report = convert_to_q4_0(Path(args.input), Path(args.output), progress=not args.quiet)
    print(report.format(), file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    print(f"wrote {report.path}", file=sys.stderr)
    return 0


def _cmd_models_default(args: argparse.Namespace) -> int:
    from rocforge_rt.model.default_model import ensure_default_model

    print(ensure_default_model(progress=not args.quiet))
    return 0


def add_model_commands(sub: Any) -> None:
    """Register `convert` and `models` on the `rocforge` subparsers."""
    conv = sub.add_parser(
        "convert",
        help="requantize a llama GGUF (any type gguf.quants reads: K-quants, Q8_0, F16, ...)"
        " to the runtime's Q4_0 layout; prints the requantization error per type",
    )
    conv.add_argument("input", help="the GGUF to convert")
    conv.add_argument("output", help="the Q4_0 GGUF to write (replaced only once complete)")
    conv.add_argument("--quiet", action="store_true", help="no progress bar")
    conv.add_argument("--json", action="store_true", help="also print the report as JSON (stdout)")
    conv.set_defaults(func=_cmd_convert)

    models = sub.add_parser("models", help="manage models")
    models_sub = models.add_subparsers(
        dest="models_command", required=True, title="commands", metavar="COMMAND"
    )
    default = models_sub.add_parser(
        "default",
        help="build the default model in the models folder and print its path (idempotent)",
    )
    default.add_argument("--quiet", action="store_true", help="no progress bars")
    add_location_options(default)
    default.set_defaults(func=_cmd_models_default)
