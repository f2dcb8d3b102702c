"""Stand-ins for the llama.cpp tools the benchmark scripts run: Python scripts written as
executables (templates take {python}, the interpreter running the tests)."""

import sys
from pathlib import Path

# How a fake tool starts: it appends its argv (one JSON line) to the .log beside it, and
# reads its "-flag value" pairs into `arg`.
LOGGED_ARGS = """\
#!{python}
import json, sys
from pathlib import Path

argv = sys.argv[1:]
with open(Path(__file__).with_suffix(".log"), "a") as log:
    log.write(json.dumps(argv) + "\\n")
arg = dict(zip(argv[::2], argv[1::2]))
"""


def write_executable(path: Path, text: str) -> Path:
    path.write_text(text.format(python=sys.executable))
    path.chmod(0o755)
    return path


def failing_tool(path: Path, message: str) -> Path:
    """An executable that prints `message` to stderr and exits 1 (a model it cannot load)."""
    script = f"#!{{python}}\nimport sys\nprint({message!r}, file=sys.stderr)\nsys.exit(1)\n"
    return write_executable(path, script)
