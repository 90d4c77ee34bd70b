"""The MoE feed-forward block of ``nn.Transformer(..., moe=dict(...))`` (seed 000 §2.2).

Tokens ``(B, S, d)`` with the batch sharded over dp and ep together are flattened to
``(B*S, d)`` rows (the sharding stays on the rows when dp*ep divides B), routed through
``op.moe``, and reshaped back.  The layer's ``aux`` of the latest forward is kept in
``auxes`` so the model's loss can add the balance and z losses.
"""
from __future__ import annotations

from ..dist.tensor.layout import ShardSpec
from ..nn.parts import register_moe_mlp
from .layer import MoE

__all__ = ["MoEMLP"]


class MoEMLP:
    """A routed SwiGLU feed-forward: ``num_experts`` experts of width ``hidden`` over ``ep``."""

    def __init__(self, d_model: int, hidden: int, *, num_experts: int, top_k: int = 2,
                 capacity_factor: float | None = None, mesh=None, ep_axis: str = "ep", dtype="float32",
                 aux_coef: float = 0.01, z_coef: float = 0.0, **kw):
        self.dtype = dtype
        self.aux_coef, self.z_coef = float(aux_coef), float(z_coef)
        layout = ShardSpec(partition=("experts",), mesh_axes=(ep_axis,))
        self.layer = MoE(num_experts, top_k, capacity_factor, d_model=d_model, d_ff=hidden, mesh=mesh,
                         experts_layout=layout, **kw)
        self.auxes: list = []

    def init(self, seed: int, name: str = "moe") -> dict:
        # one seed per block: the layer draws by parameter name, so fold the block's name in
        sub = (seed * 1000003 + sum(name.encode())) & 0x7FFFFFFF
        return self.layer.shard(self.layer.init(sub, self.dtype))

    def __call__(self, p: dict, x):
        from .. import op
        b, s, d = x.shape
        y, aux = self.layer(p, op.reshape(x, (b * s, d)))
        self.auxes.append(aux)
        return op.reshape(y, (b, s, d))

    def aux_loss(self):
        """The latest forward's ``aux_coef * balance_loss + z_coef * z_loss`` (or None)."""
        from .. import op
        if not self.auxes:
            return None
        aux = self.auxes[-1]
        total = op.mul(aux["balance_loss"], self.aux_coef)
        if self.z_coef:
            total = op.add(total, op.mul(aux["z_loss"], self.z_coef))
        return total


register_moe_mlp(MoEMLP)       # nn.Transformer(moe=...) builds its blocks with it (nn.parts)
