#!/usr/bin/env python
"""Benchmark the kernels beside their peers, in one run (DESIGN.md convention 8).

    python scripts/bench_kernels.py            # the backend's device (GPU if CuPy sees one)
    python scripts/bench_kernels.py --quick    # small sizes (CI, CPU)
    python scripts/bench_kernels.py --device cpu --markdown   # Markdown (scripts/bench_all.py: BENCHMARKS.md)
    python scripts/bench_kernels.py --json out.json   # the rows as JSON too (scripts/gpu_check.py)
    python scripts/bench_kernels.py --device cpu --fused   # the fused CPU kernels beside the references

GPU: the tile GEMM beside cuBLAS (cupy.matmul) at 4096^3 fp16 and bf16 and two skinny decode
shapes, the dual GEMM and SwiGLU beside two matmuls, flash attention forward and backward
beside PyTorch's scaled_dot_product_attention (when torch sees the GPU; else the fraction of
the tensor-core peak), the MoE grouped GEMMs beside one dense cuBLAS GEMM over the same tokens,
the cuBLASLt epilogue/FP8 GEMMs, the row kernels, FP8 quantize (per scale geometry) and paged
decode beside a device-to-device copy of the same bytes; each with TFLOP/s or GB/s and the
fraction of the device's peak.  Where the kernel table runs a vendor library by default
(``kernels.providers``: cuDNN, cuBLASLt, cuBLAS per group) a row times the project's own
kernel (``use_providers(False)``) and that default side by side ("default (provider)"); every
new kernel is checked against its reference before it is timed (scripts/_bench_sections.py).
CPU: the NumPy references beside NumPy's own matmul / a memcpy / torch SDPA, and the fused
Numba kernels the CPU kernel table picks beside those references (``--fused``).  On the CuPy
stand-in (tests/gpu_emu) the GPU path runs in the emulation harness at tiny shapes: the
figures say the code ran, not how fast a GPU is.

Fair by construction: both sides get the same input arrays (torch reads CuPy's memory through
DLPack), run on the same stream (torch on an ExternalStream of it), are timed by the same
clock (events around a loop of calls, no synchronization inside the window), and alternate
sample by sample.  Forward-only peers run without autograd.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))      # _bench_sections beside this file
from _bench_sections import epilogues, fp8_quantize, grouped, own_and_default, paged_decode

# dense fp16/bf16 tensor-core TFLOP/s and HBM TB/s (vendor datasheets); first match wins
PEAKS = {"H100 PCIe": (756.0, 2.0), "H100": (989.0, 3.35), "H200": (989.0, 4.8), "A100": (312.0, 2.0),
         "L40S": (362.0, 0.864)}


def peak_for(name: str):
    for key, val in PEAKS.items():
        if key in name:
            return val
    return (None, None)


class Clock:
    """Median milliseconds per call, the two sides of a comparison sampled alternately.

    A sample is a loop of ``iters`` calls between two timestamps (CUDA events recorded on the
    one stream both sides run on, or the host clock on the CPU), then one wait for the end
    event: the same synchronization for every side.  ``iters`` is set per side from a first
    timed call so that a sample lasts about ``target_ms``."""

    def __init__(self, gpu: bool, reps: int, stream=None, target_ms: float = 2.0, max_iters: int = 200):
        self.gpu, self.reps, self.stream = gpu, reps, stream
        self.target_ms, self.max_iters = target_ms, max_iters
        if gpu:
            import cupy
            self.cp = cupy

    def _sample(self, fn, iters: int) -> float:
        if self.gpu:
            start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
            start.record(self.stream)
            for _ in range(iters):
                fn()
            end.record(self.stream)
            end.synchronize()
            return self.cp.cuda.get_elapsed_time(start, end) / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters

    def _iters(self, fn) -> int:
        fn()                                   # warm-up: compiles, fills the memory pools
        once = self._sample(fn, 1)
        return int(max(1, min(self.max_iters, self.target_ms / max(once, 1e-4))))

    def pair(self, ours, peer=None):
        """(ours ms, peer ms or None): medians over ``reps`` samples each, interleaved."""
        return tuple(self.sides(ours, peer))

    def sides(self, *fns):
        """Median ms of each function (None for a None), sampled in turn, the order reversed
        every other round."""
        live = [fn for fn in fns if fn is not None]
        iters = [self._iters(fn) for fn in live]
        times: list[list[float]] = [[] for _ in live]
        for r in range(self.reps):
            order = range(len(live)) if r % 2 == 0 else reversed(range(len(live)))
            for i in order:
                times[i].append(self._sample(live[i], iters[i]))
        meds = iter(statistics.median(t) for t in times)
        return [next(meds) if fn is not None else None for fn in fns]


def max_rel_err(got, want) -> float:
    g, w = (np.asarray(x, np.float64) for x in (got, want))
    return float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30))


class Bench:
    def __init__(self, args):
        if args.device != "auto":
            os.environ["TESSERA_DEVICE"] = args.device
        from tessera_rt import runtime
        from tessera_rt.backend import get_backend
        self.be = get_backend()
        self.gpu, self.xp, self.quick = self.be.is_gpu, self.be.xp, args.quick
        self.emulated = self.gpu and bool(getattr(self.xp, "__tessera_standin__", False))
        self.rows: list[dict] = []
        self.rng = np.random.default_rng(0)
        self.stream = None
        self.torch, self.tdev = self._torch()
        if self.gpu:
            cp = self.xp
            self.stream = runtime.stream("compute").raw      # CuPy's current stream from here on
            props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            self.device = name + (" (emulated: CuPy stand-in + CUDA emulation harness)" if self.emulated else "")
        else:
            import platform
            self.device = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        self.peak_tf, self.peak_bw = peak_for(self.device) if self.gpu and not self.emulated else (None, None)
        reps = args.reps or (2 if self.emulated else 3 if args.quick else 10)
        self.clock = Clock(self.gpu, reps, self.stream, target_ms=2.0 if self.gpu else 5.0,
                           max_iters=1 if self.emulated else 200)

    def pick(self, emulated, quick, gpu, cpu):
        """The sizes for this run: tiny in the emulation harness, small with --quick."""
        return emulated if self.emulated else quick if self.quick else gpu if self.gpu else cpu

    def _torch(self):
        """(torch, device) for the peers: on the GPU only a torch that sees it."""
        try:
            import torch
        except Exception:              # not installed, or a broken install: bench without it
            return None, None
        if not self.gpu:
            return torch, "cpu"
        return (torch, "cuda") if not self.emulated and torch.cuda.is_available() else (None, None)

    # ---- helpers ---------------------------------------------------------------------------
    def arr(self, shape, dtype=None, scale=1.0):
        dtype = dtype or (np.float16 if self.gpu else np.float32)
        return self.xp.asarray((self.rng.standard_normal(shape) * scale).astype(dtype))

    def tt(self, a, grad: bool = False):
        """A torch tensor on ``a``'s own memory (DLPack on the GPU, from_numpy on the CPU)."""
        t = self.torch.from_dlpack(a) if self.gpu else self.torch.from_numpy(np.asarray(a))
        return t.detach().requires_grad_() if grad else t

    def on_stream(self, fn):
        """``fn`` run by torch on the benchmark's stream (so the same events time it)."""
        if not self.gpu:
            return fn
        torch = self.torch
        ext = torch.cuda.ExternalStream(self.stream.ptr)

        def run():
            with torch.cuda.stream(ext):
                return fn()
        return run

    def add(self, kernel, shape, ms, peer="", peer_ms=None, *, flops=None, nbytes=None, check="", note="",
            default_ms=None, provider=None):
        """One row: ``ms`` the project's own kernel; ``default_ms`` the kernel table's default when a
        vendor ``provider`` runs it (None: the own kernel is the default); the peer's ``peer_ms``."""
        unit, work = ("TFLOP/s", flops / 1e9) if flops is not None else ("GB/s", nbytes / 1e6)
        r = work / ms
        peak = (self.peak_tf if unit == "TFLOP/s" else (self.peak_bw * 1e3 if self.peak_bw else None))
        self.rows.append(dict(
            kernel=kernel, shape=shape, ms=ms, rate=r, unit=unit, of_peak=r / peak if peak else None, peer=peer,
            peer_ms=peer_ms, peer_rate=work / peer_ms if peer_ms else None, speedup=peer_ms / ms if peer_ms else None,
            provider=provider if default_ms is not None else None, default_ms=default_ms,
            default_rate=work / default_ms if default_ms else None, check=check, note=note))

    def checked(self, got, want, tol) -> str:
        err = max_rel_err(self.be.to_host(got), self.be.to_host(want))
        return f"{'ok' if err <= tol else 'MISMATCH'} (err {err:.1e})"

    # ---- sections --------------------------------------------------------------------------
    def gemm(self):
        xp = self.xp
        if not self.gpu:
            from tessera_rt import kernels as K
            from tessera_rt.dtypes import resolve_dtype
            sizes = self.pick(None, [(256, 256, 256)], None, [(512, 512, 512), (1024, 1024, 1024), (8, 1024, 4096)])
            for m, k, n in sizes:
                a, b = self.arr((m, k)), self.arr((k, n))
                ms, peer_ms = self.clock.pair(lambda: K.matmul(a, b, tile_shape=(128, 128, 64)), lambda: xp.matmul(a, b))
                self.add("matmul ref (K-tiled)", f"{m}x{k}x{n} f32", ms, "np.matmul", peer_ms, flops=2 * m * n * k)
                ab, bb = a.astype(resolve_dtype("bf16")), b.astype(resolve_dtype("bf16"))
                ms, peer_ms = self.clock.pair(lambda: K.matmul(ab, bb), lambda: xp.matmul(a, b))
                self.add("matmul ref bf16->f32 acc", f"{m}x{k}x{n} bf16", ms, "np.matmul f32", peer_ms,
                         flops=2 * m * n * k)
            return
        from tessera_rt.kernels.gemm_cuda import tile_gemm
        sizes = self.pick([(64, 64, 64), (2, 64, 128)], [(256, 256, 256), (8, 256, 1024)],
                          [(4096, 4096, 4096), (8, 4096, 4096), (8, 4096, 14336)], None)
        for m, k, n in sizes:
            a, b = self.arr((m, k)), self.arr((k, n))
            tiles = [(128, 256, 32), (128, 128, 32)] if m >= 128 else [(64, 64, 32), (64, 128, 32)]
            best = None
            for tile in tiles:                  # the better of the large tiles; skinny shapes: of the 64-row tiles
                ms, peer_ms = self.clock.pair(lambda: tile_gemm(a, b, tile), lambda: xp.matmul(a, b))
                if best is None or ms < best[1]:
                    best = (tile, ms, peer_ms)
            tile, ms, peer_ms = best
            self.add(f"tile_gemm{tile}", f"{m}x{k}x{n} f16", ms, "cuBLAS (cupy.matmul)", peer_ms,
                     flops=2 * m * n * k, check=self.checked(tile_gemm(a, b, tile), xp.matmul(a, b), 2e-2))
        m, k, n = sizes[0]
        self.gemm_bf16(m, k, n)

    def gemm_bf16(self, m, k, n):
        """The tile kernel's bf16 variant (operands as bit patterns: CuPy has no bfloat16 dtype)
        beside cuBLAS's bf16 GEMM through torch.matmul on the same memory."""
        xp = self.xp
        import ml_dtypes

        from tessera_rt.kernels.cuda_common import get_function
        from tessera_rt.kernels.gemm_tile_cuda import gemm_grid, gemm_smem_bytes, gemm_threads, render_gemm
        tile = (128, 256, 32)
        host = [(self.rng.standard_normal(s)).astype(ml_dtypes.bfloat16) for s in ((m, k), (k, n))]
        a, b = (xp.asarray(h.view(np.uint16)) for h in host)
        smem = gemm_smem_bytes(*tile)
        fn = get_function("tile_gemm", "ts_gemm", dict(BM=tile[0], BN=tile[1], BK=tile[2], dtype="bf16",
                                                       vec=8 if k % 8 == 0 and n % 8 == 0 else 1),
                          render_gemm, dynamic_smem=smem)

        def ours():
            c = xp.empty((m, n), np.uint16)
            fn(gemm_grid(m, n, tile), (gemm_threads(tile),), (a, b, b, c, c, np.int32(m), np.int32(n), np.int32(k),
                                                               np.int64(0), np.int64(0), np.int64(m * n)),
               shared_mem=smem)
            return c
        peer, peer_ms = "", None
        want = xp.matmul(*(xp.asarray(h.astype(np.float32)) for h in host))
        if self.torch is not None:
            ta, tb = (self.tt(x.view(np.int16)).view(self.torch.bfloat16) for x in (a, b))
            run_peer = self.on_stream(lambda: self.torch.matmul(ta, tb))
            ms, peer_ms = self.clock.pair(ours, run_peer)
            peer = "cuBLAS bf16 (torch.matmul)"
        else:
            ms, _ = self.clock.pair(ours)
        got = self.be.to_host(ours()).view(ml_dtypes.bfloat16).astype(np.float32)
        self.add(f"tile_gemm{tile} bf16", f"{m}x{k}x{n} bf16", ms, peer, peer_ms, flops=2 * m * n * k,
                 check=self.checked(got, want, 2e-2),
                 note="" if peer else "no bf16 cuBLAS peer: CuPy has no bfloat16 dtype and torch does not see the GPU")

    def dual(self):
        xp, kern = self.xp, self.be.kernel
        t_, d_, f_ = self.pick((32, 64, 128), (128, 256, 512), (4096, 4096, 11008), (512, 1024, 2048))
        xs, w1, w3 = self.arr((t_, d_)), self.arr((d_, f_), scale=0.05), self.arr((d_, f_), scale=0.05)
        flops = 2 * 2 * t_ * d_ * f_
        two = (lambda: (xp.matmul(xs, w1), xp.matmul(xs, w3)))
        ms, peer_ms = self.clock.pair(lambda: kern("dual_matmul")(xs, w1, w3), two)
        self.add("dual_matmul (one pass over x)", f"{t_}x{d_}->2x{f_}", ms, "2x matmul", peer_ms, flops=flops)

        def swiglu_peer():
            a, b = two()
            return a / (1 + xp.exp(-a)) * b
        ms, peer_ms = self.clock.pair(lambda: kern("swiglu")(xs, w1, w3), swiglu_peer)
        self.add("swiglu (dual GEMM, fused)", f"{t_}x{d_}->{f_}", ms, "2x matmul + silu*mul", peer_ms, flops=flops,
                 check=self.checked(kern("swiglu")(xs, w1, w3), swiglu_peer(), 3e-2))

    def attention(self):
        kern = self.be.kernel
        configs = self.pick([(1, 2, 2, 64, 64, True)], [(1, 4, 4, 128, 64, True)],
                            [(4, 16, 16, 2048, 64, True), (4, 16, 16, 2048, 128, True), (2, 32, 8, 4096, 128, True)],
                            [(1, 8, 8, 512, 64, True), (1, 8, 2, 512, 128, True)])
        torch = self.torch
        roofline = "" if torch is not None or not self.gpu else (
            "no CUDA torch: against the tensor-core roofline (of peak)")
        fa, fab = kern("flash_attention"), kern("flash_attention_backward")
        if self.gpu:            # the project's kernels, not the table's default (cuDNN where installed)
            from tessera_rt.kernels.attention_cuda import flash_attention_backward_cuda, flash_attention_cuda
            fa, fab = flash_attention_cuda, flash_attention_backward_cuda
        for b_, h_, hkv, s_, d_, causal in configs:
            q, k, v = self.arr((b_, h_, s_, d_)), self.arr((b_, hkv, s_, d_)), self.arr((b_, hkv, s_, d_))
            flops = 4 * b_ * h_ * s_ * s_ * d_ * (0.5 if causal else 1.0)
            label = f"B{b_} H{h_}/{hkv} S{s_} D{d_}{' causal' if causal else ''}"
            o, lse = fa(q, k, v, causal=causal, return_lse=True)
            do = self.arr(q.shape)
            peer, fwd_peer, bwd_peer, check = "", None, None, ""
            if torch is not None:
                sdpa = torch.nn.functional.scaled_dot_product_attention
                kw = dict(is_causal=causal, enable_gqa=h_ != hkv)
                tq, tk, tv = (self.tt(t) for t in (q, k, v))

                def fwd():
                    with torch.no_grad():
                        return sdpa(tq, tk, tv, **kw)
                fwd_peer = self.on_stream(fwd)
                gq, gk, gv = (self.tt(t, grad=True) for t in (q, k, v))
                to = self.on_stream(lambda: sdpa(gq, gk, gv, **kw))()
                tdo = self.tt(do)
                bwd_peer = self.on_stream(lambda: torch.autograd.grad(to, (gq, gk, gv), tdo, retain_graph=True))
                peer = "torch SDPA"
                ref = fwd_peer()
                check = self.checked(o, self.xp.from_dlpack(ref) if self.gpu else ref.numpy(), 2e-2)
            own, default, provider = own_and_default(self, "flash_attention", lambda: fa(q, k, v, causal=causal))
            ms, default_ms, peer_ms = self.clock.sides(own, default, fwd_peer)
            self.add("flash_attention fwd", label, ms, peer, peer_ms, flops=flops, check=check, note=roofline,
                     default_ms=default_ms, provider=provider)
            own, default, provider = own_and_default(self, "flash_attention_backward",
                                                     lambda: fab(q, k, v, o, do, lse, causal=causal))
            ms, default_ms, peer_ms = self.clock.sides(own, default, bwd_peer)
            self.add("flash_attention bwd", label, ms, peer + (" backward" if peer else ""), peer_ms,
                     default_ms=default_ms, provider=provider,
                     flops=2.5 * flops, note=roofline)

    def memory_bound(self):
        kern = self.be.kernel
        shape = self.pick((8, 256), (256, 1024), (8192, 4096), (2048, 1024))
        x, w, bvec = self.arr(shape, scale=2), self.arr(shape[-1:]), self.arr(shape[-1:])
        nbytes = 2 * x.size * x.dtype.itemsize                     # read x, write y
        copy = "D2D copy" if self.gpu else "memcpy"
        dt = np.dtype(x.dtype).name
        for name, fn in (("softmax", lambda: kern("softmax")(x)), ("layernorm", lambda: kern("layernorm")(x, w, bvec)),
                         ("rmsnorm", lambda: kern("rmsnorm")(x, w)), ("bias_gelu", lambda: kern("bias_act")(x, bvec)),
                         ("bias_silu", lambda: kern("bias_act")(x, bvec, act="silu"))):
            ms, peer_ms = self.clock.pair(fn, x.copy)
            self.add(name, f"{shape} {dt}", ms, copy, peer_ms, nbytes=nbytes)
        fp8_quantize(self)
        paged_decode(self)

    def grouped(self):
        """The MoE experts' grouped GEMMs (scripts/_bench_sections.py)."""
        grouped(self)

    def epilogues(self):
        """The cuBLASLt-served GEMMs, own vs default (scripts/_bench_sections.py)."""
        epilogues(self)

    def fused(self):
        """CPU: the fused Numba kernels (kernels.cpu_fused, cpu_attention) beside the NumPy
        references they replace in the kernel table, at the training step's shapes (8 x 128
        tokens, d_model 256, SwiGLU hidden 1024, vocab 256, 4 heads of 64); the backward
        references are the NumPy chains the VJP rules ran before (the SwiGLU one recomputing
        x@W1 and x@W3)."""
        if self.gpu:
            return
        from tessera_rt.kernels import attention, cpu_attention as CA, cpu_fused as CF, mlp, norms
        t_, d_, f_, v_ = self.pick(None, (256, 64, 256, 64), None, (1024, 256, 1024, 256))
        x, g = self.arr((t_, d_)), self.arr((t_, d_))
        w1, w3, w = self.arr((d_, f_), scale=0.06), self.arr((d_, f_), scale=0.06), self.arr((d_,))
        h1, h3 = x @ w1, x @ w3
        gf = self.arr((t_, f_))

        def swiglu_bwd_ref():
            a1, a3 = x @ w1, x @ w3
            s = 1 / (1 + np.exp(-a1))
            return gf * a3 * (s * (1 + a1 * (1 - s))), gf * (a1 * s)

        def rms_bwd_ref():
            r = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
            gw = g * w
            m = (gw * x).mean(-1, keepdims=True)
            return gw * r - x * (m * (r * (r * r))), (g * (x * r)).sum(0)

        def ln_bwd_ref():
            xc = x - x.mean(-1, keepdims=True)
            r = 1 / np.sqrt((xc * xc).mean(-1, keepdims=True) + 1e-5)
            xh, gw = xc * r, g * w
            gx = r * (gw - gw.mean(-1, keepdims=True) - xh * (gw * xh).mean(-1, keepdims=True))
            return gx, (g * xh).sum(0), g.sum(0)

        logits = self.arr((t_, v_), scale=2)
        tgt = self.rng.integers(0, v_, t_)
        onehot = (tgt[:, None] == np.arange(v_)[None]).astype(np.float32)

        def xent_ref():
            sh = logits - logits.max(-1, keepdims=True)
            e = np.exp(sh)
            loss = (np.log(e.sum(-1)) - (sh * onehot).sum(-1)).mean()
            return loss, (e / e.sum(-1, keepdims=True) - onehot) / t_

        def xent_ours():
            loss, lse = CF.softmax_cross_entropy(logits, tgt, return_lse=True)
            return loss, CF.cross_entropy_backward(1.0, logits, tgt, lse)

        y = CF.softmax(logits)
        gy = self.arr(y.shape)
        cases = [      # (name, shape, the array whose read + write is the rate's bytes, ours, reference)
            ("swiglu fwd", f"{t_}x{d_}->{f_}", h1, lambda: CF.swiglu(x, w1, w3), lambda: mlp.swiglu(x, w1, w3)),
            ("swiglu bwd (h1, h3 kept)", f"{t_}x{f_}", h1, lambda: CF.swiglu_backward(gf, h1, h3), swiglu_bwd_ref),
            ("rmsnorm fwd", f"{t_}x{d_}", x, lambda: CF.rmsnorm(x, w), lambda: norms.rmsnorm(x, w)),
            ("rmsnorm bwd", f"{t_}x{d_}", x, lambda: CF.rmsnorm_backward(g, x, w), rms_bwd_ref),
            ("layernorm fwd", f"{t_}x{d_}", x, lambda: CF.layernorm(x, w, w), lambda: norms.layernorm(x, w, w)),
            ("layernorm bwd", f"{t_}x{d_}", x, lambda: CF.layernorm_backward(g, x, w, w), ln_bwd_ref),
            ("softmax fwd", f"{t_}x{v_}", y, lambda: CF.softmax(logits), lambda: norms.softmax(logits)),
            ("softmax bwd", f"{t_}x{v_}", y, lambda: CF.softmax_backward(gy, y),
             lambda: y * (gy - (gy * y).sum(-1, keepdims=True))),
            ("cross-entropy fwd+bwd", f"{t_}x{v_}", y, xent_ours, xent_ref),
        ]
        for name, shape, main, ours, ref in cases:
            ms, peer_ms = self.clock.pair(ours, ref)
            got, want = ours(), ref()
            got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
            err = max(max_rel_err(a, b) for a, b in zip(got, want))
            self.add(name, shape + " f32", ms, "NumPy reference", peer_ms, nbytes=2 * main.nbytes,
                     check=f"{'ok' if err <= 1e-4 else 'MISMATCH'} (err {err:.1e})")
        b_, h_, s_, hd = self.pick(None, (2, 4, 128, 64), None, (8, 4, 128, 64))
        q, k, v = (self.arr((b_, h_, s_, hd)) for _ in range(3))
        o, lse = attention.flash_attention(q, k, v, causal=True, return_lse=True)
        do = self.arr(q.shape)
        flops = 4 * b_ * h_ * s_ * s_ * hd * 0.5
        label = f"B{b_} H{h_} S{s_} D{hd} causal f32"
        ms, peer_ms = self.clock.pair(lambda: CA.flash_attention(q, k, v, causal=True),
                                      lambda: attention.flash_attention(q, k, v, causal=True))
        self.add("attention fwd (blocked)", label, ms, "NumPy reference", peer_ms, flops=flops,
                 check=self.checked(CA.flash_attention(q, k, v, causal=True), o, 1e-4))
        ms, peer_ms = self.clock.pair(lambda: CA.flash_attention_backward(q, k, v, o, do, lse, causal=True),
                                      lambda: attention.flash_attention_backward(q, k, v, o, do, lse, causal=True))
        self.add("attention bwd (blocked)", label, ms, "NumPy reference", peer_ms, flops=2.5 * flops)

    def conv(self):
        from tessera_rt import kernels as K
        n_, c_, hw, kk = self.pick((1, 4, 32, 7), (1, 4, 32, 7), (4, 16, 256, 15), (4, 16, 64, 15))
        xi, wk = self.arr((n_, c_, hw, hw), np.float32), self.arr((c_, c_, kk, kk), np.float32)
        peer = None if self.gpu else (lambda: K.conv2d_direct(xi, wk))
        ms, peer_ms = self.clock.pair(lambda: K.conv2d_fft(xi, wk), peer)
        self.add("conv2d_fft", f"{n_}x{c_}x{hw}x{hw} k{kk}", ms, "direct conv" if peer else "", peer_ms,
                 flops=2 * n_ * c_ * c_ * hw * hw * kk * kk)


def format_rows(rows: list[dict], markdown: bool) -> list[str]:
    head = ("kernel", "shape", "ms", "rate", "of peak", "default (provider)", "default ms", "peer", "peer ms",
            "peer rate", "speedup vs peer", "check")
    def fmt(v, spec, suffix=""):
        return "" if v is None else f"{v:{spec}}{suffix}"
    cells = [(r["kernel"], r["shape"], fmt(r["ms"], ".3f"), fmt(r["rate"], ".3g", " " + r["unit"]),
              fmt(r["of_peak"], ".1%"), r.get("provider") or "own", fmt(r.get("default_ms"), ".3f"),
              r["peer"], fmt(r["peer_ms"], ".3f"), fmt(r["peer_rate"], ".3g"),
              fmt(r["speedup"], ".2f", "x"), (r["check"] + " " + r["note"]).strip()) for r in rows]
    if markdown:
        return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(c) + " |" for c in cells]
    widths = [max(len(str(c[i])) for c in cells + [head]) for i in range(len(head))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(c_, widths)).rstrip() for c_ in [head] + cells]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, few reps")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table (for BENCHMARKS.md)")
    ap.add_argument("--reps", type=int, default=None, help="samples per side (median taken)")
    ap.add_argument("--fused", action="store_true",
                    help="only the fused CPU kernels beside their NumPy references (the training step's shapes)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    bench = Bench(args)
    errors = []
    sections = (bench.fused,) if args.fused else (bench.gemm, bench.dual, bench.grouped, bench.attention,
                                                  bench.epilogues, bench.memory_bound, bench.conv, bench.fused)
    for section in sections:
        try:
            section()
        except Exception as exc:         # one broken section must not hide the others' figures
            errors.append(f"{section.__name__}: {type(exc).__name__}: {exc}")
    title = f"# tessera_rt kernel benchmarks on {bench.device}" + (" (quick)" if args.quick else "")
    print(title)
    print("\n".join(format_rows(bench.rows, args.markdown)))
    for e in errors:
        print(f"FAILED {e}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=bench.device, gpu=bench.gpu, emulated=bench.emulated, quick=args.quick,
                           rows=bench.rows, errors=errors), f, indent=1)
    return 1 if errors or any(r["check"].startswith("MISMATCH") for r in bench.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
