"""Write a random-weight llama GGUF of a known shape, for benchmarks and conversion tests.

examples:
  python scripts/make_synthetic_model.py llama-8b models/llama-8b-synthetic-q4_0.gguf
  python scripts/make_synthetic_model.py tiny-k models/tiny-k-q4_k_m.gguf --mix q4_k_m --vocab
"""

import argparse
import sys
import time
from pathlib import Path

from rocforge_rt.model.synthetic import MIXES, SHAPES, write_synthetic_model


def main(argv: list[str] | None = None) -> int:
    shapes = "\n".join(
        f"  {name:13} {s.n_embd} wide, {s.n_layer} layers, {s.n_head}/{s.n_head_kv} heads, "
        f"ffn {s.n_ff}, vocab {s.n_vocab}, {'tied' if s.output_type is None else 'untied'}"
        for name, s in SHAPES.items()
    )
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog=f"shapes:\n{shapes}",
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
        "--vocab", action="store_true", help="a small byte-level vocabulary (for generate)"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = write_synthetic_model(
        args.shape, args.out, seed=args.seed, mix=args.mix, vocab=args.vocab
    )
    size_gb = path.stat().st_size / 1e9
    print(f"{path}: {size_gb:.2f} GB in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
