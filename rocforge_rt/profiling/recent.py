"""The last N records of a profiler, appended by the engine thread, read from any thread."""

import threading
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Recent(Generic[T]):
    """A bounded, thread-safe list of the most recent records, oldest first."""

    def __init__(self, keep: int) -> None:
        self._items: deque[T] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def append(self, item: T) -> None:
        with self._lock:
            self._items.append(item)

    def last(self, n: int | None = None) -> list[T]:
        """The last n records (all kept when None), oldest first."""
        with self._lock:
            items = list(self._items)
        return items[-n:] if n else items

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
