"""The HIP driver where no AMD GPU exists (CI): no device is found, and the driver says why.

On such a machine hip-python loads Debian's HIP 5.2 through the repository's
``.rocm`` folder (see ``ensure_rocm_path``); without those libraries these
tests skip. Kernel execution on AMD is only verified where an AMD GPU runs the
suite.
"""

import pytest

from rocforge_rt.backends.gpu import hip
from rocforge_rt.errors import BackendError


@pytest.fixture(scope="module")
def hip_runtime() -> None:
    pytest.importorskip("hip", reason="hip-python is not installed")
    if hip.rocm_path() is None:
        pytest.skip("no HIP runtime: set ROCM_PATH or run scripts/install_hip_sdk.sh")
    if hip.device_count() > 0:
        pytest.skip("an AMD GPU is present")


def test_no_device_is_counted_as_zero(hip_runtime: None) -> None:
    assert hip.device_count() == 0


def test_driver_names_the_failing_call_and_code(hip_runtime: None) -> None:
    failure = r"(hipInit|hipGetDeviceCount) failed: hipError\w+ \(\d+\)"
    with pytest.raises(BackendError, match=failure):
        hip.HipDriver()
