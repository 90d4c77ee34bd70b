"""Fake ``nvmath.linalg.advanced``: a stateful ``Matmul`` with epilogs and FP8 scales.

What it checks, as cuBLASLt/nvmath would refuse it: 2-D operands whose inner dims agree; a
bias of the result's M rows (rank 1, unit stride, the result's type); FP8 only as A
row-major and B column-major with a scale per operand (one f32 value); ``reset_operands``
with the planned shapes, strides and types; ``execute`` only with operands set.  What it
computes: ``epilog(scale_a * scale_b * (A @ B) [+ bias])`` in float64, rounded to the result
type; GELU is the tanh approximation, as cuBLASLt's.  The result is column-major when A is
(nvmath orders the result as A), allocated on the stream ``execute`` was given.
"""
from __future__ import annotations

import enum

import numpy as np

import nvmath

import _fake_device as _device

__all__ = ["Matmul", "MatmulEpilog", "MatmulComputeType", "matmul"]


class MatmulComputeType(enum.IntEnum):     # cublasComputeType_t, what MatmulOptions.compute_type takes
    COMPUTE_32F = 68
    COMPUTE_32F_FAST_TF32 = 77


class MatmulEpilog(enum.IntEnum):
    DEFAULT = 1
    RELU = 2
    BIAS = 4
    RELU_BIAS = 6
    GELU = 32
    GELU_BIAS = 36


_BIAS = {MatmulEpilog.BIAS, MatmulEpilog.RELU_BIAS, MatmulEpilog.GELU_BIAS}
_RESULT = {nvmath.CudaDataType.CUDA_R_16F: np.dtype(np.float16), nvmath.CudaDataType.CUDA_R_32F: np.dtype(np.float32)}


def _stream_ptr(stream) -> int:
    if stream is None:
        return _device.current_stream_ptr()
    return int(getattr(stream, "ptr", stream))


def _sig(x) -> tuple:
    return tuple(x.shape), tuple(x.strides), x.dtype.name


def _is_fp8(x) -> bool:
    return x.dtype.name.startswith("float8")


class Matmul:
    def __init__(self, a, b, c=None, *, alpha=None, beta=None, qualifiers=None, quantization_scales=None,
                 options=None, stream=None):
        if c is not None or alpha is not None or beta is not None:
            raise NotImplementedError("the fake Matmul models a @ b only")
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise ValueError(f"Matmul: operands {a.shape} @ {b.shape}")
        self.options = dict(options or {})
        if "compute_type" in self.options:
            self.options["compute_type"] = MatmulComputeType(self.options["compute_type"])    # ValueError otherwise
        self.fp8 = _is_fp8(a) or _is_fp8(b)
        if self.fp8:
            if not (_is_fp8(a) and _is_fp8(b)):
                raise ValueError("FP8 GEMM: both operands FP8")
            if a.dtype.name == b.dtype.name == "float8_e5m2":
                raise ValueError("FP8 GEMM: e5m2 x e5m2 is not supported by cuBLASLt")
            if not a.flags.c_contiguous or not b.flags.f_contiguous:
                raise ValueError("FP8 GEMM: cuBLASLt needs A row-major and B column-major (the TN layout)")
            self._check_scales(quantization_scales, required=True)
        elif a.dtype != b.dtype:
            raise ValueError(f"Matmul: operand types {a.dtype} and {b.dtype}")
        elif quantization_scales is not None:
            raise ValueError("quantization_scales are allowed only for narrow-precision operands")
        self.scales = dict(quantization_scales or {})
        self.sig = (_sig(a), _sig(b))
        self.operands = [a, b]
        self.epilog, self.epilog_inputs, self.bias_sig = None, {}, None
        self.planned = False
        nvmath.LOG["init"].append({"a": _sig(a), "b": _sig(b), "options": dict(self.options), "fp8": self.fp8,
                                   "stream": _stream_ptr(stream), "scales": self._scale_desc()})

    def _scale_desc(self):
        return {k: ("device f32[1]" if hasattr(v, "data") else type(v).__name__) for k, v in (self.scales or {}).items()}

    @staticmethod
    def _check_scales(scales, required: bool):
        if scales is None:
            if required:
                raise ValueError("FP8 operands need quantization_scales for a and b")
            return
        for name, s in scales.items():
            if name not in ("a", "b", "c", "d"):
                raise ValueError(f"quantization_scales: unknown operand {name!r}")
            if hasattr(s, "dtype") and (s.size != 1 or s.dtype != np.float32):
                raise ValueError(f"scale {name}: one f32 value (tensor-wide scale mode), got {s.shape} {s.dtype}")
        if required and not {"a", "b"} <= set(scales):
            raise ValueError("FP8 operands need scales for both a and b")

    def result_dtype(self) -> np.dtype:
        rt = self.options.get("result_type")
        if rt is None:
            if self.fp8:
                raise ValueError("the fake requires an explicit result_type for FP8")
            return self.operands[0].dtype
        if rt == nvmath.CudaDataType.CUDA_R_16BF:
            import ml_dtypes
            return np.dtype(ml_dtypes.bfloat16)
        return _RESULT[rt]

    def plan(self, preferences=None, algorithms=None, *, epilog=None, epilog_inputs=None, stream=None):
        epilog = MatmulEpilog.DEFAULT if epilog is None else MatmulEpilog(epilog)
        inputs = dict(epilog_inputs or {})
        if epilog in _BIAS:
            self._check_bias(inputs.get("bias"))
            self.bias_sig = _sig(inputs["bias"])
        elif inputs:
            raise ValueError(f"epilog {epilog.name} takes no inputs, got {sorted(inputs)}")
        self.epilog, self.epilog_inputs, self.planned = epilog, inputs, True
        nvmath.LOG["plan"].append({"epilog": epilog.name, "bias": self.bias_sig, "stream": _stream_ptr(stream)})
        return ["algorithm"]

    def _check_bias(self, bias):
        m = self.sig[0][0][0]
        if bias is None:
            raise ValueError("The epilog requires the 'bias' input")
        if bias.ndim != 1 or bias.shape[0] != m:
            raise ValueError(f"The M dimension of the bias vector ({bias.shape}) must match the M dimension of A ({m}).")
        if bias.strides[0] != bias.itemsize:
            raise ValueError("The stride of the bias must be 1")
        if bias.dtype != self.result_dtype():
            raise ValueError(f"bias type {bias.dtype} != result type {self.result_dtype()}")

    def reset_operands(self, a=None, b=None, c=None, *, alpha=None, beta=None, quantization_scales=None,
                       epilog_inputs=None, stream=None):
        if a is None and b is None and c is None and epilog_inputs is None and alpha is None and beta is None:
            self.operands = None
            self.epilog_inputs = {}
            nvmath.LOG["reset"].append("released")
            return
        if self.operands is None and (a is None or b is None):
            raise ValueError("Operands A, B must be provided.")
        new = [a, b]
        for i, (x, name) in enumerate(zip(new, "AB")):
            if x is not None and _sig(x) != self.sig[i]:
                raise ValueError(f"operand {name}: {_sig(x)} does not match the planned {self.sig[i]}")
        self.operands = [x if x is not None else (self.operands or [None, None])[i] for i, x in enumerate(new)]
        if self.epilog in _BIAS:
            if epilog_inputs is None and not self.epilog_inputs:
                raise ValueError("The epilog inputs ['bias'] must be provided.")
            if epilog_inputs is not None:
                if _sig(epilog_inputs["bias"]) != self.bias_sig:
                    raise ValueError("bias does not match the planned bias")
                self.epilog_inputs = dict(epilog_inputs)
        if quantization_scales is not None:
            self._check_scales(quantization_scales, required=False)
            self.scales.update(quantization_scales)
        nvmath.LOG["reset"].append({"a": a is not None, "b": b is not None, "stream": _stream_ptr(stream)})

    def _host(self, x, stream) -> np.ndarray:
        return _device.read(x.data.ptr, x.shape, tuple(s // x.itemsize for s in x.strides), x.dtype, stream,
                            "matmul operand").astype(np.float64)

    def execute(self, *, algorithm=None, release_workspace=False, stream=None):
        import cupy
        if not self.planned:
            raise RuntimeError("execute before plan")
        if self.operands is None:
            raise RuntimeError("execute with no operands (reset_operands(None) released them)")
        s = _stream_ptr(stream)
        a, b = (self._host(x, s) for x in self.operands)
        scale = 1.0
        for name in ("a", "b"):
            v = self.scales.get(name)
            if v is not None:
                scale *= float(v.get(stream=cupy.cuda.ExternalStream(s)).reshape(())) if hasattr(v, "data") else float(v)
        d = scale * (a @ b)
        if self.epilog in _BIAS:
            d = d + self._host(self.epilog_inputs["bias"], s)[:, None]
        if self.epilog in (MatmulEpilog.RELU, MatmulEpilog.RELU_BIAS):
            d = np.maximum(d, 0)
        elif self.epilog in (MatmulEpilog.GELU, MatmulEpilog.GELU_BIAS):
            d = 0.5 * d * (1 + np.tanh(np.sqrt(2 / np.pi) * (d + 0.044715 * d ** 3)))
        col = self.operands[0].flags.f_contiguous and not self.operands[0].flags.c_contiguous
        host = d.astype(self.result_dtype())
        with cupy.cuda.ExternalStream(s) as st:
            r = cupy.empty(host.shape, host.dtype, order="F" if col else "C")
            r.set(np.asfortranarray(host) if col else np.ascontiguousarray(host), stream=st)
        nvmath.LOG["execute"].append({"stream": s, "epilog": self.epilog.name, "result": _sig(r)})
        return r

    def free(self):
        self.operands = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()


def matmul(a, b, c=None, *, epilog=None, epilog_inputs=None, quantization_scales=None, options=None, stream=None,
           **kw):
    mm = Matmul(a, b, c, quantization_scales=quantization_scales, options=options, stream=stream)
    mm.plan(epilog=epilog, epilog_inputs=epilog_inputs)
    return mm.execute(stream=stream)
