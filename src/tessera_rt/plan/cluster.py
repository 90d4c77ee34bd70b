"""What the planner plans on: a cluster (:class:`Cluster`: GPUs, their memory, rates and
links, calibrated alpha/beta), with presets, the calibrated ``local`` one and JSON loading.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .specs import _read_json

__all__ = ["Cluster", "CLUSTERS", "get_cluster", "local_cluster_path", "GB"]

GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """GPUs and their links.  ``topology``: "switch" (every GPU one hop from every other:
    NVLink Switch), "ring2d" (a ``grid`` of rings, seed 004's 8x4 Galaxy) or "host" (CPU
    ranks on one machine).  Rates per dtype in FLOP/s; bandwidths in bytes/s per GPU per
    direction; ``alpha`` in seconds per algorithm step.  ``measured`` holds calibrated
    alpha/beta per collective and group size ({op: {n: [alpha_s, s_per_byte]}}), which wins
    over the analytic model where present.

    Parameters
    ----------
    name : str
        The preset's name.
    n_gpus : int
        GPUs (or CPU ranks).
    hbm_bytes : float
        Memory per GPU.
    hbm_bw : float
        Memory bandwidth per GPU, bytes/s.
    flops : dict
        FLOP/s per dtype.
    link_bw : float
        Bytes/s per GPU per direction.
    alpha : float
        Seconds per algorithm step.
    topology : str
        "switch" (every GPU one hop from every other: NVLink Switch), "ring2d" (a ``grid`` of rings,
        seed 004's 8x4 Galaxy) or "host" (CPU ranks on one machine).
    grid : tuple
        The ring2d grid's shape.
    links : int
        Links per neighbour (seed 004: num_links=3).
    host_tier_bytes : float
        Host memory per GPU usable as a capacity tier (Grace LPDDR).
    host_tier_bw : float
        Its bytes/s per GPU (C2C).
    bw_efficiency : float
        Achievable busbw / link bandwidth (nccl-tests).
    op_overhead_s : float
        Fixed cost per kernel (launch, eager dispatch).
    cores : int
        CPU ranks: cores shared by the ranks (0: one per rank).
    overlap : float
        Share of tp/ep/dp collective time hidden behind compute.
    share : float
        CPU ranks: the share of a core each gets (other load on the machine).
    dp_overlap : float, optional
        Share of the dp gradient all-reduce hidden behind the backward (None: ``overlap``).
    op_rates : dict
        FLOP/s per op class ("gemm", "attention"), calibrated.
    measured : dict
        Calibrated alpha/beta per collective and group size (``{op: {n: [alpha_s, s_per_byte]}}``),
        which wins over the analytic model where present.
    calibrated : bool
        Made by ``tessera-plan --calibrate``.
    devices_per_node : int
        GPUs sharing a node's fast links; tp stays inside one (0: all).
    notes : str
        Free text.
    """

    name: str
    n_gpus: int
    hbm_bytes: float
    hbm_bw: float
    flops: dict
    link_bw: float
    alpha: float
    topology: str = "switch"
    grid: tuple = ()
    links: int = 1                          # links per neighbour (seed 004: num_links=3)
    host_tier_bytes: float = 0.0            # Grace LPDDR per GPU (a capacity tier)
    host_tier_bw: float = 0.0               # C2C bytes/s per GPU
    bw_efficiency: float = 0.8              # achievable busbw / link bw (nccl-tests)
    op_overhead_s: float = 4e-6             # fixed cost per kernel (launch, eager dispatch)
    cores: int = 0                          # CPU ranks: cores shared by the ranks (0: one per rank)
    overlap: float = 0.6                    # share of tp/ep/dp collective time hidden behind compute
    share: float = 1.0                      # CPU ranks: share of a core each gets (other load on the machine)
    dp_overlap: float | None = None         # share of the dp gradient all-reduce hidden behind the backward
                                            # (None: ``overlap``); tessera_rt issues each one async
    op_rates: dict = field(default_factory=dict)   # FLOP/s per op class ("gemm", "attention"), calibrated
    measured: dict = field(default_factory=dict)
    calibrated: bool = False
    devices_per_node: int = 0               # GPUs sharing a node's fast links; tp stays inside one
                                            # (0: not given, tp may cross nodes)
    notes: str = ""

    REQUIRED = ("name", "n_gpus", "hbm_bytes", "hbm_bw", "flops", "link_bw", "alpha")

    def __post_init__(self):
        for f in ("n_gpus", "hbm_bytes", "hbm_bw", "link_bw"):
            if not getattr(self, f) or getattr(self, f) <= 0:
                raise ValueError(f"Cluster({self.name!r}): {f}={getattr(self, f)!r} must be positive")
        if self.topology not in ("switch", "ring2d", "host"):
            raise ValueError(f"Cluster({self.name!r}): topology={self.topology!r}; use 'switch', 'ring2d' or 'host'")
        if self.topology == "ring2d" and math.prod(self.grid or (0,)) != self.n_gpus:
            raise ValueError(f"Cluster({self.name!r}): grid {self.grid} must multiply to n_gpus={self.n_gpus}")
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 0:
            raise ValueError(f"Cluster({self.name!r}): devices_per_node={self.devices_per_node!r} must be an int >= 0 "
                             "(0: unknown)")
        if not isinstance(self.flops, dict) or not self.flops:
            raise ValueError(f"Cluster({self.name!r}): flops must be a dict dtype -> FLOP/s, e.g. {{'bf16': 2.5e15}}")

    def rate(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``; a dtype the cluster lacks runs at the nearest wider one.

        Parameters
        ----------
        dtype : str
            A compute dtype.

        Returns
        -------
        float
            FLOP/s.
        """
        for d in (dtype, {"fp4": "fp8", "fp8": "bf16", "bfp8": "bf16", "fp8_e4m3": "bf16"}.get(dtype, "bf16"),
                  "bf16", "f32"):
            if d in self.flops:
                return float(self.flops[d])
        return float(next(iter(self.flops.values())))

    def to_dict(self) -> dict:
        """The fields as a dict (JSON values).

        Returns
        -------
        dict
            The fields.
        """
        d = dataclasses.asdict(self)
        d["grid"] = list(self.grid)
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "cluster") -> Cluster:
        missing = [k for k in cls.REQUIRED if k not in d]
        if missing:
            raise ValueError(f"{where}: the cluster description is missing {missing}; a cluster needs "
                             f"{list(cls.REQUIRED)} (flops: {{dtype: FLOP/s}}, hbm_bw/link_bw: bytes/s per GPU, "
                             "alpha: seconds per collective step)")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; Cluster fields are {sorted(names)}")
        d = dict(d)
        d["grid"] = tuple(d.get("grid", ()))
        return cls(**d)


# ------------------------------------------------------------------------------ presets

def local_cluster_path() -> Path:
    """Where ``tessera-plan --calibrate`` saves the `local` cluster ($TESSERA_PLAN_HOME or
    ~/.cache/tessera_rt).

    Returns
    -------
    pathlib.Path
        The JSON file's path.
    """
    base = os.environ.get("TESSERA_PLAN_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "tessera_rt")
    return Path(base) / "local_cluster.json"


def _local_default() -> Cluster:
    n = os.cpu_count() or 1
    return Cluster("local", n_gpus=4, hbm_bytes=24 * GB, hbm_bw=10 * GB, flops={"f32": 20e9, "bf16": 2e9},
                   link_bw=2 * GB, alpha=30e-6, topology="host", op_overhead_s=60e-6, cores=n, overlap=0.0, dp_overlap=1.0,
                   bw_efficiency=1.0, devices_per_node=4, notes="uncalibrated defaults: run tessera-plan --calibrate")


CLUSTERS: dict[str, Cluster] = {
    # GB200 NVL72: 72 Blackwell GPUs in one NVLink Switch domain, 1.8 TB/s NVLink per GPU
    # (900 GB/s each way), 186 GB HBM3e at 8 TB/s, dense Tensor Core rates (the spec
    # sheet's sparse figures / 2 / 72), Grace LPDDR5X 480 GB per 2 GPUs over 900 GB/s C2C.
    "nvl72": Cluster("nvl72", n_gpus=72, hbm_bytes=186 * GB, hbm_bw=8e12,
                     flops={"fp4": 10e15, "fp8": 5e15, "bf16": 2.5e15, "tf32": 1.25e15, "f32": 80e12},
                     link_bw=900 * GB, alpha=3e-6, topology="switch", host_tier_bytes=240 * GB,
                     host_tier_bw=450 * GB, op_overhead_s=4e-6, devices_per_node=72, notes="GB200 NVL72 (public spec sheet)"),
    # Seed 004: 32 Wormhole chips as an 8x4 grid of rings, 3 Ethernet links per neighbour.
    "galaxy": Cluster("galaxy", n_gpus=32, hbm_bytes=12 * GB, hbm_bw=288 * GB,
                      flops={"bfp8": 262e12, "fp8": 262e12, "bf16": 74e12, "f32": 18e12},
                      link_bw=12.5 * GB, links=3, alpha=5e-6, topology="ring2d", grid=(8, 4), bw_efficiency=0.7,
                      op_overhead_s=5e-6, overlap=0.5, devices_per_node=32, notes="Tenstorrent Galaxy (Wormhole), seed 004's 8x4 ring"),
}


def get_cluster(cluster: Any) -> Cluster:
    """A cluster from a preset name ("local" reads the calibrated file when there is one), a JSON
    path, a dict or a Cluster.

    Parameters
    ----------
    cluster : str, dict or Cluster
        What names the cluster (``CLUSTERS`` lists the presets).

    Returns
    -------
    Cluster
        The cluster.
    """
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, dict):
        return Cluster.from_dict(cluster)
    if isinstance(cluster, str):
        if cluster == "local":
            p = local_cluster_path()
            return Cluster.from_dict(_read_json(str(p)), where=str(p)) if p.exists() else _local_default()
        if cluster in CLUSTERS:
            return CLUSTERS[cluster]
        if cluster.endswith(".json") or os.path.exists(cluster):
            return Cluster.from_dict(_read_json(cluster), where=cluster)
        raise ValueError(f"unknown cluster {cluster!r}; use a preset (nvl72, galaxy, local) or a JSON file with "
                         f"fields {list(Cluster.REQUIRED)}")
    raise TypeError(f"cluster must be a preset name, a JSON path, a dict or a plan.Cluster, not "
                    f"{type(cluster).__name__}")
