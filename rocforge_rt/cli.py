"""The `rocforge` command: generate, convert, models (and the serving commands: serve, client,
keys, demo, http)."""

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from rocforge_rt.backends import BACKEND_NAMES
from rocforge_rt.errors import RocforgeError
from rocforge_rt.server.cli_commands import (
    BATCH_INVARIANT_HELP,
    THREADS_HELP,
    add_generation_options,
    add_server_commands,
    sampling_options,
    thread_count,
)
from rocforge_rt.server.http.command import add_http_command

MIN_CTX_SIZE = 2  # a prompt token and a generated one


class CommandError(RocforgeError):
    """A command cannot run with these arguments (the message says why and what to do)."""


def _ctx_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < MIN_CTX_SIZE:
        raise argparse.ArgumentTypeError(f"must be >= {MIN_CTX_SIZE}, got {value}")
    return value


def _cmd_generate(args: argparse.Namespace) -> int:
    from rocforge_rt.engine.engine import Engine
    from rocforge_rt.engine.generate import Generation
    from rocforge_rt.model.default_model import ensure_default_model
    from rocforge_rt.model.gguf_file import load_model_file
    from rocforge_rt.step.sampling import SamplingParams

    sampling = SamplingParams(**sampling_options(args))  # a bad value: before the model loads
    model_path = Path(args.model) if args.model else ensure_default_model()
    model = load_model_file(model_path)
    if model.metadata.get("tokenizer.ggml.model") == "none":
        raise CommandError(
            f"{model_path} has no vocabulary (tokenizer.ggml.model = 'none'), so generate"
            " cannot read a text prompt or write text; use a model with a vocabulary"
            " (a model without one serves token ids through `rocforge serve`)"
        )
    engine = Engine.load(
        model,
        backend=args.backend,
        n_ctx=args.ctx_size,
        batch_invariant=args.batch_invariant,
        threads=args.threads,
    )
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompt = engine.tokenizer.encode_chat([*messages, {"role": "user", "content": args.prompt}])
    else:
        prompt = engine.tokenizer.encode(args.prompt)
    generation = Generation(
        engine, prompt, sampling=sampling, stop=args.stop, max_tokens=args.max_tokens
    )
    for event in generation:
        sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = generation.stats
    print(
        f"backend={engine.backend.name} prompt_tokens={s.prompt_tokens}"
        f" generated_tokens={s.generated_tokens} finish_reason={s.finish_reason}\n"
        f"TTFT {s.ttft_s * 1000:.1f} ms | prompt {s.prompt_tokens_per_s:.1f} tok/s"
        f" | decode {s.decode_tokens_per_s:.1f} tok/s",
        file=sys.stderr,
    )
    return 0


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

    print(ensure_default_model(Path(args.models_dir) if args.models_dir else None))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rocforge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt (text to stdout)")
    gen.add_argument("--model", help="GGUF path (default: the SmolLM2 Q4_0 default model)")
    add_generation_options(gen)
    gen.add_argument("--ctx-size", type=_ctx_size, default=2048, help="tokens (>= 2)")
    gen.add_argument("--batch-invariant", action="store_true", help=BATCH_INVARIANT_HELP)
    gen.add_argument("--backend", choices=BACKEND_NAMES, default="auto")
    gen.add_argument("--threads", type=thread_count, help=THREADS_HELP)
    gen.set_defaults(func=_cmd_generate)

    conv = sub.add_parser(
        "convert",
        help="requantize a llama GGUF (any type gguf.quants reads: K-quants, Q8_0, F16, ...)"
        " to the runtime's Q4_0 layout; prints the requantization error per type",
    )
    conv.add_argument("input")
    conv.add_argument("output")
    conv.add_argument("--quiet", action="store_true", help="no progress bar")
    conv.add_argument("--json", action="store_true", help="also print the report as JSON (stdout)")
    conv.set_defaults(func=_cmd_convert)

    models = sub.add_parser("models", help="manage models")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    default = models_sub.add_parser("default", help="build the default model (idempotent)")
    default.add_argument("--models-dir", help="folder for the converted model")
    default.set_defaults(func=_cmd_models_default)

    add_server_commands(sub)  # serve, client, keys, demo
    add_http_command(sub)  # http: the OpenAI-compatible front (server/http/)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RocforgeError as exc:
        print(f"rocforge: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rocforge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
