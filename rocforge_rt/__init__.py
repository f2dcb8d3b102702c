"""rocforge-rt: GGUF Q4_0 inference runtime with fused GPU kernels and a ZeroMQ daemon."""

import os

# OpenBLAS's idle workers spin for 2^28 cycles after each call by default, holding a core
# numba's kernels then need; 2^4 cycles sped up prefill and decode on 2 cores
# (docs/performance.md). Only the CPU backend's float32 paths (F16/F32 weights,
# activations="f32") call BLAS between the kernels now. OpenBLAS reads it once, when it
# loads: this takes effect where rocforge_rt is imported before numpy (the CLI, the daemon,
# the scripts); a value in the environment wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

__version__ = "0.1.0"  # the distribution's version (pyproject.toml reads it)
