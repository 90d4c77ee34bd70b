"""A decode step: every running sequence's next token, with static buffers, so that on a GPU
the whole step (embedding, every layer, the LM head, sampling) is one CUDA graph launch.

``DecodeBatch`` holds a batch size's device buffers, made once: the step's state (input
token ids, positions, sampling keys (sequence, step), block tables as device slots), what
``decode_prepare`` derives from it on the device each step (key counts, window starts, the
slot each new K/V row goes to), the activations (``layers.Workspace``), the logits, the
sampling candidates and a token history.  A step reads only these and writes only these:

* ``decode_prepare``: lens, starts and slots from positions and tables (one launch);
* ``Llama.forward`` with ``DecodeAttention`` (the same layer stack as prefill);
* the LM head, then ``sample_argmax`` (+ an all_gather over tp) and ``sample_pick``, which
  writes the new token ids where the next step reads its input, advances positions and step
  keys, and appends the ids to the history.

So consecutive steps need nothing from the host: the host uploads the state only when the
batch changes (a sequence joins or leaves, or a page is added to a table: every
``block_size`` tokens), and reads the history back only when it needs the tokens (an eos to
check, a sequence finishing, the history full).  ``DecodeRunner`` runs a step eagerly the
first time at a batch size, then captures it (``cupy.cuda.Stream.begin_capture``) and
replays the graph; batches are padded to a few sizes (``BUCKETS``; padding rows have no
pages, so they write nothing and attend to nothing).  Not captured (eager steps): the CPU
backend, a cache with a host tier (its staging copies are planned per step) or a window
(its tables outgrow any fixed width), top-k / top-p sampling (on the host), tensor
parallelism over a host-staged communicator, and ``TESSERA_CUDA_GRAPHS=0``.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import runtime as rt
from .kv_storage import upload
from .layers import DecodeAttention, Workspace, host_int32, kernel

__all__ = ["DecodeBatch", "DecodeRunner", "BUCKETS", "HISTORY", "graphs_enabled"]

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
HISTORY = 64           # steps of token ids kept on the device between reads


def graphs_enabled() -> bool:
    """CUDA graphs for decode steps unless ``TESSERA_CUDA_GRAPHS=0``."""
    return os.environ.get("TESSERA_CUDA_GRAPHS", "1").strip().lower() not in ("0", "off", "no", "false")


class DecodeBatch:
    """The static device buffers of decode steps at (padded) batch ``b``.

    Parameters
    ----------
    model : Llama
        The model.
    cache : KVCache
        Its cache.
    b : int
        Rows.
    width : int
        Block-table width (pages a sequence may hold).
    """

    # views of the state array (set in __init__, by name)
    tok: Any
    pos: Any
    keys: Any
    hist_n: Any
    tables: Any

    def __init__(self, model, cache, b: int, width: int):
        xp = model.xp
        self.xp, self.b, self.width = xp, b, width
        # the state, one int32 array so a change is one upload: tok | pos | keys | hist_n | tables
        self._state = xp.zeros(4 * b + 1 + b * width, np.int32)
        n = 0
        for name, size, shape in (("tok", b, (b,)), ("pos", b, (b,)), ("keys", 2 * b, (b, 2)),
                                  ("hist_n", 1, (1,)), ("tables", b * width, (b, width))):
            setattr(self, name, self._state[n:n + size].reshape(shape))
            n += size
        self.lens, self.starts, self.slots = (xp.zeros(b, np.int32) for _ in range(3))
        self.hist = xp.zeros((b, HISTORY), np.int32)
        self.work = Workspace(model, b).view(b)
        self.logits = xp.empty((b, model.params["head"].shape[1]), model.dtype)
        tp = model.shard.tp
        self.pairs = xp.empty((1, b, 2), np.float64)
        self.cand = self.pairs if tp == 1 else xp.empty((tp, b, 2), np.float64)
        self.step_tables = cache.step_tables(b) if cache.n_host else None

    def upload_state(self, tok, pos, keys, tables) -> None:
        """The whole state (the batch changed); the history restarts."""
        b = self.b
        flat, _ = host_int32(_pad(tok, b), _pad(pos, b), _pad(keys, b), np.zeros(1), _pad(tables, b, -1))
        upload(self.xp, self._state, flat)

    def upload_tables(self, tables) -> None:
        """Only the block tables (a sequence got a page)."""
        upload(self.xp, self.tables, _pad(tables, self.b, -1))


def _pad(a, b: int, fill: int = 0) -> np.ndarray:
    a = np.asarray(a, np.int32)
    if a.shape[0] == b:
        return a
    out = np.full((b,) + a.shape[1:], fill, np.int32)
    out[:a.shape[0]] = a
    return out


class DecodeRunner:
    """Runs decode steps at one padded batch size: eagerly, or as a captured CUDA graph.

    Parameters
    ----------
    model, cache
        The model and its cache.
    b : int
        Rows (padded).
    sampler : DeviceSampler or None
        Device sampling (None: the caller samples on the host from ``batch.logits``).
    graphs : bool
        Capture the step once it has run eagerly (a GPU, no host tier, no window).
    """

    def __init__(self, model, cache, b: int, sampler, graphs: bool):
        self.model, self.cache, self.sampler = model, cache, sampler
        self.batch = DecodeBatch(model, cache, b, cache.num_blocks)
        self.prepare = kernel("decode_prepare")
        self.graphs = graphs
        self.graph: Any = None
        self.refused: str | None = None          # why a capture was not kept
        self.runs = 0
        self.sids: Sequence[int] = ()           # the staged path plans its copies from these

    def _step(self) -> None:
        m, c, b = self.model, self.cache, self.batch
        self.prepare(b.pos, b.tables, c.block_size, c.window, lens=b.lens, starts=b.starts, slots=b.slots)
        step = c.step(self.sids, b.step_tables) if b.step_tables is not None else None
        h = m.forward(b.tok, DecodeAttention(m, c, b, step), b.work)
        m.local_logits(h, out=b.logits)
        if self.sampler is not None:
            self.sampler(b.logits, b.keys, b.pairs, b.cand, b.tok, advance=True, pos=b.pos, hist=b.hist,
                         hist_n=b.hist_n)

    def run(self) -> None:
        """One step: eager the first time, captured the second (then replayed)."""
        self.runs += 1
        if self.graph is not None:
            self.graph.launch(self._stream())
            return
        if not self.graphs or self.runs == 1:
            self._step()
            return
        import cupy
        stream = self._stream()
        pool_malloc, made = cupy.cuda.get_allocator(), [0]

        def counting(size):              # a capture that allocates is not kept (see _capture's note)
            made[0] += size > 0
            return pool_malloc(size)
        cupy.cuda.set_allocator(counting)
        stream.begin_capture()
        try:
            self._step()
            graph = stream.end_capture()
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            # CUDA refused something in the step while capturing (nothing ran): eager steps
            if stream.is_capturing():
                try:
                    stream.end_capture()
                except cupy.cuda.runtime.CUDARuntimeError:      # (invalidated: it ends all the same)
                    pass
            graph, self.refused = None, f"CUDA refused the capture: {exc}"
        except BaseException:
            if stream.is_capturing():
                try:
                    stream.end_capture()
                except Exception:       # the capture was invalidated by the error being raised
                    pass
            raise
        finally:
            cupy.cuda.set_allocator(pool_malloc)
        if made[0]:
            # an array made inside the step is freed after the capture, and the pool would hand
            # its bytes to other work while the graph still writes them: eager steps
            graph, self.refused = None, f"the step allocated {made[0]} arrays while captured"
        if graph is None:
            self.graphs = False
            self._step()
            return
        self.graph = graph
        self.graph.launch(stream)

    @staticmethod
    def _stream():
        return rt.stream("compute").raw

    def fit(self, width: int) -> bool:
        """Room for tables ``width`` pages wide (a windowed sequence outgrows the pool's width:
        eager steps only); True when the buffers were remade (the state must be uploaded)."""
        if width <= self.batch.width:
            return False
        if self.graph is not None:
            raise RuntimeError("DecodeRunner.fit: a captured step's buffers cannot be remade (the graph holds their "
                               "addresses); captured steps have tables as wide as the cache")
        self.batch = DecodeBatch(self.model, self.cache, self.batch.b, max(width, 2 * self.batch.width))
        return True

    def tokens(self, n: int, cols: slice) -> np.ndarray:
        """History columns ``cols`` of the first ``n`` rows, ``(n, cols)`` (one read: a sync)."""
        h = self.batch.hist
        got = h.get() if hasattr(h, "get") else h
        return np.asarray(got[:n, cols])


def capturable(model, cache, sampler) -> bool:
    """Whether decode steps of ``model`` on ``cache`` may be captured as CUDA graphs."""
    if not (model.xp is not np and graphs_enabled() and sampler is not None and cache.n_host == 0
            and cache.window is None):
        return False
    if model.shard.tp == 1:
        return True
    g = model.mesh.group(model.tp_axis)
    return getattr(getattr(g, "comm", None), "kind", None) == "nccl"


def runner_for(model, cache, b: int, sampler) -> DecodeRunner:
    """The cache's runner for ``b`` rows (padded to a bucket where the steps are captured), made
    on first use.  Runners (and their graphs) are kept per cache and sampler settings."""
    graphs = capturable(model, cache, sampler)
    rows = next((x for x in BUCKETS if x >= b), b) if graphs else b
    key = (rows, None if sampler is None else (sampler.temperature, sampler.seed))
    r = cache.runners.get(key)
    if r is None:
        r = cache.runners[key] = DecodeRunner(model, cache, rows, sampler, graphs)
    return r
