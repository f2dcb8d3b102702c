"""Progress bars on the terminal for a load's long stages (a `LoadProgress`)."""

import sys
from typing import TextIO

from tqdm import tqdm

SHOW_AFTER_S = 0.5  # a stage done sooner draws no bar


class TerminalProgress:
    """A `LoadProgress` that draws one bar a stage ("compiling kernels 3/8") on `stream`
    (standard error), where it is a terminal; as a context manager, it closes any bar left
    open."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._bars: dict[str, tqdm] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        bar = self._bars.get(stage)
        if bar is None:
            bar = self._bars[stage] = tqdm(
                desc=stage, total=total, file=self._stream, delay=SHOW_AFTER_S, disable=None
            )
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    def __enter__(self) -> "TerminalProgress":
        return self

    def __exit__(self, *_exc: object) -> None:
        for bar in self._bars.values():
            bar.close()
