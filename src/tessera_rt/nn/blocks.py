"""The transformer block and its parts: attention (heads over tp), the SwiGLU MLP, and the
registry of parts that live above nn (the MoE block, the pipeline stage plan)."""
from __future__ import annotations

import math
from typing import Any

from .. import op
from ..dist.comm.mesh import Mesh
from .layers import Linear, RMSNorm
from .module import Module
from .parts import PARTS


class Attention(Module):
    """Multi-head self-attention, heads sharded over tp: q/k/v projections are
    column-parallel (each rank computes its heads), flash attention runs per head with no
    communication, and the output projection is row-parallel (a pending sum over tp).

    Parameters
    ----------
    d_model : int
        The model width.
    n_heads : int
        Heads (divisible by the tp size).
    mesh : Mesh, optional
        None: plain arrays.
    tp_axis : str
        The tensor-parallel mesh axis.
    dtype : str or dtype
        The parameters' dtype.
    causal : bool
        Mask later positions.
    """

    def __init__(self, d_model: int, n_heads: int, *, mesh: Mesh | None = None, tp_axis: str = "tp",
                 dtype: Any = "float32", causal: bool = True):
        super().__init__(mesh, tp_axis, dtype)
        if d_model % n_heads:
            raise ValueError(f"Attention: d_model={d_model} is not a multiple of n_heads={n_heads}")
        self.d, self.h, self.hd, self.causal = d_model, n_heads, d_model // n_heads, causal
        kw = dict(mesh=mesh, tp_axis=tp_axis, dtype=dtype)
        self.q, self.k, self.v = (Linear(d_model, d_model, parallel="column", **kw) for _ in range(3))
        self.o = Linear(d_model, d_model, parallel="row", std=1.0 / math.sqrt(2 * d_model), **kw)

    def init(self, seed: int, name: str = "attn") -> dict:
        """The parameters (global values, placed on the mesh in their layouts).

        Parameters
        ----------
        seed : int
            Every parameter's values depend only on (seed, name): the same global tensors on any
            mesh.
        name : str
            The parameters' name prefix (default "attn").

        Returns
        -------
        dict
            The parameter tree.
        """
        return {n: getattr(self, n).init(seed, f"{name}.{n}") for n in ("q", "k", "v", "o")}

    def _heads(self, t, b: int, s: int):
        return op.transpose(op.reshape(t, (b, s, self.h, self.hd)), (0, 2, 1, 3))

    def __call__(self, p: dict, x):
        b, s = x.shape[0], x.shape[1]
        q, k, v = (self._heads(getattr(self, n)(p[n], x), b, s) for n in ("q", "k", "v"))
        y = op.flash_attention(q, k, v, causal=self.causal)
        y = op.reshape(op.transpose(y, (0, 2, 1, 3)), (b, s, self.d))
        return self.o(p["o"], y)


class SwiGLUMLP(Module):
    """``(silu(x W1) * (x W3)) W2``: W1, W3 column-parallel, W2 row-parallel.

    Parameters
    ----------
    d_model : int
        The model width.
    hidden : int
        The hidden width (divisible by the tp size).
    mesh : Mesh, optional
        None: plain arrays.
    tp_axis : str
        The tensor-parallel mesh axis.
    dtype : str or dtype
        The parameters' dtype.
    """

    def __init__(self, d_model: int, hidden: int, *, mesh: Mesh | None = None, tp_axis: str = "tp",
                 dtype: Any = "float32"):
        super().__init__(mesh, tp_axis, dtype)
        kw = dict(mesh=mesh, tp_axis=tp_axis, dtype=dtype)
        self.w1 = Linear(d_model, hidden, parallel="column", **kw)
        self.w3 = Linear(d_model, hidden, parallel="column", **kw)
        self.w2 = Linear(hidden, d_model, parallel="row", std=1.0 / math.sqrt(2 * hidden), **kw)

    def init(self, seed: int, name: str = "mlp") -> dict:
        """The parameters (global values, placed on the mesh in their layouts).

        Parameters
        ----------
        seed : int
            Every parameter's values depend only on (seed, name): the same global tensors on any
            mesh.
        name : str
            The parameters' name prefix (default "mlp").

        Returns
        -------
        dict
            The parameter tree.
        """
        return {n: getattr(self, n).init(seed, f"{name}.{n}") for n in ("w1", "w3", "w2")}

    def __call__(self, p: dict, x):
        return self.w2(p["w2"], op.swiglu(x, p["w1"]["w"], p["w3"]["w"]))


class TransformerBlock(Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Parameters
    ----------
    d_model : int
        The model width.
    n_heads : int
        Attention heads.
    hidden : int
        The MLP's hidden width.
    mesh : Mesh, optional
        None: plain arrays.
    tp_axis : str
        The tensor-parallel mesh axis.
    dtype : str or dtype
        The parameters' dtype.
    moe : dict, optional
        Routed experts over ``ep_axis`` instead of the dense MLP: ``tessera_rt.moe``'s MoE
        block arguments (num_experts, top_k, ...).
    ep_axis : str
        The expert-parallel mesh axis.
    """

    def __init__(self, d_model: int, n_heads: int, hidden: int, *, mesh: Mesh | None = None, tp_axis: str = "tp",
                 dtype: Any = "float32", moe: dict | None = None, ep_axis: str = "ep"):
        super().__init__(mesh, tp_axis, dtype)
        kw = dict(mesh=mesh, tp_axis=tp_axis, dtype=dtype)
        self.norm1, self.norm2 = RMSNorm(d_model, **kw), RMSNorm(d_model, **kw)
        self.attn = Attention(d_model, n_heads, **kw)
        if moe:                                # routed experts over ep instead of the dense MLP
            self.mlp = PARTS.need_moe_mlp()(d_model, hidden, mesh=mesh, ep_axis=ep_axis, dtype=dtype, **moe)
        else:
            self.mlp = SwiGLUMLP(d_model, hidden, **kw)

    def init(self, seed: int, name: str = "block") -> dict:
        """The parameters (global values, placed on the mesh in their layouts).

        Parameters
        ----------
        seed : int
            Every parameter's values depend only on (seed, name): the same global tensors on any
            mesh.
        name : str
            The parameters' name prefix (default "block").

        Returns
        -------
        dict
            The parameter tree.
        """
        return {n: getattr(self, n).init(seed, f"{name}.{n}") for n in ("norm1", "attn", "norm2", "mlp")}

    def __call__(self, p: dict, x):
        x = op.add(x, self.attn(p["attn"], self.norm1(p["norm1"], x)))
        return op.add(x, self.mlp(p["mlp"], self.norm2(p["norm2"], x)))
