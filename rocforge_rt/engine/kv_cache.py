"""KV pool bookkeeping: one preallocated fp16 pool of slots, each a whole context window."""

from rocforge_rt.errors import EngineError, EngineErrorCode
from rocforge_rt.model.hparams import HParams

KV_BYTES_PER_ELEMENT = 2  # fp16, as llama.cpp


def kv_bytes_per_token(hparams: HParams) -> int:
    """Bytes of K and V one token occupies across all layers."""
    per_layer = hparams.kv_dim_k + hparams.kv_dim_v
    return hparams.n_layer * per_layer * KV_BYTES_PER_ELEMENT


def kv_pool_bytes(hparams: HParams, n_slots: int, n_ctx: int) -> int:
    return kv_bytes_per_token(hparams) * n_slots * n_ctx


class SlotAllocator:
    """Hands out KV slots (one per live session) and takes them back."""

    def __init__(self, n_slots: int, n_ctx: int) -> None:
        if n_slots < 1 or n_ctx < 1:
            raise ValueError(f"KV pool needs n_slots >= 1 and n_ctx >= 1, got {n_slots}, {n_ctx}")
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self._free = list(range(n_slots - 1, -1, -1))

    def acquire(self) -> int:
        """A free slot; EngineError(BUSY) when every slot is in use."""
        if not self._free:
            raise EngineError(EngineErrorCode.BUSY, f"all {self.n_slots} KV slots are in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not in use")
        self._free.append(slot)

    @property
    def in_use(self) -> int:
        return self.n_slots - len(self._free)
