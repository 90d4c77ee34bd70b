"""Tensor-parallel modules on DTensors (seed 002 §2.8's transformer block, seed 000 §2.2's
layouts), written with ``op.*`` so ``ts.grad`` differentiates them.

Modules are configurations; parameters are a pytree (a dict) that the caller owns and
passes in, as ``ts.grad(loss_fn)(params, ...)`` needs::

    mesh = dist.Mesh(axes=["dp", "tp"], shape={"dp": 2, "tp": 2})
    model = nn.Transformer(vocab=96, d_model=64, n_heads=4, n_layers=2, seq_len=64, mesh=mesh)
    params = model.init(seed=0)                       # the same global values on any mesh
    loss = model.loss(params, tokens, targets)        # tokens: (B, S) ints, batch over dp

Layouts (Megatron's): ``Linear(parallel="column")`` shards the weight's output dim over
``tp`` (its output comes out sharded, no communication); ``parallel="row"`` shards the
input dim (its output is a pending sum over ``tp``, reduced when the residual add needs
it).  Attention shards heads over ``tp`` (q/k/v column-parallel, the output projection
row-parallel); the SwiGLU MLP is column- then row-parallel; the embedding and the LM
head shard the vocabulary.  Data parallelism shards the batch over ``dp``: replicated
parameters' gradients arrive as pending sums over ``dp`` and ``ts.grad`` all-reduces
each one, asynchronously, as soon as it is complete.  With ``mesh=None`` every module
runs on plain arrays (the single-process reference).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import op
from .autodiff import checkpoint, detach, no_grad
from .dist.tensor.dtensor import DTensor, distribute
from .dist.tensor.layout import ShardSpec
from .dtypes import resolve_dtype

__all__ = [
    "Module", "Linear", "Embedding", "RMSNorm", "Attention", "SwiGLUMLP", "TransformerBlock", "Transformer",
    "cross_entropy", "one_hot", "vocab_iota",
]


def _rng_normal(seed: int, name: str, shape: tuple, std: float) -> np.ndarray:
    # one stream per (seed, parameter name): every rank draws the same global tensor, so a
    # model initialized on any mesh holds the same values
    key = np.frombuffer(name.encode(), dtype=np.uint8).astype(np.uint64).sum() * 1000003 + len(name)
    rng = np.random.default_rng([seed, int(key) & 0xFFFFFFFF])
    return (rng.standard_normal(shape) * std).astype(np.float32)


class Module:
    """A configuration that makes a parameter dict (``init``) and applies it (``__call__``).

    Parameters
    ----------
    mesh : Mesh, optional
        The mesh its parameters live on; None: plain arrays (the single-process reference).
    tp_axis : str
        The tensor-parallel mesh axis (used when the mesh has it).
    dtype : str or dtype
        The parameters' dtype.
    """

    def __init__(self, mesh: Mesh | None = None, tp_axis: str = "tp", dtype: Any = "float32"):
        self.mesh = mesh
        self.tp = tp_axis if mesh is not None and tp_axis in mesh.axes else None
        self.dtype = resolve_dtype(dtype)

    def _place(self, value: np.ndarray, spec) -> Any:
        value = value.astype(self.dtype)
        if self.mesh is None:
            return value
        return distribute(value, layout=spec if self.tp is not None else None, mesh=self.mesh)

    def spec(self, kind: str) -> ShardSpec | None:
        """The layout of a parameter kind: "col" (last dim over tp), "row" (dim -2 over tp),
        "vec" (1-D over tp), "rep" (replicated).

        Parameters
        ----------
        kind : str
            "col", "row", "vec" or "rep".

        Returns
        -------
        ShardSpec or None
            None without a tp axis or for "rep".
        """
        if self.tp is None or kind == "rep":
            return None
        part = {"col": ("col",), "row": ("row",), "vec": (0,)}[kind]
        return ShardSpec(partition=part, mesh_axes=(self.tp,))


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
    key = (vocab, ndim, mesh, tp_axis)
    t = _IOTAS.get(key)
    if t is None:
        a = np.arange(vocab, dtype=np.int32).reshape((1,) * ndim + (vocab,))
        spec = ShardSpec(partition=("col",), mesh_axes=(tp_axis,)) if tp_axis else None
        t = _IOTAS[key] = a if mesh is None else distribute(a, layout=spec, mesh=mesh)
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
    each rank looks up the ids it owns (a one-hot GEMM against its rows, exact for the small
    vocabularies this targets) and the result is a pending sum over tp.

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
        return op.matmul(one_hot(ids, self.iota(len(ids.shape)), self.dtype), p["w"])


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
    if type(detach(logits)) is np.ndarray and type(targets) is np.ndarray:
        return op.softmax_cross_entropy(logits, targets)       # one fused kernel on host arrays
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


# Parts of the Transformer that live above nn: the MoE block (tessera_rt.moe.model) and the
# pipeline stage split (tessera_rt.pipeline.stages). Those modules register them here on
# import (`import tessera_rt` imports both), so nn never imports upward.
_PARTS: dict = {}


def register_part(name: str, cls) -> None:
    _PARTS[name] = cls


def _part(name: str, what: str):
    cls = _PARTS.get(name)
    if cls is None:
        raise RuntimeError(f"nn.{what} needs {name}, which tessera_rt.moe / tessera_rt.pipeline register: "
                           "import tessera_rt (it imports every layer)")
    return cls


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
            self.mlp = _part("MoEMLP", "Transformer(moe=...)")(d_model, hidden, mesh=mesh, ep_axis=ep_axis, dtype=dtype, **moe)
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


class Transformer(Module):
    """A small decoder-only language model: vocab-parallel embedding + learned positions,
    ``n_layers`` blocks, a final RMSNorm and a vocab-parallel LM head with its
    cross-entropy.  A mesh with a ``pp_axis`` splits the blocks over pipeline stages (run
    with ``dist.Pipeline``): each rank builds only its stage's parameters.

    Parameters
    ----------
    vocab : int
        The vocabulary size.
    d_model : int
        The model width.
    n_heads : int
        Attention heads.
    n_layers : int
        Blocks.
    seq_len : int
        The longest sequence (the learned positions).
    hidden : int, optional
        The MLP's hidden width; default ``4 * d_model``.
    mesh : Mesh, optional
        None: plain arrays.
    tp_axis, dp_axis, ep_axis, pp_axis : str
        The tensor-, data-, expert- and pipeline-parallel mesh axes (each used when the mesh has it).
    dtype : str or dtype
        The parameters' dtype.
    remat : {"none", "all", "every_other"}
        Which blocks recompute their activations in the backward (seed 000 §3.5).
    moe : dict, optional
        MoE blocks instead of dense MLPs (see ``TransformerBlock``); needs ``remat="none"``.
    stage_of : sequence of int, optional
        ``stage_of[layer]``: the (virtual) stage of each block; default an even split.
    virtual_stages : int
        Virtual stages per pipeline rank (interleaved schedules).
    """

    def __init__(self, vocab: int, d_model: int, n_heads: int, n_layers: int, seq_len: int, *,
                 hidden: int | None = None, mesh: Mesh | None = None, tp_axis: str = "tp", dp_axis: str = "dp",
                 dtype: Any = "float32", remat: str = "none", moe: dict | None = None, ep_axis: str = "ep",
                 pp_axis: str = "pp", stage_of: list[int] | None = None, virtual_stages: int = 1):
        # a mesh with a pp axis splits the blocks over stages (run with dist.Pipeline): this
        # rank's modules live on its stage's sub-mesh and it builds only its own parameters
        self.stage_plan = None
        if mesh is not None and pp_axis in mesh.axes:
            self.stage_plan = _part("StagePlan", f"Transformer over a {pp_axis!r} axis")(mesh, pp_axis, n_layers, stage_of, virtual_stages)
            mesh = self.stage_plan.stage_mesh
        super().__init__(mesh, tp_axis, dtype)
        if remat not in ("none", "all", "every_other"):
            raise ValueError(f"Transformer(remat={remat!r}): use 'none', 'all' or 'every_other'")
        if moe and remat != "none":
            raise ValueError("Transformer(moe=..., remat=...): rematerializing MoE blocks is not supported; "
                             "use remat='none'")
        # tokens are sharded over dp and ep together; the experts over ep (seed 000 §2.2)
        self.ep = ep_axis if mesh is not None and ep_axis in mesh.axes else None
        kw = dict(mesh=mesh, tp_axis=tp_axis, dtype=dtype)
        self.vocab, self.d, self.seq_len, self.remat = vocab, d_model, seq_len, remat
        self.dp = dp_axis if mesh is not None and dp_axis in mesh.axes else None
        # MoE blocks keep tokens sharded only when dp x ep divides the rows (pipeline checks it)
        self.rows_multiple = math.prod(mesh.size(a) for a in (self.dp, self.ep) if a) if moe and mesh is not None else 1
        self.embed = Embedding(vocab, d_model, **kw)
        bkw = dict(kw, moe=moe, ep_axis=ep_axis) if moe else kw
        self.blocks = [TransformerBlock(d_model, n_heads, hidden or 4 * d_model, **bkw) for _ in range(n_layers)]
        self.norm = RMSNorm(d_model, **kw)
        self.head = Linear(d_model, vocab, parallel="column", **kw)

    def init(self, seed: int = 0) -> dict:
        """The parameters (the same global values on any mesh); with pipeline stages, this rank's
        only (``stage_init``).

        Parameters
        ----------
        seed : int
            Every parameter's values depend only on (seed, name): the same global tensors on any
            mesh.

        Returns
        -------
        dict
            The parameter tree.
        """
        if self.stage_plan is not None:
            return self.stage_init(seed)
        return {
            "embed": self.embed.init(seed, "embed"),
            "pos": self._place(_rng_normal(seed, "pos", (self.seq_len, self.d), 0.02), None),
            "blocks": [b.init(seed, f"blocks.{i}") for i, b in enumerate(self.blocks)],
            "norm": self.norm.init(seed, "norm"),
            "head": self.head.init(seed, "head"),
        }

    def batch(self, tokens: np.ndarray) -> Any:
        """Place a global (B, S) int batch (the same on every rank): batch dim over dp.

        Parameters
        ----------
        tokens : numpy.ndarray
            ``(B, S)`` ints, the same on every rank.

        Returns
        -------
        DTensor or array
            The batch, sharded over dp (and ep).
        """
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        if self.mesh is None:
            return tokens
        return distribute(tokens, layout=self._batch_spec(), mesh=self.mesh)

    def _batch_spec(self):
        """The batch dim over dp (and ep with MoE blocks: tokens over dp x ep), else None."""
        spec = ShardSpec(partition=(0,), mesh_axes=(self.dp,)) if self.dp else None
        batch_axes = tuple(a for a in (self.dp, getattr(self, "ep", None)) if a)
        if len(batch_axes) > 1 or (batch_axes and not self.dp):
            spec = ShardSpec(partition=(0,), mesh_axes=(batch_axes,))
        return spec

    def _moe_aux(self, layers):
        """The MoE balance (and z) loss terms of ``layers``' latest forward, summed (None
        without MoE blocks among them)."""
        total = None
        for i in layers:
            extra = self.blocks[i].mlp.aux_loss() if hasattr(self.blocks[i].mlp, "aux_loss") else None
            if extra is not None:
                total = extra if total is None else op.add(total, extra)
        return total

    def logits(self, p: dict, tokens: Any) -> Any:
        """The LM head's logits for ``tokens``.

        Parameters
        ----------
        p : dict
            The parameters.
        tokens : DTensor or array
            ``(B, S)`` ints (``batch``'s).

        Returns
        -------
        DTensor or array
            ``(B, S, vocab)``, the vocab dim sharded over tp.
        """
        if self.stage_plan is not None:
            raise ValueError(f"Transformer: this model is split over pipeline stages ({self.stage_plan}); "
                             "run it through dist.Pipeline(model, ...).value_and_grad(params, x, y)")
        s = tokens.shape[1]
        x = self.embed(p["embed"], tokens)
        pos = p["pos"] if s == self.seq_len else None
        if pos is None:
            raise ValueError(f"Transformer: sequence length {s} != seq_len {self.seq_len}")
        x = op.add(x, pos)
        for blk in self.blocks:
            if hasattr(blk.mlp, "auxes"):
                blk.mlp.auxes.clear()
        for i, (blk, bp) in enumerate(zip(self.blocks, p["blocks"])):
            remat = self.remat == "all" or (self.remat == "every_other" and i % 2 == 0)
            x = checkpoint(blk)(bp, x) if remat else blk(bp, x)
        return self.head(p["head"], self.norm(p["norm"], x))

    def loss(self, p: dict, tokens: Any, targets: Any) -> Any:
        """The mean token cross-entropy (plus the MoE blocks' auxiliary losses).

        Parameters
        ----------
        p : dict
            The parameters.
        tokens : DTensor or array
            ``(B, S)`` ints.
        targets : DTensor or array
            ``(B, S)`` ints.

        Returns
        -------
        DTensor or array
            The scalar loss.
        """
        logits = self.logits(p, tokens)
        if np.dtype(logits.dtype).itemsize < 4:
            logits = op.astype(logits, "float32")      # the loss in f32 for bf16/fp16 compute
        loss = cross_entropy(logits, targets, self.embed.iota(len(targets.shape)))
        extra = self._moe_aux(range(len(self.blocks)))      # MoE blocks: the balance (and z) losses
        return loss if extra is None else op.add(loss, extra)

    def moe_stats(self) -> dict | None:
        """Load std/mean per MoE block and dropped pairs of the latest forward (collective:
        call on every rank), or None without MoE blocks.

        Returns
        -------
        dict or None
            ``{"load_cv": [...], "dropped": n}``.
        """
        auxes = [blk.mlp.auxes[-1] for blk in self.blocks if getattr(blk.mlp, "auxes", None)]
        if not auxes:
            return None
        return {"load_cv": [a["load_cv"] for a in auxes], "dropped": sum(a["dropped"] for a in auxes)}

    # ------------------------------------------------------------------ pipeline stages

    def stage_init(self, seed: int = 0) -> dict:
        """This rank's parameters only: the embedding on virtual stage 0, its blocks, the
        final norm and head on the last virtual stage (the same values as ``init`` gives).

        Parameters
        ----------
        seed : int
            Every parameter's values depend only on (seed, name): the same global tensors on any
            mesh.

        Returns
        -------
        dict
            This rank's parameter tree.
        """
        plan, p = self.stage_plan, {}
        if 0 in plan.chunks:
            p["embed"] = self.embed.init(seed, "embed")
            p["pos"] = self._place(_rng_normal(seed, "pos", (self.seq_len, self.d), 0.02), None)
        p["blocks"] = [self.blocks[i].init(seed, f"blocks.{i}") for i in plan.local_layers]
        if plan.n_virtual - 1 in plan.chunks:
            p["norm"] = self.norm.init(seed, "norm")
            p["head"] = self.head.init(seed, "head")
        return p

    def split_params(self, params: dict) -> list[dict]:
        """``stage_init``'s tree as one tree per local chunk (virtual stage), in chunk order.

        Parameters
        ----------
        params : dict
            ``stage_init``'s tree.

        Returns
        -------
        list of dict
            One tree per local chunk.
        """
        plan, out, at = self.stage_plan, [], 0
        for vs in plan.chunks:
            n = len(plan.layers[vs])
            cp = {"blocks": params["blocks"][at:at + n]}
            at += n
            keys = (["embed", "pos"] if vs == 0 else []) + (["norm", "head"] if vs == plan.n_virtual - 1 else [])
            cp.update({k: params[k] for k in keys})
            out.append(cp)
        return out

    def checkpoint_tree(self, tree: dict) -> dict:
        """``tree`` (this rank's parameters, or anything of their structure: gradients, the
        optimizer's masters) with the blocks keyed by their global layer number, for
        ``dist.save``/``dist.load``: each pipeline stage's blocks then have names of their own,
        the names ``init()``'s block list has on one rank (``blocks/2`` is layer 2 on any mesh).
        ``from_checkpoint_tree`` turns a loaded tree back into this rank's structure.

        Parameters
        ----------
        tree : dict
            This rank's parameters or a tree of their structure.

        Returns
        -------
        dict
            The tree with global block keys.
        """
        layers = self.stage_plan.local_layers if self.stage_plan is not None else range(len(tree["blocks"]))
        return dict(tree, blocks={str(i): b for i, b in zip(layers, tree["blocks"])})

    def from_checkpoint_tree(self, tree: dict) -> dict:
        """The inverse of ``checkpoint_tree``: the blocks as this rank's list.

        Parameters
        ----------
        tree : dict
            ``checkpoint_tree``'s form.

        Returns
        -------
        dict
            This rank's form.
        """
        layers = self.stage_plan.local_layers if self.stage_plan is not None else range(len(tree["blocks"]))
        return dict(tree, blocks=[tree["blocks"][str(i)] for i in layers])

    def join_params(self, chunks: list[dict]) -> dict:
        """The inverse of ``split_params``.

        Parameters
        ----------
        chunks : list of dict
            ``split_params``'s trees.

        Returns
        -------
        dict
            One tree.
        """
        p: dict = {"blocks": [b for cp in chunks for b in cp["blocks"]]}
        for cp in chunks:
            p.update({k: v for k, v in cp.items() if k != "blocks"})
        return {k: p[k] for k in ("embed", "pos", "blocks", "norm", "head") if k in p}

    def stage_boundary(self, rows: int) -> tuple:
        """(global shape, dtype, spec) of the activation between stages for ``rows`` sequences:
        the batch over dp (and ep), replicated over tp.

        Parameters
        ----------
        rows : int
            Sequences in the micro-batch.

        Returns
        -------
        tuple
            ``(shape, dtype, spec)``.
        """
        spec = self._batch_spec() if self.mesh is not None else None
        return (rows, self.seq_len, self.d), self.dtype, spec

    def stage_forward(self, p: dict, vs: int, h: Any, targets: Any = None) -> Any:
        """Virtual stage ``vs`` on its chunk's parameters: token ids in on stage 0 (else the
        previous stage's activation), the mean loss out on the last stage (else the activation).
        MoE blocks add their balance/z terms: to the loss on the last stage, else returned as
        ``(activation, aux)`` so the stage's backward seeds its own term (pipeline/runner).

        Parameters
        ----------
        p : dict
            The chunk's parameters.
        vs : int
            The virtual stage.
        h : DTensor or array
            Token ids (stage 0) or the previous stage's activation.
        targets : DTensor or array, optional
            Needed on the last stage.

        Returns
        -------
        DTensor or array
            The activation (``(activation, aux)`` with MoE blocks), or the loss on the last stage.
        """
        plan = self.stage_plan
        if vs == 0:
            h = op.add(self.embed(p["embed"], h), p["pos"])
        for i in plan.layers[vs]:
            if hasattr(self.blocks[i].mlp, "auxes"):
                self.blocks[i].mlp.auxes.clear()        # keep only this micro-batch's
        for i, bp in zip(plan.layers[vs], p["blocks"]):
            remat = self.remat == "all" or (self.remat == "every_other" and i % 2 == 0)
            h = checkpoint(self.blocks[i])(bp, h) if remat else self.blocks[i](bp, h)
        aux = self._moe_aux(plan.layers[vs])
        if vs != plan.n_virtual - 1:
            return h if aux is None else (h, aux)
        logits = self.head(p["head"], self.norm(p["norm"], h))
        if np.dtype(logits.dtype).itemsize < 4:
            logits = op.astype(logits, "float32")
        loss = cross_entropy(logits, targets, self.embed.iota(len(targets.shape)))
        return loss if aux is None else op.add(loss, aux)

