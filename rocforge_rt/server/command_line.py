"""What every `rocforge` command shares: its parsers' help, options read from ROCFORGE_*
environment variables, and the exit status.

Exit status: 0 success, or stopped by SIGTERM (a service asked to stop, stops cleanly); 1
an error while running (a model file, a device, a download, a daemon that does not answer),
one line on stderr; 2 a usage error (argparse's own, or a `UsageError`: an option's value the
command cannot work with); 130 interrupted (Ctrl-C).
"""

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

from rocforge_rt.errors import RocforgeError, Terminated, UsageError, raise_terminated

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
ENVIRONMENT_PREFIX = "ROCFORGE_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions and epilogs as written; after each option's help its default (unless the
    help gives it, or there is none: None, False, []) and its environment variable; the
    subcommands listed one a line."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == []
        if "(default" not in text and not unset:
            text = super()._get_help_string(action)
        variable = getattr(action, "environment_variable", None)
        return f"{text} [env: {variable}]" if variable else text

    def _format_action(self, action: argparse.Action) -> str:
        text = super()._format_action(action)
        if action.nargs == argparse.PARSER:  # the subcommands: their list, without a header line
            text = text.split("\n", 1)[1]
        return text


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help is `HelpFormatter`'s (its subcommands' too).

    With `environment=True` (serve), each option the command line does not give takes its
    value from ROCFORGE_<OPTION> where that is set (--ctx-size: ROCFORGE_CTX_SIZE; a switch
    takes 1/0, true/false, yes/no, on/off), checked as the option's own value; the
    options named in `environment_skip` (by dest) read no variable.
    """

    def __init__(
        self,
        *args: Any,
        environment: bool = False,
        environment_skip: Collection[str] = (),
        **kwargs: Any,
    ) -> None:
        self.environment = environment
        self.environment_skip = frozenset(environment_skip)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        named = action.option_strings and action.dest not in ("help", *self.environment_skip)
        if self.environment and named:
            action.environment_variable = ENVIRONMENT_PREFIX + action.dest.upper()
        return action

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        for action in self._actions:
            variable = getattr(action, "environment_variable", None)
            if variable is not None and variable in os.environ:
                action.default = self._environment_value(action, variable, os.environ[variable])
        return super().parse_known_args(args, namespace)

    def _environment_value(self, action: argparse.Action, variable: str, text: str) -> Any:
        """`text` read as `action`'s value; a usage error naming `variable` if it is not one."""
        if action.nargs == 0:  # a switch
            if text.strip().lower() in _TRUE + _FALSE:
                return text.strip().lower() in _TRUE
            self.error(f"{variable}={text!r}: expected 1 or 0 (true/false, yes/no, on/off)")
        try:
            value = action.type(text) if callable(action.type) else text
        except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
            self.error(f"{variable}={text!r}: {exc}")
        if action.choices is not None and value not in action.choices:
            self.error(f"{variable}={text!r}: choose from {', '.join(map(str, action.choices))}")
        return value


def positive_int(text: str) -> int:
    """An option's integer >= 1 (--threads, --max-connections)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


@contextlib.contextmanager
def sigterm_raises_terminated() -> Iterator[None]:
    """SIGTERM raises Terminated in the main thread while the block runs (a server installs its
    own handler inside it, for a graceful stop). A handler someone else set (the program that
    embeds a command) stays; so does one set outside the main thread, where none can be, and
    the same one the console script set before its imports (__main__.py)."""
    main_thread = threading.current_thread() is threading.main_thread()
    if not main_thread or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run(command: Callable[[], int], prog: str) -> int:
    """Run a command (parsing included) and return its exit status (the module docstring's):
    a RocforgeError or an OSError becomes one line on stderr, never a traceback; SIGTERM
    stops it with status 0."""
    try:
        with sigterm_raises_terminated():
            return command()
    except Terminated:
        print(f"{prog}: SIGTERM received: stopped", file=sys.stderr)
        return EXIT_OK
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (RocforgeError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
