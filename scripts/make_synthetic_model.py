"""Write a random-weight llama GGUF of a known shape, for benchmarks and conversion tests.

examples:
  python scripts/make_synthetic_model.py llama-8b models/llama-8b-synthetic-q4_0.gguf
  python scripts/make_synthetic_model.py tiny-k models/tiny-k-q4_k_m.gguf --mix q4_k_m --vocab
  python scripts/make_synthetic_model.py tiny models/tiny-chat.gguf --vocab --chat-template chatml
"""

import argparse
import sys
import time
from pathlib import Path

from rocforge_rt.model.synthetic import (
    CHATML_TEMPLATE,
    MIXES,
    SHAPES,
    VOCAB_SIZE,
    write_synthetic_model,
)

CHAT_TEMPLATES = {"chatml": CHATML_TEMPLATE}


def chat_template(value: str) -> str:
    """--chat-template: a preset's name, @PATH for a file's text, or the template itself."""
    if value in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[value]
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {value[1:]}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    shapes = "\n".join(
        f"  {name:13} {s.n_embd} wide, {s.n_layer} layers, {s.n_head}/{s.n_head_kv} heads, "
        f"ffn {s.n_ff}, vocab {s.n_vocab}, {'tied' if s.output_type is None else 'untied'}"
        for name, s in SHAPES.items()
    )
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog=f"shapes:\n{shapes}\n\n--vocab raises a shape's vocab to {VOCAB_SIZE} at least.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("shape", metavar="SHAPE", choices=sorted(SHAPES), help="model shape")
    parser.add_argument("out", metavar="OUT", type=Path, help="GGUF file to write")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--mix",
        choices=sorted(MIXES),
        default="q4_0",
        help="tensor types: q4_0 (the runtime's layout, default) or q4_k_m (Q4_K/Q6_K, as"
        " most downloaded GGUFs; needs widths that are multiples of 256, e.g. tiny-k)",
    )
    parser.add_argument(
        "--vocab",
        action="store_true",
        help=f"a small byte-level vocabulary (for generate; {VOCAB_SIZE} tokens at least)",
    )
    parser.add_argument(
        "--chat-template",
        type=chat_template,
        metavar="TEMPLATE",
        help="write this Jinja chat template as tokenizer.chat_template (for --chat; needs"
        f" --vocab): a preset ({', '.join(CHAT_TEMPLATES)}), @PATH to read a file, or the"
        " template's text (default: none)",
    )
    args = parser.parse_args(argv)
    if args.chat_template is not None and not args.vocab:
        parser.error("--chat-template needs --vocab")
    start = time.perf_counter()
    path = write_synthetic_model(
        args.shape,
        args.out,
        seed=args.seed,
        mix=args.mix,
        vocab=args.vocab,
        chat_template=args.chat_template,
    )
    size_gb = path.stat().st_size / 1e9
    print(f"{path}: {size_gb:.2f} GB in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
