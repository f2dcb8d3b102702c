"""rocforge-rt: GGUF Q4_0 inference runtime with fused GPU kernels and a ZeroMQ daemon."""

import os

# OpenBLAS's idle workers spin for 2^28 cycles (~0.1 s) after each call by default, holding a
# core numba's kernels then need: on 2 cores, 2^4 cycles made a 128-token SmolLM2 prefill
# 990 -> 450 ms and decode 37.6 -> 44.9 tok/s, when the CPU backend's attention was BLAS
# products. Now only its float32 paths (F16/F32 weights, activations="f32") call BLAS
# between the kernels. OpenBLAS reads it once, when it loads: this takes effect where
# rocforge_rt is imported before numpy (the CLI, the daemon, the scripts); a value in the
# environment wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

__version__ = "0.1.0"  # the distribution's version (pyproject.toml reads it)
