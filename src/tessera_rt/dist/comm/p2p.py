"""Point-to-point calls and the barrier on a mesh-axis group: ``send``, ``recv``, ``barrier``.

They take the group and the issue path of the collectives (``work``): checked on this rank
before anything is sent, on the role's stream, watched by the same hooks.  ``recv`` fills
its array in place.  A DTensor's ``send``/``recv`` are in ``dist.tensor.dtensor_collectives``.
"""
from __future__ import annotations

from .hooks import SEAM as _SEAM
from .mesh import Mesh
from .plans import backend, check_array, check_peer as _peer
from .process_group import world
from .work import WATCHERS, Work, issue, issue_watched, resolve_group

__all__ = ["send", "recv", "barrier"]


def send(x, dst: int, *, axis=None, mesh=None, tag: int = 0, async_op: bool = False,
         role: str = "tp_collective"):
    """Send ``x`` to position ``dst`` of the group (a world rank when no mesh or axis is given)."""
    g = resolve_group(mesh, axis, "send", x)
    x = check_array("send", g, x)
    _peer("send", g, x, dst, "dst")
    comm = g.comm
    if WATCHERS:
        return issue_watched(("send", g, x, x.nbytes, mesh, (), (dst, tag)), role, async_op, comm.send, (x, dst, tag), None)
    return issue(role, async_op, comm.send, (x, dst, tag,), None)


def recv(x, src: int, *, axis=None, mesh=None, tag: int = 0, async_op: bool = False,
         role: str = "tp_collective"):
    """Receive into ``x`` (in place; returns x) from position ``src`` of the group."""
    g = resolve_group(mesh, axis, "recv", x)
    if not backend().is_array(x) or not x.flags.c_contiguous:
        raise TypeError(f"rank {world().rank}: recv fills x in place: pass a contiguous "
                        f"{backend().xp.__name__} array, got {type(x).__name__}")
    _peer("recv", g, x, src, "src")
    comm = g.comm
    if WATCHERS:
        return issue_watched(("recv", g, x, 0, mesh, (), (src, tag)), role, async_op, comm.recv, (x, src, tag), x)
    return issue(role, async_op, comm.recv, (x, src, tag,), x)


def barrier(axis: str | tuple[str, ...] | None = None, *, mesh: Mesh | None = None, async_op: bool = False,
            role: str = "tp_collective") -> Work | None:
    """Wait until every rank of the group gets here (drains the role's stream on GPU).

    Parameters
    ----------
    axis : str or tuple of str, optional
        The mesh axes whose group waits; None: every rank of the mesh (or the world).
    mesh : Mesh, optional
        Default: the current mesh, else the world.
    async_op : bool
        Return a ``Work`` at once.
    role : str
        The stream role drained.

    Returns
    -------
    Work or None
        A ``Work`` with ``async_op``, else None.
    """
    g = resolve_group(mesh, axis, "barrier")
    check = _SEAM.check
    if check is not None:
        check("barrier", g, None, (), role if async_op else None)
    comm = g.comm
    if WATCHERS:
        return issue_watched(("barrier", g, None, 0, mesh, (), None), role, async_op, comm.barrier, (), None)
    return issue(role, async_op, comm.barrier, (), None)
