"""Pytrees: nested dicts, lists and tuples of values, flattened to leaves and rebuilt.

``ts.grad`` differentiates with respect to pytrees of arrays / DTensors, optimizers walk
parameter pytrees, and checkpoints save them: all use these two functions.
"""
from __future__ import annotations

from typing import Any

__all__ = ["tree_flatten", "tree_unflatten"]


def tree_flatten(tree: Any, path: str = "") -> tuple[list, list, Any]:
    """Flatten a pytree: dicts, lists and tuples are nodes, None is an empty node, anything
    else a leaf.

    Parameters
    ----------
    tree : Any
        The pytree.
    path : str
        Prefix of the leaves' paths (``"arg0"`` gives ``arg0['w'][1]``).

    Returns
    -------
    tuple of (list, list, Any)
        The leaves in order, the path of each, and the structure ``tree_unflatten`` takes.
    """
    leaves: list = []
    paths: list = []

    def walk(t, p):
        if isinstance(t, dict):
            return ("d", tuple((k, walk(v, f"{p}[{k!r}]")) for k, v in t.items()))
        if isinstance(t, (list, tuple)) and type(t) in (list, tuple):
            return ("l" if type(t) is list else "t", tuple(walk(v, f"{p}[{i}]") for i, v in enumerate(t)))
        if t is None:
            return ("n",)
        leaves.append(t)
        paths.append(p)
        return ("x",)
    return leaves, paths, walk(tree, path)


def tree_unflatten(struct: Any, leaves: Any) -> Any:
    """Rebuild a pytree from its structure and new leaves.

    Parameters
    ----------
    struct : Any
        The structure ``tree_flatten`` returned.
    leaves : iterable
        One value per leaf, in ``tree_flatten``'s order.

    Returns
    -------
    Any
        The pytree with ``leaves`` in place of the original ones.
    """
    it = iter(leaves)

    def build(s):
        kind = s[0]
        if kind == "x":
            return next(it)
        if kind == "n":
            return None
        if kind == "d":
            return {k: build(v) for k, v in s[1]}
        seq = [build(v) for v in s[1]]
        return seq if kind == "l" else tuple(seq)
    return build(struct)
