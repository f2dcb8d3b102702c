"""The vendor GEMM: cuBLAS (through nvmath-python) or hipBLAS (through hip-python).

One operation, the one the prompt path needs: out (fp32, row-major [rows, n]) =
x (fp16 [rows, k]) · W^T (fp16 [n, k]), fp32 accumulation, optionally added to
what out holds. In the libraries' column-major terms that is C[n, rows] =
op(A) · B with A = W read transposed (lda = k), B = x (ldb = k), C = out (ldc =
the row pitch of out in elements, so a slab of W's rows writes a column band).
The output may be fp16 (the SwiGLU path keeps gate|up in fp16).

Each library is imported when a GEMM handle is made, so this module imports
anywhere; a missing library raises `BackendError` naming the extra to install.
The handle works on the backend's stream with a workspace the backend owns, so
no call allocates (which also keeps a GEMM legal under stream capture); like the
driver, it lives as long as the process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from rocforge_rt.errors import BackendError

WORKSPACE_BYTES = 32 * 1024 * 1024  # the libraries' scratch for split-K and the like


class VendorGemm(ABC):
    """An fp16 GEMM handle bound to one stream; see the module docstring for the layout.

    A vendor class sets the handle and its library's values for the arguments (the
    transpose codes, the fp16/fp32 types, fp32 compute, the default algorithm) and runs
    the library's GemmEx, whose arguments both vendors take in the same order.
    """

    library: str  # 'cublas' | 'hipblas'
    _handle: Any
    _op_t: Any
    _op_n: Any
    _f16: Any
    _f32: Any
    _compute_32f: Any
    _default_algo: Any

    def __init__(self) -> None:
        # Host scalars (the handle's default pointer mode), kept alive with the handle.
        self._one = np.ones(1, dtype=np.float32)
        self._zero = np.zeros(1, dtype=np.float32)

    def gemm(
        self,
        *,
        n: int,
        rows: int,
        k: int,
        w_ptr: int,
        x_ptr: int,
        out_ptr: int,
        out_pitch: int,
        accumulate: bool = False,
        out_f16: bool = False,
    ) -> None:
        """out[r, j] (+)= sum_i x[r, i] * W[j, i] (r < rows, j < n); out rows `out_pitch` apart."""
        beta = self._one if accumulate else self._zero
        self._gemm_ex(
            (n, rows, k),
            self._handle,
            self._op_t,
            self._op_n,
            n,
            rows,
            k,
            self._one.ctypes.data,
            w_ptr,
            self._f16,
            k,
            x_ptr,
            self._f16,
            k,
            beta.ctypes.data,
            out_ptr,
            self._f16 if out_f16 else self._f32,
            out_pitch,
            self._compute_32f,
            self._default_algo,
        )

    @abstractmethod
    def _gemm_ex(self, shape: tuple[int, int, int], *args: Any) -> None:
        """Run the library's GemmEx with `args`; BackendError (naming `shape`) on failure."""


class CublasGemm(VendorGemm):
    """cublasGemmEx through nvmath-python's low-level bindings."""

    library = "cublas"

    def __init__(self, stream_handle: Any, workspace_ptr: int, workspace_bytes: int) -> None:
        super().__init__()
        try:
            import nvmath
            from nvmath.bindings import cublas
        except ImportError as exc:
            raise BackendError(
                f"cuBLAS bindings are unavailable ({exc}); install the extra: "
                "pip install 'rocforge-rt[cuda]'"
            ) from exc
        self._cublas = cublas
        self._op_t, self._op_n = cublas.Operation.T, cublas.Operation.N
        self._f16 = int(nvmath.CudaDataType.CUDA_R_16F)
        self._f32 = int(nvmath.CudaDataType.CUDA_R_32F)
        self._compute_32f = cublas.ComputeType.COMPUTE_32F
        self._default_algo = cublas.GemmAlgo.DEFAULT
        try:
            self._handle = cublas.create()
            cublas.set_stream(self._handle, int(stream_handle))
            cublas.set_workspace(self._handle, workspace_ptr, workspace_bytes)
        except Exception as exc:  # cuBLASError, or no libcublas found
            raise BackendError(f"cuBLAS could not start: {exc}") from exc

    def _gemm_ex(self, shape: tuple[int, int, int], *args: Any) -> None:
        try:
            self._cublas.gemm_ex(*args)
        except self._cublas.cuBLASError as exc:
            raise BackendError(f"cublasGemmEx (n, rows, k = {shape}): {exc}") from exc


class HipblasGemm(VendorGemm):
    """hipblasGemmEx through hip-python's hipblas module."""

    library = "hipblas"

    def __init__(self, stream_handle: Any, workspace_ptr: int, workspace_bytes: int) -> None:
        super().__init__()
        try:
            from hip import hip, hipblas
        except ImportError as exc:
            raise BackendError(
                f"hipBLAS bindings are unavailable ({exc}); install the extra: "
                "pip install 'rocforge-rt[hip]'"
            ) from exc
        self._hipblas = hipblas
        op = hipblas.hipblasOperation_t
        self._op_t, self._op_n = op.HIPBLAS_OP_T, op.HIPBLAS_OP_N
        self._f16, self._f32 = hip.hipDataType.HIP_R_16F, hip.hipDataType.HIP_R_32F
        self._compute_32f = hipblas.hipblasComputeType_t.HIPBLAS_COMPUTE_32F
        self._default_algo = hipblas.hipblasGemmAlgo_t.HIPBLAS_GEMM_DEFAULT
        self._handle = self._check("hipblasCreate", hipblas.hipblasCreate())
        self._check("hipblasSetStream", hipblas.hipblasSetStream(self._handle, stream_handle))
        self._check(
            "hipblasSetWorkspace",
            hipblas.hipblasSetWorkspace(self._handle, workspace_ptr, workspace_bytes),
        )

    def _check(self, name: str, result: Any) -> Any:
        status, *values = result if isinstance(result, tuple) else (result,)
        if status != self._hipblas.hipblasStatus_t.HIPBLAS_STATUS_SUCCESS:
            raise BackendError(f"{name} failed: {getattr(status, 'name', status)}")
        return values[0] if values else None

    def _gemm_ex(self, shape: tuple[int, int, int], *args: Any) -> None:
        self._check(f"hipblasGemmEx (n, rows, k = {shape})", self._hipblas.hipblasGemmEx(*args))


def open_vendor_gemm(
    vendor: str, stream_handle: Any, workspace_ptr: int, workspace_bytes: int
) -> VendorGemm:
    """The vendor's GEMM on this stream ('cuda': cuBLAS, 'hip': hipBLAS)."""
    kind = {"cuda": CublasGemm, "hip": HipblasGemm}.get(vendor)
    if kind is None:
        raise BackendError(f"no vendor GEMM for {vendor!r}")
    return kind(stream_handle, workspace_ptr, workspace_bytes)
