"""RoPE + KV-append after a prompt chunk's QKV GEMM (kernels/rope_kv.hip).

Decode rows get the same through the QKV GEMV's epilogue (matmul.py); both store
through kernels/rf_rope.h, so q, k and v are bit-identical either way.
"""

from rocforge_rt.backends.gpu.kernel_constants import ROPE_THREADS
from rocforge_rt.backends.gpu.kernel_variants import RopeKvKernel
from rocforge_rt.backends.gpu.launcher import Launcher
from rocforge_rt.backends.gpu.workspace import Activation, Workspace
from rocforge_rt.model.hparams import HParams


class RopeKvAppend:
    """q of a fused Q|K|V row rotated into the workspace's `q`; k, v into the KV pool (its
    format's kernel: rf_rope_kv_append[_fp8])."""

    def __init__(
        self, launcher: Launcher, workspace: Workspace, hparams: HParams, *, n_ctx: int
    ) -> None:
        self._launch = launcher.launch
        self.ws = workspace
        self.hparams = hparams
        self.n_ctx = n_ctx

    def __call__(self, qkv: Activation, layer: int) -> Activation:
        hp, ws = self.hparams, self.ws
        self._launch(
            ("rope", layer, qkv.rows),
            RopeKvKernel(ws.kv_fp8).name,
            (qkv.rows, 1, 1),
            (ROPE_THREADS, 1, 1),
            (
                qkv.ptr,
                ws.q.ptr,
                ws.k_cache[layer].ptr,
                ws.v_cache[layer].ptr,
                ws.step_positions.ptr,
                ws.step_slots.ptr,
                ws.rope_cos.ptr,
                ws.rope_sin.ptr,
                hp.n_head,
                hp.n_head_kv,
                hp.head_dim_k,
                hp.head_dim_v,
                hp.rope_dims,
                self.n_ctx,
            ),
        )
        return Activation(ws.q, qkv.rows, hp.q_dim)
