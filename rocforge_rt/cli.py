"""The `rocforge` command: generate, convert, models, kernels (and the serving commands:
serve, client, trace, keys, demo, http)."""

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import rocforge_rt
from rocforge_rt.backends import BACKEND_NAMES, KERNEL_TARGETS
from rocforge_rt.dirs import cache_dir, downloads_dir, models_dir
from rocforge_rt.errors import BackendError, EngineError, UsageError
from rocforge_rt.server.cli_commands import (
    BACKEND_HELP,
    BATCH_INVARIANT_HELP,
    MODEL_HELP,
    THREADS_HELP,
    add_generation_options,
    add_kv_cache_dtype_option,
    add_location_options,
    add_server_commands,
    export_locations,
    sampling_options,
)
from rocforge_rt.server.command_line import Parser, positive_int, run
from rocforge_rt.server.http.command import add_http_command

MIN_CTX_SIZE = 2  # a prompt token and a generated one
DESCRIPTION = """\
Run GGUF Q4_0 llama-family models on a CUDA or HIP GPU, or on the CPU: generate text,
convert models, serve them over ZeroMQ and an OpenAI-compatible HTTP API."""


class CommandError(UsageError):
    """A command cannot run with these arguments (the message says why and what to do)."""


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
    engine = Engine.load(
        model,
        backend=args.backend,
        n_ctx=args.ctx_size,
        batch_invariant=args.batch_invariant,
        threads=args.threads,
        kv_dtype=args.kv_cache_dtype,
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

    print(ensure_default_model(progress=not args.quiet))
    return 0


def _cmd_kernels_check(args: argparse.Namespace) -> int:
    """Compile every kernel source for each target whose compiler is installed."""
    from rocforge_rt.backends import kernel_compiler
    from rocforge_rt.backends.gpu.kernel_library import KernelLibrary, kernels_dir

    print(f"kernel sources: {kernels_dir()}")
    checked = 0
    for target in args.target or KERNEL_TARGETS:
        try:
            compiler = kernel_compiler(target)
        except ValueError as exc:
            raise CommandError(f"--target {target}: {exc}") from None
        except BackendError as exc:
            if args.target:  # asked for by name: it must compile
                raise
            print(f"{target}: skipped, no compiler: {exc}")
            continue
        library = KernelLibrary(compiler)
        started = time.perf_counter()
        objects = library.load_all()  # KernelCompileError: the compiler's log, exit 1
        kernels = sum(len(code.kernels) for code in objects.values())
        print(
            f"{target}: {len(objects)} sources, {kernels} kernels ({library.compiles} compiled,"
            f" {library.cache_hits} cached) in {time.perf_counter() - started:.1f} s"
            f" [{compiler.version}]"
        )
        checked += 1
    if not checked:
        raise BackendError(
            "no kernel compiler found: pip install 'rocforge-rt[cuda]' (NVRTC) or"
            " 'rocforge-rt[hip]' (hiprtc, with the HIP libraries under $ROCM_PATH)"
        )
    return 0


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

    kernels = sub.add_parser("kernels", help="the GPU kernels: check that they compile")
    kernels_sub = kernels.add_subparsers(
        dest="kernels_command", required=True, title="commands", metavar="COMMAND"
    )
    check = kernels_sub.add_parser(
        "check",
        help="compile every kernel source for each target whose compiler (NVRTC, hiprtc) is"
        " installed; no GPU needed",
    )
    check.add_argument(
        "--target",
        action="append",
        metavar="ARCH",
        help="a target that must compile, e.g. sm_90, gfx90a (repeatable) (default: each of"
        f" {', '.join(KERNEL_TARGETS)} that has a compiler)",
    )
    add_location_options(check, models=False)
    check.set_defaults(func=_cmd_kernels_check)

    add_server_commands(sub)  # serve, client, trace, keys, demo
    add_http_command(sub)  # http: the OpenAI-compatible front (server/http/)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `rocforge`; the exit status (0, 1, 2, 130) as server/command_line.py says."""

    def command() -> int:
        args = build_parser().parse_args(argv)
        export_locations(args)
        return args.func(args)

    return run(command, "rocforge")


if __name__ == "__main__":
    sys.exit(main())
