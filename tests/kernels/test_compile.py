"""Every RawKernel source compiles through NVRTC for sm_80 and sm_90 and ptxas reports its cost.

No GPU needed: NVRTC emits PTX, ``ptxas -v`` assembles it and reports registers, spills
and static shared memory.  The budgets asserted here are what a launch needs to succeed
and run without local-memory traffic: <= 255 registers, no spills, static shared memory
under the 48 KiB static limit, dynamic shared memory under the 227 KiB opt-in limit.
"""
import numpy as np
import pytest

from tessera_rt.kernels import compile as C
from tessera_rt.kernels.compile import CompileError, inspect_ir, nvrtc_compile, ptxas_resources

SOURCES = C.registered_sources()
CASES = [(name, cfg, arch) for name, src in SOURCES.items() for cfg in src.configs
         for arch in ("sm_80", "sm_90")]


def _id(case):
    name, cfg, arch = case
    return f"{name}-{'-'.join(f'{k}={v}' for k, v in cfg.items())}-{arch}"


def _param(case):
    # the fast tier compiles each source once (its first config, for sm_90); the whole
    # matrix (~0.4 s a case, 300 cases) runs in the full suite
    name, cfg, arch = case
    first = cfg == SOURCES[name].configs[0] and arch == "sm_90"
    return pytest.param(case, id=_id(case), marks=() if first else pytest.mark.slow)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_source_compiles_and_fits(case):
    name, cfg, arch = case
    src = SOURCES[name]
    ptx = nvrtc_compile(src.render(**cfg), f"{name}.cu", arch, fast_math=src.fast_math)
    assert f".target {arch}" in ptx
    usage = ptxas_resources(ptx, arch)
    assert set(usage) == set(src.entries), f"entries {sorted(usage)} != {sorted(src.entries)}"
    for entry, u in usage.items():
        assert 0 < u.registers <= 255, u
        assert u.spill_stores == 0 and u.spill_loads == 0, f"spills: {u}"
        assert u.smem_static <= 48 * 1024, u
        if src.smem_dynamic is not None:
            dyn = src.smem_dynamic(**cfg, kernel=entry) if name.startswith("flash_attention") else src.smem_dynamic(**cfg)
            assert dyn <= 227 * 1024, (entry, dyn)


def test_tensor_core_kernels_use_mma_ldmatrix_and_cp_async():
    for name, cfg in (("tile_gemm", SOURCES["tile_gemm"].configs[0]),
                      ("flash_attention", SOURCES["flash_attention"].configs[0])):
        ptx = nvrtc_compile(SOURCES[name].render(**cfg), f"{name}.cu", "sm_90")
        for instr in ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "cp.async.cg.shared.global",
                      "cp.async.wait_group"):
            assert instr in ptx, (name, instr)


def test_f32_attention_runs_tf32_mma_without_fast_math_and_fits_sm80():
    """The f32 flash kernels: TF32 MMAs on cvt.rna-rounded operands, ldmatrix and cp.async, no
    flush-to-zero or approximate log/reciprocal (compiled without fast math), and shared memory
    within sm_80's 163 KiB per block for every head-dim bucket."""
    from tessera_rt.kernels.flash_f32_cuda import FLASH32_CONFIGS, flash32_smem_bytes
    src = SOURCES["flash_attention_f32"]
    assert not src.fast_math
    ptx = nvrtc_compile(src.render(head_dim=64), "f32.cu", "sm_80", fast_math=False)
    for instr in ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", "cvt.rna.tf32.f32",
                  "ldmatrix.sync.aligned.m8n8.x4.shared.b16", "cp.async.cg.shared.global", "rcp.rn.f32"):
        assert instr in ptx, instr
    assert ".ftz" not in ptx and "lg2.approx" not in ptx and "m16n8k16" not in ptx
    for d in FLASH32_CONFIGS:
        for entry in src.entries:
            assert flash32_smem_bytes(d, entry) <= 163 * 1024, (d, entry)


def test_gemm_shared_memory_is_dynamic_and_fits():
    from tessera_rt.kernels.gemm_tile_cuda import DUAL_CONFIGS, GEMM_CONFIGS, gemm_smem_bytes, render_gemm
    ptx = nvrtc_compile(render_gemm(BM=64, BN=128, BK=32), "g.cu", "sm_80")
    assert ptxas_resources(ptx, "sm_80")["ts_gemm"].smem_static == 0
    assert gemm_smem_bytes(64, 128, 32) == 4 * (64 * 32 + 32 * 128) * 2
    for tile in GEMM_CONFIGS:
        assert gemm_smem_bytes(*tile) <= 163 * 1024          # sm_80's opt-in maximum per block (A100)
    for tile in DUAL_CONFIGS:
        assert gemm_smem_bytes(*tile, dual=True) <= 163 * 1024


def test_nvrtc_error_carries_log():
    with pytest.raises(CompileError, match="undefined"):
        nvrtc_compile('extern "C" __global__ void k() { not_a_function(); }', "bad.cu", "sm_80")


def test_inspect_ir_levels():
    src = inspect_ir("flash_attention", "source", head_dim=128)
    assert "ts_flash_fwd" in src and "#define D 128" in src
    assert inspect_ir("fp8", "tile") == SOURCES["fp8"].render(**SOURCES["fp8"].configs[0])
    ptx = inspect_ir("rows", "target", arch="sm_80", mode="rmsnorm")
    assert ".entry ts_rows" in ptx
    assert "regs" in inspect_ir("rows", "resources", arch="sm_90")
    with pytest.raises(KeyError, match="known"):
        inspect_ir("nope")
    with pytest.raises(ValueError, match="level"):
        inspect_ir("rows", "sass")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_numba_tile_kernels_compile_to_ptx(arch):
    from tessera_rt.kernels.tile_kernels import make_tiled_matmul, saxpy_kernel, staged_axpy_kernel
    sig1 = "void(float32[:], float32[:], float32)"
    for kern, sig, smem in ((saxpy_kernel, sig1, 0), (staged_axpy_kernel, sig1, 2 * 32 * 4),
                            (make_tiled_matmul(16), "void(float32[:,:], float32[:,:], float32[:,:])",
                             2 * 16 * 16 * 4)):
        ptx = kern.inspect_ir("ptx", sig, arch)
        (u,) = ptxas_resources(ptx, arch).values()
        assert u.smem_static == smem and u.spill_stores == 0
        if smem:
            assert "bar.sync" in ptx
    assert "tile.linear_id()" in saxpy_kernel.inspect_ir("tile")


def test_tile_launch_passes_cupy_arrays_as_unsynchronized_numba_views(monkeypatch):
    """A tile launch hands Numba device views made with sync=False (Numba's own import of a
    CUDA-array-interface argument synchronizes its stream on the host, once per array)."""
    from tessera_rt.kernels import tile
    from tessera_rt.kernels.tile_kernels import saxpy_kernel
    if tile.SIMULATOR:
        pytest.skip("the simulator takes CuPy arrays as they are")
    launched, imports = [], []

    class Dispatcher:                      # Numba's configured launch, recording its arguments
        def __getitem__(self, config):
            return lambda *args: launched.append(args)

    class CupyLike:                        # a device array known only by its interface
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0x1000, False),
                                    "version": 3, "stream": 0x5EE0}

    def import_cai(desc, owner=None, sync=True):
        imports.append(sync)
        return ("numba view of", owner)

    monkeypatch.setattr(saxpy_kernel, "_jit", Dispatcher())
    monkeypatch.setattr(tile.cuda, "from_cuda_array_interface", import_cai)
    monkeypatch.setattr(tile, "numba_stream", lambda stream=None: 0)
    x, y, alpha = CupyLike(), CupyLike(), np.float32(2)
    saxpy_kernel.launch(4, x, y, alpha)
    assert imports == [False, False]
    assert launched == [(("numba view of", x), ("numba view of", y), alpha)]


def test_tile_shape_over_shared_memory_is_rejected_before_launch():
    from tessera_rt.kernels.gemm import check_tile_shape
    with pytest.raises(ValueError, match="shared memory"):
        check_tile_shape("matmul", (256, 256, 128), itemsize=2)
    assert check_tile_shape("matmul", (128, 128, 32)) == (128, 128, 32)
