"""The options several `rocforge` commands share: the model, backend, threads, batch
invariance and KV cache format; the prompt and sampling; the models and cache folders. And
`CommandError`, a command's refusal of its arguments."""

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from rocforge_rt.dirs import CACHE_ENV, MODELS_ENV, cache_dir, models_dir, point_numba_cache
from rocforge_rt.errors import UsageError
from rocforge_rt.step.kv_format import KV_DTYPES


class CommandError(UsageError):
    """A command cannot run with these arguments (the message says why and what to do)."""


BATCH_INVARIANT_HELP = (
    "GPU: a token's logits identical alone, batched or in a prompt chunk (prompt chunks on"
    " the int8 GEMM instead of cuBLAS/hipBLAS in fp16: slower prompts)"
)


THREADS_HELP = "CPU backend threads (default: the physical cores); other backends ignore it"
MODEL_HELP = "GGUF path (default: the SmolLM2 Q4_0 default model, built on first use)"
BACKEND_HELP = "auto: a GPU if any, else cpu"
KV_CACHE_DTYPE_HELP = (
    "the KV cache's elements: f16, or fp8 (E4M3, as vLLM's fp8: half the KV memory, lossy)"
)


def add_kv_cache_dtype_option(parser: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype: the KV pool's format (step/kv_format.py), f16 by default."""
    parser.add_argument(
        "--kv-cache-dtype", choices=KV_DTYPES, default="f16", help=KV_CACHE_DTYPE_HELP
    )


def default_model(path: str | None) -> Path:
    """The GGUF at `path`, or the default model (built on first use) where none is given."""
    from rocforge_rt.model.default_model import ensure_default_model

    return Path(path) if path else ensure_default_model()


def prompt_argument(text: str) -> str:
    """--prompt: the text, or all of stdin for `-`."""
    return sys.stdin.read() if text == "-" else text


def prompt_file(path: str) -> str:
    """--prompt-file: the file's text (UTF-8), as it is."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from None


def add_generation_options(parser: argparse.ArgumentParser) -> None:
    """Prompt, chat and sampling options shared by `generate` and `client generate`."""
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt", type=prompt_argument, metavar="TEXT", help="the prompt; - reads it from stdin"
    )
    prompt.add_argument(
        "--prompt-file",
        dest="prompt",
        type=prompt_file,
        metavar="PATH",
        help="read the prompt from a file (UTF-8, as it is)",
    )
    parser.add_argument("--chat", action="store_true", help="render the prompt as a chat turn")
    parser.add_argument(
        "--system", metavar="TEXT", help="system message for --chat (default: none)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=128, metavar="N", help="tokens to generate at most"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    parser.add_argument(
        "--top-k", type=int, default=0, metavar="K", help="sample among the K most likely (0: all)"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="sample within this probability mass (1: all)"
    )
    # llama.cpp's, as rocforge_rt/step/sampling.py says
    parser.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="0 to 1: tokens less likely than MIN_P times the best one are out (0: off)",
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="> 0: on each of the last 64 tokens of the context (1: off)",
    )
    parser.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="-2 to 2: times each token's count in the last 64 (0: off)",
    )
    parser.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="-2 to 2: once for each token in the last 64 (0: off)",
    )
    parser.add_argument(
        "--seed", type=int, metavar="N", help="sampling seed (default: a random one)"
    )
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop at this text (repeatable) (default: none)",
    )


SAMPLING_OPTIONS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
)


def sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling options of add_generation_options, by the names SamplingParams and the
    protocol's turn fields share."""
    return {name: getattr(args, name) for name in SAMPLING_OPTIONS}


def add_location_options(parser: argparse.ArgumentParser, *, models: bool = True) -> None:
    """--models-dir (where `models` is true) and --cache-dir; `export_locations` applies them."""
    if models:
        parser.add_argument(
            "--models-dir",
            metavar="DIR",
            help=f"the models folder, where the default model is built (default: {models_dir()};"
            f" ${MODELS_ENV} where set)",
        )
    parser.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="the cache folder: compiled kernels, numba's cache, downloads outside a checkout"
        f" (default: {cache_dir()}; ${CACHE_ENV} where set)",
    )


def export_locations(args: argparse.Namespace) -> None:
    """Put --models-dir and --cache-dir in the environment (ROCFORGE_MODELS_DIR,
    ROCFORGE_CACHE_DIR and numba's NUMBA_CACHE_DIR, unless the user set it) before the
    command runs, so that everything it loads or starts (numba, a daemon) uses them."""
    for option, variable in (("models_dir", MODELS_ENV), ("cache_dir", CACHE_ENV)):
        folder = getattr(args, option, None)
        if folder:
            os.environ[variable] = str(Path(folder).absolute())
    point_numba_cache()
