"""The repository's scripts (scripts/<name>.py) as modules, for their tests.

scripts/ goes on sys.path, as `python scripts/<name>.py` has it: the scripts import their
shared harness (bench_harness) and each other by module name."""

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py executed as module `name`, registered in sys.modules (where its
    dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def import_script(name: str) -> ModuleType:
    """scripts/<name>.py imported once by name: the same module the scripts import (a script
    module they share, such as bench_harness, whose classes and attributes tests use)."""
    return importlib.import_module(name)
