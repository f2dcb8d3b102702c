"""Where rocforge-rt keeps its files: a source checkout's models/ and its kernels/ as they
were, the user's data and cache folders where installed, each moved by its variable."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import rocforge_rt
from rocforge_rt import dirs
from rocforge_rt.backends.gpu.kernel_library import KernelLibrary, kernels_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (dirs.MODELS_ENV, dirs.CACHE_ENV, "ROCFORGE_KERNELS_DIR"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def installed(clean_environment: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """As where the package is installed (no checkout around it), the XDG folders in tmp."""
    clean_environment.setattr(dirs, "checkout_root", lambda: None)
    clean_environment.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    clean_environment.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def test_a_checkout_keeps_its_models_and_downloads_in_models(clean_environment) -> None:
    assert dirs.checkout_root() == ROOT
    assert dirs.models_dir() == ROOT / "models"
    assert dirs.downloads_dir() == ROOT / "models" / ".cache"
    assert kernels_dir() == ROOT / "kernels"


@pytest.mark.skipif(sys.platform != "linux", reason="the XDG folders are Linux's")
def test_installed_models_go_to_the_user_data_folder_and_the_rest_to_its_cache(
    installed: Path,
) -> None:
    assert dirs.models_dir() == installed / "data" / "rocforge-rt" / "models"
    cache = installed / "cache" / "rocforge-rt"
    assert dirs.cache_dir() == cache
    assert dirs.downloads_dir() == cache / "downloads"
    assert dirs.kernel_cache_dir() == cache / "kernels"
    assert dirs.numba_cache_dir() == cache / "numba"


def test_installed_kernel_sources_are_the_package_data(installed: Path) -> None:
    assert kernels_dir() == Path(rocforge_rt.__file__).parent / "_kernels"


def test_each_variable_moves_its_folders(installed: Path, monkeypatch) -> None:
    monkeypatch.setenv(dirs.MODELS_ENV, str(installed / "m"))
    monkeypatch.setenv(dirs.CACHE_ENV, str(installed / "c"))
    monkeypatch.setenv("ROCFORGE_KERNELS_DIR", str(installed / "k"))
    assert dirs.models_dir() == installed / "m"
    assert dirs.downloads_dir() == installed / "c" / "downloads"
    assert dirs.kernel_cache_dir() == installed / "c" / "kernels"
    assert dirs.numba_cache_dir() == installed / "c" / "numba"
    assert kernels_dir() == installed / "k"


def test_a_checkout_with_models_moved_downloads_into_the_cache(clean_environment, tmp_path):
    clean_environment.setenv(dirs.MODELS_ENV, str(tmp_path / "m"))
    clean_environment.setenv(dirs.CACHE_ENV, str(tmp_path / "c"))
    assert dirs.downloads_dir() == tmp_path / "c" / "downloads"


def test_the_kernel_library_caches_in_the_cache_folder(clean_environment, tmp_path) -> None:
    clean_environment.setenv(dirs.CACHE_ENV, str(tmp_path))
    library = KernelLibrary(compiler=object())  # type: ignore[arg-type]
    assert library.cache_dir == tmp_path / "kernels"
    assert library.source_dir == ROOT / "kernels"


@pytest.mark.parametrize("user_set", [False, True])
def test_numba_caches_in_the_cache_folder_unless_the_user_says_otherwise(
    tmp_path: Path, user_set: bool
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", dirs.CACHE_ENV)}
    env[dirs.CACHE_ENV] = str(tmp_path / "cache")
    if user_set:
        env["NUMBA_CACHE_DIR"] = str(tmp_path / "mine")
    code = "import os, rocforge_rt.backends; print(os.environ['NUMBA_CACHE_DIR'])"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    expected = tmp_path / "mine" if user_set else tmp_path / "cache" / "numba"
    assert done.stdout.strip() == str(expected)
