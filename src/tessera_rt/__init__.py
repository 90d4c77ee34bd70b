"""tessera_rt: the Tessera programming model as an eager runtime.

Tile kernels on CuPy/Numba (NumPy on the CPU), device meshes, sharded tensors and
collectives as first-class operations, launched with ``tessera-run`` / ``mpirun``.

    import tessera_rt as ts
    from tessera_rt import dist, op, graph, runtime as rt
    grads = ts.grad(loss_fn)(W)
"""
# the layers bottom up; each upper one plugs into the ones below as it is imported (autodiff
# into dist.comm.hooks, op into autodiff's VJP table and traced values' operators, moe into op);
# kept in this order, not sorted:
# isort: off
from . import backend, dtypes, runtime
from . import kernels
from . import dist
from . import autodiff
from . import op, graph, nn, optim, profiler
from . import moe  # noqa: F401  (plugs op.moe and nn.Transformer's MoE block in)
from .inference import KVCache as _KVCache, Llama as _Llama
from .pipeline import Pipeline as _Pipeline
# isort: on
from .autodiff import checkpoint, detach, grad, no_grad, value_and_grad, vjp
from .backend import get_backend
from .dtypes import resolve_dtype
from .kernels.precision import float32_matmul_precision, get_float32_matmul_precision, set_float32_matmul_precision

# public names of modules above their home (dist sits below pipeline, nn below inference):
# the package root, which imports every layer, attaches them
dist.Pipeline = _Pipeline
nn.Llama, nn.KVCache = _Llama, _KVCache

__version__ = "0.1.0"
__all__ = [
    "backend", "dtypes", "runtime", "dist", "kernels", "op", "autodiff", "graph", "nn", "optim", "profiler",
    "grad", "value_and_grad", "vjp", "no_grad", "detach", "checkpoint", "get_backend", "resolve_dtype",
    "set_float32_matmul_precision", "get_float32_matmul_precision", "float32_matmul_precision",
    "__version__",
]
