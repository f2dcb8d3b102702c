"""Where rocforge-rt keeps its files: models, downloads, compiled kernels, numba's cache.

Installed (a wheel), nothing is written beside the package: models go to the user data
folder and everything that can be rebuilt to the user cache folder (platformdirs: on Linux
$XDG_DATA_HOME/rocforge-rt/models, default ~/.local/share/rocforge-rt/models, and
$XDG_CACHE_HOME/rocforge-rt, default ~/.cache/rocforge-rt). A source checkout (the
repository's pyproject.toml and models/ beside the package) keeps its models and their
downloads in models/ and models/.cache, as the scripts and docs there expect.

ROCFORGE_MODELS_DIR moves the models (and then the downloads go to the cache folder);
ROCFORGE_CACHE_DIR moves the cache folder: kernels/ (compiled code objects), numba/
(numba's cache of the CPU kernels) and downloads/.
"""

import os
from pathlib import Path

import platformdirs

APP_NAME = "rocforge-rt"
MODELS_ENV = "ROCFORGE_MODELS_DIR"
CACHE_ENV = "ROCFORGE_CACHE_DIR"
NUMBA_CACHE_ENV = "NUMBA_CACHE_DIR"
# numba's cache folder as the user set it when rocforge_rt was first imported (None: unset)
_USER_NUMBA_CACHE_DIR = os.environ.get(NUMBA_CACHE_ENV)


def checkout_root() -> Path | None:
    """The source checkout this package runs from (editable install or PYTHONPATH), or None
    where it is installed."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "models").is_dir() else None


def models_dir() -> Path:
    """Models: $ROCFORGE_MODELS_DIR, else a checkout's models/, else the user data folder's."""
    if os.environ.get(MODELS_ENV):
        return Path(os.environ[MODELS_ENV])
    root = checkout_root()
    if root is not None:
        return root / "models"
    return platformdirs.user_data_path(APP_NAME, appauthor=False) / "models"


def cache_dir() -> Path:
    """Files that can be rebuilt: $ROCFORGE_CACHE_DIR, else the user cache folder."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return platformdirs.user_cache_path(APP_NAME, appauthor=False)


def downloads_dir() -> Path:
    """Downloaded model sources: a checkout's models/.cache while its models/ is in use,
    else the cache folder's downloads/."""
    root = checkout_root()
    if root is not None and not os.environ.get(MODELS_ENV):
        return root / "models" / ".cache"
    return cache_dir() / "downloads"


def kernel_cache_dir() -> Path:
    """Compiled kernel code objects."""
    return cache_dir() / "kernels"


def numba_cache_dir() -> Path:
    """numba's cache of the CPU backend's compiled kernels."""
    return cache_dir() / "numba"


def point_numba_cache() -> None:
    """Set NUMBA_CACHE_DIR to `numba_cache_dir()` unless the user set it; numba reads it when
    it loads. Otherwise numba caches beside the package's modules: in site-packages."""
    if _USER_NUMBA_CACHE_DIR is None:
        os.environ[NUMBA_CACHE_ENV] = str(numba_cache_dir())
