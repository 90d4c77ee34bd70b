"""The sections of scripts/bench_kernels.py that set the project's own kernels beside the kernel
table's default (a vendor provider where one runs) and a peer, each checked before it is timed
(bench_kernels.py's library; ``python scripts/_bench_sections.py`` runs them alone):

* the grouped GEMM of the MoE experts (``kernels.grouped_gemm``): the one-launch kernel on
  device offsets, the table's default with host offsets (one cuBLAS call per expert), and one
  dense cuBLAS GEMM over the same tokens (the target: the grouped GEMM within 1.2x of it);
* paged decode attention: the own split-K kernel, the default (cuDNN where installed), and a
  device-to-device copy of as many bytes as it reads (its fraction of HBM is the figure);
* FP8 quantize per scale geometry (two launches for computed per-tensor / per-column scales,
  one for per-row or given ones) beside a copy of the same bytes (x read, q written);
* the cuBLASLt epilogue and FP8 GEMMs (``matmul_bias_act``, ``matmul_fp8``) own vs default.

Each function takes the ``Bench`` of bench_kernels.py.
"""
from __future__ import annotations

import numpy as np

__all__ = ["own_and_default", "grouped", "paged_decode", "fp8_quantize", "epilogues"]


def own_and_default(bench, op: str, fn):
    """(own, default, provider): ``fn`` with the project's kernels forced, and ``fn`` as the table
    runs it when a vendor provider takes it (else None) with that provider's name."""
    from tessera_rt.kernels import use_providers
    from tessera_rt.kernels.precision import add_listener, remove_listener
    seen = []

    def listen(o, precision, provider, why):
        if o == op:
            seen.append(provider)
    add_listener(listen)
    try:
        with use_providers(True):
            fn()
    finally:
        remove_listener(listen)
    provider = seen[-1] if seen else None

    def own():
        with use_providers(False):
            return fn()

    def default():
        with use_providers(True):
            return fn()
    return own, (default if provider not in (None, "own") else None), provider


def _ragged(rng, rows: int, groups: int, empty: bool) -> np.ndarray:
    """Routing-like group sizes summing to ``rows`` (one group empty when asked)."""
    p = rng.dirichlet(np.full(groups, 2.0))
    if empty:
        p[1] = 0.0
        p /= p.sum()
    sizes = np.floor(p * rows).astype(np.int64)
    sizes[np.argmax(p)] += rows - sizes.sum()
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def grouped(bench) -> None:
    from tessera_rt.kernels import use_providers
    xp, kern = bench.xp, bench.be.kernel
    if not bench.gpu:
        return
    e, t, d, f = bench.pick((4, 24, 32, 48), (8, 256, 256, 512), (8, 4096, 4096, 14336), None)
    rows = 2 * t                                                     # top-2 routing
    off = _ragged(bench.rng, rows, e, empty=bench.emulated)
    doff = xp.asarray(off)
    x, dy = bench.arr((rows, d)), bench.arr((rows, f))
    w1, w3 = bench.arr((e, d, f), scale=d ** -0.5), bench.arr((e, d, f), scale=d ** -0.5)
    label = f"E{e} {rows} rows ({np.diff(off).min()}-{np.diff(off).max()} a group) d{d} f{f} f16"
    target = "target: grouped GEMM <= 1.2x one dense GEMM (speedup >= 0.83x)"
    mm, dual, wg = kern("grouped_matmul", like=x), kern("grouped_dual_matmul", like=x), kern("grouped_matmul_wgrad",
                                                                                              like=x)
    with use_providers(True):                                        # per-group cuBLAS: the check
        ref1, (_, ref_h3), ref_w = mm(x, w1, off), dual(x, w1, w3, off), wg(x, dy, off)
    cases = [("grouped_matmul (x @ w[e])", 2 * rows * d * f, lambda: mm(x, w1, doff), lambda: mm(x, w1, off),
              lambda: xp.matmul(x, w1[0]), "1 dense cuBLAS GEMM", lambda y: bench.checked(y, ref1, 2e-2)),
             ("grouped_dual_matmul (x@w1, x@w3)", 4 * rows * d * f, lambda: dual(x, w1, w3, doff),
              lambda: dual(x, w1, w3, off), lambda: (xp.matmul(x, w1[0]), xp.matmul(x, w3[0])),
              "2 dense cuBLAS GEMMs", lambda y: bench.checked(y[1], ref_h3, 2e-2)),
             ("grouped_matmul_wgrad (x.T @ dy)", 2 * rows * d * f, lambda: wg(x, dy, doff), lambda: wg(x, dy, off),
              lambda: xp.matmul(x.T, dy), "1 dense cuBLAS GEMM (x.T @ dy)", lambda y: bench.checked(y, ref_w, 2e-2))]
    for name, flops, own_fn, host_fn, peer, peer_name, check in cases:
        check_text = check(own_fn())                 # device offsets: the one-launch kernel
        ms, default_ms, peer_ms = bench.clock.sides(own_fn, _with_providers(host_fn), peer)
        bench.add(name, label, ms, peer_name, peer_ms, flops=flops, check=check_text, default_ms=default_ms,
                  provider="cublas per group (host offsets)", note=target if "wgrad" not in name else "")


def _with_providers(fn):
    from tessera_rt.kernels import use_providers

    def run():
        with use_providers(True):
            return fn()
    return run


def paged_decode(bench) -> None:
    xp, kern = bench.xp, bench.be.kernel
    from tessera_rt.kernels import paged_decode_attention as reference
    configs = bench.pick([(2, 4, 2, 64, 16, 40), (1, 4, 2, 64, 16, 300)], [(4, 8, 2, 64, 16, 256)],
                         [(16, 32, 8, 128, 16, 2048), (1, 32, 8, 128, 16, 32768)], [(4, 8, 2, 64, 16, 512)])
    for b, h, hkv, d, bs, n in configs:
        per = -(-n // bs)
        nb = b * per
        tables = xp.asarray(np.random.default_rng(1).permutation(nb).reshape(b, per).astype(np.int32))
        lens = xp.asarray(np.full(b, n, np.int32))
        q, kp, vp = bench.arr((b, h, d)), bench.arr((nb, hkv, bs, d)), bench.arr((nb, hkv, bs, d))
        item = np.dtype(q.dtype).itemsize
        nbytes = 2 * b * n * hkv * d * item + 2 * q.size * item      # K and V read, q read, out written
        fn = lambda: kern("paged_decode_attention")(q, kp, vp, tables, lens)
        own, default, provider = own_and_default(bench, "paged_decode_attention", fn)
        check = bench.checked(own(), reference(q, kp, vp, tables, lens), 2e-2)
        ms, default_ms, peer_ms = bench.clock.sides(own, default, kp.copy)
        bench.add("paged_decode_attention", f"B{b} H{h}/{hkv} D{d} len {n} page {bs}", ms,
                  f"{'D2D copy' if bench.gpu else 'memcpy'} of the K pages (same bytes)", peer_ms, nbytes=nbytes,
                  check=check, default_ms=default_ms, provider=provider)


def fp8_quantize(bench) -> None:
    xp, kern = bench.xp, bench.be.kernel
    from tessera_rt.kernels import fp8 as F
    shape = bench.pick((8, 256), (256, 1024), (8192, 4096), (2048, 1024))
    rng = np.random.default_rng(2)
    host = (rng.standard_normal(shape) * 3).astype(np.float32)
    cases = [("per column (2 launches)", np.float32, "per_channel", -1), ("per tensor (2 launches)", np.float32,
             "per_tensor", -1), ("per row (1 launch)", np.float32, "per_channel", 0),
             ("given scale (1 launch)", np.float32, np.float32(0.01), -1), ("per row, f16 in (1 launch)", np.float16,
                                                                             "per_channel", 0)]
    for name, dt, scale, axis in cases:
        hx = host.astype(dt)
        x = xp.asarray(hx)
        fn = lambda: kern("quantize_fp8")(x, "fp8_e4m3", scale=scale, axis=axis)
        q, s = fn()
        qc, sc = F.quantize_fp8(hx.astype(np.float32), "fp8_e4m3", scale=scale, axis=axis)
        same = np.array_equal(bench.be.to_host(q), qc.view(np.uint8))
        nb = x.size * (x.itemsize + 1)                                # x read, q written
        peer = xp.zeros(nb // 2, np.uint8)                            # its copy reads and writes nb bytes
        ms, peer_ms = bench.clock.pair(fn, peer.copy)
        bench.add(f"quantize_fp8 e4m3 {name}", f"{shape} {np.dtype(dt).name}", ms, "D2D copy, same bytes", peer_ms,
                  nbytes=nb, check="ok (bits equal)" if same else "MISMATCH (bits differ)",
                  note="target >= 0.9x the copy")


def epilogues(bench) -> None:
    """The cuBLASLt-served ops beside the own path (matmul + row kernel; dequantize + f32 GEMM)."""
    if not bench.gpu:
        return
    xp, kern = bench.xp, bench.be.kernel
    from tessera_rt.kernels import matmul_bias_act as ref_bias_act
    m, k, n = bench.pick((32, 64, 48), (256, 256, 256), (4096, 4096, 4096), None)
    x, w, bias = bench.arr((m, k)), bench.arr((k, n), scale=k ** -0.5), bench.arr((n,))
    fn = lambda: kern("matmul_bias_act")(x, w, bias, act="relu")
    own, default, provider = own_and_default(bench, "matmul_bias_act", fn)
    check = bench.checked(own(), ref_bias_act(x, w, bias, act="relu"), 2e-2)
    ms, default_ms, peer_ms = bench.clock.sides(own, default, lambda: xp.matmul(x, w))
    bench.add("matmul_bias_act relu", f"{m}x{k}x{n} f16", ms, "cuBLAS GEMM alone (no epilogue)", peer_ms,
              flops=2 * m * k * n, check=check, default_ms=default_ms, provider=provider)
    q = kern("quantize_fp8")
    a8, sa = q(bench.arr((m, k), np.float32), "fp8_e4m3")
    b8, sb = q(bench.arr((k, n), np.float32), "fp8_e4m3")
    fn = lambda: kern("matmul_fp8")(a8, b8, sa, sb, out_dtype="f16")
    own, default, provider = own_and_default(bench, "matmul_fp8", fn)
    ms, default_ms, peer_ms = bench.clock.sides(own, default, lambda: xp.matmul(x, w))
    bench.add("matmul_fp8 e4m3 (per-tensor scales)", f"{m}x{k}x{n} -> f16", ms, "cuBLAS f16 GEMM", peer_ms,
              flops=2 * m * k * n, default_ms=default_ms, provider=provider,
              note="" if default else "own: dequantize + f32 GEMM")


def main(argv=None) -> int:
    """These sections alone, with bench_kernels.py's options (its library otherwise)."""
    import bench_kernels
    args = bench_kernels.argparse.ArgumentParser(
        description="The sections of scripts/bench_kernels.py that set the own kernels beside the kernel "
                    "table's default provider (grouped GEMM, paged decode, FP8 quantize, cuBLASLt GEMMs).")
    args.add_argument("--quick", action="store_true", help="small sizes, few reps")
    args.add_argument("--reps", type=int, default=None, help="samples per side (median taken)")
    ns = args.parse_args(argv)
    bench = bench_kernels.Bench(bench_kernels.argparse.Namespace(device="auto", quick=ns.quick, reps=ns.reps))
    for section in (grouped, epilogues, fp8_quantize, paged_decode):
        section(bench)
    print("\n".join(bench_kernels.format_rows(bench.rows, markdown=False)))
    return 1 if any(r["check"].startswith("MISMATCH") for r in bench.rows) else 0


if __name__ == "__main__":
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
