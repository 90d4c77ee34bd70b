from . import cublasLt  # noqa: F401
