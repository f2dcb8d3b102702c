"""Write a random-weight Q4_0 llama GGUF of a known shape, for benchmarks.

example: python scripts/make_synthetic_model.py llama-8b models/llama-8b-synthetic-q4_0.gguf
"""

import argparse
import sys
import time
from pathlib import Path

from rocforge_rt.model.synthetic import SHAPES, write_synthetic_model


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
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = write_synthetic_model(args.shape, args.out, seed=args.seed)
    size_gb = path.stat().st_size / 1e9
    print(f"{path}: {size_gb:.2f} GB in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
