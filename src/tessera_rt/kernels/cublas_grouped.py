"""Grouped GEMMs as one cuBLAS call per group, where the host already knows the group sizes.

The provider of the grouped ops (``grouped_matmul``, ``grouped_dual_matmul``,
``grouped_matmul_wgrad``, ``grouped_matmul_wgrad_dual``) when ``offsets`` is a NumPy array:
the sizes are on the host (an MoE layer over several ep ranks learns them in its counts
exchange), so each group is a ``cupy.matmul`` on row slices, with no sync and cuBLAS's
speed.  Device offsets (one rank's dropless routing, whose counts never leave the GPU) go to
the project's one-launch kernel (``grouped_gemm_cuda``): learning them here would cost the
host sync that kernel exists to avoid.  ``grouped_swiglu`` has no provider (cuBLAS has no
SwiGLU epilogue).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..dtypes import dtype_name, resolve_dtype
from .cuda_common import launch_stream
from .grouped_gemm import host_offsets
from .precision import note
from .providers import Provider, register_provider

__all__ = ["CublasPerGroup"]

_DTYPES = (np.dtype(np.float16), resolve_dtype("bf16"), np.dtype(np.float32))
_SHORT = {np.dtype(np.float16): "f16", resolve_dtype("bf16"): "bf16", np.dtype(np.float32): "f32"}
# where each op's offsets sit among its positional arguments after x
_OFFSETS_AT = {"grouped_matmul": 1, "grouped_dual_matmul": 2, "grouped_matmul_wgrad": 1,
               "grouped_matmul_wgrad_dual": 2}


class CublasPerGroup(Provider):
    """One cuBLAS GEMM per non-empty group (CuPy's ``matmul`` on row slices of the batch)."""

    name = "cublas"
    library = "cupy"

    def _probe(self) -> str | None:
        import cupy  # noqa: F401   (CuPy is this provider's library)
        return None

    def supports(self, x: Any, *args: Any, **kwargs: Any) -> str | None:
        i = _OFFSETS_AT[self.op]
        offsets = kwargs.get("offsets", args[i] if i < len(args) else None)
        if not isinstance(offsets, np.ndarray):
            return ("offsets on the device: one cuBLAS call per group would need the group sizes on the "
                    "host (a sync); the project's one-launch grouped kernel reads them on the device")
        if np.dtype(x.dtype) not in _DTYPES:
            return f"{dtype_name(x.dtype)}: cuBLAS per group serves f16, bf16 and f32"
        return None

    def run(self, x: Any, *args: Any, stream: Any = None, **kwargs: Any) -> Any:
        import cupy

        from .gemm_cuda import _cublas
        with launch_stream(stream):
            op = self.op
            if op == "grouped_matmul":
                w, offsets = args[0], args[1]
                trans, x2, out = kwargs.get("trans_w", False), kwargs.get("x2"), kwargs.get("out")
                w2: Any = kwargs.get("w2")                  # with x2: the sum form, x @ w + x2 @ w2
                off = host_offsets(op, offsets, x.shape[0])
                n = w.shape[1] if trans else w.shape[2]
                y = out if out is not None else cupy.empty((x.shape[0], n), x.dtype)
                for g in range(off.size - 1):
                    lo, hi = int(off[g]), int(off[g + 1])
                    if hi > lo:
                        _cublas(x[lo:hi], w[g].T if trans else w[g], y[lo:hi])
                        if x2 is not None:
                            y[lo:hi] += _cublas(x2[lo:hi], w2[g].T if trans else w2[g], None)
                result = y
            elif op == "grouped_dual_matmul":
                w1, w3, offsets = args[0], args[1], args[2]
                off = host_offsets(op, offsets, x.shape[0])
                h1, h3 = (cupy.empty((x.shape[0], w1.shape[2]), x.dtype) for _ in range(2))
                for g in range(off.size - 1):
                    lo, hi = int(off[g]), int(off[g + 1])
                    if hi > lo:
                        _cublas(x[lo:hi], w1[g], h1[lo:hi])
                        _cublas(x[lo:hi], w3[g], h3[lo:hi])
                result = (h1, h3)
            else:                                   # the weight gradients
                dys, offsets = args[:-1], kwargs.get("offsets", args[-1])
                off = host_offsets(op, offsets, x.shape[0])
                outs = []
                for dy in dys:
                    dw = cupy.empty((off.size - 1, x.shape[1], dy.shape[1]), x.dtype)
                    for g in range(off.size - 1):
                        lo, hi = int(off[g]), int(off[g + 1])
                        if hi > lo:
                            _cublas(x[lo:hi].T, dy[lo:hi], dw[g])
                        else:
                            dw[g].fill(0)
                    outs.append(dw)
                result = outs[0] if op == "grouped_matmul_wgrad" else tuple(outs)
        note(self.op, _SHORT[np.dtype(x.dtype)], "cublas")
        return result


for _op in _OFFSETS_AT:
    register_provider(CublasPerGroup(_op))
