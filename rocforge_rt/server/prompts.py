"""The prompt thread: renders and tokenizes the prompts of incoming jobs before the engine
thread sees them.

Everything the I/O thread submits to the engine thread keeps its arrival order (a
session's requests stay in order, a client's disconnect notice comes after its
requests). A job with a text prompt goes through this thread; anything else goes
straight on when nothing is ahead of it here. A job with a turn arrives with
`turn_ids` set: its prompt's token ids, or the exception making them raised, which the
engine thread answers. A byte-level BPE tokenizer works with the GIL released
(model/tokenizer.py), so a long prompt being tokenized here does not pause the streams the
engine thread is decoding; a SentencePiece one runs in Python (model/spm.py), and the
interpreter hands the GIL to a waiting engine thread at its switch interval meanwhile (its
cost a character: docs/performance.md).
"""

import threading
from collections.abc import Callable
from queue import SimpleQueue

from rocforge_rt.model.tokenizer import Tokenizer
from rocforge_rt.server.jobs import Job, PeerGone
from rocforge_rt.server.protocol import TurnRequest
from rocforge_rt.server.translate import prompt_ids

Item = Job | PeerGone | None  # None: the engine thread is to stop
_END = object()  # ends the thread; never passed on


def tokenize_turn(job: Job, tokenizer: Tokenizer | None) -> None:
    """Set `job.turn_ids` for a job with a turn (an append's prompt goes on a session, so it
    gets no BOS of its own); an exception is kept for the engine thread to answer."""
    request = job.request
    if not isinstance(request, TurnRequest) or request.turn is None or job.cancel is not None:
        return
    try:
        job.turn_ids = prompt_ids(
            tokenizer, job.request.turn.prompt, first_turn=job.request.op != "append"
        )
    except Exception as exc:  # a ProtocolError, or a tokenizer bug: answered as internal
        job.turn_ids = exc


def _has_text(item: Item) -> bool:
    return (
        isinstance(item, Job)
        and isinstance(item.request, TurnRequest)
        and item.request.turn is not None
        and (item.request.turn.prompt.tokens is None)
    )


class PromptThread:
    """Passes items to `forward` in order, tokenizing text prompts on its own thread."""

    def __init__(
        self, tokenizer: Callable[[], Tokenizer | None], forward: Callable[[Item], None]
    ) -> None:
        self._tokenizer = tokenizer  # read when the first text comes: after the model loaded
        self._forward = forward
        self._queue: SimpleQueue[Item | object] = SimpleQueue()
        self._lock = threading.Lock()
        self._ahead = 0  # items queued here and not yet passed on
        self._thread = threading.Thread(target=self._run, name="rocforge-prompts")

    def start(self) -> None:
        """Start the thread (items queued before wait)."""
        self._thread.start()

    def submit(self, item: Item) -> None:
        """Pass an item on: at once when it has no text and nothing is ahead of it."""
        with self._lock:
            if self._ahead == 0 and not _has_text(item):
                if isinstance(item, Job):
                    tokenize_turn(item, None)  # token ids given: nothing to tokenize
                self._forward(item)
                return
            self._ahead += 1
        self._queue.put(item)

    def finish(self) -> None:
        """End the thread once everything queued has been passed on."""
        self._queue.put(_END)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not _END:
            if isinstance(item, Job):
                tokenize_turn(item, self._tokenizer())
            self._forward(item)
            with self._lock:
                self._ahead -= 1
