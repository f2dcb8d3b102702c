"""The backend contract (backends/contract.py): every backend is a `Backend`, says what it
can do in a frozen `BackendCaps`, and is built from typed `BackendOptions`; the engine and
the server use no member of a backend that `Backend` does not declare."""

import ast
import dataclasses
from pathlib import Path
from typing import Protocol

import pytest
from fake_driver import FakeDriver
from gpu_checks import hparams
from test_kernel_abi import FakeCompiler, signatures

from rocforge_rt.backends import Backend, BackendCaps, BackendOptions, create_backend
from rocforge_rt.backends.cpu import CpuBackend
from rocforge_rt.backends.gpu.backend import MIN_LOGIT_ROWS, GpuBackend
from rocforge_rt.engine.engine import Engine

PACKAGE = Path(__file__).resolve().parents[1] / "rocforge_rt"


def declared_members(protocol: type) -> set[str]:
    """The names a Protocol declares, its bases' included."""
    return {
        name
        for cls in protocol.__mro__
        if cls not in (Protocol, object) and Protocol in cls.__mro__
        for name in (*vars(cls), *vars(cls).get("__annotations__", {}))
        if not name.startswith("_")
    }


def backend_members_used(source: str) -> set[str]:
    """Members read off a name `backend` or an attribute `.backend` (`self.backend.caps`,
    `engine.backend.device_info`)."""
    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "backend") or (
                isinstance(owner, ast.Attribute) and owner.attr == "backend"
            ):
                used.add(node.attr)
    return used


def test_the_engine_and_the_server_use_only_members_the_contract_declares() -> None:
    used = {
        member: path.relative_to(PACKAGE.parent)
        for folder in ("engine", "server")
        for path in sorted((PACKAGE / folder).rglob("*.py"))
        for member in backend_members_used(path.read_text())
    }
    undeclared = {m: str(where) for m, where in used.items() if m not in declared_members(Backend)}
    assert not undeclared, f"backend members used but not declared by Backend: {undeclared}"
    assert {"caps", "run_step", "device_info"} <= set(used)  # the walk finds what is there


def test_the_cpu_backend_is_a_backend_with_no_launches_and_no_step_limits() -> None:
    cpu = CpuBackend(hparams(), 2, 16, lookahead=True, kv_dtype="fp8")
    assert isinstance(cpu, Backend)
    assert cpu.caps == BackendCaps(
        ragged_steps=True,
        lookahead=True,
        batch_invariant=True,
        max_tokens=None,
        max_logit_rows=None,
        kv_dtype="fp8",
    )
    assert (cpu.launch_tracker, cpu.kernel_timer, cpu.runtime_stats()) == (None, None, None)


def test_a_gpu_backend_is_a_backend_whose_caps_are_its_options() -> None:
    with FakeDriver(signatures()) as driver:
        gpu = GpuBackend(driver, FakeCompiler(), hparams(), n_slots=2, n_ctx=64, max_tokens=8,
                         batch_invariant=True, lookahead=False)  # fmt: skip
        assert isinstance(gpu, Backend)
        assert gpu.caps == BackendCaps(
            ragged_steps=True,
            lookahead=False,
            batch_invariant=True,
            max_tokens=8,
            max_logit_rows=min(8, MIN_LOGIT_ROWS),
            kv_dtype="f16",
        )
        assert gpu.launch_tracker is not None and gpu.kernel_timer is not None
        assert gpu.runtime_stats() is not None


def test_caps_are_frozen() -> None:
    caps = CpuBackend(hparams(), 1, 16).caps
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.max_tokens = 4  # type: ignore[misc]


def test_a_misspelt_option_is_a_value_error_naming_it(tiny_model) -> None:
    with pytest.raises(ValueError, match="unknown backend option 'batch_invarient'"):
        BackendOptions.of(batch_invarient=True)
    with pytest.raises(ValueError, match="'kv_type'"):
        Engine.load(tiny_model, backend="cpu", n_ctx=16, kv_type="fp8")


def test_the_cpu_backend_ignores_the_gpu_options() -> None:
    """The command line gives the same options whatever the backend: the CPU takes the
    GPU's step mode, token limit, batch invariance and lookahead without complaint (it has
    no modes or limits, is batch invariant anyway, and takes no part in pipelined decode)."""
    gpu_only = BackendOptions(max_tokens=4, mode="deferred", overlap=False, lookahead=True)
    cpu = create_backend("cpu", hparams(), n_slots=1, n_ctx=16, options=gpu_only)
    assert cpu.caps.max_tokens is None and not cpu.caps.lookahead and cpu.caps.batch_invariant
