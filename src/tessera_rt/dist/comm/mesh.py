"""Device meshes: named axes over the ranks of the job (seed 000 §2, 001 §7.5).

    mesh = dist.Mesh(axes=["tp", "dp"], shape={"tp": 2, "dp": 2})
    mesh = dist.mesh(devices=range(4), axes=("dp", "tp"), shape=(2, 2))

Making a mesh is collective over the whole job: every rank must make the same mesh, in
the same order (the constructor checks, and says which ranks disagree).  Ranks are laid
out row-major over the axes, the last axis varying fastest; with ``devices`` left out the
ranks come in topology order (host by host), so the last axis stays inside a node.
A group's communicator is made on the first collective over it, by its members only.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .communicators import make_communicator
from .interface import Communicator
from .mpi import MPI
from .process_group import world

__all__ = ["Mesh", "mesh", "AxisGroup", "current_mesh", "set_mesh"]

_DEVICE_NAME = re.compile(r"^(?:gpu|cuda:?|rank|device)?\s*(\d+)$", re.IGNORECASE)


@dataclass(frozen=True)
class AxisGroup:
    """This rank's group along some mesh axes: its members (world ranks) and communicator
    (``Mesh.group(axis)`` makes it).

    Parameters
    ----------
    axes : tuple of str
        The mesh axes the group spans.
    ranks : tuple of int
        Its members' world ranks, in group order.
    index : int
        This rank's position in ``ranks``.
    comm : Communicator
        The group's communicator.
    size : int
        Set to ``len(ranks)`` (stored: it is read on every collective).
    """
    axes: tuple[str, ...]
    ranks: tuple[int, ...]
    index: int                 # this rank's position in ``ranks``
    comm: Communicator
    size: int = 0              # len(ranks), stored: it is read on every collective

    def __post_init__(self):
        object.__setattr__(self, "size", len(self.ranks))

    @property
    def name(self) -> str:
        return ",".join(self.axes)


def _parse_device(d) -> int:
    if isinstance(d, (int, np.integer)):
        return int(d)
    m = _DEVICE_NAME.match(str(d).strip())
    if not m:
        raise ValueError(f"device {d!r} is not a rank: use ints or names like 'GPU3', 'cuda:3', 'rank3'")
    return int(m.group(1))


def _normalize_shape(axes: tuple[str, ...], shape, n_devices: int | None) -> tuple[int, ...]:
    if shape is None:
        if len(axes) == 1 and n_devices is not None:
            return (n_devices,)
        raise ValueError(f"Mesh(axes={list(axes)}): give shape= (a dict like "
                         f"{ {a: 2 for a in axes} } or a tuple) when there is more than one axis")
    if isinstance(shape, dict):
        if set(shape) != set(axes):
            missing, extra = set(axes) - set(shape), set(shape) - set(axes)
            raise ValueError(f"Mesh shape keys {sorted(shape)} do not match axes {list(axes)}"
                             + (f"; missing {sorted(missing)}" if missing else "")
                             + (f"; unknown {sorted(extra)}" if extra else ""))
        sizes = tuple(shape[a] for a in axes)
    elif isinstance(shape, (int, np.integer)):
        sizes = (int(shape),)
    else:
        sizes = tuple(shape)
    if len(sizes) != len(axes):
        raise ValueError(f"Mesh shape {shape!r} has {len(sizes)} sizes for {len(axes)} axes {list(axes)}")
    for axis, s in zip(axes, sizes):
        if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s < 1:
            raise ValueError(f"Mesh axis {axis!r} has size {s!r}; every axis size must be an int >= 1")
    return tuple(int(s) for s in sizes)


class Mesh:
    """A named N-axis grid of ranks (collective over the job: every rank makes the same one).

    Parameters
    ----------
    axes : str or iterable of str
        The axis names, major first, each unique.
    shape : dict or tuple of int, optional
        ``{axis: size}`` or sizes in ``axes`` order; may be left out for one axis (all ranks).
    devices : iterable of int or str, optional
        The ranks on the grid in row-major order (ints or names like "GPU3", "cuda:3",
        "rank3"); default every rank of the job in topology order.
    """

    def __init__(self, axes: Iterable[str], shape: dict | tuple | None = None, devices: Iterable | None = None):
        w = world()
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        if not axes:
            raise ValueError("Mesh needs at least one axis name, e.g. axes=['dp']")
        for a in axes:
            if not isinstance(a, str) or not a:
                raise ValueError(f"Mesh axis names must be non-empty strings; got {a!r} in {list(axes)}")
        if len(set(axes)) != len(axes):
            dup = sorted({a for a in axes if axes.count(a) > 1})
            raise ValueError(f"Mesh axes {list(axes)} repeat {dup}; each axis name must be unique")
        ranks = None if devices is None else [_parse_device(d) for d in devices]
        sizes = _normalize_shape(axes, shape, w.size if ranks is None else len(ranks))
        n = int(np.prod(sizes))
        if ranks is None:
            if n != w.size:
                raise ValueError(
                    f"Mesh {dict(zip(axes, sizes))} needs {n} devices but the job has {w.size} ranks; "
                    f"launch with tessera-run -n {n}, or pass devices= naming {n} of the ranks")
            ranks = w.topology_order()
        if len(ranks) != n:
            raise ValueError(f"Mesh {dict(zip(axes, sizes))} has {n} positions but devices names "
                             f"{len(ranks)}; the product of the shape must equal the number of devices")
        if len(set(ranks)) != len(ranks):
            twice = sorted({r for r in ranks if ranks.count(r) > 1})
            raise ValueError(f"Mesh devices repeat ranks {twice}; each rank may appear once")
        bad = [r for r in ranks if not 0 <= r < w.size]
        if bad:
            raise ValueError(f"Mesh devices name ranks {bad[:8]} but the job has ranks 0..{w.size - 1}; "
                             f"launch with tessera-run -n {max(bad) + 1} or use fewer devices")
        self.axes: tuple[str, ...] = axes
        self.sizes: tuple[int, ...] = sizes
        self.devices: tuple[int, ...] = tuple(ranks)
        self._grid = np.array(ranks, dtype=np.int64).reshape(sizes)
        self._hash = hash((self.axes, self.sizes, self.devices))   # meshes key plan caches
        self._check_same_on_all_ranks(w)
        pos = np.argwhere(self._grid == w.rank)
        self._coords = tuple(int(c) for c in pos[0]) if len(pos) else None
        # The mesh's own MPI communicator, over its members (ordered by mesh position).
        key = self.devices.index(w.rank) if self._coords is not None else 0
        color = 0 if self._coords is not None else MPI.UNDEFINED
        # (an Intracomm's Split is one: mpi4py's stub says Comm, the base of both kinds)
        self._mpi: MPI.Intracomm = w.mpi.Split(color, key)  # type: ignore[assignment]  # the stub: Comm
        self._groups: dict = {}

    def _check_same_on_all_ranks(self, w) -> None:
        signature = (self.axes, self.sizes, self.devices)
        everyone = w.mpi.allgather(signature)
        if any(s != signature for s in everyone):
            by_sig: dict = {}
            for r, s in enumerate(everyone):
                by_sig.setdefault(s, []).append(r)
            desc = "; ".join(f"ranks {rs}: axes={list(s[0])} shape={s[1]} devices={list(s[2])[:8]}"
                             for s, rs in by_sig.items())
            raise ValueError(f"rank {w.rank}: ranks made different meshes ({desc}); "
                             "every rank must make the same Mesh, in the same order")

    # identity -------------------------------------------------------------
    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{a}={s}" for a, s in zip(self.axes, self.sizes)) + ")"

    def __eq__(self, other) -> bool:
        return isinstance(other, Mesh) and (self.axes, self.sizes, self.devices) == (
            other.axes, other.sizes, other.devices)

    def __hash__(self) -> int:
        return self._hash

    # geometry -------------------------------------------------------------
    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self.axes, self.sizes))

    @property
    def ndim(self) -> int:
        return len(self.axes)

    @property
    def device_grid(self) -> np.ndarray:
        return self._grid.copy()

    def size(self, axis: str | Iterable[str] | None = None) -> int:
        """Ranks along ``axis``.

        Parameters
        ----------
        axis : str or iterable of str, optional
            One axis or several (their product); None: the whole mesh.

        Returns
        -------
        int
            The size.
        """
        if axis is None:
            return len(self.devices)
        if isinstance(axis, str):                # the hot case (autodiff asks per gradient)
            return self.sizes[self.axis_index(axis)]
        return math.prod(self.sizes[self.axis_index(a)] for a in axis)

    def axis_index(self, axis: str) -> int:
        """The position of ``axis`` in ``axes``.

        Parameters
        ----------
        axis : str
            An axis name.

        Returns
        -------
        int
            The index; ValueError names the axes for an unknown one.
        """
        try:
            return self.axes.index(axis)
        except ValueError:
            raise ValueError(f"rank {world().rank}: unknown mesh axis {axis!r}; {self!r} has axes "
                             f"{list(self.axes)}") from None

    def _axes_of(self, axis) -> tuple[str, ...]:
        return (axis,) if isinstance(axis, str) else tuple(axis)

    @property
    def is_member(self) -> bool:
        return self._coords is not None

    @property
    def coords(self) -> dict[str, int] | None:
        """This rank's position on each axis (None if the rank is not in the mesh)."""
        return None if self._coords is None else dict(zip(self.axes, self._coords))

    def coordinate(self, axis: str) -> int:
        """This rank's coordinate along ``axis`` (it must be on the mesh).

        Parameters
        ----------
        axis : str
            An axis name.

        Returns
        -------
        int
            The coordinate.
        """
        return self._require_member("coordinate")[self.axis_index(axis)]

    def group_ranks(self, axis: str | tuple[str, ...]) -> tuple[int, ...]:
        """World ranks of this rank's group along ``axis`` (a name or a tuple of names).

        Parameters
        ----------
        axis : str or tuple of str
            The axes.

        Returns
        -------
        tuple of int
            Group order.
        """
        coords = self._require_member("group_ranks")
        axes = self._axes_of(axis)
        idx = [self.axis_index(a) for a in axes]
        if len(set(idx)) != len(idx):
            raise ValueError(f"axis {axis!r} names a mesh axis twice")
        index: list = list(coords)
        for i in idx:
            index[i] = slice(None)
        sub = self._grid[tuple(index)]
        # order the group by the axes as the caller listed them
        remaining = sorted(idx)
        sub = np.transpose(sub, [remaining.index(i) for i in idx])
        return tuple(int(r) for r in sub.reshape(-1))

    def rank_map(self) -> list[dict]:
        """One row per position: coordinates, world rank, host, node-local rank and GPU.

        Returns
        -------
        list of dict
            One row per position.
        """
        seats = world().seats
        rows = []
        for pos in np.ndindex(*self.sizes):
            r = int(self._grid[pos])
            s = seats[r]
            rows.append({"coords": dict(zip(self.axes, pos)), "rank": r, "host": s.host,
                         "local_rank": s.local_rank, "device": s.device})
        return rows

    # groups and communicators ----------------------------------------------
    def group(self, axis: str | tuple[str, ...]) -> AxisGroup:
        """This rank's group along ``axis``; the communicator is made on first use
        (collective over the group's members only).

        Parameters
        ----------
        axis : str or tuple of str
            The axes.

        Returns
        -------
        AxisGroup
            Cached per axes.
        """
        g = self._groups.get(axis)
        if g is not None:
            return g
        ranks = self.group_ranks(axis)
        w = world()
        mesh_ranks = [self.devices.index(r) for r in ranks]
        sub = self._mpi.Create_group(self._mpi.Get_group().Incl(mesh_ranks))
        comm = make_communicator(sub, w.backend, w.comm_preference)
        g = AxisGroup(self._axes_of(axis), ranks, ranks.index(w.rank), comm)
        self._groups[axis] = g
        return g

    def _require_member(self, what: str) -> tuple[int, ...]:
        """This rank's coordinates; a ValueError on a rank outside the mesh."""
        if self._coords is None:
            raise ValueError(f"rank {world().rank} is not in {self!r} (devices {list(self.devices)[:8]}); "
                             f"{what} needs a member rank")
        return self._coords

    # default mesh ------------------------------------------------------------
    def __enter__(self) -> Mesh:
        _CURRENT.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _CURRENT.remove(self)


# this layer's mesh state: the ``with mesh:`` stack (innermost last) and set_mesh's default;
# lists read live by dist/comm/_hot.c (mesh_stacks), written only here
_CURRENT: list[Mesh] = []
_DEFAULT: list[Mesh] = []


def set_mesh(m: Mesh | None) -> None:
    """Make ``m`` the mesh that collectives on plain arrays use when given no ``mesh=``.

    Parameters
    ----------
    m : Mesh or None
        The default mesh; None clears it.
    """
    _DEFAULT[:] = [m] if m is not None else []


def mesh_stacks() -> tuple[list, list]:
    """The ``with mesh:`` stack and the ``set_mesh`` default, as the lists themselves (read live
    by the collectives' C path to find the current mesh; changed only here)."""
    return _CURRENT, _DEFAULT


def current_mesh() -> Mesh | None:
    """The mesh of the innermost ``with mesh:``, else the one ``set_mesh`` set.

    Returns
    -------
    Mesh or None
        None when neither is set.
    """
    if _CURRENT:
        return _CURRENT[-1]
    return _DEFAULT[0] if _DEFAULT else None


def mesh(devices: Iterable | None = None, axes: Iterable[str] = ("dp",), shape: dict | tuple | None = None) -> Mesh:
    """The seeds' spelling: ``dist.mesh(devices=[...], axes=("dp", "tp"), shape=(2, 2))``.

    Parameters
    ----------
    devices : iterable of int or str, optional
        The ranks on the grid (see ``Mesh``); default every rank.
    axes : iterable of str
        The axis names, major first.
    shape : dict or tuple of int, optional
        The axis sizes.

    Returns
    -------
    Mesh
        ``Mesh(axes=axes, shape=shape, devices=devices)``.
    """
    return Mesh(axes=axes, shape=shape, devices=devices)
