"""tessera_rt: the Tessera programming model as an eager runtime.

Tile kernels on CuPy/Numba (NumPy on the CPU), device meshes, sharded tensors and
collectives as first-class operations, launched with ``tessera-run`` / ``mpirun``.

    import tessera_rt as ts
    from tessera_rt import dist, op, graph, runtime as rt
    grads = ts.grad(loss_fn)(W)

Import what you use: ``import tessera_rt`` itself is cheap, and a layer imported by its full
name (``import tessera_rt.dist``) brings only itself and the layers below it (the
distributed core without autodiff, MoE, pipelines or inference).  The first name a program
reads on the package (``ts.grad``, ``ts.dist``, ``from tessera_rt import nn``) imports every
layer, bottom up, so every registry an upper layer fills is filled (docs/architecture.md).
"""
import importlib as _importlib
import sys as _sys

__version__ = "0.1.0"

# Every layer, bottom up (docs/architecture.md's table); each upper one plugs into the ones
# below as it is imported (autodiff into dist.comm.hooks, op into autodiff's VJP table and
# traced values' operators, moe into op and nn.parts, pipeline into nn.parts and dist's
# names, inference into nn's names).
_LAYERS = ("backend", "dtypes", "runtime", "kernels", "dist", "autodiff", "op", "graph", "nn", "optim", "profiler",
           "moe", "pipeline", "models", "inference")
# the package's own names: name -> (module, attribute)
_NAMES = {
    "grad": ("autodiff", "grad"), "value_and_grad": ("autodiff", "value_and_grad"), "vjp": ("autodiff", "vjp"),
    "no_grad": ("autodiff", "no_grad"), "detach": ("autodiff", "detach"), "remat": ("autodiff", "remat"),
    "get_backend": ("backend", "get_backend"), "resolve_dtype": ("dtypes", "resolve_dtype"),
    "set_float32_matmul_precision": ("kernels.precision", "set_float32_matmul_precision"),
    "get_float32_matmul_precision": ("kernels.precision", "get_float32_matmul_precision"),
    "float32_matmul_precision": ("kernels.precision", "float32_matmul_precision"),
}

__all__ = [
    "backend", "dtypes", "runtime", "dist", "kernels", "op", "autodiff", "graph", "nn", "optim", "profiler",
    "grad", "value_and_grad", "vjp", "no_grad", "detach", "remat", "get_backend", "resolve_dtype",
    "set_float32_matmul_precision", "get_float32_matmul_precision", "float32_matmul_precision",
    "__version__",
]

_assembled = False


def _assemble() -> None:
    """Import every layer (each registers what it plugs in) and bind the package's own names."""
    global _assembled
    if _assembled:
        return
    _assembled = True
    for name in _LAYERS:
        _importlib.import_module(f"{__name__}.{name}")
    g = globals()
    for name, (mod, attr) in _NAMES.items():
        g[name] = getattr(_sys.modules[f"{__name__}.{mod}"], attr)


def _from_inside(frame) -> bool:
    """Whether the code reading a name on the package is tessera_rt's own: a module of the
    package importing a sibling layer (``from .. import runtime``), seen past the import
    system's frames.  That import must load the sibling only, or ``import tessera_rt.dist``
    would load every layer."""
    while frame is not None and frame.f_globals.get("__name__", "").startswith("importlib"):
        frame = frame.f_back
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name == __name__ or name.startswith(__name__ + ".")


def __getattr__(name: str):
    # called only for a name the package does not hold yet: a layer not imported, or one of
    # the package's own names before the first assembly
    if name.startswith("__"):                       # copy, pickle, inspect, importlib probes
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _from_inside(_sys._getframe(1)):
        _assemble()
        if name == "checkpoint":                    # renamed (issue 41), kept for one release
            from .deprecation import warn
            warn("tessera_rt.checkpoint", "tessera_rt.remat")
            return globals()["remat"]
        if name in globals():
            return globals()[name]
    try:
        return _importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__) | set(_LAYERS) | {"plan", "launcher"})
