"""Seed 004's fused CCL ops: a double matmul with a reduce-scatter, a reduce-scatter that
makes QKV heads, and an all-gather that concatenates heads.  Each equals its unfused
composition (tests/collectives/mpi_ccl.py checks it)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...kernels.mlp import dual_reads_x_once
from ..comm import collectives as C
from ..comm.mesh import Mesh
from . import buffers
from ._common import check_array, resolve, where
from .line import line_all_gather, line_reduce_scatter

__all__ = ["double_matmul_line_reduce_scatter", "llama_rs_create_heads", "all_gather_concat", "local_matmul"]


def local_matmul(a: Any, b: Any):
    """``a @ b`` on this rank's arrays: the backend's kernel, what op.matmul runs on arrays
    (op sits above the distributed core)."""
    return C.backend().kernel("matmul", like=a)(a, b)


def double_matmul_line_reduce_scatter(x: Any, w1: Any, w3: Any, cluster_axis: int | str = 1, dim: int = -1, *,
                                      mesh: Mesh | None = None, sizes: Sequence[int] | None = None,
                                      buffer_key: str | None = None, num_links: int = 1, algo: str = "auto",
                                      overlap: bool | None = None) -> tuple[Any, Any]:
    """``(line_reduce_scatter(x @ w1, dim), x @ w3)`` in one of two ways:

    * one pass (``overlap=False``): the ``dual_matmul`` kernel makes both products reading x
      once (on a GPU one tile kernel holding a w1 and a w3 tile per block, fp16; on the CPU
      ``x @ [w1 | w3]``), then the reduce-scatter runs;
    * overlapped (``overlap=True``): ``x @ w1``, then the reduce-scatter is posted and
      ``x @ w3`` runs while it is in flight (x is read twice).

    Parameters
    ----------
    x : array
        This rank's input ``(..., K)``.
    w1, w3 : array
        This rank's weights ``(K, F)``; ``x @ w1`` is a partial sum over the axis.
    cluster_axis : int or str
        The mesh axis (index or name) reduced over.
    dim : int
        The dim of ``x @ w1`` scattered.
    mesh : Mesh, optional
        Default: the current mesh.
    sizes : sequence of int, optional
        Uneven part lengths along ``dim``.
    buffer_key : str, optional
        Reuse the key's persistent buffers (the result is a view into them).
    num_links : int
        Sub-messages each transfer is cut into, all in flight together.
    algo : {"auto", "library", "ring", "line"}
        The reduce-scatter's algorithm (``auto``: by size, ``algo_table``).
    overlap : bool, optional
        None takes the one pass wherever the kernel really reads x once
        (``kernels.mlp.dual_reads_x_once``: fp16 on a GPU; on the CPU when x has more rows
        than 2F) and overlaps otherwise.

    Returns
    -------
    tuple of array
        This rank's part of the reduced ``x @ w1``, and ``x @ w3``.
    """
    name = "double_matmul_line_reduce_scatter"
    mesh, axis, g = resolve(name, mesh, cluster_axis)
    x, w1, w3 = (check_array(name, g, a) for a in (x, w1, w3))
    if w1.ndim != 2 or tuple(w1.shape) != tuple(w3.shape) or x.shape[-1] != w1.shape[0]:
        raise ValueError(f"{where(name, g, x)}: w1 {tuple(w1.shape)} and w3 {tuple(w3.shape)} must be the same "
                         f"2-D (K, N) shape with K = x's last dim {x.shape[-1]}")
    n = g.size
    out_shape = tuple(x.shape[:-1]) + (w1.shape[1],)
    if not -len(out_shape) <= dim < len(out_shape):
        raise ValueError(f"{where(name, g, x)}: dim={dim} is out of range for x @ w1 of shape {list(out_shape)}")
    length = out_shape[dim]
    if sizes is None and length % n:
        raise ValueError(f"{where(name, g, x)}: x @ w1 has shape {list(out_shape)}, whose dim {dim} ({length}) "
                         f"does not split evenly over the {n} ranks of {axis!r}; pass sizes= with {n} part "
                         f"sizes adding up to {length}")
    backend = C.backend()
    if overlap is None:
        overlap = not dual_reads_x_once(x, w1, w3, on_gpu=backend.is_gpu)
    if not overlap:
        y1, y3 = backend.kernel("dual_matmul")(x, w1, w3)
        return line_reduce_scatter(y1, dim, axis, mesh=mesh, sizes=sizes, buffer_key=buffer_key,
                                   num_links=num_links, algo=algo), y3
    y1 = local_matmul(x, w1)
    y3 = []
    rs = line_reduce_scatter(y1, dim, axis, mesh=mesh, sizes=sizes, buffer_key=buffer_key, num_links=num_links,
                             algo=algo, between=lambda: y3.append(local_matmul(x, w3)))
    return rs, y3[0]


def llama_rs_create_heads(xqkv: Any, n_heads: int, n_kv_heads: int, head_dim: int, cluster_axis: int | str = 1, *,
                          mesh: Mesh | None = None, buffer_key: str | None = None, num_links: int = 1,
                          algo: str = "auto") -> tuple[Any, Any, Any]:
    """Reduce-scatter the fused QKV projection's partial sums so each rank of the axis gets
    its own heads, summed.  The columns are put in per-rank order ``[q_i | k_i | v_i]``
    first (one copy), so one reduce-scatter does it.

    Parameters
    ----------
    xqkv : array
        ``(batch, seq, (H + 2 Hkv) * D)``: Q heads, then K, then V (a partial sum over the axis).
    n_heads, n_kv_heads : int
        ``H`` and ``Hkv``, both divisible by the axis size.
    head_dim : int
        ``D``.
    cluster_axis : int or str
        The mesh axis (index or name) reduced over.
    mesh : Mesh, optional
        Default: the current mesh.
    buffer_key : str, optional
        Reuse the key's persistent buffers.
    num_links : int
        Sub-messages each transfer is cut into.
    algo : {"auto", "library", "ring", "line"}
        The reduce-scatter's algorithm.

    Returns
    -------
    tuple of array
        ``q (batch, H/n, seq, D)``, ``k, v (batch, Hkv/n, seq, D)``.
    """
    name = "llama_rs_create_heads"
    mesh, axis, g = resolve(name, mesh, cluster_axis)
    xqkv = check_array(name, g, xqkv)
    n = g.size
    if xqkv.ndim != 3 or xqkv.shape[-1] != (n_heads + 2 * n_kv_heads) * head_dim:
        raise ValueError(f"{where(name, g, xqkv)}: xqkv must be (batch, seq, (n_heads + 2 * n_kv_heads) * head_dim)"
                         f" = (..., {(n_heads + 2 * n_kv_heads) * head_dim}) for n_heads={n_heads}, "
                         f"n_kv_heads={n_kv_heads}, head_dim={head_dim}")
    if n_heads % n or n_kv_heads % n:
        raise ValueError(f"{where(name, g, xqkv)}: n_heads={n_heads} and n_kv_heads={n_kv_heads} must both be "
                         f"divisible by the {n} ranks of {axis!r} (each rank gets whole heads); change the "
                         "head counts or the axis")
    xp = C.backend().xp
    hl, kl, d = n_heads // n, n_kv_heads // n, head_dim
    idx = _ORDER.get((n, n_heads, n_kv_heads, d))
    if idx is None:
        idx = _ORDER[(n, n_heads, n_kv_heads, d)] = xp.asarray(_head_order(n, n_heads, n_kv_heads, d))
    sig = (name, axis, xqkv.shape, xqkv.dtype, (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("head_dim", d)))
    perm = buffers.take(None if buffer_key is None else buffer_key + "/order", sig,
                        lambda: {"perm": tuple(xqkv.shape)}, xqkv.dtype)["perm"]
    xp.take(xqkv, idx, axis=-1, out=perm)
    mine = line_reduce_scatter(perm, -1, axis, mesh=mesh, buffer_key=buffer_key, num_links=num_links, algo=algo)
    b, s = xqkv.shape[:2]

    def heads(lo, h):
        return xp.ascontiguousarray(mine[..., lo * d:(lo + h) * d].reshape(b, s, h, d).transpose(0, 2, 1, 3))
    return heads(0, hl), heads(hl, kl), heads(hl + kl, kl)


_ORDER: dict = {}      # (n, heads, kv heads, head_dim) -> column order, on the device


def _head_order(n: int, h: int, hkv: int, d: int) -> list[int]:
    """Columns of [Q | K | V] reordered to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (rank i's heads)."""
    hl, kl = h // n, hkv // n
    cols: list = []
    for i in range(n):
        for base, per in ((0, hl), (h, kl), (h + hkv, kl)):
            first = (base + i * per) * d
            cols.extend(range(first, first + per * d))
    return cols


def all_gather_concat(x: Any, dim: int = 1, cluster_axis: int | str = 1, *, num_heads: int | None = None,
                      mesh: Mesh | None = None, buffer_key: str | None = None, num_links: int = 1,
                      algo: str = "auto") -> Any:
    """Gather every rank's heads and concatenate them on the feature dim, i.e.
    ``all_gather(x, dim=1).transpose(0, 2, 1, 3).reshape(batch, seq, -1)``.  The local heads
    are laid out as features first (one copy), so one gather lands in final order.

    Parameters
    ----------
    x : array
        This rank's heads ``(batch, local_heads, seq, D)``.
    dim : int
        The heads dim: must be 1 (or -3).
    cluster_axis : int or str
        The mesh axis (index or name) gathered over.
    num_heads : int, optional
        This rank's heads, checked against ``x.shape[1]``.
    mesh : Mesh, optional
        Default: the current mesh.
    buffer_key : str, optional
        Reuse the key's persistent buffers.
    num_links : int
        Sub-messages each transfer is cut into.
    algo : {"auto", "library", "ring", "line"}
        The gather's algorithm.

    Returns
    -------
    array
        ``(batch, seq, n * local_heads * D)`` in rank order.
    """
    name = "all_gather_concat"
    mesh, axis, g = resolve(name, mesh, cluster_axis)
    x = check_array(name, g, x)
    if x.ndim != 4 or dim % 4 != 1:
        raise ValueError(f"{where(name, g, x)}: x must be (batch, heads, seq, head_dim) with the heads on "
                         f"dim=1, got dim={dim}")
    if num_heads is not None and x.shape[1] != num_heads:
        raise ValueError(f"{where(name, g, x)}: num_heads={num_heads} but x holds {x.shape[1]} heads on dim 1")
    b, h, s, d = x.shape
    xp = C.backend().xp
    sig = (name, axis, x.shape, x.dtype, (("dim", dim),))
    feat = buffers.take(None if buffer_key is None else buffer_key + "/features", sig,
                        lambda: {"f": (b, s, h * d)}, x.dtype)["f"]
    feat.reshape(b, s, h, d)[...] = xp.swapaxes(x, 1, 2)
    return line_all_gather(feat, -1, axis, mesh=mesh, buffer_key=buffer_key, num_links=num_links, algo=algo)
