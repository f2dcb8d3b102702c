"""Each logits row's token on the device (kernels/sampling.hip), advancing the step state.

The argmax kernel serves greedy batches alone; when a row draws at random, reports
alternatives or is penalized (`RowSampling.needs_sampler`), the sampler's two kernels
follow it: per-slice candidates (when the vocabulary has at most SAMPLE_MAX_SLICES
slices), then the draw. When a row is penalized, the penalty kernel comes first,
changing the logits in place. The rules are rocforge_rt/step/sampling.py's.
"""

from rocforge_rt.backends.gpu.kernel_constants import (
    ARGMAX_THREADS,
    SAMPLE_PENALTY_WINDOW,
    SAMPLE_THREADS,
)
from rocforge_rt.backends.gpu.launcher import Launcher
from rocforge_rt.backends.gpu.workspace import Activation, Readback, Workspace
from rocforge_rt.step.sampling import RowSampling


class Sampling:
    """Launches the argmax, and the sampler when a row needs it, over rows of logits."""

    def __init__(self, launcher: Launcher, workspace: Workspace) -> None:
        self._launch = launcher.launch
        self.ws = workspace

    def __call__(
        self, logits: Activation, sampling: RowSampling, first_row: int, readback: Readback
    ) -> None:
        """Each logits row's token (its log-probability, the alternatives asked for) into
        `readback` and the step state (token, position + 1).

        `first_row` is the batch row of logits row 0 (whose position keys the draw).
        """
        if logits.rows == 0:
            return
        ws = self.ws
        drawn = sampling.needs_sampler
        if sampling.penalized:
            self._launch(
                ("penalize", logits.rows),
                "rf_sample_penalize",
                (logits.rows, 1, 1),
                (SAMPLE_PENALTY_WINDOW, 1, 1),
                (
                    logits.ptr,
                    logits.width,
                    ws.step_sampling.ptr,
                    ws.step_recent.ptr,
                    ws.step_tokens.ptr,
                    ws.step_positions.ptr,
                    first_row,
                ),
            )
        self._launch(
            ("argmax", logits.rows, readback.index, drawn),  # its `advance` argument differs
            "rf_argmax_advance",
            (ws.argmax_slices, logits.rows, 1),
            (ARGMAX_THREADS, 1, 1),
            (
                logits.ptr,
                logits.width,
                ws.step_tokens.ptr,
                ws.step_positions.ptr,
                readback.tokens.device_ptr,
                readback.logprobs.device_ptr,
                ws.row_stats.ptr,
                ws.argmax_partial.ptr,
                ws.argmax_counters.ptr,
                int(not drawn),
            ),
        )
        if not drawn:
            return
        common = (logits.ptr, logits.width, ws.step_sampling.ptr, ws.row_stats.ptr)
        candidates = (ws.sample_candidates.ptr, ws.sample_slice_sums.ptr)
        if ws.sample_slices:
            self._launch(
                ("sample-candidates", logits.rows),
                "rf_sample_candidates",
                (ws.sample_slices, logits.rows, 1),
                (SAMPLE_THREADS, 1, 1),
                common + candidates,
            )
        self._launch(
            ("sample", logits.rows, readback.index),
            "rf_sample_advance",
            (logits.rows, 1, 1),
            (SAMPLE_THREADS, 1, 1),
            (
                *common,
                first_row,
                ws.sample_slices,
                *candidates,
                ws.step_tokens.ptr,
                ws.step_positions.ptr,
                readback.tokens.device_ptr,
                readback.logprobs.device_ptr,
                readback.top_tokens.device_ptr,
                readback.top_logprobs.device_ptr,
            ),
        )
