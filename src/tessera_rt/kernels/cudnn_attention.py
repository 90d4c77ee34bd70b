"""cuDNN's fused attention (``nvidia-cudnn-frontend``'s graph API) as attention providers.

Forward and backward of ``flash_attention`` on CuPy arrays and the caller's CuPy stream, no
torch: a cuDNN graph is built once per (shape, dtype, causal, scale, ...) and cached
(building one takes milliseconds to seconds); each call sets the cuDNN handle to the current
CuPy stream, takes the workspace from CuPy's pool on that stream and hands cuDNN raw device
pointers.  ``cudnn_varlen`` adds packed variable-length prefill and paged decode.

Conventions, mapped once here:

* layout: the project's ``(B, H, S, D)`` contiguous arrays are cuDNN's BHSD strides;
* causal: the project aligns the mask bottom-right (query ``i`` sees keys ``j <= i + Sk - Sq``),
  which is cuDNN's ``diagonal_alignment=BOTTOM_RIGHT`` with ``diagonal_band_right_bound=0``;
* grouped-query heads: K/V are ``(B, Hkv, Sk, D)``, as cuDNN takes them;
* logsumexp: cuDNN's ``Stats`` is ``max + log(sum(exp(s - max)))`` of the scaled scores in the
  natural log, shape ``(B, H, Sq, 1)`` f32 (the frontend's reference, test/python/sdpa): the
  project's ``lse (B, H, Sq)``, the same memory with a unit last dim, no conversion.

Only f16/bf16: f32 attention keeps the project's f32 flash kernels (``flash_f32_cuda``, 3xTF32
or TF32) unless the float32 matmul precision is "medium", which allows bf16 (``kernels.precision``).
The backward asks cuDNN for its deterministic algorithm, as the project's own backward is.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..dtypes import dtype_name, resolve_dtype
from ._common import check_stream
from .attention import check_attention
from .cuda_common import aligned, launch_stream, scratch
from .precision import f32_compute, note
from .providers import Provider, Unsupported, compute_capability, register_provider

__all__ = ["CudnnProvider", "CudnnAttention", "CudnnAttentionBackward", "MIN_CUDNN", "DETERMINISTIC_BACKWARD",
           "cudnn_module", "graph_cache_info"]

MIN_CUDNN = 90500                   # paged K/V and bottom-right causal masks: cuDNN 9.5
DETERMINISTIC_BACKWARD = True       # the project's own backward is deterministic: so is this one
_BF16 = resolve_dtype("bf16")
_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_INSTALL = "pip install 'tessera_rt[cuda13]' (or [cuda12]): nvidia-cudnn-frontend"


def cudnn_module():
    """The ``cudnn`` frontend module (imported on first use)."""
    import cudnn
    return cudnn


def short(dt: np.dtype) -> str:
    """The precision a note records for a 16-bit operand type."""
    return "bf16" if dt == _BF16 else "f16"


def _io_type(cudnn, dt: np.dtype):
    return cudnn.data_type.HALF if dt == _F16 else cudnn.data_type.BFLOAT16


# --------------------------------------------------------------------------- handles, graphs

_LOCAL = threading.local()          # one cuDNN handle per (thread, device)
_GRAPHS: dict = {}                  # key -> (graph, tensors) or the reason cuDNN refused it
_GRAPH_LOCK = threading.Lock()
_BUILDS = [0]                       # graphs built in this process (tests check the caching)


def graph_cache_info() -> dict:
    """``{"graphs": cached graphs, "refused": configurations cuDNN refused, "builds": graphs
    built so far}`` (tests and ``TESSERA_DEBUG`` read it)."""
    ok = sum(1 for v in _GRAPHS.values() if not isinstance(v, str))
    return {"graphs": ok, "refused": len(_GRAPHS) - ok, "builds": _BUILDS[0]}


def _handle(cudnn) -> int:
    import cupy
    handles = getattr(_LOCAL, "handles", None)
    if handles is None:
        handles = _LOCAL.handles = {}
    dev = cupy.cuda.Device().id
    h = handles.get(dev)
    if h is None:
        h = handles[dev] = cudnn.create_handle()
    return h


def cached_graph(key: tuple, build: Callable[[Any, int], tuple]) -> tuple:
    """The graph of ``key``, built once by ``build(cudnn, handle) -> (graph, tensors)``; a
    configuration cuDNN refuses is remembered, and raises ``Unsupported`` with cuDNN's words."""
    import cupy
    key = key + (cupy.cuda.Device().id,)
    entry = _GRAPHS.get(key)
    if entry is None:
        cudnn = cudnn_module()
        with _GRAPH_LOCK:
            entry = _GRAPHS.get(key)
            if entry is None:
                try:
                    graph, tensors = build(cudnn, _handle(cudnn))
                    graph.validate()
                    graph.build_operation_graph()
                    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
                    graph.check_support()
                    graph.build_plans()
                    entry = (graph, tensors, int(graph.get_workspace_size()))
                except Exception as exc:          # cudnnGraphNotSupportedError and friends
                    first = (str(exc).strip().splitlines() or [""])[0]
                    entry = f"cuDNN refused the graph ({type(exc).__name__}: {first[:200]})"
                _BUILDS[0] += 1
                _GRAPHS[key] = entry
    if isinstance(entry, str):
        raise Unsupported(entry)
    return entry


def execute(entry: tuple, pointers: dict) -> None:
    """Run a cached graph on the current CuPy stream: ``pointers`` maps tensor names to device
    pointers; the workspace is the stream's scratch of that size (``cuda_common.scratch``: a
    decode step captured as a CUDA graph must not allocate)."""
    import cupy
    graph, tensors, ws = entry
    cudnn = cudnn_module()
    handle = _handle(cudnn)
    cudnn.set_stream(handle=handle, stream=cupy.cuda.get_current_stream().ptr)
    workspace = scratch("cudnn_workspace", max(ws, 1), np.uint8)
    graph.execute({tensors[name]: int(ptr) for name, ptr in pointers.items()}, workspace.data.ptr, handle=handle)


def dense(x: Any, dt: np.dtype) -> Any:
    """``x`` as contiguous ``dt`` starting on a 16-byte boundary (what cuDNN's vector loads
    need); no copy when it already is.  Call inside the launch's stream context."""
    import cupy
    x = x if x.dtype == dt else x.astype(dt)
    return aligned(cupy.ascontiguousarray(x), 16)


def causal_mask(cudnn, causal: bool) -> dict:
    """The project's causal mask (bottom-right aligned) in cuDNN's preferred masking arguments."""
    if not causal:
        return {}
    return dict(diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_right_bound=0)


def give_back(o: Any, dtype: Any, out: Any | None) -> Any:
    """``o`` in the caller's dtype (f32 at "medium" ran in bf16), written into ``out`` if given."""
    if o.dtype != dtype:
        o = o.astype(dtype)
    if out is not None:
        out[...] = o
        return out
    return o


def bhsd_strides(b: int, h: int, s: int, d: int) -> list[int]:
    return [h * s * d, s * d, d, 1]


# --------------------------------------------------------------------------- the provider base

class CudnnProvider(Provider):
    """What every cuDNN attention provider checks: the frontend imports, the backend library
    loads and is new enough, the GPU is sm_80 or newer."""

    name = "cudnn"
    library = "nvidia-cudnn-frontend"
    min_version = MIN_CUDNN

    def _probe(self) -> str | None:
        try:
            cudnn = cudnn_module()
        except ImportError as exc:
            return f"nvidia-cudnn-frontend is not installed ({exc}); {_INSTALL}"
        version = int(cudnn.backend_version())
        if version < self.min_version:
            return f"cuDNN {version} is older than {self.min_version} (pip install -U nvidia-cudnn-cu13)"
        cc = compute_capability()
        if cc < 80:
            return f"sm_{cc}: cuDNN's fused attention needs sm_80 or newer"
        _handle(cudnn)               # the library loads and a handle can be made
        return None

    def elem(self, dt: np.dtype, policy: Any) -> tuple[np.dtype | None, str | None]:
        """The 16-bit type cuDNN computes ``dt`` in, or why it does not take ``dt``."""
        if policy is not None:
            return None, "a NumericPolicy asks for the reference's own rounding"
        if dt in (_F16, _BF16):
            return dt, None
        if dt == _F32:
            if f32_compute() == "bf16":
                return _BF16, None
            return None, ("float32: cuDNN's fused attention takes f16/bf16; f32 keeps the project's f32 "
                          "kernels (set_float32_matmul_precision('medium') allows bf16)")
        return None, f"{dtype_name(dt)}: cuDNN's fused attention takes f16/bf16"

    def run_type(self, dt: np.dtype, policy: Any) -> np.dtype:
        """``elem``'s type for a call this provider runs (``unavailable`` found it takes ``dt``)."""
        elem, why = self.elem(dt, policy)
        if elem is None:
            raise TypeError(f"{self.op}: {why}")
        return elem

    def head_dim(self, d: int, kind: str = "prefill") -> str | None:
        """None when cuDNN takes head dim ``d`` for ``kind`` ("prefill", "decode", "backward"),
        else why not: multiples of 8, up to 256 on sm_90+, on sm_80/89 up to 256 for the
        forward and 128 for decode and the backward (cuDNN's SDPA support matrix)."""
        cc = compute_capability()
        top = 128 if cc < 90 and kind != "prefill" else 256
        if d % 8 or d > top:
            return f"head_dim {d}: cuDNN's {kind} attention takes multiples of 8 up to {top} on sm_{cc}"
        return None

    def reset(self) -> None:
        super().reset()
        _GRAPHS.clear()
        _LOCAL.__dict__.clear()


def _checked(op: str, fn: Callable, *args: Any) -> tuple | str:
    """``fn(*args)`` or, when it raises a people's error, a reason that sends the call to the
    own kernel (which raises the same error for the caller)."""
    try:
        return fn(*args)
    except (TypeError, ValueError) as exc:
        return f"the arguments are invalid ({exc}); the own kernel reports it"


# --------------------------------------------------------------------------- forward

class CudnnAttention(CudnnProvider):
    """``flash_attention`` forward through cuDNN's SDPA graph."""

    def supports(self, q: Any, k: Any, v: Any, *, causal: bool = False, scale: float | None = None,
                 return_lse: bool = False, block_kv: int | None = None, out: Any | None = None,
                 stream: Any | None = None, policy: Any = None) -> str | None:
        shape = _checked(self.op, check_attention, self.op, q, k, v)
        if isinstance(shape, str):
            return shape
        b, h, hkv, sq, sk, d = shape
        elem, why = self.elem(np.dtype(q.dtype), policy)
        if why:
            return why
        if not (b and h and sq and sk):
            return f"empty attention {tuple(q.shape)} x {tuple(k.shape)}"
        if causal and sq > sk:
            return (f"causal with Sq={sq} > Sk={sk}: the first rows see no key, and cuDNN does not "
                    "document its output for them")
        return self.head_dim(d)

    def run(self, q: Any, k: Any, v: Any, *, causal: bool = False, scale: float | None = None,
            return_lse: bool = False, block_kv: int | None = None, out: Any | None = None,
            stream: Any | None = None, policy: Any = None) -> Any:
        import cupy
        b, h, hkv, sq, sk, d = check_attention(self.op, q, k, v)
        check_stream(self.op, stream)
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        dt = self.run_type(np.dtype(q.dtype), policy)
        key = ("sdpa_fwd", b, h, hkv, sq, sk, d, dt.str, bool(causal), scale, bool(return_lse))

        def build(cudnn, handle):
            g = cudnn.pygraph(io_data_type=_io_type(cudnn, dt), intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)
            t = {"q": g.tensor(name="q", dim=[b, h, sq, d], stride=bhsd_strides(b, h, sq, d), data_type=_io_type(cudnn, dt)),
                 "k": g.tensor(name="k", dim=[b, hkv, sk, d], stride=bhsd_strides(b, hkv, sk, d),
                               data_type=_io_type(cudnn, dt)),
                 "v": g.tensor(name="v", dim=[b, hkv, sk, d], stride=bhsd_strides(b, hkv, sk, d),
                               data_type=_io_type(cudnn, dt))}
            o, stats = g.sdpa(name="sdpa", q=t["q"], k=t["k"], v=t["v"], generate_stats=bool(return_lse),
                              attn_scale=scale, **causal_mask(cudnn, causal))
            o.set_output(True).set_dim([b, h, sq, d]).set_stride(bhsd_strides(b, h, sq, d)).set_data_type(
                _io_type(cudnn, dt))
            t["o"] = o
            if return_lse:
                stats.set_output(True).set_dim([b, h, sq, 1]).set_stride([h * sq, sq, 1, 1]).set_data_type(
                    cudnn.data_type.FLOAT)
                t["stats"] = stats
            return g, t

        entry = cached_graph(key, build)
        with launch_stream(stream):
            qh, kh, vh = (dense(x, dt) for x in (q, k, v))
            o = cupy.empty((b, h, sq, d), dt)
            ptrs = {"q": qh.data.ptr, "k": kh.data.ptr, "v": vh.data.ptr, "o": o.data.ptr}
            lse = None
            if return_lse:
                lse = cupy.empty((b, h, sq), np.float32)      # cuDNN's (B, H, Sq, 1) stats, natural log
                ptrs["stats"] = lse.data.ptr
            execute(entry, ptrs)
            o = give_back(o, q.dtype, out)
        note(self.op, short(dt), self.name)
        return (o, lse) if return_lse else o


# --------------------------------------------------------------------------- backward

class CudnnAttentionBackward(CudnnProvider):
    """``flash_attention_backward`` through cuDNN's SDPA backward graph (deterministic)."""

    def supports(self, q: Any, k: Any, v: Any, o: Any, do: Any, lse: Any, *, causal: bool = False,
                 scale: float | None = None, out: tuple | None = None, stream: Any | None = None,
                 policy: Any = None) -> str | None:
        shape = _checked(self.op, check_attention, self.op, q, k, v)
        if isinstance(shape, str):
            return shape
        b, h, hkv, sq, sk, d = shape
        elem, why = self.elem(np.dtype(q.dtype), policy)
        if why:
            return why
        if tuple(lse.shape) != (b, h, sq) or tuple(o.shape) != tuple(q.shape) or tuple(do.shape) != tuple(q.shape):
            return "o/do/lse shapes do not match q; the own kernel reports it"
        if np.dtype(lse.dtype) != _F32:
            return f"lse is {dtype_name(lse.dtype)}, cuDNN's stats are f32"
        if not (b and h and sq and sk):
            return "empty attention"
        if causal and sq > sk:
            return f"causal with Sq={sq} > Sk={sk}: rows with no visible key"
        return self.head_dim(d, "backward")

    def run(self, q: Any, k: Any, v: Any, o: Any, do: Any, lse: Any, *, causal: bool = False,
            scale: float | None = None, out: tuple | None = None, stream: Any | None = None,
            policy: Any = None) -> tuple:
        import cupy
        b, h, hkv, sq, sk, d = check_attention(self.op, q, k, v)
        check_stream(self.op, stream)
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        dt = self.run_type(np.dtype(q.dtype), policy)
        key = ("sdpa_bwd", b, h, hkv, sq, sk, d, dt.str, bool(causal), scale, DETERMINISTIC_BACKWARD)
        qs, ks = bhsd_strides(b, h, sq, d), bhsd_strides(b, hkv, sk, d)

        def build(cudnn, handle):
            io = _io_type(cudnn, dt)
            g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)
            t = {n: g.tensor(name=n, dim=[b, h, sq, d], stride=qs, data_type=io) for n in ("q", "o", "dO")}
            t.update({n: g.tensor(name=n, dim=[b, hkv, sk, d], stride=ks, data_type=io) for n in ("k", "v")})
            t["stats"] = g.tensor(name="stats", dim=[b, h, sq, 1], stride=[h * sq, sq, 1, 1],
                                  data_type=cudnn.data_type.FLOAT)
            dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["dO"],
                                         stats=t["stats"], attn_scale=scale,
                                         use_deterministic_algorithm=DETERMINISTIC_BACKWARD,
                                         **causal_mask(cudnn, causal))
            for name, tensor, dims, strides in (("dQ", dq, [b, h, sq, d], qs), ("dK", dk, [b, hkv, sk, d], ks),
                                                ("dV", dv, [b, hkv, sk, d], ks)):
                tensor.set_output(True).set_dim(dims).set_stride(strides).set_data_type(io)
                t[name] = tensor
            return g, t

        entry = cached_graph(key, build)
        with launch_stream(stream):
            qh, kh, vh, oh, doh = (dense(x, dt) for x in (q, k, v, o, do))
            stats = dense(lse, _F32)
            grads = [cupy.empty(x.shape, dt) for x in (q, k, v)]
            execute(entry, {"q": qh.data.ptr, "k": kh.data.ptr, "v": vh.data.ptr, "o": oh.data.ptr,
                            "dO": doh.data.ptr, "stats": stats.data.ptr, "dQ": grads[0].data.ptr,
                            "dK": grads[1].data.ptr, "dV": grads[2].data.ptr})
            grads = [g_ if g_.dtype == q.dtype else g_.astype(q.dtype) for g_ in grads]
            if out is not None:
                for dst, g_ in zip(out, grads):
                    dst[...] = g_
                grads = list(out)
        note(self.op, short(dt), self.name)
        return tuple(grads)


register_provider(CudnnAttention("flash_attention"))
register_provider(CudnnAttentionBackward("flash_attention_backward"))
