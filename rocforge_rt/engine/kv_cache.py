"""KV pool bookkeeping: one preallocated pool of slots, each a whole context window, its
elements in the format chosen at load (`kv_format`: fp16 by default, or fp8)."""

import threading

from rocforge_rt.errors import EngineError, EngineErrorCode
from rocforge_rt.model.hparams import HParams
from rocforge_rt.step.kv_format import kv_element_bytes


def kv_bytes_per_token(hparams: HParams, kv_dtype: str = "f16") -> int:
    """Bytes of K and V one token occupies across all layers, in the pool's format."""
    per_layer = hparams.kv_dim_k + hparams.kv_dim_v
    return hparams.n_layer * per_layer * kv_element_bytes(kv_dtype)


def kv_pool_bytes(hparams: HParams, n_slots: int, n_ctx: int, kv_dtype: str = "f16") -> int:
    """Bytes of the whole pool: n_slots windows of n_ctx tokens."""
    return kv_bytes_per_token(hparams, kv_dtype) * n_slots * n_ctx


class SlotAllocator:
    """Hands out KV slots and takes them back: the one count of free slots.

    Thread-safe: the daemon's socket thread reserves a slot when it accepts a request that
    will open a session, and the engine thread releases it (or the session that took it
    over does, when it closes). A slot has one holder at a time; releasing a slot that is
    not in use is a bug and raises ValueError.
    """

    def __init__(self, n_slots: int) -> None:
        if n_slots < 1:
            raise ValueError(f"KV pool needs n_slots >= 1, got {n_slots}")
        self.n_slots = n_slots
        self._lock = threading.Lock()
        self._free = list(range(n_slots - 1, -1, -1))

    def acquire(self) -> int:
        """A free slot; EngineError(BUSY) when every slot is in use."""
        with self._lock:
            if not self._free:
                raise EngineError(EngineErrorCode.BUSY, f"all {self.n_slots} KV slots are in use")
            return self._free.pop()

    def release(self, slot: int) -> None:
        with self._lock:
            if not 0 <= slot < self.n_slots or slot in self._free:
                raise ValueError(f"slot {slot} is not in use")
            self._free.append(slot)

    def in_use_slot(self, slot: int) -> bool:
        with self._lock:
            return 0 <= slot < self.n_slots and slot not in self._free

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def in_use(self) -> int:
        return self.n_slots - self.free
