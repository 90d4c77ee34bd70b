"""A fake ``nvmath`` (nvmath-python) for the tests: ``nvmath.linalg.advanced.Matmul`` as
tessera_rt's cuBLASLt providers use it, recording every call (``LOG``) and computing with
NumPy what cuBLASLt documents (``linalg/advanced``).  ``CONFIG["cublaslt_version"]`` sets what
``nvmath.bindings.cublasLt.get_version()`` answers."""
from __future__ import annotations

import enum

__version__ = "1.0.0+fake"
LOG: dict = {"init": [], "plan": [], "reset": [], "execute": []}
CONFIG: dict = {"cublaslt_version": 130100}


def reset() -> None:
    for v in LOG.values():
        v.clear()
    CONFIG.update(cublaslt_version=130100)


class CudaDataType(enum.IntEnum):
    CUDA_R_16F = 2
    CUDA_R_16BF = 14
    CUDA_R_32F = 0
    CUDA_R_8F_E4M3 = 28
    CUDA_R_8F_E5M2 = 29


class ComputeType(enum.IntEnum):          # nvmath._utils' enum: not cuBLAS's (MatmulComputeType)
    COMPUTE_32F = 1 << 2
    COMPUTE_TF32 = 1 << 12


from . import bindings, linalg  # noqa: F401  (nvmath's subpackages, imported after the enums they use)
