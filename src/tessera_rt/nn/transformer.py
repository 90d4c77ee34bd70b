"""The decoder-only Transformer: embedding, blocks (optionally over pipeline stages), LM head."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import op
from ..autodiff import remat as remat_block
from ..backend import get_backend
from ..dist.comm.mesh import Mesh
from ..dist.tensor.dtensor import distribute
from ..dist.tensor.layout import ShardSpec
from .blocks import TransformerBlock
from .layers import Embedding, Linear, RMSNorm, cross_entropy
from .module import Module, _rng_normal
from .parts import PARTS


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
            split = PARTS.need_stage_plan(pp_axis)            # tessera_rt.pipeline's StagePlan (nn.parts)
            self.stage_plan = split(mesh, pp_axis, n_layers, stage_of, virtual_stages)
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
            The batch, sharded over dp (and ep); without a mesh, an int32 array on the
            backend's device.
        """
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        if self.mesh is None:
            return get_backend().asarray(tokens)       # on the device the parameters live on
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
            x = remat_block(blk)(bp, x) if remat else blk(bp, x)
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
            h = remat_block(self.blocks[i])(bp, h) if remat else self.blocks[i](bp, h)
        aux = self._moe_aux(plan.layers[vs])
        if vs != plan.n_virtual - 1:
            return h if aux is None else (h, aux)
        logits = self.head(p["head"], self.norm(p["norm"], h))
        loss = cross_entropy(logits, targets, self.embed.iota(len(targets.shape)))
        return loss if aux is None else op.add(loss, aux)
