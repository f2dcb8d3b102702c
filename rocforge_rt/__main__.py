"""`rocforge` (the console script) and `python -m rocforge_rt`: the command line, with SIGTERM
heard from its first moment.

The commands' modules take most of a second to import (numpy, the engine, the server). A
SIGTERM then (a supervisor stopping a daemon it has just started) stops the command with
status 0, as one later does (server/command_line.py's `run`), instead of killing the process
by the signal's default action: a handler goes in before anything else is imported. Only the
interpreter's own start comes before it. While the modules import, the handler only notes
the signal, and the command stops once they are in: an exception raised inside a C
extension's import (numpy's imports `datetime` from C) would come out as that extension's
ImportError.
"""

import signal
import sys

from rocforge_rt.errors import Terminated, raise_terminated

_asked_to_stop: list[int] = []  # the SIGTERMs that came while the modules imported


def _note_sigterm(signum: int, _frame: object) -> None:
    _asked_to_stop.append(signum)


def main() -> int:
    signal.signal(signal.SIGTERM, _note_sigterm)
    from rocforge_rt.cli import main as cli_main

    try:
        signal.signal(signal.SIGTERM, raise_terminated)
        if _asked_to_stop:
            raise Terminated
        return cli_main()
    except Terminated:  # before the command began: `run` answers it from then on
        print("rocforge: SIGTERM received: stopped", file=sys.stderr)
        return 0


if __name__ == "__main__":
    sys.exit(main())
