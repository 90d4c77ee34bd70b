"""``cupy._core``: the part tessera_rt and its tests reach (GEMM compute types)."""
from . import _routines_linalg  # noqa: F401  (CuPy's names)
from ._routines_linalg import dot, get_compute_type, matmul, set_compute_type  # noqa: F401  (CuPy's names)
