"""scripts/kernel_registers.py: each kernel's registers, stack and spills from ptxas's log."""

import pytest
from script_modules import load_script

from rocforge_rt.backends.gpu.kernel_library import KernelLibrary, kernel_names, kernel_source
from rocforge_rt.errors import BackendError

LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'rf_small' for 'sm_90'
ptxas info    : Function properties for rf_small
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 24 registers, used 0 barriers
ptxas info    : Compile time = 17.287 ms
ptxas info    : Compiling entry function 'rf_spilling' for 'sm_90'
ptxas info    : Function properties for rf_spilling
ptxas         .     32 bytes stack frame, 112 bytes spill stores, 40 bytes spill loads
ptxas info    : Used 80 registers, used 1 barriers, 32 bytes cumulative stack size
"""


def test_the_log_gives_each_entry_function_its_registers_stack_and_spills():
    script = load_script("kernel_registers")
    found = script.parse_ptxas_log(LOG)
    assert found == {
        "rf_small": script.KernelResources(24, 0, 0, 0),
        "rf_spilling": script.KernelResources(80, 32, 112, 40),
    }


def test_every_kernel_of_a_source_is_reported_within_the_register_file():
    script = load_script("kernel_registers")
    try:
        from rocforge_rt.backends.gpu.cuda import NvrtcCompiler

        compiler = NvrtcCompiler("sm_90")
    except BackendError as exc:
        pytest.skip(f"no NVRTC: {exc}")
    library = KernelLibrary(compiler)
    found = script.source_resources(library, "embedding.hip")
    assert set(found) == set(kernel_names(kernel_source(library.source_dir, "embedding.hip")))
    assert all(1 <= r.registers <= 255 for r in found.values()), found
