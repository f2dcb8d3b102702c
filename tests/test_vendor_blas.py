"""The vendor GEMM's bindings (backends/gpu/vendor_blas.py), checked without a GPU.

What it calls must exist in the installed binding (a renamed enum would only show on a
device), and a missing binding is a BackendError that names the extra to install.
"""

import sys

import pytest

from rocforge_rt.backends.gpu.vendor_blas import CublasGemm, HipblasGemm, open_vendor_gemm
from rocforge_rt.errors import BackendError


def test_cublas_binding_has_every_name_the_gemm_uses() -> None:
    pytest.importorskip("nvmath.bindings.cublas")
    import nvmath
    from nvmath.bindings import cublas

    for name in ("create", "set_stream", "set_workspace", "gemm_ex", "cuBLASError"):
        assert callable(getattr(cublas, name)), name
    assert (cublas.Operation.N, cublas.Operation.T) == (0, 1)
    assert cublas.ComputeType.COMPUTE_32F == 68 and cublas.GemmAlgo.DEFAULT == -1
    assert (nvmath.CudaDataType.CUDA_R_32F, nvmath.CudaDataType.CUDA_R_16F) == (0, 2)


def test_hipblas_binding_has_every_name_the_gemm_uses() -> None:
    hip_python = pytest.importorskip("hip")  # hip-python[libraries] re-exports hipblas
    hip, hipblas = hip_python.hip, hip_python.hipblas

    for name in ("hipblasCreate", "hipblasSetStream", "hipblasSetWorkspace", "hipblasGemmEx"):
        assert callable(getattr(hipblas, name)), name
    assert hipblas.hipblasOperation_t.HIPBLAS_OP_T != hipblas.hipblasOperation_t.HIPBLAS_OP_N
    assert hipblas.hipblasStatus_t.HIPBLAS_STATUS_SUCCESS == 0
    assert hipblas.hipblasComputeType_t.HIPBLAS_COMPUTE_32F is not None
    assert hipblas.hipblasGemmAlgo_t.HIPBLAS_GEMM_DEFAULT is not None
    assert (hip.hipDataType.HIP_R_32F, hip.hipDataType.HIP_R_16F) == (0, 2)


@pytest.mark.parametrize(
    ("gemm", "hidden", "extra"),
    [(CublasGemm, "nvmath", "rocforge-rt[cuda]"), (HipblasGemm, "hip", "rocforge-rt[hip]")],
)
def test_a_missing_binding_is_a_backend_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, gemm: type, hidden: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, hidden, None)  # import fails as if not installed
    with pytest.raises(BackendError, match=extra.replace("[", r"\[").replace("]", r"\]")):
        gemm(0, 0, 0)


def test_an_unknown_vendor_has_no_vendor_gemm() -> None:
    with pytest.raises(BackendError, match="no vendor GEMM for 'fake'"):
        open_vendor_gemm("fake", 0, 0, 0)
