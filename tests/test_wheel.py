"""The wheel, installed as a user would: built from the sources, installed with its
dependencies into a fresh virtual environment, run from a folder outside the checkout.

The wheel holds the code objects of the target whose compiler is here (setup.py,
ROCFORGE_PREBUILT_TARGETS). `rocforge --version`, `rocforge generate` on the default model
(the checkout's, linked into the environment's models folder: no second download),
`import rocforge_client` and the kernel compile check (`rocforge kernels check`, which
finds every object in the wheel) succeed there, and write nothing into site-packages:
numba's cache goes to the user cache folder.

Slow: a build and an install from the package index (~1-3 minutes). Without a network or
a `venv` module these tests skip with the reason, except under CI (CI=true), where they fail.
"""

import importlib.metadata
import os
import shutil
import socket
import subprocess
import sys
import venv
import zipfile
from pathlib import Path
from urllib.parse import urlparse

import pytest

from rocforge_rt.backends import kernel_compiler
from rocforge_rt.backends.gpu.hip import rocm_path
from rocforge_rt.errors import BackendError
from rocforge_rt.model.default_model import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "rocforge_rt", "kernels", "clients")
KERNEL_FILES = sorted(p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".hip", ".h"))
# A kernel compiler's packages, installed into the environment at the versions found here.
COMPILERS = {"sm_90": ("cuda-bindings", "nvidia-cuda-nvrtc"), "gfx90a": ("hip-python",)}


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"{reason} (CI is set, so this fails instead of skipping)")
    pytest.skip(reason)


def _index_reachable() -> bool:
    index = urlparse(os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple")
    try:
        socket.create_connection((index.hostname, index.port or 443), timeout=5).close()
    except OSError:
        return False
    return True


def _pip(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)  # fmt: skip
    assert done.returncode == 0, f"pip {' '.join(args)}:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def compiler() -> tuple[str, list[str]] | None:
    return _compiler()


@pytest.fixture(scope="module")
def wheel(
    tmp_path_factory: pytest.TempPathFactory,
    cache_folder: Path,
    compiler: tuple[str, list[str]] | None,
) -> Path:
    """The wheel, built from a copy of the sources (a build in the checkout leaves build/)
    with the code objects of the target whose compiler works here (`make wheel` names more),
    from the session's kernel cache where the compile tests have filled it."""
    if not _index_reachable():
        _unavailable("no network: the build and the install need the package index")
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "ROCFORGE_CACHE_DIR": str(cache_folder),
           "ROCFORGE_PREBUILT_TARGETS": compiler[0] if compiler else ""}  # fmt: skip
    _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src), env=env)
    (built,) = dist.glob("rocforge_rt-*.whl")
    return built


def _compiler() -> tuple[str, list[str]] | None:
    """A target whose compiler works here, and its packages pinned to the versions here."""
    for target, packages in COMPILERS.items():
        try:
            kernel_compiler(target)
        except BackendError:
            continue
        return target, [f"{p}=={importlib.metadata.version(p)}" for p in packages]
    return None


class Environment:
    """A fresh virtual environment with the wheel installed, and a user's folders."""

    def __init__(self, root: Path, wheel: Path, compiler: tuple[str, list[str]] | None) -> None:
        try:
            venv.EnvBuilder(with_pip=False).create(root / "venv")
        except (OSError, subprocess.CalledProcessError) as exc:
            _unavailable(f"venv cannot make an environment: {exc}")
        self.bin = root / "venv" / "bin"
        self.target = compiler[0] if compiler else None  # for `rocforge kernels check`
        packages = compiler[1] if compiler else []
        _pip("--python", str(self.bin / "python"), "install", "-q", str(wheel), *packages)
        self.work = root / "work"  # the current folder: outside the checkout
        self.cache = root / "cache"
        self.models = root / "models"
        for folder in (self.work, self.models):
            folder.mkdir()
        self.env = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith(("ROCFORGE_", "NUMBA_", "PYTHON", "VIRTUAL_ENV", "XDG_"))
        }
        self.env.update(
            PATH=f"{self.bin}{os.pathsep}{os.environ['PATH']}",
            XDG_CACHE_HOME=str(self.cache),
            XDG_DATA_HOME=str(root / "data"),
            ROCFORGE_MODELS_DIR=str(self.models),
        )
        if rocm_path() is not None:
            self.env["ROCM_PATH"] = rocm_path()
        purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
        self.site_packages = Path(self.output("python", "-c", purelib).strip())

    def run(self, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.bin / command[0]), *command[1:]],
            cwd=self.work,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    def output(self, *command: str) -> str:
        done = self.run(*command)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def site_files(self) -> set[str]:
        return {str(p.relative_to(self.site_packages)) for p in self.site_packages.rglob("*")}


@pytest.fixture(scope="module")
def installed(
    wheel: Path,
    default_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    compiler: tuple[str, list[str]] | None,
) -> Environment:
    """The environment, with the checkout's default model in its models folder."""
    env = Environment(tmp_path_factory.mktemp("user"), wheel, compiler)
    (env.models / DEFAULT_MODEL_NAME).symlink_to(default_model)
    return env


def test_the_wheel_holds_the_two_packages_every_kernel_source_and_code_objects(
    wheel: Path, compiler: tuple[str, list[str]] | None
) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {
        "rocforge_rt",
        "rocforge_client",
        f"rocforge_rt-{importlib.metadata.version('rocforge-rt')}.dist-info",
    }
    kernels = sorted(n.removeprefix("rocforge_rt/_kernels/") for n in names if "/_kernels/" in n)
    assert kernels == KERNEL_FILES
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "rocforge_rt").rglob("*.py")}
    assert modules <= set(names), f"left out: {sorted(modules - set(names))}"
    clients = {f"rocforge_client/{p.name}" for p in (ROOT / "clients").glob("*.py")}
    assert clients <= set(names), f"left out: {sorted(clients - set(names))}"
    objects = sorted(n.removeprefix("rocforge_rt/_prebuilt/") for n in names if "/_prebuilt/" in n)
    if compiler is None:
        assert objects == []
    else:  # one a source: gemv.cuda-sm_90.<sha256 of the source, its headers and defines>
        stems = [n.removesuffix(".hip") for n in KERNEL_FILES if n.endswith(".hip")]
        vendor = "cuda" if compiler[0].startswith("sm_") else "hip"
        assert [n.rsplit(".", 1)[0] for n in objects] == [
            f"{s}.{vendor}-{compiler[0]}" for s in stems
        ]


def test_installed_it_runs_outside_the_checkout_and_writes_nothing_beside_itself(
    installed: Environment,
) -> None:
    env = installed
    before = env.site_files()

    version = env.output("rocforge", "--version")
    release = importlib.metadata.version("rocforge-rt")
    assert version.startswith(f"rocforge {release} from {env.site_packages / 'rocforge_rt'}")

    generated = env.run("rocforge", "generate", "--prompt", "hi", "--max-tokens", "8")
    assert generated.returncode == 0, generated.stderr
    assert "backend=cpu" in generated.stderr and "generated_tokens=" in generated.stderr
    assert "rebuilding" not in generated.stderr  # the linked default model passed its check

    client = env.output("python", "-c", "import rocforge_client; print(rocforge_client.__file__)")
    assert client.startswith(str(env.site_packages))
    assert env.run("python", "-c", "import clients").returncode != 0

    target = ["--target", env.target] if env.target else []
    check = env.run("rocforge", "kernels", "check", *target)
    assert f"kernel sources: {env.site_packages / 'rocforge_rt' / '_kernels'}" in check.stdout
    if env.target:  # the wheel's code objects: nothing to compile
        assert check.returncode == 0, check.stderr
        sources = sum(name.endswith(".hip") for name in KERNEL_FILES)
        assert f"{env.target}: {sources} sources" in check.stdout
        assert f"(0 compiled, 0 cached, {sources} from the wheel)" in check.stdout
    else:
        assert check.returncode == 1 and "no kernel compiler found" in check.stderr

    assert env.site_files() == before
    assert list((env.cache / "rocforge-rt" / "numba").rglob("*.nbi"))  # numba's cache index
