"""Launching the flash attention kernels in the emulation harness as attention_cuda launches them
(grids, blocks, dynamic shared memory, strides), and the float64 reference they are checked against.

The f16/bf16 kernels (flash_cuda) and the f32 ones (flash_f32_cuda) share entry names and
parameters; ``geom`` is the family's (threads, rows, shared-memory bytes) functions.
"""
import numpy as np

import tessera_rt.kernels as K
from tessera_rt.kernels.flash_cuda import flash_rows, flash_smem_bytes, flash_threads
from tessera_rt.kernels.flash_f32_cuda import flash32_rows, flash32_smem_bytes, flash32_threads

FLASH16 = (flash_threads, flash_rows, flash_smem_bytes)
FLASH32 = (flash32_threads, flash32_rows, flash32_smem_bytes)


def strides(a):
    return tuple(np.int64(x // a.itemsize) for x in a.strides[:3])


def laid_like(dev, a):
    """A new device array in ``a``'s memory order (its strides): O and dQ follow q, dK and dV k."""
    order = sorted(range(a.ndim), key=lambda i: -a.strides[i])
    out = dev.empty(tuple(a.shape[i] for i in order), a.dtype).transpose([order.index(i) for i in range(a.ndim)])
    assert out.strides == a.strides
    return out


def forward(dev, mod, q, k, v, causal, geom=FLASH16):
    """q (B, H, Sq, D) and k, v (B, Hkv, Sk, D) as device arrays (any strides, D contiguous)."""
    threads, rows, smem = geom
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    o = laid_like(dev, q)
    lse = dev.empty((b, h, sq), np.float32)
    dev.launch(mod.get_function("ts_flash_fwd"), (-(-sq // rows(d, "ts_flash_fwd")), b * h), threads(d, "ts_flash_fwd"),
               q, k, v, o, lse, np.int32(h), np.int32(hkv), np.int32(sq), np.int32(sk),
               np.float32(np.log2(np.e) / np.sqrt(d)), np.int32(causal), *strides(q), *strides(k),
               shared_mem=smem(d, "ts_flash_fwd"))
    return o, lse


def backward(dev, mod, q, k, v, o, do, lse, causal, geom=FLASH16):
    threads, rows_of, smem = geom
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    delta = dev.empty((b, h, sq), np.float32)
    dq, dk, dv = laid_like(dev, q), laid_like(dev, k), laid_like(dev, k)
    rows = b * h * sq
    dev.launch(mod.get_function("ts_flash_bwd_delta"), -(-rows // rows_of(d, "ts_flash_bwd_delta")),
               threads(d, "ts_flash_bwd_delta"), o, do, delta, np.int64(rows), np.int32(h), np.int32(sq),
               *strides(q))
    args = (np.int32(h), np.int32(hkv), np.int32(sq), np.int32(sk), np.float32(1 / np.sqrt(d)),
            np.int32(causal)) + strides(q) + strides(k)
    dev.launch(mod.get_function("ts_flash_bwd_dkdv"), (-(-sk // rows_of(d, "ts_flash_bwd_dkdv")), b * hkv),
               threads(d, "ts_flash_bwd_dkdv"), q, k, v, do, lse, delta, dk, dv, *args,
               shared_mem=smem(d, "ts_flash_bwd_dkdv"))
    dev.launch(mod.get_function("ts_flash_bwd_dq"), (-(-sq // rows_of(d, "ts_flash_bwd_dq")), b * h),
               threads(d, "ts_flash_bwd_dq"), q, k, v, do, lse, delta, dq, *args,
               shared_mem=smem(d, "ts_flash_bwd_dq"))
    return dq, dk, dv


def reference(q, k, v, do, causal):
    q64, k64, v64, do64 = (t.astype(np.float64) for t in (q, k, v, do))
    o, lse = K.flash_attention(q64, k64, v64, causal=causal, return_lse=True)
    return o, lse, K.flash_attention_backward(q64, k64, v64, o, do64, lse, causal=causal)


def check(got, want, tol):
    got = np.asarray(got, np.float64)
    fin = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), fin)
    np.testing.assert_allclose(got[fin], want[fin], rtol=tol, atol=tol)
