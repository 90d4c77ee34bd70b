from nvmath import ComputeType  # noqa: F401  (nvmath.linalg.ComputeType, as nvmath has it)

from . import advanced  # noqa: F401  (nvmath.linalg.advanced)
