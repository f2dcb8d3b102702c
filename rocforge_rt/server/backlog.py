"""Replies a client has not taken yet, bounded in messages and in bytes.

ZeroMQ bounds a peer's outgoing queue only in messages (its high-water mark), and a
reply can be large (a `step` of thousands of tokens with logprobs). So the ROUTER's
own queue is kept short (PIPE_MESSAGES), and what does not fit waits here, per client,
in order, counted in both: past either bound the client is not reading, and the
daemon drops it (its replies are discarded and its requests stopped). The I/O
thread alone uses it.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

PIPE_MESSAGES = 16  # the ROUTER's per-client queue (ZMQ_SNDHWM)
MAX_MESSAGES = 1000  # replies waiting here for one client
MAX_BYTES = 16 << 20  # bytes of replies waiting here for one client

# send(frames): True once ZeroMQ took the message, False when the client's queue is full
Send = Callable[[list[bytes]], bool]


@dataclass
class _Waiting:
    replies: deque[list[bytes]] = field(default_factory=deque)
    nbytes: int = 0


class Backlog:
    """Per client: replies ZeroMQ could not queue yet, sent in order as room comes."""

    def __init__(self) -> None:
        self.max_messages = MAX_MESSAGES
        self.max_bytes = MAX_BYTES
        self._waiting: dict[bytes, _Waiting] = {}

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def send(self, frames: list[bytes], send: Send) -> bool:
        """Send a reply now or queue it behind the client's earlier ones; False when that
        puts the client past a bound (the caller drops it: `drop`)."""
        peer = frames[0]
        waiting = self._waiting.get(peer)
        if waiting is None:
            if send(frames):
                return True
            waiting = self._waiting[peer] = _Waiting()
        waiting.replies.append(frames)
        waiting.nbytes += sum(len(f) for f in frames)
        return len(waiting.replies) <= self.max_messages and waiting.nbytes <= self.max_bytes

    def flush(self, send: Send) -> None:
        """Send what now fits, oldest first, client by client."""
        for peer, waiting in list(self._waiting.items()):
            # a send may find the client gone: its replies are dropped meanwhile
            while self._waiting.get(peer) is waiting and waiting.replies:
                if not send(waiting.replies[0]):
                    break
                waiting.nbytes -= sum(len(f) for f in waiting.replies.popleft())
            if self._waiting.get(peer) is waiting and not waiting.replies:
                del self._waiting[peer]

    def drop(self, peer: bytes) -> tuple[int, int]:
        """Discard a client's waiting replies; how many there were, and their bytes."""
        waiting = self._waiting.pop(peer, None)
        return (0, 0) if waiting is None else (len(waiting.replies), waiting.nbytes)
