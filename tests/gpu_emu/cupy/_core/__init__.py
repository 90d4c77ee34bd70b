"""``cupy._core``: the part tessera_rt and its tests reach (GEMM compute types)."""
from ._routines_linalg import dot, get_compute_type, matmul, set_compute_type  # noqa: F401
from . import _routines_linalg  # noqa: F401
