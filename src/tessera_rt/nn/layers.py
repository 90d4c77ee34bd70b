"""The layers: Linear, the vocab-parallel embedding (a gather) and cross-entropy (with its vocab
ids and, on vocab-parallel logits, a one-hot pick), and RMSNorm."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import op
from ..autodiff import detach, no_grad
from ..backend import get_backend
from ..dist.comm.mesh import Mesh
from ..dist.tensor.dtensor import DTensor, distribute
from ..dist.tensor.layout import ShardSpec
from .module import Module, _rng_normal


class Linear(Module):
    """``y = x @ W (+ b)``.

    Parameters
    ----------
    d_in, d_out : int
        The input and output features.
    parallel : {"column", "row"} or None
        "column": W sharded on its output dim; "row": sharded on its input dim (the output is
        a pending sum over tp); None: replicated.
    bias : bool
        Add a bias ``b``.
    mesh : Mesh, optional
        None: plain arrays.
    tp_axis : str
        The tensor-parallel mesh axis.
    dtype : str or dtype
        The parameters' dtype.
    std : float, optional
        The weights' init standard deviation; default ``1 / sqrt(d_in)``.
    """

    def __init__(self, d_in: int, d_out: int, *, parallel: str | None = "column", bias: bool = False,
                 mesh: Mesh | None = None, tp_axis: str = "tp", dtype: Any = "float32", std: float | None = None):
        super().__init__(mesh, tp_axis, dtype)
        if parallel not in ("column", "row", None):
            raise ValueError(f"Linear(parallel={parallel!r}): use 'column', 'row' or None")
        self.d_in, self.d_out, self.parallel, self.bias = d_in, d_out, parallel, bias
        self.std = 1.0 / math.sqrt(d_in) if std is None else std

    def init(self, seed: int, name: str = "linear") -> dict:
        """The parameters (global values, placed on the mesh in their layouts).

        Parameters
        ----------
        seed : int
            Every parameter's values depend only on (seed, name): the same global tensors on any
            mesh.
        name : str
            The parameters' name prefix (default "linear").

        Returns
        -------
        dict
            The parameter tree.
        """
        kind = {"column": "col", "row": "row", None: "rep"}[self.parallel]
        p = {"w": self._place(_rng_normal(seed, name + ".w", (self.d_in, self.d_out), self.std), self.spec(kind))}
        if self.bias:
            p["b"] = self._place(np.zeros(self.d_out, np.float32), self.spec("vec" if self.parallel == "column"
                                                                             else "rep"))
        return p

    def __call__(self, p: dict, x):
        y = op.matmul(x, p["w"])
        return op.add(y, p["b"]) if self.bias else y


# cache: (vocab, dtype, backend) -> arange(vocab), for one-hot comparisons
_IOTAS: dict = {}


def vocab_iota(vocab: int, ndim: int, mesh: Mesh | None = None, tp_axis: str | None = None) -> Any:
    """``arange(vocab)`` shaped ``(1,) * ndim + (vocab,)``, its last dim sharded over ``tp_axis``
    (each rank holds the ids of its vocab slice).

    Parameters
    ----------
    vocab : int
        The vocabulary size.
    ndim : int
        The leading length-1 dims (the ids' ndim).
    mesh : Mesh, optional
        None: a plain array.
    tp_axis : str, optional
        The axis the vocab dim is sharded over; None: replicated.

    Returns
    -------
    DTensor or array
        The ids, int32.
    """
    key = (vocab, ndim, mesh, tp_axis, get_backend().name)     # (tests switch backends in one process)
    t = _IOTAS.get(key)
    if t is None:
        a = np.arange(vocab, dtype=np.int32).reshape((1,) * ndim + (vocab,))
        spec = ShardSpec(partition=("col",), mesh_axes=(tp_axis,)) if tp_axis else None
        t = _IOTAS[key] = get_backend().asarray(a) if mesh is None else distribute(a, layout=spec, mesh=mesh)
    return t


def one_hot(ids: Any, iota: Any, dtype: Any) -> Any:
    """One-hot rows of integer ``ids`` against ``iota`` (from ``vocab_iota``): a constant,
    laid out like iota's vocab dim, so a vocab-parallel rank builds only its columns.

    Parameters
    ----------
    ids : DTensor or array
        Integer ids ``(...)``.
    iota : DTensor or array
        ``vocab_iota(vocab, ids.ndim, ...)``.
    dtype : str or dtype
        The result's dtype.

    Returns
    -------
    DTensor or array
        ``(..., vocab)``: 1 where the column is the id.
    """
    with no_grad():
        col = op.reshape(ids, tuple(ids.shape) + (1,))
        return op.astype(op.equal(col, iota), dtype)


class Embedding(Module):
    """Vocab-parallel embedding: the (vocab, dim) table is sharded over tp on the vocab dim;
    each rank gathers the rows of the ids it owns (``op.embedding``: zeros for the others)
    and the result is a pending sum over tp.  The backward is a scatter-add into its rows.

    Parameters
    ----------
    vocab : int
        The vocabulary size.
    dim : int
        The embedding width.
    mesh : Mesh, optional
        None: plain arrays.
    tp_axis : str
        The tensor-parallel mesh axis.
    dtype : str or dtype
        The table's dtype.
    std : float
        The init standard deviation.
    """

    def __init__(self, vocab: int, dim: int, *, mesh: Mesh | None = None, tp_axis: str = "tp", dtype: Any = "float32",
                 std: float = 0.02):
        super().__init__(mesh, tp_axis, dtype)
        self.vocab, self.dim, self.std = vocab, dim, std

    def iota(self, ndim: int) -> Any:
        """``vocab_iota`` for ids of ``ndim`` dims, sharded like the table.

        Parameters
        ----------
        ndim : int
            The ids' ndim.

        Returns
        -------
        DTensor or array
            The vocab ids.
        """
        return vocab_iota(self.vocab, ndim, self.mesh, self.tp)

    def init(self, seed: int, name: str = "embed") -> dict:
        """The parameters (global values, placed on the mesh in their layouts).

        Parameters
        ----------
        seed : int
            Every parameter's values depend only on (seed, name): the same global tensors on any
            mesh.
        name : str
            The parameters' name prefix (default "embed").

        Returns
        -------
        dict
            The parameter tree.
        """
        return {"w": self._place(_rng_normal(seed, name + ".w", (self.vocab, self.dim), self.std), self.spec("row"))}

    def __call__(self, p: dict, ids):
        return op.embedding(ids, p["w"])


def cross_entropy(logits: Any, targets: Any, iota: Any = None) -> Any:
    """Mean token cross-entropy of ``logits`` against integer ``targets``.  Vocab-parallel
    when the logits are sharded over tp on the vocab dim: the max and the sum of
    exponentials are pending reductions over tp (one small all-reduce each) and the target
    logit is picked by a one-hot against the local vocab slice, so the full logits never
    exist on one rank.

    Parameters
    ----------
    logits : DTensor or array
        ``(..., V)``.
    targets : DTensor or array
        Integer ids ``(...)``.
    iota : DTensor, optional
        ``vocab_iota`` with the logits' vocab sharding (needed when they are sharded).

    Returns
    -------
    DTensor or array
        The scalar mean loss.
    """
    if type(detach(logits)) is not DTensor and type(targets) is not DTensor:
        return op.softmax_cross_entropy(logits, targets)       # one fused kernel, f32 statistics
    if np.dtype(logits.dtype).itemsize < 4:
        logits = op.astype(logits, "float32")                  # the op chain's statistics in f32
    v = logits.shape[-1]
    if iota is None:
        iota = vocab_iota(v, len(targets.shape))
    with no_grad():
        m = op.max(logits, axis=-1, keepdims=True)         # stability shift: no gradient needed
    shifted = op.sub(logits, m)
    lse = op.log(op.sum(op.exp(shifted), axis=-1))
    picked = op.sum(op.mul(shifted, one_hot(targets, iota, logits.dtype)), axis=-1)
    return op.mean(op.sub(lse, picked))


class RMSNorm(Module):
    """RMSNorm over the last dim with a learned scale (``op.rmsnorm``), replicated.

    Parameters
    ----------
    dim : int
        The normalized width.
    eps : float
        Added to the mean square.
    mesh : Mesh, optional
        None: plain arrays.
    tp_axis : str
        The tensor-parallel mesh axis.
    dtype : str or dtype
        The scale's dtype.
    """
    def __init__(self, dim: int, *, eps: float = 1e-6, mesh: Mesh | None = None, tp_axis: str = "tp",
                 dtype: Any = "float32"):
        super().__init__(mesh, tp_axis, dtype)
        self.dim, self.eps = dim, eps

    def init(self, seed: int, name: str = "norm") -> dict:
        """The parameters (global values, placed on the mesh in their layouts).

        Parameters
        ----------
        seed : int
            Every parameter's values depend only on (seed, name): the same global tensors on any
            mesh.
        name : str
            The parameters' name prefix (default "norm").

        Returns
        -------
        dict
            The parameter tree.
        """
        return {"w": self._place(np.ones(self.dim, np.float32), None)}

    def __call__(self, p: dict, x):
        return op.rmsnorm(x, p["w"], eps=self.eps)
