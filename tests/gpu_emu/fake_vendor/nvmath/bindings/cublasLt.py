def get_version() -> int:
    import nvmath
    return nvmath.CONFIG["cublaslt_version"]
