from nvmath import ComputeType  # noqa: F401

from . import advanced  # noqa: F401
