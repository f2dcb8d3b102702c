"""rocforge-rt: GGUF Q4_0 inference runtime with fused GPU kernels and a ZeroMQ daemon."""

__version__ = "0.1.0"
