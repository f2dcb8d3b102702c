"""The vendor drivers without their GPU (CI): the name tables, and HIP without a device.

Each vendor's `api_names` must name, for every primitive `Driver` runs through
its generic call, a function its binding module has (checked where the binding
imports). Where no AMD GPU exists, no HIP device is found and the driver says
why: hip-python loads Debian's HIP 5.2 through the repository's ``.rocm``
folder (see ``ensure_rocm_path``); without those libraries these tests skip.
Kernel execution on AMD is only verified where an AMD GPU runs the suite.
"""

import ast
import inspect
from typing import Any

import pytest

from rocforge_rt.backends.gpu import cuda, driver, driver_types, hip
from rocforge_rt.errors import BackendError

DRIVERS = {"cuda": (cuda.CudaDriver, cuda._driver_api), "hip": (hip.HipDriver, hip._hip_api)}


def generic_calls() -> set[str]:
    """The primitives the `Driver` base calls, read from its source: ``self._call("name", ...)``."""
    return {
        node.args[0].value
        for node in ast.walk(ast.parse(inspect.getsource(driver)))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "_call"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }


def binding(vendor: str) -> Any:
    """The vendor's binding module as its driver loads it; skips where it does not import."""
    try:
        return DRIVERS[vendor][1]()
    except BackendError as exc:
        pytest.skip(f"{vendor} binding unavailable: {exc}")


def test_the_base_calls_exactly_the_declared_primitives() -> None:
    assert generic_calls() == set(driver_types.PRIMITIVES)


@pytest.mark.parametrize("vendor", sorted(DRIVERS))
def test_the_name_table_covers_every_generic_call(vendor: str) -> None:
    assert set(DRIVERS[vendor][0].api_names) == generic_calls()


@pytest.mark.parametrize("vendor", sorted(DRIVERS))
def test_every_name_is_a_function_of_the_binding(vendor: str) -> None:
    api = binding(vendor)
    missing = [
        n for n in DRIVERS[vendor][0].api_names.values() if not callable(getattr(api, n, None))
    ]
    assert missing == []


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
