"""The planner's time model, lent to the runtime: ``dist`` prices its redistribution choices
(conflicting operand layouts, one direct all_to_all against one-axis steps) with whatever
model is registered in ``dist.cost``; this registers a cluster's (calibrated) model there.

    from tessera_rt import plan
    plan.use_calibrated()            # the `local` cluster from tessera-plan --calibrate
    plan.use_calibrated("nvl72")     # or any cluster: a preset, a JSON file, a plan.Cluster

Nothing is registered on import: call it alike on every rank (the model decides which
collectives run, and a calibration file that differs between hosts must not change that
behind the program's back).
"""
from __future__ import annotations

from ..dist.tensor import cost as _cost
from .cluster import Cluster, get_cluster, local_cluster_path
from .timing import collective_time

__all__ = ["ClusterCostModel", "use_calibrated", "use_builtin"]


class ClusterCostModel:
    """dist.cost's interface over ``plan.timing.collective_time`` (measured alpha/beta where the
    cluster has them, nccl-tests bus factors otherwise) and the cluster's memory bandwidth.

    Parameters
    ----------
    cluster : Cluster
        The cluster whose time model it serves.
    """

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.name = f"plan cluster {cluster.name!r}" + (" (calibrated)" if cluster.calibrated else "")

    def collective_time(self, op: str, size: float, n: int) -> float:
        """Seconds for one collective (``plan.timing.collective_time``'s fastest algorithm).

        Parameters
        ----------
        op : str
            The collective.
        size : float
            Bytes.
        n : int
            Ranks in the group.

        Returns
        -------
        float
            Seconds.
        """
        return collective_time(self.cluster, op, size, n)[0]

    def copy_time(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` on one GPU (read and write at the memory bandwidth).

        Parameters
        ----------
        nbytes : float
            Bytes.

        Returns
        -------
        float
            Seconds.
        """
        return 2.0 * nbytes / self.cluster.hbm_bw

    def __repr__(self) -> str:
        return f"ClusterCostModel({self.name})"


def use_calibrated(cluster: object = "local") -> ClusterCostModel:
    """Register ``cluster``'s time model for the runtime's choices.  For "local" the calibration
    must exist (``tessera-plan --calibrate`` writes it).

    Parameters
    ----------
    cluster : str, dict or Cluster
        As ``get_cluster`` takes it.

    Returns
    -------
    ClusterCostModel
        The registered model.
    """
    if isinstance(cluster, str) and cluster == "local" and not local_cluster_path().exists():
        raise ValueError(f"plan.use_calibrated(): no calibration at {local_cluster_path()}; run "
                         "`tessera-plan --calibrate` first, or name a cluster (a preset, a JSON file, a plan.Cluster)")
    model = ClusterCostModel(get_cluster(cluster))
    _cost.set_cost_model(model)
    return model


def use_builtin() -> None:
    """Go back to dist's built-in alpha-beta model.
    """
    _cost.set_cost_model(None)
