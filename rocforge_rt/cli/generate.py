"""`rocforge generate`: text from a prompt, generated in this process (text to stdout,
figures to stderr)."""

import argparse
import sys
from pathlib import Path
from typing import Any

from rocforge_rt.backends import BACKEND_NAMES
from rocforge_rt.cli.options import (
    BACKEND_HELP,
    BATCH_INVARIANT_HELP,
    MODEL_HELP,
    THREADS_HELP,
    CommandError,
    add_generation_options,
    add_kv_cache_dtype_option,
    add_location_options,
    sampling_options,
)
from rocforge_rt.errors import EngineError
from rocforge_rt.server.command_line import positive_int

MIN_CTX_SIZE = 2  # a prompt token and a generated one


def _ctx_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < MIN_CTX_SIZE:
        raise argparse.ArgumentTypeError(f"must be >= {MIN_CTX_SIZE}, got {value}")
    return value


def _cmd_generate(args: argparse.Namespace) -> int:
    from rocforge_rt.cli.progress import TerminalProgress
    from rocforge_rt.engine.engine import Engine
    from rocforge_rt.engine.generate import Generation
    from rocforge_rt.model.default_model import ensure_default_model
    from rocforge_rt.model.gguf_file import load_model_file
    from rocforge_rt.step.sampling import SamplingParams

    try:
        sampling = SamplingParams(**sampling_options(args))  # a bad value: before the model loads
    except EngineError as exc:
        raise CommandError(exc.message) from None
    model_path = Path(args.model) if args.model else ensure_default_model()
    model = load_model_file(model_path)
    if model.metadata.get("tokenizer.ggml.model") == "none":
        raise CommandError(
            f"{model_path} has no vocabulary (tokenizer.ggml.model = 'none'), so generate"
            " cannot read a text prompt or write text; use a model with a vocabulary"
            " (a model without one serves token ids through `rocforge serve`)"
        )
    if args.chat and not model.metadata.get("tokenizer.chat_template"):
        raise CommandError(
            f"{model_path} has no chat template (tokenizer.chat_template) to render --chat"
            " with; leave --chat out for a plain prompt, or use a model that has one"
        )
    with TerminalProgress() as progress:
        engine = Engine.load(
            model,
            backend=args.backend,
            n_ctx=args.ctx_size,
            batch_invariant=args.batch_invariant,
            threads=args.threads,
            kv_dtype=args.kv_cache_dtype,
            progress=progress,
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


def add_generate_command(sub: Any) -> None:
    """Register `generate` on the `rocforge` subparsers."""
    gen = sub.add_parser("generate", help="generate text from a prompt (text to stdout)")
    gen.add_argument("--model", metavar="PATH", help=MODEL_HELP)
    add_generation_options(gen)
    gen.add_argument(
        "--ctx-size", type=_ctx_size, default=2048, metavar="N", help="context tokens (>= 2)"
    )
    add_kv_cache_dtype_option(gen)
    gen.add_argument("--batch-invariant", action="store_true", help=BATCH_INVARIANT_HELP)
    gen.add_argument("--backend", choices=BACKEND_NAMES, default="auto", help=BACKEND_HELP)
    gen.add_argument("--threads", type=positive_int, metavar="N", help=THREADS_HELP)
    add_location_options(gen)
    gen.set_defaults(func=_cmd_generate)
