"""The arrays that hold the KV cache's pages, and every copy into or between them; which page
sits in which slot is decided elsewhere (``kv_blocks.PageTiers``), this module is told slots.

The device pool is one flat array of pages so the paged kernel reads both tiers through one
table: layer ``l``'s device slot ``s`` is page ``l * n_dev + s``; staging buffer ``b``'s slot
``h`` is page ``layers * n_dev + b * n_host + h``.  The host tier holds ``(layers, n_host)``
pages, pinned on a GPU so the ``io`` stream's copies are asynchronous.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import runtime as rt

__all__ = ["PageStorage", "upload"]


def upload(xp, dst, host: np.ndarray) -> None:
    """``dst[...] = host`` with no device allocation (CuPy: one host->device copy into ``dst``)."""
    if xp is np:
        np.copyto(dst, host)
    else:
        dst.set(np.ascontiguousarray(host, dtype=dst.dtype))


def _host_empty(xp, shape, dtype):
    """Host pages: pinned on a GPU (so the io stream's copies are asynchronous); plain memory on
    the CPU backend, or where the array module has no pinned allocator (the copies then block)."""
    n = int(np.prod(shape))
    alloc = getattr(getattr(xp, "cuda", None), "alloc_pinned_memory", None)
    if xp is np or n == 0 or alloc is None:
        return np.zeros(shape, dtype)
    mem = alloc(n * np.dtype(dtype).itemsize)
    return np.frombuffer(mem, dtype, n).reshape(shape)


class PageStorage:
    """K and V pages of shape ``page`` for ``layers`` layers: ``n_dev`` device slots and
    ``n_host`` host slots per layer, plus two layers' worth of device staging for host pages."""

    def __init__(self, xp, layers: int, n_dev: int, n_host: int, page: tuple, dtype):
        self.xp, self.layers, self.n_dev, self.n_host = xp, layers, n_dev, n_host
        flat = layers * n_dev + 2 * n_host           # device pages + two staging layers
        self.k, self.v = xp.zeros((flat,) + page, dtype), xp.zeros((flat,) + page, dtype)
        # each layer's device pages, indexed by device slot (contiguous views of the pool)
        self.layer_k = [self.k[i * n_dev:(i + 1) * n_dev] for i in range(layers)]
        self.layer_v = [self.v[i * n_dev:(i + 1) * n_dev] for i in range(layers)]
        host = (layers, n_host) + page
        self.host_k, self.host_v = _host_empty(xp, host, dtype), _host_empty(xp, host, dtype)

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer's K and V page."""
        return 2 * self.k[0].nbytes

    def staging_base(self, layer):
        """Pool index of ``layer``'s staging half's slot 0 (double buffered: layer l+1 fills while
        l reads)."""
        return self.layers * self.n_dev + (layer % 2) * self.n_host

    def spill(self, slot: int, hslot: int) -> None:
        """Copy device slot ``slot`` of every layer into host slot ``hslot`` on the io stream,
        after compute's writes into it and before compute overwrites it."""
        io = rt.stream("io")
        io.wait_event(rt.stream("compute").record())      # after the writes into the page
        with io:
            for layer in range(self.layers):              # page by page: no gathered copy on the device
                _download(self.k[layer * self.n_dev + slot], self.host_k[layer, hslot])
                _download(self.v[layer * self.n_dev + slot], self.host_v[layer, hslot])
        rt.stream("compute").wait_event(io.record())      # before the slot is overwritten

    def stage(self, layer: int, host_slots) -> Any:
        """Copy ``layer``'s host slots into its staging half on the io stream (once the compute
        stream has issued the reads of layer - 1, which used the other half); returns the
        event compute waits on before reading them."""
        io, compute = rt.stream("io"), rt.stream("compute")
        io.wait_event(compute.record())            # after the reads of the other half's last user
        with io:
            base = self.staging_base(layer)
            for h in host_slots:                   # page by page into the staging slots: no index arrays
                upload(self.xp, self.k[base + h], self.host_k[layer, h])
                upload(self.xp, self.v[base + h], self.host_v[layer, h])
        return io.record()

    def write(self, layer: int, dev: np.ndarray, host: np.ndarray, slot: np.ndarray, rows: np.ndarray,
              k: Any, v: Any) -> None:
        """Store rows ``k, v (N, Hkv_l, D)`` of ``layer``: row i at page row ``rows[i]`` of slot
        ``slot[i]`` of the device where ``dev[i]``, of the host where ``host[i]`` (neither: skipped)."""
        xp = self.xp
        hkv, d = k.shape[1], k.shape[2]
        bs = self.k.shape[2]
        sel = np.flatnonzero(dev)
        if sel.size:
            # page-row (p, r) of head h: row (p * Hkv + h) * bs + r of the pool seen as (-1, D)
            idx = ((layer * self.n_dev + slot[sel])[:, None] * hkv + np.arange(hkv)) * bs + rows[sel][:, None]
            for dst, src in ((self.k, k), (self.v, v)):
                _put(xp, dst.reshape(-1, d), idx, _take(xp, src, sel))
        sel = np.flatnonzero(host)
        if sel.size:
            self.host_k[layer, slot[sel], :, rows[sel]] = _to_host(_take(xp, k, sel))
            self.host_v[layer, slot[sel], :, rows[sel]] = _to_host(_take(xp, v, sel))

    def write_host(self, layer: int, slot: np.ndarray, rows: np.ndarray, k: Any, v: Any) -> None:
        """Store rows ``k, v (N, Hkv_l, D)`` of ``layer`` into host slots ``slot`` at page rows
        ``rows`` (a prefill whose pages were moved to the host before it wrote them)."""
        self.host_k[layer, slot, :, rows] = _to_host(k)
        self.host_v[layer, slot, :, rows] = _to_host(v)


def _to_host(a):
    return a if isinstance(a, np.ndarray) else a.get()


def _download(src, out: np.ndarray) -> None:
    """``out[...] = src`` from the device into host memory ``out`` (no new host or device array)."""
    if isinstance(src, np.ndarray):
        np.copyto(out, src)
    else:
        src.get(out=out)


def _put(xp, dst, index: np.ndarray, values) -> None:
    """``dst[index] = values`` along dst's first axis, as a flat ``put`` (element indices made on
    the host): one scatter that CuPy and NumPy both run in place on a contiguous ``dst``."""
    inner = int(np.prod(dst.shape[1:]))
    flat = (np.asarray(index, np.int64).reshape(-1, 1) * inner + np.arange(inner)).ravel()
    dst.put(xp.asarray(flat), xp.ascontiguousarray(values).ravel())


def _take(xp, src, index: np.ndarray):
    return xp.take(src, xp.asarray(np.asarray(index, np.int64)), axis=0)
