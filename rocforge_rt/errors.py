"""Exception types shared across the package.

Each layer raises one type so callers (the CLI, the daemon) can turn it into a
clear message or an error code without catching unrelated failures.
"""

from enum import StrEnum


class RocforgeError(Exception):
    """Base class of every error this package raises on purpose."""


class UsageError(RocforgeError):
    """The command line cannot work as given: an option's value out of range, a malformed
    address, a refused combination. The CLI exits 2 for it, as for argparse's own errors;
    1 for any other RocforgeError."""


class ModelFormatError(RocforgeError):
    """A GGUF file is unreadable or does not describe a model this runtime can run.

    The message names the file, the key or tensor, what was expected, what was
    found, and how to fix it.
    """


class BackendError(RocforgeError):
    """A device API call failed; the message names the API and its error code."""


class KernelCompileError(RocforgeError):
    """A kernel failed to compile; the message carries the compiler log."""


class EngineErrorCode(StrEnum):
    """Why the engine refused a call (`EngineError.code`); the daemon maps each to a reply code."""

    BUSY = "busy"  # every KV slot is in use
    CONTEXT_FULL = "context_full"  # the turn does not fit in the session's context window
    # an argument out of range: an empty turn, max_tokens < 1, a token id outside the
    # vocabulary, a sampling parameter (temperature, top_k, top_p, logprobs, seed)
    INVALID_ARGUMENT = "invalid_argument"
    TURN_RUNNING = "turn_running"  # a new turn for a session whose turn is still generating
    NOT_DECODABLE = "not_decodable"  # decode of a session whose turn ended or is not prefilled
    BAD_CONFIG = "bad_config"  # an engine the model cannot hold (ctx size over its training)


class EngineError(RocforgeError):
    """A request cannot be served by the engine; `code` says why, `message` in words."""

    def __init__(self, code: EngineErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class LoadCancelled(RocforgeError):
    """Loading stopped because its caller asked it to (a daemon stopping while it loads)."""


class Terminated(BaseException):
    """SIGTERM arrived while a command ran (`raise_terminated`, the handler the command line
    installs). A BaseException, as KeyboardInterrupt is: no `except Exception` on the way
    (a model file's parser, a conversion) may take the request to stop for an error of its
    own."""


def raise_terminated(_signum: int, _frame: object) -> None:
    """A SIGTERM handler: Terminated, in the main thread, wherever it is."""
    raise Terminated
