"""tessera_rt.op: the public op namespace (seed 000 §4.1).

Every op takes DTensors or plain arrays.  With a DTensor argument it runs through the
DTensor dispatcher (sharding rule, the collectives the layouts need, the local kernel);
with arrays only it calls the kernel table (``matmul``, ``softmax``, ``layernorm``,
``rmsnorm``) or the array module directly.

    from tessera_rt import op
    Y = op.matmul(X, W, tile_shape=(128, 128, 64))
    P = op.softmax(S, axis=-1)
    policy = op.numeric(dtype="fp8_e4m3", accum="f32")

Names in ``tessera_rt.kernels.__all__`` that this module does not define (flash_attention,
swiglu, quantize_fp8, ...) are re-exported at the bottom and work on arrays.
"""
from __future__ import annotations

from typing import Any

from .. import kernels as _kernels
from ..autodiff.tape import differentiable
from ..backend import get_backend
from ..dist.tensor import dispatch as _d
from ..dist.tensor.dtensor import DTensor
from ..dist.tensor.rules import unary_table
from ..kernels.numerics import NumericPolicy, numeric

__all__ = [
    "numeric", "NumericPolicy", "matmul", "softmax", "layernorm", "rmsnorm",
    "add", "sub", "mul", "div", "pow", "maximum", "minimum", "less", "less_equal", "greater",
    "greater_equal", "equal", "not_equal",
    "neg", "abs", "exp", "log", "sqrt", "rsqrt", "tanh", "sin", "cos", "square", "relu", "sigmoid", "silu",
    "astype", "sum", "mean", "max", "min", "transpose", "reshape", "getitem", "flash_attention", "swiglu",
    "moe", "set_router", "set_router_regularizer",
]


def _is_dt(*xs) -> bool:
    for x in xs:                 # (a loop, not any(generator): every op call asks, ~0.2 us less)
        if type(x) is DTensor:
            return True
    return False


def _no_extras(op: str, **kw) -> None:
    given = [k for k, v in kw.items() if v is not None]
    if given:
        raise TypeError(f"op.{op} on a DTensor does not take {given}: the result is a new DTensor and "
                        "runs on the compute stream")


# --------------------------------------------------------------------------- kernels

@differentiable("matmul", ("a", "b"))
def matmul(a: Any, b: Any, *, tile_shape: tuple[int, int, int] | None = None, out: Any = None, stream: Any = None,
           policy: NumericPolicy | None = None) -> Any:
    """``a @ b`` (batched, broadcasting).

    Parameters
    ----------
    a, b : array or DTensor
        The operands; DTensors go through the sharding rules (eager collectives where needed).
    tile_shape : tuple of int, optional
        ``(BM, BN, BK)`` for the kernel (arrays only).
    out : array, optional
        Receives the result (arrays only).
    stream : optional
        The stream the kernel runs on (arrays only; default the compute stream).
    policy : NumericPolicy, optional
        Accumulation and output dtypes (default: the current ``op.numeric`` policy).

    Returns
    -------
    array or DTensor
        The product, a DTensor when an operand is one.
    """
    if _is_dt(a, b):
        _no_extras("matmul", out=out, stream=stream)
        return _d.matmul(a, b, tile_shape, policy)
    return get_backend().kernel("matmul", like=a)(a, b, tile_shape=tile_shape, out=out, stream=stream, policy=policy)


@differentiable("softmax", ("x",))
def softmax(x: Any, axis: int = -1, *, out: Any = None, stream: Any = None,
            policy: NumericPolicy | None = None) -> Any:
    """Softmax along ``axis``; a DTensor sharded along it is redistributed first.

    Parameters
    ----------
    x : array or DTensor
        The input.
    axis : int
        The dim normalized over.
    out : array, optional
        Receives the result (arrays only).
    stream : optional
        The stream the kernel runs on (arrays only).
    policy : NumericPolicy, optional
        Accumulation and output dtypes (default: the current ``op.numeric`` policy).

    Returns
    -------
    array or DTensor
        ``exp(x - max) / sum(exp(x - max))`` along ``axis``.
    """
    if _is_dt(x):
        _no_extras("softmax", out=out, stream=stream)
        return _d.softmax(x, axis, policy)
    return get_backend().kernel("softmax", like=x)(x, axis=axis, out=out, stream=stream, policy=policy)


@differentiable("layernorm", ("x", "weight", "bias"))
def layernorm(x: Any, weight: Any = None, bias: Any = None, *, eps: float = 1e-5, out: Any = None,
              stream: Any = None, policy: NumericPolicy | None = None) -> Any:
    """LayerNorm over the last dim (which a DTensor must not be sharded on: it is moved first).

    Parameters
    ----------
    x : array or DTensor
        The input, normalized over its last dim.
    weight, bias : array or DTensor, optional
        The scale and shift (length of the last dim); None: 1 and 0.
    eps : float
        Added to the variance.
    out : array, optional
        Receives the result (arrays only).
    stream : optional
        The stream the kernel runs on (arrays only).
    policy : NumericPolicy, optional
        Accumulation and output dtypes (default: the current ``op.numeric`` policy).

    Returns
    -------
    array or DTensor
        ``(x - mean) / sqrt(var + eps) * weight + bias``.
    """
    if _is_dt(x, weight, bias):
        _no_extras("layernorm", out=out, stream=stream)
        return _d.layernorm(x, weight, bias, eps, policy)
    return get_backend().kernel("layernorm", like=x)(x, weight, bias, eps=eps, out=out, stream=stream, policy=policy)


@differentiable("rmsnorm", ("x", "weight"))
def rmsnorm(x: Any, weight: Any = None, *, eps: float = 1e-6, out: Any = None, stream: Any = None,
            policy: NumericPolicy | None = None) -> Any:
    """RMSNorm over the last dim.

    Parameters
    ----------
    x : array or DTensor
        The input, normalized over its last dim.
    weight : array or DTensor, optional
        The scale (length of the last dim); None: 1.
    eps : float
        Added to the mean square.
    out : array, optional
        Receives the result (arrays only).
    stream : optional
        The stream the kernel runs on (arrays only).
    policy : NumericPolicy, optional
        Accumulation and output dtypes (default: the current ``op.numeric`` policy).

    Returns
    -------
    array or DTensor
        ``x / sqrt(mean(x**2) + eps) * weight``.
    """
    if _is_dt(x, weight):
        _no_extras("rmsnorm", out=out, stream=stream)
        return _d.rmsnorm(x, weight, eps, policy)
    return get_backend().kernel("rmsnorm", like=x)(x, weight, eps=eps, out=out, stream=stream, policy=policy)


# --------------------------------------------------------------------------- elementwise

def _binary(name: str, xp_name: str):
    def fn(a: Any, b: Any) -> Any:
        if _is_dt(a, b):
            return _d.binary(name, a, b)
        return getattr(get_backend().xp, xp_name)(a, b)
    fn.__name__ = fn.__qualname__ = xp_name if name in ("maximum", "minimum") else name
    fn.__doc__ = (f"Elementwise {xp_name} with NumPy broadcasting (DTensors, arrays or scalars).\n\n"
                  "Parameters\n----------\na, b : DTensor, array or scalar\n    The operands.\n\n"
                  "Returns\n-------\nDTensor or array\n    The result, a DTensor when an operand is one.\n")
    return differentiable(name)(fn)


add = _binary("add", "add")
sub = _binary("sub", "subtract")
mul = _binary("mul", "multiply")
div = _binary("div", "true_divide")
pow = _binary("pow", "power")
maximum = _binary("maximum", "maximum")
minimum = _binary("minimum", "minimum")
less = _binary("lt", "less")
less_equal = _binary("le", "less_equal")
greater = _binary("gt", "greater")
greater_equal = _binary("ge", "greater_equal")
equal = _binary("eq", "equal")
not_equal = _binary("ne", "not_equal")


def _unary(name: str):
    def fn(x: Any) -> Any:
        if _is_dt(x):
            return _d.unary(name, x)
        return unary_table(get_backend().xp)[name](x)
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (f"Elementwise {name} (DTensor or array).\n\nParameters\n----------\nx : DTensor or array\n"
                  "    The input.\n\nReturns\n-------\nDTensor or array\n    The result, with ``x``'s layout.\n")
    return differentiable(name)(fn)


neg = _unary("neg")
abs = _unary("abs")
exp = _unary("exp")
log = _unary("log")
sqrt = _unary("sqrt")
rsqrt = _unary("rsqrt")
tanh = _unary("tanh")
sin = _unary("sin")
cos = _unary("cos")
square = _unary("square")
relu = _unary("relu")
sigmoid = _unary("sigmoid")
silu = _unary("silu")


@differentiable("astype")
def astype(x: Any, dtype: Any) -> Any:
    """``x`` converted to ``dtype``.

    Parameters
    ----------
    x : array or DTensor
        The input.
    dtype : str or dtype
        The target dtype (a name ``resolve_dtype`` knows, e.g. "bf16", or a NumPy dtype).

    Returns
    -------
    array or DTensor
        A converted copy with the same layout.
    """
    from ..dtypes import resolve_dtype
    if _is_dt(x):
        return x.astype(dtype)
    return x.astype(resolve_dtype(dtype))


# --------------------------------------------------------------------------- reductions, shape

def _reduction(name: str):
    def fn(x: Any, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Any:
        if _is_dt(x):
            return _d.reduce(name, x, axis, keepdims)
        return getattr(get_backend().xp, name)(x, axis=axis, keepdims=keepdims)
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (f"{name} over ``axis`` (None: all dims).  On a DTensor sharded along a reduced dim "
                  "the result is a pending reduction (no collective until it is needed).\n\n"
                  "Parameters\n----------\nx : DTensor or array\n    The input.\n"
                  "axis : int or tuple of int, optional\n    The dims reduced; None: all.\n"
                  "keepdims : bool\n    Keep the reduced dims with length 1.\n\n"
                  "Returns\n-------\nDTensor or array\n    The reduction.\n")
    return differentiable(name)(fn)


sum = _reduction("sum")
mean = _reduction("mean")
max = _reduction("max")
min = _reduction("min")


@differentiable("transpose")
def transpose(x: Any, axes: tuple[int, ...] | None = None) -> Any:
    """Permute dims; a DTensor's layout is permuted too.

    Parameters
    ----------
    x : array or DTensor
        The input.
    axes : tuple of int, optional
        The new order of the dims; None reverses them.

    Returns
    -------
    array or DTensor
        The permuted tensor.
    """
    if _is_dt(x):
        return _d.transpose(x, axes)
    return get_backend().xp.transpose(x, axes)


@differentiable("reshape")
def reshape(x: Any, shape: tuple[int, ...]) -> Any:
    """Reshape; a DTensor keeps a dim's sharding where every rank's piece stays contiguous and
    gathers it first otherwise.

    Parameters
    ----------
    x : array or DTensor
        The input.
    shape : tuple of int
        The new (global) shape; one entry may be -1.

    Returns
    -------
    array or DTensor
        The reshaped tensor.
    """
    if _is_dt(x):
        return _d.reshape(x, shape)
    return get_backend().xp.reshape(x, shape)


@differentiable("getitem")
def getitem(x: Any, index: Any) -> Any:
    """``x[index]`` on an array (traced values support ``x[...]`` through this).

    Parameters
    ----------
    x : array
        The input (DTensor indexing raises with what to do instead).
    index : int, slice, tuple or array
        A NumPy index.

    Returns
    -------
    array
        ``x[index]``.
    """
    return x[index]                   # DTensor indexing raises with what to do instead


@differentiable("flash_attention", ("q", "k", "v"))
def flash_attention(q: Any, k: Any, v: Any, *, causal: bool = False, scale: float | None = None,
                    return_lse: bool = False, block_kv: int | None = None, out: Any = None, stream: Any = None,
                    policy: NumericPolicy | None = None) -> Any:
    """``softmax(q kᵀ·scale) v`` for ``(B, H, S, D)`` inputs.  DTensors may be sharded over batch
    and heads (heads over tp: each rank attends with its own heads, no communication).

    Parameters
    ----------
    q, k, v : array or DTensor
        Queries ``(B, H, Sq, D)``, keys and values ``(B, H, Sk, D)``.
    causal : bool
        Mask keys after each query's position (aligned at the end when ``Sq < Sk``).
    scale : float, optional
        The logit scale; default ``1 / sqrt(D)``.
    return_lse : bool
        Also return the log-sum-exp per query row (arrays only).
    block_kv : int, optional
        Keys per tile in the kernel (arrays only).
    out : array, optional
        Receives the result (arrays only).
    stream : optional
        The stream the kernel runs on (arrays only).
    policy : NumericPolicy, optional
        Accumulation and output dtypes (default: the current ``op.numeric`` policy).

    Returns
    -------
    array or DTensor, or (array, array)
        The attention output ``(B, H, Sq, D)``; with ``return_lse`` also the ``(B, H, Sq)`` log-sum-exp.
    """
    if _is_dt(q, k, v):
        _no_extras("flash_attention", out=out, stream=stream, block_kv=block_kv)
        if return_lse:
            raise TypeError("op.flash_attention on DTensors does not return lse; call it on the local pieces "
                            "for that")
        return _d.dispatch("flash_attention", (bool(causal), scale, policy), (q, k, v))
    return get_backend().kernel("flash_attention", like=q)(q, k, v, causal=causal, scale=scale, return_lse=return_lse,
                                                   block_kv=block_kv, out=out, stream=stream, policy=policy)


@differentiable("swiglu", ("x", "w1", "w3"))
def swiglu(x: Any, w1: Any, w3: Any, *, out: Any = None, stream: Any = None,
           policy: NumericPolicy | None = None) -> Any:
    """``silu(x @ w1) * (x @ w3)``; on DTensors the two matmuls and the gate run through the
    dispatcher (column-sharded w1/w3 give a column-sharded result without communication).

    Parameters
    ----------
    x : array or DTensor
        The input ``(..., K)``.
    w1, w3 : array or DTensor
        The gate and up projections ``(K, N)``.
    out : array, optional
        Receives the result (arrays only).
    stream : optional
        The stream the kernel runs on (arrays only).
    policy : NumericPolicy, optional
        Accumulation and output dtypes (default: the current ``op.numeric`` policy).

    Returns
    -------
    array or DTensor
        The gated product ``(..., N)``.
    """
    if _is_dt(x, w1, w3):
        _no_extras("swiglu", out=out, stream=stream)
        return _d.binary("mul", _d.unary("silu", _d.matmul(x, w1, None, policy)), _d.matmul(x, w3, None, policy))
    return get_backend().kernel("swiglu", like=x)(x, w1, w3, out=out, stream=stream, policy=policy)


# --------------------------------------------------------------------------- mixture of experts

# The layer lives in tessera_rt.moe, above op: moe fills this table on import (and
# `import tessera_rt` imports it), so op does not import upward.
_MOE: dict = {}


def register_moe(**parts) -> None:
    """tessera_rt.moe's ``MoE``, ``set_router`` and ``set_router_regularizer``, for the names below."""
    _MOE.update(parts)


def _moe_part(name: str):
    part = _MOE.get(name)
    if part is None:
        raise RuntimeError(f"op.{name} is tessera_rt.moe's: import tessera_rt (or tessera_rt.moe) first")
    return part


def moe(num_experts: int, top_k: int = 2, capacity_factor: float | None = 1.25, **kw: Any) -> Any:
    """A mixture-of-experts layer over the ``ep`` mesh axis (``tessera_rt.moe.MoE``).

    Parameters
    ----------
    num_experts : int
        Experts in all (divided over the ``ep`` axis).
    top_k : int
        Experts each token is routed to.
    capacity_factor : float or None
        Slots per expert as a multiple of the even share; None: no token is dropped.
    **kw
        The rest of ``tessera_rt.moe.MoE``'s parameters.

    Returns
    -------
    tessera_rt.moe.MoE
        The layer.
    """
    return _moe_part("MoE")(num_experts, top_k, capacity_factor, **kw)


def set_router(layer: Any, fn: Any) -> Any:
    """Route ``layer`` with ``fn(logits, meta) -> logits`` (``tessera_rt.moe.set_router``).

    Parameters
    ----------
    layer : tessera_rt.moe.MoE
        The layer.
    fn : callable
        ``fn(logits, meta) -> logits`` in traced ``op.*`` code.

    Returns
    -------
    tessera_rt.moe.MoE
        ``layer``.
    """
    return _moe_part("set_router")(layer, fn)


def set_router_regularizer(layer: Any, kind: str = "topology_distance", weight: float = 0.05, **kw: Any) -> Any:
    """Locality-aware gating for ``layer`` (``tessera_rt.moe.set_router_regularizer``).

    Parameters
    ----------
    layer : tessera_rt.moe.MoE
        The layer.
    kind : str
        The one kind is "topology_distance".
    weight : float
        The penalty's weight (>= 0).
    **kw
        ``groups`` and ``scale``, as ``tessera_rt.moe.set_router_regularizer`` takes them.

    Returns
    -------
    tessera_rt.moe.MoE
        ``layer``.
    """
    return _moe_part("set_router_regularizer")(layer, kind, weight, **kw)


# --------------------------------------------------------------------------- kernels re-exported

_NOT_OPS = ("NumericPolicy", "numeric", "tile", "inspect_ir", "autotune")
_NN_OPS = ("softmax_cross_entropy",)          # op.nn_ops's, through the kernel table
for _name in _kernels.__all__:
    if _name not in globals() and _name not in _NN_OPS:
        _fn = getattr(_kernels, _name)
        # every kernel entry point is hooked: traced inputs get the op's VJP rule (or a clear error)
        globals()[_name] = _fn if _name in _NOT_OPS else differentiable(_name)(_fn)
        __all__.append(_name)
del _name, _fn
