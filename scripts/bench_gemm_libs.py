"""Single-precision GEMM on one CPU thread, library against library, at tessera's own shapes.

    python scripts/bench_gemm_libs.py --markdown                  # every shape, 15 rounds
    python scripts/bench_gemm_libs.py --lib-path /tmp/blaslibs    # where the optional libraries are
    python scripts/bench_gemm_libs.py --quick                     # smoke run: one round, one call

C = op(A) @ op(B), f32, row-major, at the GEMMs of bench_vs_torch.py's training step (d 256,
MLP hidden 4 x d = 1024, vocab 256; per layer q, k, v, o, w1, w3, w2; the LM head, and the
vocab-by-d product the embedding's one-hot matmul was before it became a gather): forward x @ W (NN), backward g @ W^T (NT) and X^T @ g (TN), at
1024 tokens (batch 8 x seq 128) and 128 (one of the 8 pipeline micro-batches); and at
bench_decode.py's Llama prefill (32 tokens, hidden 1024, fused qkv 2048, fused gate/up 2 x 2816).
Libraries: NumPy's np.matmul (its bundled OpenBLAS: tessera's CPU path), torch.matmul (MKL, the
peer), and where installed MKL's cblas_sgemm (libmkl_rt), scipy-openblas32's and BLIS; one that
is missing is a 'not installed' row.  Every result is checked against NumPy's first
(max |C - C_numpy| <= 1e-4 max |C_numpy|).  Rounds interleave the libraries; per call the min
over rounds (the median in brackets).
"""
from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
    os.environ[_v] = "1"                        # one thread: set before any BLAS loads
os.environ.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL")     # libmkl_rt without Intel OpenMP

import argparse
import ctypes
import glob
import math
import sys
import time

import numpy as np

D, F, V, PRE = 256, 1024, 256, 32
# (group, weight, tokens, K, N, weights of this shape per training step / prefill)
WEIGHTS = [("train", "d x d (q,k,v,o, head, embed)", 1024, D, D, 18), ("train", "d x ffn (w1, w3)", 1024, D, F, 8),
           ("train", "ffn x d (w2)", 1024, F, D, 4)]
WEIGHTS += [("micro-batch", w, 128, k, n, c) for _, w, _, k, n, c in WEIGHTS]
PREFILL = [("prefill", w, PRE, k, n, 8) for w, k, n in (("qkv", 1024, 2048), ("o", 1024, 1024),
                                                        ("gate_up", 1024, 2 * 2816), ("down", 2816, 1024))]


def cases():
    """(group, label, m, k, n, transA, transB, count): C (m x n) = op(A) (m x k) @ op(B) (k x n)."""
    out = []
    for g, w, t, k, n, c in WEIGHTS:         # y = x @ W: x (t x k), W (k x n), g (t x n)
        out += [(g, f"{w} fwd x@W", t, k, n, False, False, c), (g, f"{w} bwd g@W^T", t, n, k, False, True, c),
                (g, f"{w} bwd x^T@g", k, t, n, True, False, c)]
    return out + [(g, f"{w} fwd x@W", t, k, n, False, False, c) for g, w, t, k, n, c in PREFILL]


def _cblas(lib, name):
    """A row-major cblas_sgemm of a ctypes library as f(A, ta, B, tb, C) on stored C-order arrays."""
    fn = getattr(lib, name)
    fn.restype, p = None, ctypes.c_void_p
    fn.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, p, ctypes.c_int, p, ctypes.c_int, ctypes.c_float, p,
                                        ctypes.c_int]

    def gemm(a, ta, b, tb, c):
        m, n = c.shape
        k = a.shape[0] if ta else a.shape[1]
        fn(101, 112 if ta else 111, 112 if tb else 111, m, n, k, 1.0, a.ctypes.data, a.shape[1], b.ctypes.data,
           b.shape[1], 0.0, c.ctypes.data, n)
    return gemm


def libraries(dirs):
    """{name: gemm(A, ta, B, tb, C) or the reason it is missing}."""
    libs = {"numpy (bundled OpenBLAS)": lambda a, ta, b, tb, c: np.matmul(a.T if ta else a, b.T if tb else b, out=c)}
    try:
        import torch
        torch.set_num_threads(1)
        t = torch.from_numpy
        libs[f"torch {torch.__version__.split('+')[0]} (MKL)"] = \
            lambda a, ta, b, tb, c: torch.matmul(t(a).T if ta else t(a), t(b).T if tb else t(b), out=t(c))
    except ImportError:
        libs["torch (MKL)"] = "not installed"
    found = lambda pattern: next(iter(sorted(f for d in dirs for f in glob.glob(os.path.join(d, pattern)))), None)
    path = found("libmkl_rt.so*") or found("lib/libmkl_rt.so*")
    if path:
        mkl = ctypes.CDLL(path)
        mkl.MKL_Set_Num_Threads(1)
        buf = ctypes.create_string_buffer(256)
        mkl.MKL_Get_Version_String(buf, 256)
        ver = buf.value.decode().split("Version ")[-1].split("-")[0]
        libs[f"MKL {ver} cblas_sgemm"] = _cblas(mkl, "cblas_sgemm")
    else:
        libs["MKL cblas_sgemm"] = "not installed"
    path = found("scipy_openblas32/lib/libscipy_openblas*.so*")
    if path:
        ob = ctypes.CDLL(path)
        ob.scipy_openblas_set_num_threads(1)
        ob.scipy_openblas_get_config.restype = ob.scipy_openblas_get_corename.restype = ctypes.c_char_p
        ver = ob.scipy_openblas_get_config().decode().split()[1]
        libs[f"OpenBLAS {ver} ({ob.scipy_openblas_get_corename().decode()}) cblas_sgemm"] = \
            _cblas(ob, "scipy_cblas_sgemm")
    else:
        libs["scipy-openblas32 cblas_sgemm"] = "not installed"
    try:
        sys.path[:0] = [d for d in dirs if d not in sys.path]
        import blis.about
        import blis.py
        libs[f"BLIS {blis.about.__version__}"] = \
            lambda a, ta, b, tb, c: blis.py.gemm(a, b, out=c, trans1=ta, trans2=tb, alpha=1.0, beta=0.0)
    except ImportError:
        libs["BLIS"] = "not installed"
    return libs


def run(args):
    dirs = [args.lib_path] if args.lib_path else [*sys.path, "/tmp/blaslibs"]
    libs = libraries([d for d in dirs if d and os.path.isdir(d)])
    ok = [n for n, f in libs.items() if callable(f)]
    rng = np.random.default_rng(0)
    rows, times = [], {n: [] for n in ok}
    for group, label, m, k, n, ta, tb, count in cases():
        a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
        b = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
        ref, outs = None, {}
        for name in ok:
            c = outs[name] = np.empty((m, n), np.float32)
            libs[name](a, ta, b, tb, c)
            ref = c if ref is None else ref
            err = float(np.max(np.abs(c - ref))) / float(np.max(np.abs(ref)))
            if err > 1e-4:
                raise SystemExit(f"{name}: {label} {m}x{k}x{n} differs from numpy by {err:.1e} (> 1e-4 of max)")
        # calls per round: ~target ms of the numpy call (at least 1)
        t0 = time.perf_counter()
        libs[ok[0]](a, ta, b, tb, outs[ok[0]])
        calls = 1 if args.quick else max(1, int(args.target_ms / 1e3 / max(time.perf_counter() - t0, 1e-6)))
        per = {name: [] for name in ok}
        for _ in range(1 if args.quick else args.rounds):
            for name in ok:
                f, c = libs[name], outs[name]
                t0 = time.perf_counter()
                for _ in range(calls):
                    f(a, ta, b, tb, c)
                per[name].append((time.perf_counter() - t0) / calls * 1e3)
        best = {name: min(v) for name, v in per.items()}
        for name in ok:
            times[name].append((group, count, best[name], best[ok[0]]))
        cells = [f"{best[x]:.3f} ({np.median(per[x]):.3f}) ms, {2 * m * k * n / best[x] / 1e6:.0f} GF/s, "
                 f"{best[ok[0]] / best[x]:.2f}x" for x in ok]
        rows.append([group, label, f"{m}x{k}x{n}", str(count), *cells])
    return libs, ok, rows, times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib-path", default=None, help="where MKL (lib/libmkl_rt.so*), scipy_openblas32 and blis are "
                                                     "(default: sys.path and /tmp/blaslibs)")
    ap.add_argument("--rounds", type=int, default=15, help="timed rounds per shape (min and median over them)")
    ap.add_argument("--target-ms", type=float, default=10.0, help="time of one library's calls per round")
    ap.add_argument("--quick", action="store_true", help="one round of one call per shape: a smoke run")
    ap.add_argument("--markdown", action="store_true",
                    help="accepted like the other bench scripts: the tables are Markdown either way")
    args = ap.parse_args(argv)
    libs, ok, rows, times = run(args)
    print(f"# GEMM libraries, f32 C = op(A) @ op(B) row-major, one thread{' (quick)' if args.quick else ''}; "
          f"cell: min ms over rounds (median), GFLOP/s, numpy ms / this ms (> 1: faster than numpy); per step: how "
          "many such GEMMs one training step (4 layers) or prefill (8 layers) runs.")
    table = lambda head, body: print("\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                                               + ["| " + " | ".join(r) + " |" for r in body]) + "\n")
    table(["group", "GEMM", "m x k x n", "per step", *ok], rows)
    groups = list(dict.fromkeys(g for g, *_ in times[ok[0]]))
    summary = []
    for name, lib in libs.items():
        if not callable(lib):
            summary.append([name, *["not installed"] * (len(groups) + 1)])
            continue
        t = times[name]
        ms = [sum(c * x for g, c, x, _ in t if g == grp) for grp in groups]
        geo = math.exp(sum(c * math.log(r / x) for _, c, x, r in t) / sum(c for _, c, *_ in t))
        summary.append([name, *(f"{x:.1f}" for x in ms), f"{geo:.3f}"])
    table(["library", *(f"{g} GEMM ms" for g in groups), "geo. mean of numpy/this, weighted by per step"], summary)
    print("# GEMM ms: the sum over the group's GEMMs of per step x min ms (train: one step's 90 weight GEMMs at "
          "1024 tokens; micro-batch: the same at 128 tokens; prefill: the 32 of a 32-token Llama prefill).  "
          "Attention's batched S x S GEMMs and the prefill LM head are left out.")


if __name__ == "__main__":
    main()
