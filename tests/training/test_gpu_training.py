"""Training on the GPU backend: the precision asked for, the dtype kept, no host syncs.

gpu-marked: on a GPU machine these run on the GPU; in the suite they run on the CuPy stand-in
and the CUDA emulation harness (tests/gpu/test_gpu_path_standin.py starts them), where every
RawKernel executes from its source and cuBLAS is NumPy's f32/f64 product.  The sizes are the
smallest where the defects they guard against show: attention silently run in fp16 gave 1-9%
gradient errors on a 152M model and none visible at d_model 64.
"""
import numpy as np
import pytest

import tessera_rt as ts
from tessera_rt import nn
from tessera_rt.backend import get_backend


def _cupy():
    try:
        import cupy
        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:
        return None


cp = _cupy()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason="needs a CUDA GPU with CuPy")]

SIZE = dict(vocab=512, d_model=256, n_heads=4, n_layers=2, seq_len=256)


def _batch(batch=2, seed=1):
    tok = np.random.default_rng(seed).integers(0, SIZE["vocab"], (batch, SIZE["seq_len"] + 1))
    return tok[:, :-1], tok[:, 1:]


def _grads(dtype, precision="highest"):
    model = nn.Transformer(**SIZE, dtype=dtype)
    params = model.init(0)
    x, y = _batch()
    with ts.kernels.precision.float32_matmul_precision(precision):
        loss, grads = ts.value_and_grad(lambda p: model.loss(p, model.batch(x), model.batch(y)))(params)
    leaves, paths, _ = ts.autodiff.engine.tree_flatten(grads)
    return float(loss), {p: get_backend().to_host(g).astype(np.float64) for p, g in zip(paths, leaves)}


def _worst(got: dict, want: dict) -> tuple[float, str]:
    """The largest per-parameter error relative to that gradient's largest entry."""
    errs = {p: float(np.max(np.abs(got[p] - want[p])) / max(np.max(np.abs(want[p])), 1e-30)) for p in want}
    p = max(errs, key=errs.get)
    return errs[p], p


def test_f32_gradients_match_float64():
    """f32 means f32: every gradient within 1e-4 of the float64 run (max relative error per
    parameter), attention's q/k gradients included; the same step at "high" (TF32) is
    allowed to differ more, and does, so the switch reaches the kernels."""
    assert get_backend().is_gpu
    loss64, g64 = _grads("float64")
    loss32, g32 = _grads("float32")
    err, where = _worst(g32, g64)
    assert abs(loss32 - loss64) <= 1e-6 * abs(loss64)
    assert err < 1e-4, f"f32 gradient {where} is {err:.2e} off the float64 run"
    assert any("attn" in p for p in g64)


def _step_work(dtype: str, layers: int):
    """(whole step, clip + optimizer) device work of a second training step (the first compiles
    and allocates), on the stand-in's counters."""
    from tessera_rt import optim
    model = nn.Transformer(**dict(SIZE, n_layers=layers, seq_len=128), dtype=dtype)
    params = model.init(0)
    opt = optim.AdamW(params, lr=1e-3)
    tok = np.random.default_rng(1).integers(0, SIZE["vocab"], (2, 129))
    x, y = model.batch(tok[:, :-1]), model.batch(tok[:, 1:])
    fn = ts.value_and_grad(model.loss)

    def step(params):
        loss, grads = fn(params, x, y)
        with cp.testing.count_device_work() as update:
            grads, _ = optim.clip_grad_norm(grads, 1.0, in_place=True)
            params = opt.step(params, grads)
        return float(loss), params, update
    _, params, _ = step(params)
    with cp.testing.count_device_work() as work:
        loss, params, update = step(params)
    assert np.isfinite(loss)
    return work, update


counting = pytest.mark.skipif(cp is None or not hasattr(getattr(cp, "testing", None), "count_device_work"),
                              reason="counting launches needs the CuPy stand-in's counters (tests/gpu_emu)")


@counting
@pytest.mark.parametrize("dtype,per_block", [("bf16", 40), ("float32", 40)])
def test_a_training_step_syncs_once_and_stays_within_its_launch_budget(dtype, per_block):
    """One host sync a step (the loss the caller reads), no casts in bf16, the optimizer and
    clip in a handful of multi-tensor launches, and a bounded number of launches per block
    (a block's forward and backward: the difference between a 2- and a 1-layer model)."""
    one, upd1 = _step_work(dtype, 1)
    two, upd2 = _step_work(dtype, 2)
    for w in (one, two):
        assert w.syncs == 1 and w.d2h == 1, w.report()
        assert w.h2d <= 3 and w.h2d_bytes < 4096, w.report()        # the multi-tensor ops' pointer tables
    if dtype == "bf16":
        assert two.casts == 0, two.report()
    assert upd1.launches <= 10 and upd2.launches == upd1.launches, upd2.report()
    block = two.launches - one.launches
    assert block <= per_block, f"{block} launches per transformer block (forward + backward)\n{two.report()}"


def test_bf16_activations_stay_bf16_through_every_block():
    """Every part of every block keeps bf16: norms, attention, the MLP, the residual stream, the
    logits, and the gradients of bf16 parameters (nothing is widened to f32 on the way)."""
    model = nn.Transformer(**dict(SIZE, seq_len=64), dtype="bf16")
    p = model.init(0)
    x = model.batch(np.random.default_rng(2).integers(0, SIZE["vocab"], (2, 64)))
    bf16 = ts.resolve_dtype("bf16")
    h = ts.op.add(model.embed(p["embed"], x), p["pos"])
    assert h.dtype == bf16
    for blk, bp in zip(model.blocks, p["blocks"]):
        n1 = blk.norm1(bp["norm1"], h)
        a = blk.attn(bp["attn"], n1)
        n2 = blk.norm2(bp["norm2"], ts.op.add(h, a))
        m = blk.mlp(bp["mlp"], n2)
        h = blk(bp, h)
        assert [t.dtype for t in (n1, a, n2, m, h)] == [bf16] * 5
    assert model.logits(p, x).dtype == bf16
    _, grads = ts.value_and_grad(lambda q: model.loss(q, x, x))(p)
    leaves, paths, _ = ts.autodiff.engine.tree_flatten(grads)
    assert all(g.dtype == bf16 for g in leaves), [(path, g.dtype) for path, g in zip(paths, leaves) if g.dtype != bf16]
