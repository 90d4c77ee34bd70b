"""cuBLASLt through ``nvmath-python``: GEMMs with fused epilogues and FP8 GEMMs with scales.

``nvmath.linalg.advanced.Matmul`` is planned once per (shape, dtype, epilogue) and cached;
each call hands it the new operands (``reset_operands``), runs it on the caller's CuPy
stream (``execute(stream=...)``; nvmath's workspace and results come from CuPy's pool) and
drops the references again, so the cache keeps no activation alive.

* ``matmul_bias_act``: cuBLASLt's epilogues add the bias along the result's M dimension and
  apply RELU or GELU (the tanh approximation: cuBLASLt's GELU is that form, so only
  ``act="gelu_tanh"`` fuses; "gelu" (erf) and "silu" stay on the project's path).  The
  project's bias runs along N (``x @ w + bias``), so the provider computes the transposed
  product ``(w^T @ x^T)`` whose rows are N: the operands are transposed views (no copy) and
  the column-major result read transposed is ``x @ w``'s row-major array.
* ``matmul_fp8``: e4m3 x e4m3, e4m3 x e5m2 or e5m2 x e4m3 with one f32 scale per operand
  (cuBLASLt's tensor-wide scale mode), f16/bf16/f32 result.  cuBLASLt's FP8 GEMM wants A
  row-major and B column-major: ``b`` is copied to column-major (K x N bytes).

Plain GEMMs stay on CuPy's cuBLAS (``matmul``): for a GEMM without an epilogue cuBLASLt
runs the same kernels (cuBLAS dispatches to cuBLASLt's), and CuPy's call costs less host
time than planning through nvmath.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..dtypes import dtype_name, resolve_dtype
from ._common import is_cupy
from .cuda_common import launch_stream
from .gemm_epilogue import check_bias_act, check_fp8_matmul
from .precision import f32_compute, note
from .providers import Provider, compute_capability, register_provider

__all__ = ["CublasLtBiasAct", "CublasLtFp8", "plan_cache_info", "EPILOGUES"]

_INSTALL = "pip install 'tessera_rt[cuda13]' (or [cuda12]): nvmath-python"
_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)
_BF16 = resolve_dtype("bf16")
# act -> (epilogue with a bias, without): what cuBLASLt computes exactly as the project's act does
EPILOGUES = {"identity": ("BIAS", None), "relu": ("RELU_BIAS", "RELU"), "gelu_tanh": ("GELU_BIAS", "GELU")}
_WHY_ACT = {"gelu": "cuBLASLt's GELU epilogue is the tanh approximation, act='gelu' the exact erf form "
                    "(act='gelu_tanh' fuses)",
            "silu": "cuBLASLt has no SiLU epilogue"}

_PLANS: dict = {}                   # key -> [Matmul, lock]
_PLAN_LOCK = threading.Lock()
# plans built in this process (the tests check the caching)
_PLANS_MADE = [0]


def plan_cache_info() -> dict:
    """``{"plans": cached nvmath Matmul plans, "planned": plans made so far}`` (tests)."""
    return {"plans": len(_PLANS), "planned": _PLANS_MADE[0]}


def _advanced():
    from nvmath.linalg import advanced
    return advanced


def _run(key: tuple, make: Any, operands: dict) -> Any:
    """Execute the plan of ``key`` (made and planned by ``make()`` the first time) on the
    current CuPy stream with ``operands`` (``reset_operands`` keywords), then release them."""
    import cupy
    stream = cupy.cuda.get_current_stream().ptr
    key = key + (cupy.cuda.Device().id,)
    entry = _PLANS.get(key)
    if entry is None:
        with _PLAN_LOCK:
            entry = _PLANS.get(key)
            if entry is None:
                mm = make(stream)
                _PLANS_MADE[0] += 1
                entry = _PLANS[key] = [mm, threading.Lock(), True]      # True: holds make()'s operands
    mm, lock = entry[0], entry[1]
    with lock:
        if entry[2]:
            entry[2] = False
        else:
            mm.reset_operands(stream=stream, **operands)
        try:
            return mm.execute(stream=stream)
        finally:
            mm.reset_operands()          # drop the operand references (no activation kept alive)


class _NvmathProvider(Provider):
    name = "cublaslt"
    library = "nvmath-python"
    min_cc = 0

    def _probe(self) -> str | None:
        try:
            _advanced()
            from nvmath.bindings import cublasLt
        except ImportError as exc:
            return f"nvmath-python is not installed ({exc}); {_INSTALL}"
        self.version = int(cublasLt.get_version())
        cc = compute_capability()
        if cc < self.min_cc:
            return f"sm_{cc}: needs sm_{self.min_cc} or newer"
        return None

    def reset(self) -> None:
        super().reset()
        _PLANS.clear()


class CublasLtBiasAct(_NvmathProvider):
    """``matmul_bias_act`` as one cuBLASLt GEMM with a bias/RELU/GELU epilogue."""

    def supports(self, x: Any, w: Any, bias: Any | None = None, *, act: str = "identity", out: Any | None = None,
                 stream: Any | None = None, policy: Any = None) -> str | None:
        try:
            check_bias_act(self.op, x, w, bias, act)
        except (TypeError, ValueError) as exc:
            return f"the arguments are invalid ({exc}); the own kernel reports it"
        if policy is not None:
            return "a NumericPolicy asks for the reference's own rounding"
        if act in _WHY_ACT:
            return _WHY_ACT[act]
        if act == "identity" and bias is None:
            return "a plain GEMM: CuPy's cuBLAS runs it"
        dt = np.dtype(x.dtype)
        if dt == _F32 and f32_compute() == "bf16":
            return "float32 at precision 'medium' rounds operands to bf16 on the project's path"
        if dt not in (_F16, _BF16, _F32):
            return f"{dtype_name(dt)}: cuBLASLt epilogues here take f16/bf16/f32"
        if bias is not None and bias.dtype != x.dtype:
            return f"bias is {dtype_name(bias.dtype)}, x {dtype_name(dt)}: cuBLASLt's bias has the result's type"
        if not x.size or not w.size:
            return "empty GEMM"
        return None

    def run(self, x: Any, w: Any, bias: Any | None = None, *, act: str = "identity", out: Any | None = None,
            stream: Any | None = None, policy: Any = None) -> Any:
        import cupy
        m, k, n = check_bias_act(self.op, x, w, bias, act)
        dt = np.dtype(x.dtype)
        kind = f32_compute() if dt == _F32 else ("bf16" if dt == _BF16 else "f16")
        epilog = EPILOGUES[act][0 if bias is not None else 1]
        key = ("bias_act", m, k, n, dt.str, epilog, kind)
        with launch_stream(stream):
            x2 = cupy.ascontiguousarray(x).reshape(m, k)
            wc = cupy.ascontiguousarray(w)
            a, b = wc.T, x2.T                    # (N, K) @ (K, M): the bias runs along the result's rows
            inputs = {"bias": cupy.ascontiguousarray(bias)} if bias is not None else None

            def make(stream_ptr):
                adv = _advanced()
                options = None
                if dt == _F32:          # cuBLAS's compute types (not nvmath.ComputeType, another enum)
                    ct = adv.MatmulComputeType
                    options = {"compute_type": ct.COMPUTE_32F_FAST_TF32 if kind == "tf32" else ct.COMPUTE_32F}
                mm = adv.Matmul(a, b, options=options, stream=stream_ptr)
                mm.plan(epilog=getattr(adv.MatmulEpilog, epilog), epilog_inputs=inputs)
                return mm

            r = _run(key, make, {"a": a, "b": b, "epilog_inputs": inputs})
            y = r.T                              # (M, N), row-major when cuBLASLt wrote column-major
            if not y.flags.c_contiguous:
                y = cupy.ascontiguousarray(y)
            y = y.reshape(tuple(x.shape[:-1]) + (n,))
            if out is not None:
                out[...] = y
                y = out
        note(self.op, kind, self.name)
        return y


class CublasLtFp8(_NvmathProvider):
    """``matmul_fp8`` through cuBLASLt's FP8 GEMM (sm_89+, cuBLAS 12.8+, per-tensor scales)."""

    min_cc = 89

    def _probe(self) -> str | None:
        why = super()._probe()
        if why:
            return why
        if self.version < 120800:
            return f"cuBLASLt {self.version}: FP8 GEMMs through nvmath need cuBLAS 12.8 or newer"
        import cupy
        import ml_dtypes
        try:
            cupy.zeros((1,), np.uint8).view(ml_dtypes.float8_e4m3fn)
        except Exception as exc:
            return f"CuPy {cupy.__version__} cannot view uint8 as float8_e4m3fn for nvmath ({type(exc).__name__})"
        return None

    def supports(self, a: Any, b: Any, a_scale: Any | None = None, b_scale: Any | None = None, *,
                 a_format: str = "fp8_e4m3", b_format: str = "fp8_e4m3", out_dtype: Any = "f32",
                 out: Any | None = None, stream: Any | None = None) -> str | None:
        try:
            m, k, n, fa, fb, od, sa, sb = check_fp8_matmul(self.op, a, b, a_scale, b_scale, a_format, b_format,
                                                          out_dtype)
        except (TypeError, ValueError) as exc:
            return f"the arguments are invalid ({exc}); the own kernel reports it"
        if sa == "none" or sb == "none":
            return ("FP8 without scales: cuBLASLt's FP8 GEMM takes one scale per operand (pass the scales "
                    "quantize_fp8 returned)")
        if sa == "channel" or sb == "channel":
            return "per-channel scales: cuBLASLt's FP8 GEMM here takes one scale per tensor"
        if fa == fb == resolve_dtype("fp8_e5m2"):
            return "e5m2 x e5m2: cuBLASLt's FP8 GEMM takes e4m3 x e4m3, e4m3 x e5m2 or e5m2 x e4m3"
        if not (is_cupy(a) and is_cupy(b)) or a.dtype != np.uint8 or b.dtype != np.uint8:
            return "operands are not uint8 FP8 bit patterns on the device"
        if not (m and k and n):
            return "empty GEMM"
        if k % 16 or n % 16 or m % 16:
            return f"M={m}, K={k}, N={n}: cuBLASLt's FP8 GEMM needs multiples of 16"
        return None

    def run(self, a: Any, b: Any, a_scale: Any | None = None, b_scale: Any | None = None, *,
            a_format: str = "fp8_e4m3", b_format: str = "fp8_e4m3", out_dtype: Any = "f32",
            out: Any | None = None, stream: Any | None = None) -> Any:
        import cupy
        import ml_dtypes
        m, k, n, fa, fb, od, _, _ = check_fp8_matmul(self.op, a, b, a_scale, b_scale, a_format, b_format, out_dtype)
        fmt = {resolve_dtype("fp8_e4m3"): ml_dtypes.float8_e4m3fn, resolve_dtype("fp8_e5m2"): ml_dtypes.float8_e5m2}
        key = ("fp8", m, k, n, np.dtype(fa).name, np.dtype(fb).name, od.str)
        with launch_stream(stream):
            a8 = cupy.ascontiguousarray(a).view(fmt[fa])        # row-major (M, K)
            b8 = cupy.asfortranarray(b).view(fmt[fb])           # column-major (K, N): cuBLASLt's FP8 layout
            scales = {"a": cupy.asarray(a_scale, np.float32).reshape(1),
                      "b": cupy.asarray(b_scale, np.float32).reshape(1)}

            def make(stream_ptr):
                import nvmath
                result = {_F16: nvmath.CudaDataType.CUDA_R_16F, _F32: nvmath.CudaDataType.CUDA_R_32F}.get(
                    od, nvmath.CudaDataType.CUDA_R_16BF)
                mm = _advanced().Matmul(a8, b8, quantization_scales=scales, options={"result_type": result},
                                        stream=stream_ptr)
                mm.plan()
                return mm

            y = _run(key, make, {"a": a8, "b": b8, "quantization_scales": scales})
            if out is not None:
                out[...] = y
                y = out
        note(self.op, "fp8", self.name)
        return y


register_provider(CublasLtBiasAct("matmul_bias_act"))
register_provider(CublasLtFp8("matmul_fp8"))
