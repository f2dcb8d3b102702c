"""What a load tells of its long stages: `LoadProgress(stage, done, total)`.

The GPU backend tells of the kernel sources it compiles (those in neither the kernel cache
nor the wheel), the engine of the layers it uploads. The CLI draws a progress bar a stage
(cli/progress.py); the daemon logs each step and shows the latest in `health`
(``"loading": "compiling kernels 3/8"``).
"""

from collections.abc import Callable

LoadProgress = Callable[[str, int, int], None]

COMPILING_KERNELS = "compiling kernels"
UPLOADING_WEIGHTS = "uploading weights"
