"""``grad``, ``value_and_grad``, ``vjp`` and ``remat``: the reverse sweep over a tape.

    gW = ts.grad(loss_fn)(W)                        # seed 002 §2.5
    loss, grads = ts.value_and_grad(loss_fn)(params, batch)   # params: a pytree
    y, pullback = ts.vjp(f, x); (gx,) = pullback(gy)          # non-scalar outputs
    block = ts.remat(block_fn)                       # activation remat (seed 000 §3.5)

A DTensor parameter's gradient comes back in the parameter's layout.  When a parameter's
gradient is complete (every op that read it has been swept) and only pending sums stand
between it and that layout (data-parallel replicas, tensor-parallel partial products),
it goes into a gradient bucket (``finish``, ``buckets``: DDP's flat buckets, one async
all-reduce per full bucket on the ``grad_reduce`` stream role), so the reduction overlaps the
rest of the backward pass; the sweep waits for them all at the end.  Pytrees: ``pytree``.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..backend import get_backend
from ..deprecation import aliases
from ..dist.tensor.dtensor import DTensor, full, zeros
from .buckets import grad_bucket_bytes
from .finish import GRAD_ROLE, Finisher, reduce_grads
from .pytree import tree_flatten, tree_unflatten
from .tape import EFFECT_OPS, STATE, VJPS, Tape, Var, detach, float_kind, no_grad, ops, vjp_rule

__all__ = ["grad", "value_and_grad", "vjp", "remat", "backward", "GRAD_ROLE", "tree_flatten", "tree_unflatten",
           "reduce_grads", "trace", "add_cotangents"]


def _check_param(value, path: str, fn_name: str) -> None:
    dt = getattr(value, "dtype", None)
    if dt is None:
        raise TypeError(f"ts.grad({fn_name}): argument {path or '0'} is a {type(value).__name__}; differentiate "
                        "with respect to arrays or DTensors (pass constants as other arguments)")
    if float_kind(dt) not in ("f", "b", "h"):         # float, bf16, fp16 (not fp8, not integers)
        name = np.dtype(dt).name
        raise TypeError(f"ts.grad({fn_name}): argument {path or '0'} has dtype {name}; only float parameters "
                        "(f32, bf16, fp16) have gradients (fp8 and integer values are data: move them to "
                        "another argument, or keep bf16/f32 masters and quantize inside the function)")


# --------------------------------------------------------------------------- the sweep

def _zeros_like(x):
    if type(x) is DTensor:
        return zeros(x.shape, layout=x.layout.with_partial(()), mesh=x.mesh, dtype=x.dtype)
    return get_backend().xp.zeros_like(x)


def add_cotangents(a, b):
    """``a + b`` for two cotangents of one value, as a new array: the sweep's one add where an
    in-place sum (``_add_into``) does not apply."""
    return ops().add(a, b)               # the op layer's add (registered with the tape)


def _add_into(acc, ct) -> bool:
    """``acc += ct`` in place when the sum keeps acc's shape, dtype and layout (a pending sum
    adds piecewise); False (nothing done) otherwise."""
    if type(acc) is DTensor:
        if type(ct) is not DTensor or ct.layout != acc.layout or ct.mesh is not acc.mesh or \
                any(o != "sum" for _, o in acc.layout.partial):
            return False
        acc, ct = acc.to_local(), ct.to_local()
    elif type(ct) is DTensor or not hasattr(ct, "shape"):
        return False
    if acc.shape != ct.shape or acc.dtype != ct.dtype or type(acc) is not type(ct):
        return False
    type(acc).__iadd__(acc, ct)
    return True


def backward(tape: Tape, out: Var, seed: Any, later: set | None = None) -> list | None:
    """Sweep ``tape`` backwards from ``out``, leaving each traced value's cotangent in its
    ``grad`` (and finishing leaves through their ``finish`` hook).  Runs with no tape active,
    so the VJP rules' own ops are not recorded.

    Parameters
    ----------
    tape : Tape
        The recorded ops.
    out : Var
        The traced value the sweep starts from.
    seed : array or DTensor
        ``out``'s cotangent (``out.grad`` is set to it).
    later : set of int, optional
        ids of leaves whose matmul weight gradients wait: a matmul whose right operand is
        one of them computes only its left operand's cotangent now (a pipeline stage sends
        its input's gradient before the weight GEMMs).

    Returns
    -------
    list or None
        With ``later``: the held work, for ``backward_weights``.
    """
    # The loop's Python is time the gradient all-reduces issued during the sweep do not
    # run under any op, so the globals it reads are bound to locals once per sweep.
    rules, effects, add, add_into = VJPS, EFFECT_OPS, add_cotangents, _add_into
    # ids of the gradients this sweep's own adds made: nothing else holds them, so a third
    # contribution adds into one in place (a rule's cotangent may alias its input or
    # another's, so a first one is never written to)
    owned: set = set()
    held: list = []                                # (with later only)
    saved, STATE.tape = STATE.tape, None
    try:
        out.grad = seed
        nodes = tape.nodes
        for i in range(len(nodes) - 1, -1, -1):
            v = nodes[i]
            g = v.grad
            parents = v.parents
            if g is None and v.op not in effects:
                _release(parents)
                continue
            v.grad = None
            owned.discard(id(g))                   # handed to the rule: no longer only ours
            needs = [False] * len(v.args)
            for pos, _ in parents:
                needs[pos] = True
            if later is not None and v.op == "matmul" and parents[-1][0] == 1 and id(parents[-1][1]) in later:
                held.append((v, g, parents[-1][1]))
                needs[1], parents = False, parents[:-1]
                if not parents:
                    continue
            cts = rules[v.op](g, v.value, v.args, v.kw, needs)
            for pos, p in parents:
                ct = cts[pos]
                if ct is not None:
                    pg = p.grad
                    if pg is None:
                        p.grad = ct
                    elif not (id(pg) in owned and add_into(pg, ct)):
                        p.grad = add(pg, ct)
                        owned.add(id(p.grad))
            _release(parents)
            if not held or held[-1][0] is not v:
                v.args, v.kw = (), None            # drop the residuals as soon as they are used
    finally:
        STATE.tape = saved
    return held if later is not None else None


def backward_weights(held: list) -> None:
    """The weight gradients ``backward(..., later=...)`` held back, into their leaves."""
    saved, STATE.tape = STATE.tape, None
    try:
        for v, g, p in held:
            needs = [False] * len(v.args)
            needs[1] = True
            ct = VJPS[v.op](g, v.value, v.args, v.kw, needs)[1]
            if ct is not None:
                p.grad = ct if p.grad is None else add_cotangents(p.grad, ct)
            _release(((1, p),))
            v.args = v.kw = None
    finally:
        STATE.tape = saved


def _release(parents) -> None:
    for _, p in parents:
        p.uses -= 1
        if p.leaf and p.uses == 0 and p.finish is not None:
            p.finish(p)


def _seed(value, what: str):
    if type(value) is DTensor:
        if value.shape != ():
            raise ValueError(f"{what}: the function returned a DTensor of shape {list(value.shape)} "
                             f"({value.layout!r}); ts.grad needs a scalar loss: reduce it (op.sum / op.mean), "
                             "or use ts.vjp(fn, *args) and pass a cotangent of that shape")
        return full((), 1.0, mesh=value.mesh, dtype=value.dtype)
    shape = tuple(getattr(value, "shape", ()))
    if shape != () or not _is_float_value(value):
        raise ValueError(f"{what}: the function returned {_describe(value)}; ts.grad needs a scalar float "
                         "loss: reduce it (op.sum / op.mean), or use ts.vjp(fn, *args) and pass a cotangent")
    xp = get_backend().xp
    return xp.ones((), dtype=getattr(value, "dtype", np.float32))


def _is_float_value(v) -> bool:
    if isinstance(v, float):
        return True
    dt = getattr(v, "dtype", None)
    return dt is not None and (np.dtype(dt).kind in "fc" or np.dtype(dt).name == "bfloat16")


def _describe(v) -> str:
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        return f"a {np.dtype(v.dtype).name}{list(v.shape)} value"
    return f"a {type(v).__name__}"


def trace(fn: Callable, args: tuple, argnums, fn_name: str, reduce: bool = True, bucket_mb: float | None = None):
    """Run ``fn`` with the leaves of ``args[argnums]`` traced: (tape, finisher, output, leaf
    groups, whether ``argnums`` was one int), the pieces of a pullback (``grad``, ``vjp``; the
    planner's ``measure`` counts the bytes the tape keeps)."""
    if STATE.tape is not None:
        raise NotImplementedError(f"ts.grad({fn_name}) inside another ts.grad: higher-order gradients are "
                                  "not supported; compute the inner gradient outside, or use ts.remat")
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for n in nums:
        if not -len(args) <= n < len(args):
            raise ValueError(f"ts.grad({fn_name}): argnums={argnums} but the function got {len(args)} arguments")
    tape = Tape()
    finisher = Finisher(bucket_mb)
    traced = list(args)
    leaf_groups = []
    for n in nums:
        leaves, paths, struct = tree_flatten(traced[n], f"arg{n}")
        vs = []
        for x, p in zip(leaves, paths):
            _check_param(x, p, fn_name)
            v = Var(x, tape)
            v.name = p
            v.finish = finisher if reduce else None
            vs.append(v)
        traced[n] = tree_unflatten(struct, vs)
        leaf_groups.append((vs, struct))
    finisher.plan([v.value for vs, _ in leaf_groups for v in vs])
    STATE.tape = tape
    try:
        out = fn(*traced)
    finally:
        STATE.tape = None
    return tape, finisher, out, leaf_groups, isinstance(argnums, int)


def _collect(tape, finisher, leaf_groups, single, allow_unused: bool, fn_name: str):
    for vs, _ in leaf_groups:
        for v in vs:
            if v.uses > 0:                       # read only by ops after the output
                v.uses = 0
                if v.finish is not None:
                    finisher(v)
    finisher.wait()
    results = []
    for vs, struct in leaf_groups:
        grads = []
        for v in vs:
            if v.grad is None:
                if not allow_unused:
                    raise ValueError(f"ts.grad({fn_name}): parameter {v.name} ({_describe(v.value)}) does not "
                                     "reach the loss, so it has no gradient; use it, leave it out of the "
                                     "differentiated arguments, or pass allow_unused=True for zeros")
                grads.append(_zeros_like(v.value))
            else:
                grads.append(v.grad)
            v.grad = None
        results.append(tree_unflatten(struct, grads))
    tape.nodes.clear()
    return results[0] if single else tuple(results)


def value_and_grad(fn: Callable, argnums: int | tuple[int, ...] = 0, *, has_aux: bool = False,
                   allow_unused: bool = False, bucket_mb: float | None = None) -> Callable:
    """``(loss, grads)`` of a function returning a scalar loss (or ``(loss, aux)`` with
    ``has_aux``).

    Parameters
    ----------
    fn : callable
        Returns a scalar float loss (an array or a DTensor of shape ``()``).
    argnums : int or tuple of int
        Which arguments to differentiate; each may be a pytree of arrays / DTensors.
    has_aux : bool
        ``fn`` returns ``(loss, aux)``; ``aux`` comes back detached beside the loss.
    allow_unused : bool
        A parameter that does not reach the loss gets zeros (else an error names it).
    bucket_mb : float or None
        The gradient bucket cap for the pending sums' all-reduces, in MiB (``autodiff.buckets``;
        None: ``set_grad_bucket_mb``'s, ``$TESSERA_GRAD_BUCKET_MB`` or the default; 0: one
        all-reduce per parameter).

    Returns
    -------
    callable
        Takes ``fn``'s arguments and returns ``(loss, grads)`` (``((loss, aux), grads)`` with
        ``has_aux``); ``grads`` mirrors ``args[argnums]`` (a tuple of them for a tuple
        ``argnums``), a DTensor's gradient in the DTensor's layout.
    """
    name = getattr(fn, "__name__", "fn")
    if bucket_mb is not None:
        grad_bucket_bytes(bucket_mb)             # a bad cap fails here, not in the backward

    @functools.wraps(fn)
    def wrapped(*args):
        tape, finisher, out, groups, single = trace(fn, args, argnums, name, bucket_mb=bucket_mb)
        aux = None
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ValueError(f"ts.value_and_grad({name}, has_aux=True): the function must return "
                                 f"(loss, aux), got {type(out).__name__}")
            out, aux = out
            aux = detach(aux)
        if type(out) is not Var:
            what = f"ts.grad({name})"
            _seed(out, what)                     # a non-scalar error first, if that is the mistake
            raise ValueError(f"{what}: the loss does not depend on the differentiated arguments "
                             f"(argnums={argnums}); every parameter would have no gradient")
        seed = _seed(out.value, f"ts.grad({name})")
        backward(tape, out, seed)
        grads = _collect(tape, finisher, groups, single, allow_unused, name)
        value = out.value
        return ((value, aux), grads) if has_aux else (value, grads)
    return wrapped


def grad(fn: Callable, argnums: int | tuple[int, ...] = 0, *, has_aux: bool = False, allow_unused: bool = False,
         bucket_mb: float | None = None) -> Callable:
    """The gradient of a scalar-valued ``fn`` with respect to ``args[argnums]``.

    Parameters
    ----------
    fn : callable
        Returns a scalar float loss (or ``(loss, aux)`` with ``has_aux``).
    argnums : int or tuple of int
        Which arguments to differentiate (pytrees of arrays / DTensors).
    has_aux : bool
        ``fn`` returns ``(loss, aux)``; the result is then ``(grads, aux)``.
    allow_unused : bool
        A parameter that does not reach the loss gets zeros (else an error names it).
    bucket_mb : float or None
        The gradient bucket cap in MiB (see ``value_and_grad``).

    Returns
    -------
    callable
        Takes ``fn``'s arguments and returns the gradients (``(grads, aux)`` with ``has_aux``),
        shaped like ``args[argnums]``.
    """
    vg = value_and_grad(fn, argnums, has_aux=has_aux, allow_unused=allow_unused, bucket_mb=bucket_mb)
    if has_aux:
        @functools.wraps(fn)
        def wrapped_aux(*args):
            (_, aux), grads = vg(*args)
            return grads, aux
        return wrapped_aux

    @functools.wraps(fn)
    def wrapped_plain(*args):
        return vg(*args)[1]
    return wrapped_plain


def vjp(fn: Callable, *args: Any, allow_unused: bool = True, reduce: bool = True) -> tuple[Any, Callable]:
    """``fn(*args)`` and its pullback: ``pullback(cotangent)`` gives the gradient of
    ``<out, cotangent>`` with respect to every argument (a tuple, one pytree per argument).

    ``fn`` may return a tuple: ``pullback`` then takes a tuple of cotangents, one per output
    (None: zero), and sweeps once for their sum (a pipeline stage seeds its activation and its
    own loss term together).  The pullback runs once.

    ``pullback(cotangent, weights_later=True)`` returns ``(grads, weights)`` instead: every
    argument's gradient but the first's (``grads[0]`` is None), computed without the weight
    GEMMs of the matmuls that read the first argument's leaves, and ``weights()``, which runs
    those GEMMs and returns the first argument's gradient.  A pipeline stage sends its input's
    gradient upstream between the two (the B/W split of zero-bubble pipelines).

    Parameters
    ----------
    fn : callable
        The function; its output may be any shape.
    *args
        Its arguments (pytrees of arrays / DTensors), all differentiated.
    allow_unused : bool
        An argument that does not reach the output gets zeros (else an error names it).
    reduce : bool
        False leaves DTensor gradients raw (pending sums over dp/tp not yet all-reduced), for
        callers that accumulate several pullbacks and reduce once (``reduce_grads``).

    Returns
    -------
    tuple of (Any, callable)
        ``fn``'s output (plain values) and the pullback.
    """
    name = getattr(fn, "__name__", "fn")
    tape, finisher, out, groups, _ = trace(fn, args, tuple(range(len(args))), name, reduce)
    used = [False]
    many = type(out) is tuple
    outs = out if many else (out,)

    def pullback(ct, weights_later: bool = False):
        if used[0]:
            raise RuntimeError(f"ts.vjp({name}): the pullback can run once (the tape is freed as it sweeps)")
        used[0] = True
        cts = ct if many else (ct,)
        if many and (type(cts) is not tuple or len(cts) != len(outs)):
            raise ValueError(f"ts.vjp({name}): the function returned {len(outs)} outputs; pass a tuple of "
                             f"{len(outs)} cotangents (None for an output that gets none)")
        seeds = [(o, c) for o, c in zip(outs, cts) if c is not None]
        if not seeds or any(type(o) is not Var for o, _ in seeds):
            raise ValueError(f"ts.vjp({name}): the output does not depend on the arguments")
        for o, c in seeds:
            if getattr(c, "shape", None) != o.value.shape:
                raise ValueError(f"ts.vjp({name}): the cotangent has shape {getattr(c, 'shape', None)}, the "
                                 f"output {tuple(o.value.shape)}; pass one of the output's shape")
        for o, c in seeds:                     # the sweep starts with every output seeded
            o.grad = c if o.grad is None else add_cotangents(o.grad, c)
        if not weights_later:
            backward(tape, seeds[0][0], seeds[0][0].grad)
            return _collect(tape, finisher, groups, False, allow_unused, name)
        held = backward(tape, seeds[0][0], seeds[0][0].grad, later={id(v) for v in groups[0][0]})
        rest = _collect(tape, finisher, groups[1:], False, allow_unused, name)

        def weights():
            if held and held[0] is None:
                raise RuntimeError(f"ts.vjp({name}): weights() runs once (it frees what it used)")
            backward_weights(held)
            held[:] = [None]
            return _collect(tape, finisher, groups[:1], True, allow_unused, name)
        return (None,) + rest, weights
    values = tuple(o.value if type(o) is Var else o for o in outs)
    return (values if many else values[0]), pullback


# --------------------------------------------------------------------------- remat

def remat(fn: Callable) -> Callable:
    """Activation rematerialization (seed 000 §3.5): the forward keeps only ``fn``'s inputs;
    the backward runs ``fn`` again to rebuild its activations and sweeps them at once.
    (``ts.checkpoint`` before; distributed checkpoints are ``dist.save``/``dist.load``.)

    Parameters
    ----------
    fn : callable
        The block; traced values must come in as arguments (pytrees are fine), not from
        closures, and it returns one array or DTensor.

    Returns
    -------
    callable
        ``fn`` with rematerialized activations (outside ``ts.grad`` it is ``fn``).
    """
    name = getattr(fn, "__name__", "fn")

    @functools.wraps(fn)
    def wrapped(*args):
        tape = STATE.tape
        if tape is None or not tape.recording:
            return fn(*args)
        leaves, _, struct = tree_flatten(list(args))
        parents = tuple((i, x) for i, x in enumerate(leaves) if type(x) is Var)
        if not parents:
            return fn(*args)
        for _, p in parents:
            if p.tape is not tape:
                raise ValueError(f"ts.remat({name}): an argument belongs to another trace")
        with no_grad():
            out = fn(*args)
        if type(out) is Var or isinstance(out, (tuple, list, dict)):
            raise TypeError(f"ts.remat({name}) must return one array or DTensor, got {type(out).__name__}")
        plain = tuple(x.value if type(x) is Var else x for x in leaves)
        v = Var(out, tape, "remat", plain, {"fn": fn, "struct": struct}, parents)
        for _, p in parents:
            p.uses += 1
        tape.nodes.append(v)
        return v
    return wrapped


@vjp_rule("remat")
def _remat_vjp(g, out, args, kw, needs):
    fn, struct = kw["fn"], kw["struct"]
    sub = Tape()
    leaves = [Var(a, sub) if need else a for a, need in zip(args, needs)]
    STATE.tape = sub
    try:
        y = fn(*tree_unflatten(struct, leaves))
    finally:
        STATE.tape = None
    if type(y) is not Var:
        return [None] * len(args)
    backward(sub, y, g)
    sub.nodes.clear()
    return [lv.grad if type(lv) is Var else None for lv in leaves]


# renamed (issue 41: "checkpoint" is dist.save/dist.load's word), kept for one release
__getattr__ = aliases(__name__, {"checkpoint": ("tessera_rt.remat", lambda: remat)})
