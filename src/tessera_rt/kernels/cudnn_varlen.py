"""cuDNN attention over packed variable-length sequences and paged KV caches.

* ``flash_attention_varlen`` (issue 39's packed prefill): ``q (Tq, H, D)`` and ``k, v (Tk,
  Hkv, D)`` hold every sequence back to back, ``cu_seqlens_q/k (B + 1,)`` where each one
  starts.  cuDNN reads them as ragged BSHD tensors: logical ``(B, H, S_max, D)`` with strides
  ``(., D, H*D, 1)`` and a ragged offset per sequence, ``cu_seqlens * H * D`` elements (int64,
  as the frontend's own tests pass them), plus the per-sequence lengths for the padding mask.
  A causal mask aligns bottom-right per sequence (cuDNN's reference: ``seq_len_kv[b] -
  seq_len_q[b]``), the project's convention.  ``S_max`` is rounded up to a power of two
  so that one graph serves many batches (the lengths ride in device tensors, not the graph).
* ``paged_decode_attention``: one query per sequence against cuDNN's paged K/V containers,
  which have the project's page layout ``(num_blocks, Hkv, block_size, D)``; the block table
  ``(B, max_blocks)`` is cuDNN's ``(B, 1, max_blocks, 1)`` page table.  Sliding windows
  (``seq_starts``) stay on the project's kernel.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._common import check_stream, is_cupy
from .cuda_common import launch_stream
from .cudnn_attention import (
    CudnnProvider,
    _checked,
    _io_type,
    cached_graph,
    causal_mask,
    dense,
    execute,
    give_back,
    short,
)
from .paged_attention import check_paged
from .precision import note
from .providers import register_provider
from .varlen_attention import check_varlen, host_lengths

__all__ = ["CudnnVarlenAttention", "CudnnPagedDecode", "RAGGED_MIN_CUDNN", "bucket"]

RAGGED_MIN_CUDNN = 91000            # packed (ragged) Q: the frontend's sample needs cuDNN 9.10
_TOKEN_SLACK = 64                   # ragged tensors: the frontend's tests allocate tokens rounded up to 64


def bucket(n: int) -> int:
    """``n`` rounded up to a power of two (at least 64): the graph's maximum sequence length."""
    return max(64, 1 << max(0, int(n) - 1).bit_length())


def _with_slack(x: Any) -> Any:
    """``x (T, H, D)`` (contiguous) if its allocation holds T rounded up to 64 tokens, else a
    zero-padded copy that does: the frontend's tests allocate ragged tensors that way, so
    cuDNN's 64-token tiles may touch rows past the last sequence."""
    import cupy
    t = x.shape[0]
    need = (-(-t // _TOKEN_SLACK) * _TOKEN_SLACK) * x.strides[0]
    mem = x.data.mem
    if mem.size - (x.data.ptr - mem.ptr) >= need:
        return x
    padded = cupy.zeros((-(-t // _TOKEN_SLACK) * _TOKEN_SLACK,) + x.shape[1:], x.dtype)
    padded[:t] = x
    return padded


def _lengths(cu: Any) -> Any:
    """``(B, 1, 1, 1)`` int32 lengths from cumulative ``cu (B + 1,)`` (one kernel)."""
    return (cu[1:] - cu[:-1]).astype(np.int32).reshape(-1, 1, 1, 1)


class CudnnVarlenAttention(CudnnProvider):
    """``flash_attention_varlen``: packed sequences through cuDNN's ragged SDPA."""

    min_version = RAGGED_MIN_CUDNN

    def supports(self, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *,
                 max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, causal: bool = False,
                 scale: float | None = None, out: Any | None = None, stream: Any | None = None) -> str | None:
        shape = _checked(self.op, check_varlen, self.op, q, k, v, cu_seqlens_q, cu_seqlens_k)
        if isinstance(shape, str):
            return shape
        b, h, hkv, tq, tk, d = shape
        _, why = self.elem(np.dtype(q.dtype), None)
        if why:
            return why
        if not (b and tq and tk):
            return "empty batch"
        if causal and not (is_cupy(cu_seqlens_q) or is_cupy(cu_seqlens_k)):
            lq = np.diff(np.asarray(cu_seqlens_q, np.int64))
            lk = np.diff(np.asarray(cu_seqlens_k, np.int64))
            if (lq > lk).any():
                return ("causal with a sequence of more queries than keys: its first rows see no key, and cuDNN "
                        "does not document its output for them")
        return self.head_dim(d)

    def run(self, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *,
            max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, causal: bool = False,
            scale: float | None = None, out: Any | None = None, stream: Any | None = None) -> Any:
        import cupy
        b, h, hkv, tq, tk, d = check_varlen(self.op, q, k, v, cu_seqlens_q, cu_seqlens_k)
        check_stream(self.op, stream)
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        dt = self.run_type(np.dtype(q.dtype), None)
        if max_seqlen_q is None or max_seqlen_k is None:
            # host lengths: given as NumPy (checked), else read back (one device sync)
            lq, lk = host_lengths(self.op, cu_seqlens_q, cu_seqlens_k, tq, tk)
            max_seqlen_q = max_seqlen_q if max_seqlen_q is not None else int(lq.max(initial=0))
            max_seqlen_k = max_seqlen_k if max_seqlen_k is not None else int(lk.max(initial=0))
        sq, sk = bucket(max_seqlen_q), bucket(max_seqlen_k)
        key = ("sdpa_varlen", b, h, hkv, sq, sk, d, dt.str, bool(causal), scale)

        def build(cudnn, handle):
            io = _io_type(cudnn, dt)
            g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)
            off = {n: g.tensor(name=n, dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64)
                   for n in ("q_offsets", "kv_offsets")}
            lens = {n: g.tensor(name=n, dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
                    for n in ("seq_len_q", "seq_len_kv")}
            t = {"q": g.tensor(name="q", dim=[b, h, sq, d], stride=[sq * h * d, d, h * d, 1], data_type=io),
                 "k": g.tensor(name="k", dim=[b, hkv, sk, d], stride=[sk * hkv * d, d, hkv * d, 1], data_type=io),
                 "v": g.tensor(name="v", dim=[b, hkv, sk, d], stride=[sk * hkv * d, d, hkv * d, 1], data_type=io)}
            t["q"].set_ragged_offset(off["q_offsets"])
            t["k"].set_ragged_offset(off["kv_offsets"])
            t["v"].set_ragged_offset(off["kv_offsets"])
            o, _ = g.sdpa(name="sdpa_varlen", q=t["q"], k=t["k"], v=t["v"], generate_stats=False, attn_scale=scale,
                          use_padding_mask=True, seq_len_q=lens["seq_len_q"], seq_len_kv=lens["seq_len_kv"],
                          **causal_mask(cudnn, causal))
            o.set_output(True).set_dim([b, h, sq, d]).set_stride([sq * h * d, d, h * d, 1]).set_data_type(io)
            o.set_ragged_offset(off["q_offsets"])
            t["o"] = o
            t.update(off)
            t.update(lens)
            return g, t

        entry = cached_graph(key, build)
        with launch_stream(stream):
            cq, ck = (c if is_cupy(c) else cupy.asarray(c) for c in (cu_seqlens_q, cu_seqlens_k))
            qh, kh, vh = (_with_slack(dense(x, dt)) for x in (q, k, v))
            # rows past cu_seqlens_q[-1] are not attended and must read 0: cuDNN leaves them alone
            covered = not is_cupy(cu_seqlens_q) and int(cu_seqlens_q[-1]) == tq
            o = (cupy.empty if covered else cupy.zeros)((-(-tq // _TOKEN_SLACK) * _TOKEN_SLACK, h, d), dt)
            # every array whose pointer cuDNN gets is held in a local until the launch is enqueued:
            # a temporary freed earlier could hand its block to the next one
            q_off = cq.astype(np.int64) * (h * d)
            kv_off = ck.astype(np.int64) * (hkv * d)
            len_q, len_k = _lengths(cq), _lengths(ck)
            execute(entry, {"q": qh.data.ptr, "k": kh.data.ptr, "v": vh.data.ptr, "o": o.data.ptr,
                            "q_offsets": q_off.data.ptr, "kv_offsets": kv_off.data.ptr,
                            "seq_len_q": len_q.data.ptr, "seq_len_kv": len_k.data.ptr})
            o = give_back(o[:tq], q.dtype, out)
        note(self.op, short(dt), self.name)
        return o


class CudnnPagedDecode(CudnnProvider):
    """``paged_decode_attention`` through cuDNN's paged-K/V SDPA (one query per sequence)."""

    def supports(self, q: Any, k_pages: Any, v_pages: Any, block_tables: Any, seq_lens: Any, *,
                 seq_starts: Any = None, scale: float | None = None, out: Any | None = None,
                 stream: Any | None = None, policy: Any = None) -> str | None:
        shape = _checked(self.op, check_paged, self.op, q, k_pages, v_pages, block_tables, seq_lens, seq_starts)
        if isinstance(shape, str):
            return shape
        b, h, hkv, d, bs, mb = shape
        _, why = self.elem(np.dtype(q.dtype), policy)
        if why:
            return why
        if seq_starts is not None:
            return "seq_starts (a sliding window) is not mapped onto cuDNN's paged attention"
        if not (b and mb):
            return "empty batch"
        return self.head_dim(d, "decode")

    def run(self, q: Any, k_pages: Any, v_pages: Any, block_tables: Any, seq_lens: Any, *,
            seq_starts: Any = None, scale: float | None = None, out: Any | None = None,
            stream: Any | None = None, policy: Any = None) -> Any:
        import cupy
        b, h, hkv, d, bs, mb = check_paged(self.op, q, k_pages, v_pages, block_tables, seq_lens, seq_starts)
        check_stream(self.op, stream)
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        dt = self.run_type(np.dtype(q.dtype), policy)
        nblocks = k_pages.shape[0]
        key = ("sdpa_paged_decode", b, h, hkv, d, bs, mb, nblocks, dt.str, scale)

        def build(cudnn, handle):
            io = _io_type(cudnn, dt)
            g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)
            page_strides = [hkv * bs * d, bs * d, d, 1]
            t = {"q": g.tensor(name="q", dim=[b, h, 1, d], stride=[h * d, d, d, 1], data_type=io),
                 "k": g.tensor(name="k", dim=[nblocks, hkv, bs, d], stride=page_strides, data_type=io),
                 "v": g.tensor(name="v", dim=[nblocks, hkv, bs, d], stride=page_strides, data_type=io)}
            for n in ("k_table", "v_table"):
                t[n] = g.tensor(name=n, dim=[b, 1, mb, 1], stride=[mb, mb, 1, 1], data_type=cudnn.data_type.INT32)
            for n in ("seq_len_q", "seq_len_kv"):
                t[n] = g.tensor(name=n, dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
            o, _ = g.sdpa(name="sdpa_paged_decode", q=t["q"], k=t["k"], v=t["v"], generate_stats=False,
                          attn_scale=scale, use_padding_mask=True, seq_len_q=t["seq_len_q"],
                          seq_len_kv=t["seq_len_kv"], paged_attention_k_table=t["k_table"],
                          paged_attention_v_table=t["v_table"], paged_attention_max_seq_len_kv=mb * bs)
            o.set_output(True).set_dim([b, h, 1, d]).set_stride([h * d, d, d, 1]).set_data_type(io)
            t["o"] = o
            return g, t

        entry = cached_graph(key, build)
        with launch_stream(stream):
            qh, kh, vh = (dense(x, dt) for x in (q, k_pages, v_pages))
            # entries past a sequence may be -1 (the project's convention): never a page index for cuDNN
            tables = cupy.maximum(cupy.ascontiguousarray(block_tables), 0).astype(np.int32, copy=False)
            lens_kv = cupy.ascontiguousarray(seq_lens).reshape(b, 1, 1, 1)
            lens_q = cupy.ones((b, 1, 1, 1), np.int32)
            o = cupy.empty((b, h, d), dt)
            execute(entry, {"q": qh.data.ptr, "k": kh.data.ptr, "v": vh.data.ptr, "k_table": tables.data.ptr,
                            "v_table": tables.data.ptr, "seq_len_q": lens_q.data.ptr,
                            "seq_len_kv": lens_kv.data.ptr, "o": o.data.ptr})
            o = give_back(o, q.dtype, out)
        note(self.op, short(dt), self.name)
        return o


register_provider(CudnnVarlenAttention("flash_attention_varlen"))
register_provider(CudnnPagedDecode("paged_decode_attention"))
