"""When a generation ends, and stop strings held back from streamed text."""

from collections.abc import Sequence
from enum import StrEnum


class FinishReason(StrEnum):
    STOP_TOKEN = "stop_token"  # an end-of-generation token (EOS, <|im_end|>...)
    STOP_STRING = "stop_string"  # one of the request's stop strings appeared
    LENGTH = "length"  # the token limit or the end of the context window
    ABORT = "abort"  # the client aborted, or its deadline passed
    ERROR = "error"


class StopStringFilter:
    """Streams text through, cutting it at the first stop string.

    Text that could still turn into a stop string is held back, so a client
    never sees part of a stop string; the stop string itself is never emitted.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was found)."""
        self._pending += text
        hits = [i for i in (self._pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self._pending = self._pending[: min(hits)], ""
            return out, True
        keep = self._held_back_length()
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        """Everything held back (the generation ended for another reason)."""
        out, self._pending = self._pending, ""
        return out

    def _held_back_length(self) -> int:
        """Length of the longest suffix of the pending text that begins some stop string."""
        text = self._pending
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
