"""tessera_rt.op: the public op namespace (seed 000 §4.1).

Every op takes DTensors or plain arrays (see ``tessera_rt.op.ops``).

    from tessera_rt import op
    Y = op.matmul(X, W, tile_shape=(128, 128, 64))
    P = op.softmax(S, axis=-1)

The op layer sits above autodiff: ``ops`` holds the entry points (each wrapped with
``differentiable``, so ``ts.grad`` records it) and ``vjps`` / ``vjps_nn`` their VJP rules, written with
``op.*``. Importing this package plugs both into autodiff: the rules into its VJP table, and
the entry points as the operators of traced values (``x + y`` inside ``ts.grad``).
"""
from ..autodiff import register_ops
from . import nn_ops, ops
from .nn_ops import (
    embedding as embedding,
    embedding_backward as embedding_backward,
    softmax_cross_entropy as softmax_cross_entropy,
)
from .ops import *  # noqa: F403  (the namespace: op.matmul, op.add, ...)
from .ops import __all__, register_moe as register_moe  # (register_moe: for the moe package)

__all__ = __all__ + [n for n in nn_ops.__all__ if n not in __all__]
from . import vjps, vjps_nn  # noqa: F401  (register the VJP rules of the ops above)

register_ops(ops)   # traced values' operators (x + y, x.sum(), ...) are these ops
