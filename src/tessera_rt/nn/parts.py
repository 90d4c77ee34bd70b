"""The parts of ``nn.Transformer`` that live above nn, and how they plug in.

nn sits below ``moe`` and ``pipeline`` and never imports them.  Each plugs its part in when
it is imported, through one typed registration function here (``PARTS`` holds them):

* ``register_moe_mlp(factory)``: ``tessera_rt.moe`` registers ``moe.model.MoEMLP``, which
  ``Transformer(moe=dict(...))`` builds each block's feed-forward with;
* ``register_stage_plan(factory)``: ``tessera_rt.pipeline`` registers
  ``pipeline.stages.StagePlan``, which a Transformer on a mesh with a pipeline axis splits
  its blocks with.

A Transformer that needs a part nobody registered raises, naming the package to import
(``import tessera_rt`` and reading a name on it imports every layer).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["MoEMLPFactory", "StagePlanFactory", "TransformerParts", "PARTS", "register_moe_mlp",
           "register_stage_plan", "register_part"]


class MoEMLPFactory(Protocol):
    """Builds a block's routed feed-forward: ``factory(d_model, hidden, mesh=, ep_axis=, dtype=,
    **moe)``, ``moe`` being ``Transformer(moe=...)``'s dict; the result has ``init(seed,
    name)``, ``__call__(params, x)`` and ``aux_loss()``."""

    def __call__(self, d_model: int, hidden: int, *, mesh: Any, ep_axis: str, dtype: Any, **moe: Any) -> Any: ...


class StagePlanFactory(Protocol):
    """Splits the blocks over pipeline stages: ``factory(mesh, pp_axis, n_layers, stage_of,
    virtual_stages)``; the result has ``stage_mesh`` (this rank's sub-mesh), ``local_layers``
    and the rest of ``pipeline.stages.StagePlan``'s protocol (``dist.Pipeline`` reads it)."""

    def __call__(self, mesh: Any, pp_axis: str, n_layers: int, stage_of: Sequence[int] | None,
                 virtual_stages: int) -> Any: ...


@dataclass
class TransformerParts:
    """The registered parts (None until their package is imported)."""
    moe_mlp: MoEMLPFactory | None = None
    stage_plan: StagePlanFactory | None = None

    def need_moe_mlp(self) -> MoEMLPFactory:
        if self.moe_mlp is None:
            raise RuntimeError("nn.Transformer(moe=...) builds its blocks with tessera_rt.moe's MoEMLP, which "
                               "registers when tessera_rt.moe is imported: import tessera_rt.moe first")
        return self.moe_mlp

    def need_stage_plan(self, pp_axis: str) -> StagePlanFactory:
        if self.stage_plan is None:
            raise RuntimeError(f"nn.Transformer on a mesh with a {pp_axis!r} axis splits its blocks with "
                               "tessera_rt.pipeline's StagePlan, which registers when tessera_rt.pipeline is "
                               "imported: import tessera_rt.pipeline first")
        return self.stage_plan


PARTS = TransformerParts()      # the one per process, filled by the packages above


def register_moe_mlp(factory: MoEMLPFactory) -> None:
    """What ``Transformer(moe=...)`` builds each block's feed-forward with (``tessera_rt.moe`` on import)."""
    PARTS.moe_mlp = factory


def register_stage_plan(factory: StagePlanFactory) -> None:
    """What a Transformer over a pipeline axis splits its blocks with (``tessera_rt.pipeline`` on import)."""
    PARTS.stage_plan = factory


def register_part(name: str, cls: Any) -> None:
    """The string registry's entry point, kept for one release: ``register_part("MoEMLP", cls)``
    is ``register_moe_mlp(cls)``, ``register_part("StagePlan", cls)`` ``register_stage_plan(cls)``."""
    from ..deprecation import warn
    setter = {"MoEMLP": register_moe_mlp, "StagePlan": register_stage_plan}.get(name)
    if setter is None:
        raise ValueError(f"nn.register_part({name!r}): the parts are 'MoEMLP' and 'StagePlan'")
    warn(f"nn.register_part({name!r}, ...)", f"nn.parts.{setter.__name__}(...)")
    setter(cls)
