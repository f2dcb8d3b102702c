"""The wheel's build: what pyproject.toml declares, plus the kernels' code objects for the
targets ROCFORGE_PREBUILT_TARGETS names (comma-separated; `make wheel` names
rocforge_rt.backends.WHEEL_TARGETS), compiled by `rocforge kernels build --out` into the
wheel's rocforge_rt/_prebuilt. The compile runs this source tree with the building Python,
so build without isolation in an environment that has the package's dependencies and the
targets' compilers (pip wheel --no-build-isolation, as `make wheel` does)."""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

TARGETS_ENV = "ROCFORGE_PREBUILT_TARGETS"
SOURCE = Path(__file__).resolve().parent


class BuildPyWithCodeObjects(build_py):
    """build_py, then the code objects of each target in ROCFORGE_PREBUILT_TARGETS (none
    for an editable install)."""

    def run(self) -> None:
        super().run()
        targets = [t.strip() for t in os.environ.get(TARGETS_ENV, "").split(",") if t.strip()]
        if not targets or self.editable_mode:
            return
        out = Path(self.build_lib) / "rocforge_rt" / "_prebuilt"
        command = [sys.executable, "-m", "rocforge_rt.cli", "kernels", "build", "--out", str(out)]
        for target in targets:
            command += ["--target", target]
        env = {
            **os.environ,
            "PYTHONPATH": str(SOURCE),
            "ROCFORGE_KERNELS_DIR": str(SOURCE / "kernels"),
        }
        subprocess.run(command, check=True, env=env)


setup(cmdclass={"build_py": BuildPyWithCodeObjects})
