"""The cuda backend's Python, end to end on the CPU: TESSERA_DEVICE=cuda with the strict
CuPy/NCCL stand-in (tests/gpu_emu/cupy) and the CUDA emulation harness (tests/gpu_emu/cuda_emu).

Nothing here runs on a GPU.  The stand-in refuses what CuPy refuses and reports stream-order
hazards; every RawKernel runs in the harness against its NumPy reference.  Ranks on distinct
emulated devices talk through the NCCL stand-in, ranks sharing one through the host-staged path.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import LAUNCH_TIMEOUT_S, ROOT, mpi_env, standin_env


def _final_loss(extra_env: dict, dtype: str) -> float:
    """scripts/train.py's final loss at dp=2 x tp=2 on 4 ranks (``extra_env`` picks the backend)."""
    cmd = ["timeout", "-k", "5", str(LAUNCH_TIMEOUT_S), str(Path(sys.executable).parent / "tessera-run"), "-n", "4",
           "scripts/train.py", "--dp", "2", "--tp", "2", "--steps", "3", "--batch", "4", "--seq", "16",
           "--d-model", "16", "--heads", "2", "--layers", "2", "--no-plot", "--no-checkpoint",
           "--data", "tests/data/tiny_corpus.txt", "--dtype", dtype]
    proc = subprocess.run(cmd, cwd=ROOT, env=mpi_env(4, "cpu", extra_env), capture_output=True, text=True)
    m = re.search(r"final loss ([0-9.]+) after 3 steps", proc.stdout + proc.stderr)
    assert proc.returncode == 0 and m, f"train.py exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return float(m.group(1))


@pytest.mark.mpi
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
@pytest.mark.parametrize("dtype,rtol", [("float32", 1e-4), ("fp16", 2e-3)])
def test_training_on_the_standin_matches_the_cpu(dtype, rtol):
    # dp=2 x tp=2 with gradient clipping, the async data-parallel all-reduce and, for fp16,
    # dynamic loss scaling: the same losses as the CPU backend
    gpu = _final_loss(standin_env(devices=4), dtype)
    cpu = _final_loss({}, dtype)
    assert gpu == pytest.approx(cpu, rel=rtol)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kernels_run_through_their_launchers_on_the_standin():
    # tests/kernels/test_gpu.py and test_gpu_fused.py as written for a GPU: every launcher, its
    # argument packing and grid, every RawKernel executed by the emulation harness against its
    # NumPy reference.  Numba tile kernels run in Numba's simulator instead
    # (tests/kernels/sim_tile_kernels.py).
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "kernels" / "test_gpu.py"),
                           str(ROOT / "tests" / "kernels" / "test_gpu_fused.py"), "-k", "not tile_saxpy_on_gpu"],
                          cwd=ROOT, env=mpi_env(1, "cuda", standin_env()), capture_output=True, text=True)
    tail = proc.stdout[-5000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and " passed" in tail and "skipped" not in tail, tail


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_grouped_gemm_paged_decode_and_fp8_kernels_on_the_standin():
    # the MoE grouped GEMMs, split-K paged decode and FP8 quantize as written for a GPU, in a
    # process of their own: the harness keeps each loaded kernel module's fiber stacks mapped
    # (two mappings a thread), and with the files above one process would pass the kernel's
    # limit on mappings (vm.max_map_count)
    files = ["test_grouped_gemm_gpu.py", "test_paged_decode_gpu.py", "test_fp8_gpu.py"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *(str(ROOT / "tests" / "kernels" / f) for f in files)],
                          cwd=ROOT, env=mpi_env(1, "cuda", standin_env()), capture_output=True, text=True)
    tail = proc.stdout[-5000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and " passed" in tail and "skipped" not in tail, tail


# What `scripts/test.sh` runs on a GPU machine, in miniature: CPU-written tests from each area
# around a few gpu-marked ones (so the backend switches both ways), in a process where CuPy
# sees one GPU (the stand-in) and TESSERA_DEVICE is unset.
GPU_MACHINE_TESTS = [
    "tests/dtensor/test_layout.py", "tests/training/test_nn.py",
    "tests/kernels/test_gpu.py::test_matmul_cuda_default_is_cublas_and_tile_is_opt_in",
    "tests/kernels/test_gpu.py::test_swiglu_dual_gemm",
    "tests/kernels/test_gpu.py::test_row_kernels[256-float16]",
    "tests/kernels/test_gpu.py::test_kernels_run_on_runtime_stream",
    "tests/kernels/test_gpu.py::test_ordering_events_skip_timing_and_timed_ones_time",
    "tests/kernels/test_gpu.py::test_outputs_are_allocated_on_the_launch_stream",
    "tests/autodiff/test_autodiff.py", "tests/kernels/test_gemm_norms.py",
    "tests/inference/test_inference.py::test_decode_through_the_cache_equals_full_recompute",
    "tests/inference/test_inference.py::test_continuous_batching_gives_the_same_tokens",
    "tests/inference/test_inference.py::test_window_drops_stale_pages_and_limits_look_back",
    "tests/inference/test_inference.py::test_bf16_weights_and_cache",
    "tests/inference/test_inference.py::test_bad_inputs_raise_clear_errors",
]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_single_process_tests_pass_on_a_gpu_machine():
    env = {k: v for k, v in mpi_env(1).items() if k != "TESSERA_DEVICE"}
    env.update(standin_env(devices=1))
    del env["TESSERA_DEVICE"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *GPU_MACHINE_TESTS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    out = proc.stdout + proc.stderr
    gpu = [t for t in GPU_MACHINE_TESTS if "test_gpu.py" in t]
    ran_on_gpu = [t for t in gpu if f"PASSED {t}" in out]
    assert proc.returncode == 0 and ran_on_gpu == gpu and " failed" not in out, out[-6000:]
