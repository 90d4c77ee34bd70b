#!/usr/bin/env python
"""Benchmark the tile kernels beside their peers, in one run (DESIGN.md convention 8).

    python scripts/bench_kernels.py            # the backend's device (GPU if CuPy sees one)
    python scripts/bench_kernels.py --quick    # small sizes (CI, CPU)
    python scripts/bench_kernels.py --device cpu --markdown >> BENCHMARKS.md

GPU: the tile GEMM beside cuBLAS (cupy.matmul), flash attention forward/backward beside
PyTorch's scaled_dot_product_attention (when torch sees the GPU), the row kernels and FP8
quantize beside a device-to-device copy; each with TFLOP/s or GB/s and the fraction of the
device's peak.  CPU: the NumPy references beside NumPy's own matmul / a memcpy / torch SDPA.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import numpy as np

# dense fp16 tensor-core TFLOP/s and HBM TB/s (vendor datasheets, SXM parts)
PEAKS = {"H100": (989.0, 3.35), "H200": (989.0, 4.8), "A100": (312.0, 2.0), "L40S": (362.0, 0.864)}


def peak_for(name: str):
    for key, val in PEAKS.items():
        if key in name:
            return val
    return (None, None)


class Timer:
    def __init__(self, gpu: bool, reps: int):
        self.gpu, self.reps = gpu, reps
        if gpu:
            import cupy
            self.cp = cupy

    def __call__(self, fn, *args, **kw) -> float:
        """Median milliseconds of ``reps`` runs after one warmup."""
        fn(*args, **kw)
        times = []
        for _ in range(self.reps):
            if self.gpu:
                s, e = self.cp.cuda.Event(), self.cp.cuda.Event()
                s.record()
                fn(*args, **kw)
                e.record()
                e.synchronize()
                times.append(self.cp.cuda.get_elapsed_time(s, e))
            else:
                t0 = time.perf_counter()
                fn(*args, **kw)
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def rate(flops=None, nbytes=None, ms=1.0):
    if flops is not None:
        return flops / ms / 1e9, "TFLOP/s"
    return nbytes / ms / 1e6, "GB/s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, few reps")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table (for BENCHMARKS.md)")
    ap.add_argument("--reps", type=int, default=None)
    args = ap.parse_args(argv)
    if args.device != "auto":
        os.environ["TESSERA_DEVICE"] = args.device
    from tessera_rt.backend import get_backend
    import tessera_rt.kernels as K
    be = get_backend()
    gpu = be.is_gpu
    xp = be.xp
    timer = Timer(gpu, args.reps or (3 if args.quick else 10))
    if gpu:
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        device = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    else:
        import platform
        device = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    peak_tf, peak_bw = peak_for(device) if gpu else (None, None)
    rows: list[tuple] = []

    def add(kernel, shape, ms, r, unit, peer, peer_ms, peer_r=None):
        frac = ""
        if unit == "TFLOP/s" and peak_tf:
            frac = f"{r / peak_tf:.1%}"
        elif unit == "GB/s" and peak_bw:
            frac = f"{r / (peak_bw * 1e3):.1%}"
        ratio = f"{peer_ms / ms:.2f}x" if peer_ms else ""
        rows.append((kernel, shape, f"{ms:.3f}", f"{r:.2f} {unit}", frac, peer,
                     f"{peer_ms:.3f}" if peer_ms else "", f"{peer_r:.2f}" if peer_r else "", ratio))

    rng = np.random.default_rng(0)

    def arr(shape, dtype=np.float16 if gpu else np.float32, scale=1.0):
        return xp.asarray((rng.standard_normal(shape) * scale).astype(dtype))

    # ---- GEMM
    sizes = [(256, 256, 256)] if args.quick else [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192)]
    if not gpu and not args.quick:
        sizes = [(512, 512, 512), (1024, 1024, 1024)]
    for m, k, n in sizes:
        a, b = arr((m, k)), arr((k, n))
        flops = 2 * m * n * k
        peer_ms = timer(xp.matmul, a, b)
        peer_r = rate(flops, ms=peer_ms)[0]
        if gpu:
            from tessera_rt.kernels.gemm_cuda import tile_gemm
            for tile in ((128, 128, 32), (64, 64, 32)):
                ms = timer(tile_gemm, a, b, tile)
                add(f"tile_gemm{tile}", f"{m}x{k}x{n} f16", ms, *rate(flops, ms=ms), "cuBLAS", peer_ms, peer_r)
        else:
            ms = timer(K.matmul, a, b, tile_shape=(128, 128, 64))
            add("matmul ref (K-tiled)", f"{m}x{k}x{n} f32", ms, *rate(flops, ms=ms), "np.matmul", peer_ms, peer_r)
            from tessera_rt.dtypes import resolve_dtype
            ab, bb = a.astype(resolve_dtype("bf16")), b.astype(resolve_dtype("bf16"))
            ms = timer(K.matmul, ab, bb)
            add("matmul ref bf16->f32 acc", f"{m}x{k}x{n} bf16", ms, *rate(flops, ms=ms), "np.matmul f32",
                peer_ms, peer_r)

    # ---- memory-bound: norms, softmax, bias+act, fp8 vs a device copy
    shape = (256, 1024) if args.quick else ((8192, 4096) if gpu else (2048, 1024))
    x = arr(shape, scale=2)
    w = arr(shape[-1:])
    bvec = arr(shape[-1:])
    nbytes = 2 * x.size * x.dtype.itemsize
    copy_ms = timer(lambda: x.copy())
    copy_r = rate(nbytes=nbytes, ms=copy_ms)[0]
    kern = be.kernel
    for name, fn in (("softmax", lambda: kern("softmax")(x)), ("layernorm", lambda: kern("layernorm")(x, w, bvec)),
                     ("rmsnorm", lambda: kern("rmsnorm")(x, w)), ("bias_gelu", lambda: kern("bias_act")(x, bvec)),
                     ("bias_silu", lambda: kern("bias_act")(x, bvec, act="silu"))):
        ms = timer(fn)
        add(name, f"{shape} {np.dtype(x.dtype).name}", ms, *rate(nbytes=nbytes, ms=ms), "D2D copy" if gpu else "memcpy",
            copy_ms, copy_r)
    xf = arr(shape, np.float32, scale=3)
    ms = timer(kern("quantize_fp8"), xf, "fp8_e4m3", scale="per_channel")
    add("quantize_fp8 e4m3/ch", f"{shape} f32", ms, *rate(nbytes=xf.size * 5, ms=ms), "copy", copy_ms, copy_r)

    # ---- SwiGLU double matmul
    t_, d_, f_ = (128, 256, 512) if args.quick else ((4096, 4096, 11008) if gpu else (512, 1024, 2048))
    xs, w1, w3 = arr((t_, d_)), arr((d_, f_), scale=0.05), arr((d_, f_), scale=0.05)
    flops = 2 * 2 * t_ * d_ * f_
    peer_ms = timer(lambda: (xp.matmul(xs, w1), xp.matmul(xs, w3)))
    ms = timer(kern("swiglu"), xs, w1, w3)
    add("swiglu (dual GEMM)", f"{t_}x{d_}->{f_}", ms, *rate(flops, ms=ms), "2x matmul", peer_ms, rate(flops, ms=peer_ms)[0])

    # ---- attention
    try:
        import torch
        tdev = "cuda" if gpu and torch.cuda.is_available() else "cpu"
        if gpu and tdev == "cpu":
            torch = None
    except Exception:              # not installed, or a broken install: bench without the peer
        torch = None
    configs = [(1, 4, 4, 128, 64, True)] if args.quick else (
        [(4, 16, 16, 2048, 64, True), (4, 16, 16, 2048, 128, True), (2, 32, 8, 4096, 128, True)] if gpu
        else [(1, 8, 8, 512, 64, True), (1, 8, 2, 512, 128, True)])
    for b_, h_, hkv, s_, d_, causal in configs:
        q, k, v = arr((b_, h_, s_, d_)), arr((b_, hkv, s_, d_)), arr((b_, hkv, s_, d_))
        flops = 4 * b_ * h_ * s_ * s_ * d_ * (0.5 if causal else 1.0)
        peer, peer_ms = "", None
        if torch is not None:
            tq, tk, tv = (torch.as_tensor(t_ if not gpu else t_.get(), device=tdev).requires_grad_()
                          for t_ in (q, k, v))
            sdpa = torch.nn.functional.scaled_dot_product_attention
            def run_sdpa():
                r = sdpa(tq, tk, tv, is_causal=causal, enable_gqa=h_ != hkv)
                if tdev == "cuda":
                    torch.cuda.synchronize()
                return r
            peer, peer_ms = "torch SDPA", timer(run_sdpa)
        fa = kern("flash_attention")
        ms = timer(fa, q, k, v, causal=causal)
        label = f"B{b_} H{h_}/{hkv} S{s_} D{d_}{' causal' if causal else ''}"
        add("flash_attention fwd", label, ms, *rate(flops, ms=ms), peer, peer_ms,
            rate(flops, ms=peer_ms)[0] if peer_ms else None)
        o, lse = fa(q, k, v, causal=causal, return_lse=True)
        do = arr(q.shape)
        ms = timer(kern("flash_attention_backward"), q, k, v, o, do, lse, causal=causal)
        add("flash_attention bwd", label, ms, *rate(2.5 * flops, ms=ms), "", None)

    # ---- spectral conv
    n_, c_, hw, kk = (1, 4, 32, 7) if args.quick else (4, 16, 64 if not gpu else 256, 15)
    xi, wk = arr((n_, c_, hw, hw), np.float32), arr((c_, c_, kk, kk), np.float32)
    flops = 2 * n_ * c_ * c_ * hw * hw * kk * kk
    ms = timer(K.conv2d_fft, xi, wk)
    peer, peer_ms = "", None
    if not gpu:
        peer, peer_ms = "direct conv", timer(K.conv2d_direct, xi, wk)
    add("conv2d_fft", f"{n_}x{c_}x{hw}x{hw} k{kk}", ms, *rate(flops, ms=ms), peer, peer_ms,
        rate(flops, ms=peer_ms)[0] if peer_ms else None)

    head = ("kernel", "shape", "ms", "rate", "of peak", "peer", "peer ms", "peer rate", "speedup vs peer")
    print(f"# tessera_rt kernel benchmarks on {device}" + (" (quick)" if args.quick else ""))
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
        for r in [head] + rows:
            print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
