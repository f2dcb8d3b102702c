"""The token embedding gather (kernels/embedding.hip) from the repacked table.

The table is repacked as the GEMV reads it (matmul.py `repack_rows`), so a tied LM
head and the gather share one copy.
"""

import math

from rocforge_rt.backends.gpu.kernel_constants import EMBED_THREADS
from rocforge_rt.backends.gpu.kernel_variants import EmbedKernel
from rocforge_rt.backends.gpu.launcher import Launcher
from rocforge_rt.backends.gpu.matmul import DeviceMatrix
from rocforge_rt.backends.gpu.workspace import Activation, Workspace
from rocforge_rt.model.hparams import HParams
from rocforge_rt.step.batch import StepBatch


class Embedding:
    """The rows of the step's tokens (step state) into the workspace's `x`."""

    def __init__(self, launcher: Launcher, workspace: Workspace, hparams: HParams) -> None:
        self._launch = launcher.launch
        self.ws = workspace
        self.hparams = hparams

    def __call__(self, table: DeviceMatrix, batch: StepBatch) -> Activation:
        n = batch.n_tokens
        hp, ws = self.hparams, self.ws
        self._launch(
            ("embed", n),
            EmbedKernel(table.fmt, split=True).name,
            (math.ceil(hp.n_embd / EMBED_THREADS), min(n, 65535), 1),
            (EMBED_THREADS, 1, 1),
            (table.qs.ptr, table.d.ptr, table.n, hp.n_embd, ws.step_tokens.ptr, n, ws.x.ptr),
        )
        return Activation(ws.x, n, hp.n_embd)
