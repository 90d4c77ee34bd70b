from . import cublasLt  # noqa: F401  (nvmath.bindings.cublasLt)
