"""Errors the stand-in raises that real CuPy has no class for."""


class StreamOrderError(RuntimeError):
    """Device memory is used (or handed out by the pool) while work on another stream that is
    not ordered before it may still access the same bytes: a race on a real GPU."""


class StandinLimitation(NotImplementedError):
    """The stand-in does not model this part of CuPy (the message says what to use instead)."""
