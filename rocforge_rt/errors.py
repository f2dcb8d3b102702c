"""Exception types shared across the package.

Each layer raises one type so callers (the CLI, the daemon) can turn it into a
clear message or an error code without catching unrelated failures.
"""


class RocforgeError(Exception):
    """Base class of every error this package raises on purpose."""


class ModelFormatError(RocforgeError):
    """A GGUF file is unreadable or does not describe a model this runtime can run.

    The message names the file, the key or tensor, what was expected, what was
    found, and how to fix it.
    """


class BackendError(RocforgeError):
    """A device API call failed; the message names the API and its error code."""


class KernelCompileError(RocforgeError):
    """A kernel failed to compile; the message carries the compiler log."""


class EngineError(RocforgeError):
    """A request cannot be served by the engine (context full, bad parameters...)."""
