"""Fixtures that put the fake vendor libraries (tests/gpu_emu/fake_vendor: ``cudnn``, ``nvmath``)
in place of the real ones, on the CuPy stand-in, and a minimal ``cupy._core`` compute-type
switch where the stand-in lacks it (f32 GEMMs ask for it).  A test module imports
``fixture_<name>`` and its tests ask for ``<name>`` (the same name would be shadowed by them)."""
import sys
import types
from pathlib import Path

import numpy as np
import pytest

FAKE = str(Path(__file__).resolve().parents[1] / "gpu_emu" / "fake_vendor")
_NAMES = ("cudnn", "nvmath", "_fake_device")


def _drop(monkeypatch=None) -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in _NAMES:
            if monkeypatch is not None:
                monkeypatch.delitem(sys.modules, name)
            else:
                sys.modules.pop(name, None)


def gpu_cupy():
    """CuPy when it sees a GPU (or the stand-in's emulated one), else None."""
    try:
        import cupy
        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:
        return None


def standin_cupy():
    try:
        import cupy
    except ImportError:
        return None
    return cupy if getattr(cupy, "__tessera_standin__", False) else None


@pytest.fixture(name="fake_vendor")
def fixture_fake_vendor(monkeypatch):
    """The fake ``cudnn`` and ``nvmath`` importable, their logs empty, every provider's
    availability and graph/plan caches forgotten (before and after)."""
    from tessera_rt.kernels import providers
    monkeypatch.syspath_prepend(FAKE)
    _drop(monkeypatch)
    import cudnn
    import nvmath
    cudnn.reset()
    nvmath.reset()
    providers.reset()
    yield types.SimpleNamespace(cudnn=cudnn, nvmath=nvmath)
    # undo first (sys.path, and the modules _drop deleted), then drop every fake module and the
    # providers' cached availability: no later test may find a fake library importable
    monkeypatch.undo()
    _drop()
    providers.reset()


@pytest.fixture(name="compute_type_switch")
def fixture_compute_type_switch(monkeypatch):
    """``cupy._core.set_compute_type`` and ``_routines_linalg.get_compute_type`` for f32 GEMMs
    (CuPy has them; the stand-in of this branch may not)."""
    try:
        from cupy._core import _routines_linalg  # noqa: F401  (is it there? then nothing to put in)
        yield
        return
    except ImportError:
        pass
    state: dict = {}
    core = types.ModuleType("cupy._core")
    lin = types.ModuleType("cupy._core._routines_linalg")
    lin.COMPUTE_TYPE_DEFAULT, lin.COMPUTE_TYPE_TF32 = 1, 7
    lin.get_compute_type = lambda dt: state.get(np.dtype(dt), 1)
    core.set_compute_type = lambda dt, v: state.__setitem__(np.dtype(dt), v)
    core._routines_linalg = lin
    monkeypatch.setitem(sys.modules, "cupy._core", core)
    monkeypatch.setitem(sys.modules, "cupy._core._routines_linalg", lin)
    yield


class Notes:
    """Every ``kernels.precision.note`` made while it is installed: ``(op, precision, provider, why)``."""

    def __init__(self):
        self.items: list = []

    def __call__(self, op, precision, provider, why):
        self.items.append((op, precision, provider, why))

    def of(self, op: str) -> list:
        return [n for n in self.items if n[0] == op]


@pytest.fixture(name="notes")
def fixture_notes():
    from tessera_rt.kernels import precision
    rec = Notes()
    precision.add_listener(rec)
    yield rec
    precision.remove_listener(rec)
