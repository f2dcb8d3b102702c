"""Building the kernels ahead of a load: what is missing is compiled in parallel behind a
progress report, a wheel's code objects stand in for compiles whatever the compiler's
version, and a load tells of its long stages (no GPU: a fake compiler and driver)."""

import threading
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from fake_driver import FakeDriver
from gpu_checks import hparams
from test_kernel_abi import FakeCompiler, signatures

from rocforge_rt.backends.gpu.backend import GpuBackend
from rocforge_rt.backends.gpu.kernel_library import KernelLibrary, kernels_dir
from rocforge_rt.engine.engine import Engine
from rocforge_rt.errors import KernelCompileError
from rocforge_rt.profiling.load_progress import COMPILING_KERNELS, UPLOADING_WEIGHTS

SOURCES = sorted(p.name for p in kernels_dir().glob("*.hip"))


class SlowCompiler(FakeCompiler):
    """A fake compiler whose compiles take `seconds` each and note how many overlap; its
    code objects end with its version."""

    def __init__(self, seconds: float = 0.05, version: str = "fake 1") -> None:
        super().__init__()
        self.version = version
        self.seconds = seconds
        self.running = 0
        self.most_at_once = 0
        self._lock = threading.Lock()

    def compile(
        self, source: str, filename: str, headers: Mapping[str, str], defines: Mapping[str, str]
    ) -> bytes:
        with self._lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        time.sleep(self.seconds)
        with self._lock:
            self.running -= 1
        return super().compile(source, filename, headers, defines) + self.version.encode()


class BrokenCompiler(FakeCompiler):
    def compile(self, source, filename, headers, defines) -> bytes:
        if filename == "gemv.hip":
            raise KernelCompileError(f"{filename}: error: expected ';'")
        return super().compile(source, filename, headers, defines)


def test_a_build_compiles_every_missing_source_at_once_and_reports_each(tmp_path: Path) -> None:
    compiler = SlowCompiler()
    library = KernelLibrary(compiler, cache_dir=tmp_path / "cache", prebuilt=tmp_path / "none")
    assert library.missing() == SOURCES
    reports: list[tuple[int, int]] = []
    assert library.build(jobs=4, progress=lambda done, total: reports.append((done, total))) == len(
        SOURCES
    )
    assert reports == [(done, len(SOURCES)) for done in range(len(SOURCES) + 1)]
    assert compiler.most_at_once == 4
    assert library.compiles == len(SOURCES) and library.missing() == []
    assert library.build(progress=lambda *_: pytest.fail("nothing to compile")) == 0
    assert all(library.load(name).origin == "cache" for name in SOURCES)
    assert library.compiles == len(SOURCES)


def test_a_source_that_does_not_compile_fails_the_build_with_its_log(tmp_path: Path) -> None:
    library = KernelLibrary(BrokenCompiler(), cache_dir=tmp_path, prebuilt=tmp_path / "none")
    with pytest.raises(KernelCompileError, match="gemv.hip: error: expected ';'"):
        library.build(jobs=2)
    assert library.missing() == ["gemv.hip"]  # the others were compiled and cached


def test_the_wheels_code_objects_load_whatever_the_compilers_version(tmp_path: Path) -> None:
    """A wheel's objects are keyed without the compiler's version (the user's NVRTC may be
    newer than the one that built the wheel); the cache, keyed with it, comes first."""
    wheel = tmp_path / "wheel"
    built = KernelLibrary(FakeCompiler(), cache_dir=tmp_path / "build-cache", prebuilt=wheel)
    written = built.export_prebuilt(wheel)
    assert sorted(p.name.split(".")[0] for p in wheel.iterdir()) == [Path(s).stem for s in SOURCES]
    assert written == sum(p.stat().st_size for p in wheel.iterdir())

    newer = SlowCompiler(version="fake 2")
    user = KernelLibrary(newer, cache_dir=tmp_path / "user-cache", prebuilt=wheel)
    assert user.missing() == [] and user.build() == 0
    code = user.load("gemv.hip")
    assert (code.origin, code.code) == ("prebuilt", built.load("gemv.hip").code)
    assert user.compiles == 0 and user.prebuilt_hits == 1
    user.compile("gemv.hip")  # now cached under fake 2's key: the cache wins
    assert user.load("gemv.hip").origin == "cache"


def test_a_code_object_the_driver_refuses_is_compiled_here(tmp_path: Path, monkeypatch) -> None:
    """A wheel's object this driver does not take (built by a newer toolkit) is compiled for
    it instead; a refused object that was compiled here is an error."""
    monkeypatch.setenv("ROCFORGE_CACHE_DIR", str(tmp_path / "cache"))
    wheel = tmp_path / "wheel"
    KernelLibrary(FakeCompiler(), cache_dir=tmp_path / "build", prebuilt=wheel).export_prebuilt(
        wheel
    )
    monkeypatch.setattr("rocforge_rt.backends.gpu.kernel_library.prebuilt_dir", lambda: wheel)
    compiler = SlowCompiler(seconds=0, version="fake 2")
    with FakeDriver(signatures()) as driver:
        refused = wheel / next(p.name for p in wheel.iterdir() if p.name.startswith("gemv."))
        driver.refused_code.add(refused.read_bytes())
        GpuBackend(driver, compiler, hparams(), n_slots=1, n_ctx=64, mode="deferred",
                   batch_invariant=True)  # fmt: skip
    assert len(compiler.defines) == 1  # gemv.hip alone was compiled here


def test_a_gpu_backend_tells_of_the_kernels_it_compiles(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ROCFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(
        "rocforge_rt.backends.gpu.kernel_library.prebuilt_dir", lambda: tmp_path / "none"
    )
    heard: list[tuple[str, int, int]] = []

    def build() -> None:
        with FakeDriver(signatures()) as driver:
            GpuBackend(driver, SlowCompiler(seconds=0), hparams(), n_slots=1, n_ctx=64,
                       mode="deferred", batch_invariant=True,
                       progress=lambda *report: heard.append(report))  # fmt: skip

    build()
    n = len(SOURCES)
    assert heard == [(COMPILING_KERNELS, done, n) for done in range(n + 1)]
    heard.clear()
    build()  # a warm start: nothing to tell
    assert heard == []


def test_a_load_tells_of_each_layer_it_uploads(tiny_model: Path) -> None:
    heard: list[tuple[str, int, int]] = []
    engine = Engine.load(tiny_model, backend="cpu", n_ctx=64, threads=1,
                         progress=lambda *report: heard.append(report))  # fmt: skip
    parts = engine.hparams.n_layer + 1
    assert heard == [(UPLOADING_WEIGHTS, done, parts) for done in range(parts + 1)]
