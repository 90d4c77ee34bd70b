"""Numerics policies (seed 000 §10.3, seed 002 §2.4): storage dtype, accumulation, scaling.

A policy is a frozen, hashable value so that compiled kernels and autotune entries can be
keyed on it.  Ops take ``policy=`` and ask the helpers here which dtype to compute in,
which to accumulate in and which to return, so every op reads the policy the same way:

* ``accum`` is the accumulation dtype; low-precision inputs are widened to it (never
  narrowed: f64 inputs keep accumulating in f64).
* ``dtype`` is the operand/storage dtype.  A float type of 16 bits or more is also the
  result dtype.  An FP8 ``dtype`` means "quantize the operands to FP8 with ``scale``
  (and ``stochastic_round``) before computing", as Transformer Engine does; the result
  stays in the input dtype, because an FP8 result would throw away what f32
  accumulation kept.
* ``deterministic`` asks GPU kernels for a fixed reduction order (no atomics, no
  split-K); CPU references are always deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dtypes import dtype_name, resolve_dtype

__all__ = [
    "NumericPolicy", "numeric", "DEFAULT_POLICY", "FLOAT_DTYPES", "FP8_DTYPES",
    "accum_dtype", "result_dtype", "is_fp8", "tolerance",
]

FP8_DTYPES: frozenset[np.dtype] = frozenset((resolve_dtype("fp8_e4m3"), resolve_dtype("fp8_e5m2")))
FLOAT_DTYPES: frozenset[np.dtype] = FP8_DTYPES | {np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16),
                                                   resolve_dtype("bf16")}
_ACCUM: dict[str, np.dtype]
_ACCUM = {"f32": np.dtype(np.float32), "fp32": np.dtype(np.float32), "float32": np.dtype(np.float32),
          "f64": np.dtype(np.float64), "fp64": np.dtype(np.float64), "float64": np.dtype(np.float64)}
_SCALES = (None, "per_tensor", "per_channel")


_SCOPES: list = []      # the deterministic() contexts of nested ``with policy:`` blocks
# The mode ``with policy:`` switches belongs to the distributed core, above the kernels:
# dist.checks.determinism puts its ``deterministic`` context class here when it is imported.
_MODE_SWITCH: list = []


def register_mode_switch(context) -> None:
    """``context(policy)``: what ``with policy:`` enters (dist.checks.determinism's ``deterministic``)."""
    _MODE_SWITCH[:] = [context]


@dataclass(frozen=True)
class NumericPolicy:
    """How an op stores, accumulates, scales and rounds.  Build it with :func:`numeric`.

    Parameters
    ----------
    dtype : dtype, optional
        What operands are stored/quantized as (None: as given).
    accum : dtype
        The accumulation dtype (f32 or f64).
    scale : str, optional
        FP8 scaling: "per_tensor" or "per_channel".
    stochastic_round : bool
        Round FP8 stochastically.
    deterministic : bool
        Fixed-order reductions (``dist.deterministic``).
    """

    dtype: np.dtype | None = None
    accum: np.dtype = np.dtype(np.float32)
    scale: str | None = None
    stochastic_round: bool = False
    deterministic: bool = False

    def __repr__(self) -> str:
        parts = [f"dtype={dtype_name(self.dtype) if self.dtype is not None else None!r}",
                 f"accum={dtype_name(self.accum)!r}"]
        if self.scale:
            parts.append(f"scale={self.scale!r}")
        if self.stochastic_round:
            parts.append("stochastic_round=True")
        if self.deterministic:
            parts.append("deterministic=True")
        return f"numeric({', '.join(parts)})"

    def __enter__(self) -> NumericPolicy:
        """``with op.numeric(deterministic=True):`` (the seeds' spelling) turns fixed-order
        reductions on for the block (``tessera_rt.dist.deterministic``); the other fields
        apply per op, where a policy is passed.  A mode switch, not communication."""
        if not _MODE_SWITCH:
            raise RuntimeError("`with op.numeric(...)` switches the distributed core's deterministic mode: "
                               "import tessera_rt (or tessera_rt.dist) first")
        ctx = _MODE_SWITCH[0](self)
        _SCOPES.append(ctx)
        ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        _SCOPES.pop().__exit__(*exc)

    @property
    def quantizes(self) -> bool:
        """True when operands are quantized to FP8 before the op computes."""
        return self.dtype is not None and self.dtype in FP8_DTYPES


def numeric(dtype: str | np.dtype | None = None, accum: str | np.dtype = "f32", scale: str | None = None,
            stochastic_round: bool = False, deterministic: bool = False) -> NumericPolicy:
    """Make a :class:`NumericPolicy`; ``op.numeric(dtype="fp8_e4m3", accum="f32", scale="per_channel")``.

    Parameters
    ----------
    dtype : str or dtype, optional
        A float dtype (FP8 ones quantize operands).
    accum : str or dtype
        "f32" or "f64".
    scale : str, optional
        "per_tensor" or "per_channel" (FP8 dtypes only).
    stochastic_round : bool
        Round FP8 stochastically.
    deterministic : bool
        Fixed-order reductions; ``with op.numeric(deterministic=True):`` turns them on for a block.

    Returns
    -------
    NumericPolicy
        The policy.
    """
    dt = None if dtype is None else resolve_dtype(dtype)
    if dt is not None and dt not in FLOAT_DTYPES:
        raise TypeError(f"numeric: dtype {dtype_name(dt)} is not a float type; use one of "
                        f"{sorted(dtype_name(d) for d in FLOAT_DTYPES)}")
    key = accum if isinstance(accum, str) else np.dtype(accum).name
    if key not in _ACCUM:
        raise ValueError(f"numeric: accum={accum!r} is not supported; accumulate in 'f32' or 'f64' "
                         "(16-bit accumulation loses too much to be a policy)")
    if scale not in _SCALES:
        raise ValueError(f"numeric: scale={scale!r}; use None, 'per_tensor' or 'per_channel'")
    if scale is not None and (dt is None or dt not in FP8_DTYPES):
        raise ValueError(f"numeric: scale={scale!r} only applies to an FP8 dtype, got dtype={dtype!r}; "
                         "pass dtype='fp8_e4m3' or 'fp8_e5m2', or drop scale")
    return NumericPolicy(dtype=dt, accum=_ACCUM[key], scale=scale,
                         stochastic_round=bool(stochastic_round), deterministic=bool(deterministic))


DEFAULT_POLICY = NumericPolicy()


def is_fp8(dtype) -> bool:
    return np.dtype(dtype) in FP8_DTYPES


def accum_dtype(dtype, policy: NumericPolicy | None = None) -> np.dtype:
    """The dtype to compute statistics and sums in: the wider of the input and the policy's accum."""
    acc = (policy or DEFAULT_POLICY).accum
    dt = np.dtype(dtype)
    return np.dtype(np.float64) if dt == np.float64 or acc == np.float64 else acc


def result_dtype(dtype, policy: NumericPolicy | None = None) -> np.dtype:
    """The dtype an op returns for an input of ``dtype`` under ``policy`` (see module doc)."""
    if policy is not None and policy.dtype is not None and not policy.quantizes:
        return policy.dtype
    return np.dtype(dtype)


# rtol, atol of a kernel's result against a float64 reference, per result dtype.  Set from
# the unit roundoff of each format times a small factor for reductions of length <= 1k.
_TOL = {
    np.dtype(np.float64): (1e-10, 1e-12),
    np.dtype(np.float32): (2e-5, 2e-6),
    np.dtype(np.float16): (1e-2, 2e-3),
    resolve_dtype("bf16"): (4e-2, 1e-2),
    resolve_dtype("fp8_e4m3"): (1.3e-1, 2e-2),
    resolve_dtype("fp8_e5m2"): (2.6e-1, 4e-2),
}


def tolerance(dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing a result of ``dtype`` with a float64 reference."""
    try:
        return _TOL[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"tolerance: no tolerance for dtype {dtype_name(dtype)}") from None
