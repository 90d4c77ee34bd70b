"""``grad``, ``value_and_grad``, ``vjp`` and ``checkpoint``: the reverse sweep over a tape.

    gW = ts.grad(loss_fn)(W)                        # seed 002 §2.5
    loss, grads = ts.value_and_grad(loss_fn)(params, batch)   # params: a pytree
    y, pullback = ts.vjp(f, x); (gx,) = pullback(gy)          # non-scalar outputs
    block = ts.checkpoint(block_fn)                  # activation remat (seed 000 §3.5)

A DTensor parameter's gradient comes back in the parameter's layout.  When a parameter's
gradient is complete (every op that read it has been swept) and only pending sums stand
between it and that layout (data-parallel replicas, tensor-parallel partial products),
it goes into a gradient bucket (``buckets``: DDP's flat buckets, one async all-reduce per
full bucket on the ``grad_reduce`` stream role), so the reduction overlaps the rest of the
backward pass; the sweep waits for them all at the end.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from .buckets import GradBuckets, grad_bucket_bytes, largest_shard
from .tape import EFFECT_OPS, STATE, VJPS, Tape, Var, _kind, _op, no_grad, vjp_rule

__all__ = ["grad", "value_and_grad", "vjp", "checkpoint", "GRAD_ROLE", "tree_flatten", "tree_unflatten",
           "reduce_grads"]

GRAD_ROLE = "grad_reduce"
_RULES_LOADED = []


def _load_rules() -> None:
    if not _RULES_LOADED:
        from . import dist_vjps, vjps    # noqa: F401  (register the VJP table)
        _RULES_LOADED.append(True)


# --------------------------------------------------------------------------- pytrees

def tree_flatten(tree, path: str = "") -> tuple[list, list, Any]:
    """(leaves, their paths, structure); dicts, lists and tuples are nodes, None is empty."""
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


def tree_unflatten(struct, leaves) -> Any:
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


_MODS: dict = {}


def _dtensor_type():
    # a function-level import costs a trip through the import machinery on every call; the
    # finisher calls this once per gradient inside the backward's window
    t = _MODS.get("DTensor")
    if t is None:
        from ..dist.dtensor import DTensor as t
        _MODS["DTensor"] = t
    return t


def _check_param(value, path: str, fn_name: str) -> None:
    dt = getattr(value, "dtype", None)
    if dt is None:
        raise TypeError(f"ts.grad({fn_name}): argument {path or '0'} is a {type(value).__name__}; differentiate "
                        "with respect to arrays or DTensors (pass constants as other arguments)")
    if _kind(dt) not in ("f", "b", "h"):         # float, bf16, fp16 (not fp8, not integers)
        name = np.dtype(dt).name
        raise TypeError(f"ts.grad({fn_name}): argument {path or '0'} has dtype {name}; only float parameters "
                        "(f32, bf16, fp16) have gradients (fp8 and integer values are data: move them to "
                        "another argument, or keep bf16/f32 masters and quantize inside the function)")


# --------------------------------------------------------------------------- the sweep

def _zeros_like(x):
    if type(x) is _dtensor_type():
        from ..dist.dtensor import zeros
        return zeros(x.shape, layout=x.layout.with_partial(()), mesh=x.mesh, dtype=x.dtype)
    from ..backend import get_backend
    return get_backend().xp.zeros_like(x)


def _add(a, b):
    return _op().add(a, b)               # tape's cached module, not an import per call


def _add_into(acc, ct) -> bool:
    """``acc += ct`` in place when the sum keeps acc's shape, dtype and layout (a pending sum
    adds piecewise); False (nothing done) otherwise."""
    dt = _dtensor_type()
    if type(acc) is dt:
        if type(ct) is not dt or ct.layout != acc.layout or ct.mesh is not acc.mesh or \
                any(o != "sum" for _, o in acc.layout.partial):
            return False
        acc, ct = acc.to_local(), ct.to_local()
    elif type(ct) is dt or not hasattr(ct, "shape"):
        return False
    if acc.shape != ct.shape or acc.dtype != ct.dtype or type(acc) is not type(ct):
        return False
    type(acc).__iadd__(acc, ct)
    return True


def backward(tape: Tape, out: Var, seed) -> None:
    """Sweep ``tape`` backwards from ``out`` (cotangent ``seed``).  Runs with no tape
    active, so the VJP rules' own ops are not recorded."""
    # The loop's Python is time the gradient all-reduces issued during the sweep do not
    # run under any op, so the globals it reads are bound to locals once per sweep.
    rules, effects, add, add_into = VJPS, EFFECT_OPS, _add, _add_into
    # ids of the gradients this sweep's own adds made: nothing else holds them, so a third
    # contribution adds into one in place (a rule's cotangent may alias its input or
    # another's, so a first one is never written to)
    owned: set = set()
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
            v.args = v.kw = None                   # drop the residuals as soon as they are used
    finally:
        STATE.tape = saved


def _release(parents) -> None:
    for _, p in parents:
        p.uses -= 1
        if p.leaf and p.uses == 0 and p.finish is not None:
            p.finish(p)


def _issue_reduce(local, mesh, axis, out=None):
    """The async all-reduce of a gradient's (or a bucket's) pending sum on ``GRAD_ROLE``."""
    rt, dc = _MODS.get("rt"), _MODS.get("dc")
    if dc is None:                       # imported once (this runs once per bucket, in the backward)
        from .. import runtime as rt
        from ..dist import dtensor_collectives as dc
        _MODS["rt"], _MODS["dc"] = rt, dc
    if GRAD_ROLE not in rt.stream_map():
        rt.set_stream_map({GRAD_ROLE: rt.stream_map()["tp_collective"]})
    return dc.all_reduce(local, axis=axis, mesh=mesh, out=out, async_op=True, role=GRAD_ROLE)


class _Finisher:
    """Brings each DTensor leaf's gradient into the leaf's layout and dtype; pending sums
    over mesh axes go into a gradient bucket the moment the gradient is complete, and a full
    bucket becomes one async all-reduce (``buckets``; cap 0: one all-reduce per gradient)."""

    def __init__(self, bucket_mb: float | None = None):
        self.pending: list = []
        self.bucket_mb = bucket_mb
        self.buckets = None

    def plan(self, params) -> None:
        """Size the buckets for ``params`` (the differentiated values): the default cap
        depends on their DTensors' global bytes, the same number on every rank."""
        DT = _dtensor_type()
        total = sum(int(np.prod(p.shape)) * np.dtype(p.dtype).itemsize for p in params if type(p) is DT)
        cap = grad_bucket_bytes(self.bucket_mb, total)
        self.buckets = GradBuckets(cap, _issue_reduce) if cap > 0 else None

    def __call__(self, leaf: Var) -> None:
        g, p = leaf.grad, leaf.value
        if g is None:
            return
        DT = _dtensor_type()
        if type(p) is not DT:
            if type(g) is DT:
                g = g.full_tensor()
            if getattr(g, "dtype", None) != p.dtype or getattr(g, "shape", None) != p.shape:
                from ..backend import get_backend
                g = get_backend().xp.asarray(g, dtype=p.dtype).reshape(p.shape)
            if not getattr(g.flags, "writeable", True):   # CuPy flags have no writeable
                g = g.copy()                     # a broadcast view (the gradient of a sum)
            leaf.grad = g
            return
        if type(g) is not DT:
            raise TypeError(f"ts.grad: the gradient of DTensor argument {leaf.name} came back as a "
                            f"{type(g).__name__}; a VJP rule lost the layout")
        if g.dtype != p.dtype:
            g = g.astype(p.dtype)
        want = p.layout
        lay = g.layout
        if lay == want:
            leaf.grad = g
            return
        sums = [a for a, o in lay.partial if o == "sum"]
        if lay.dims == want.dims and not want.partial and len(sums) == len(lay.partial) and sums:
            axis = sums[0] if len(sums) == 1 else tuple(sums)
            if g.mesh.size(axis) == 1:           # a sum over one rank: the piece is the sum already
                from ..dist.dtensor import meta_of
                leaf.grad = DT._wrap(g.to_local(), meta_of(want, p.shape, g.dtype, p.mesh))
                return
            if self.buckets is not None:
                self.buckets.add(leaf, g.to_local(), g.mesh, axis, largest_shard(g.shape, lay, g.mesh))
            else:
                self.pending.append((leaf, _issue_reduce(g.to_local(), g.mesh, axis)))
            leaf.grad = None
            return
        leaf.grad = g.redistribute(want)

    def flush(self) -> None:
        """Issue the buckets still open (their gradients are all in)."""
        if self.buckets is not None:
            self.buckets.flush()

    def wait(self) -> None:
        from ..dist.dtensor import DTensor, meta_of
        done = [(leaf, work.wait()) for leaf, work in self.pending]
        if self.buckets is not None:
            done += self.buckets.results()
        for leaf, local in done:
            p = leaf.value
            leaf.grad = DTensor._wrap(local, meta_of(p.layout, p.shape, local.dtype, p.mesh))
        self.pending.clear()


def _seed(value, what: str):
    DT = _dtensor_type()
    if type(value) is DT:
        if value.shape != ():
            raise ValueError(f"{what}: the function returned a DTensor of shape {list(value.shape)} "
                             f"({value.layout!r}); ts.grad needs a scalar loss: reduce it (op.sum / op.mean), "
                             "or use ts.vjp(fn, *args) and pass a cotangent of that shape")
        from ..dist.dtensor import full
        return full((), 1.0, mesh=value.mesh, dtype=value.dtype)
    shape = tuple(getattr(value, "shape", ()))
    if shape != () or not _is_float_value(value):
        raise ValueError(f"{what}: the function returned {_describe(value)}; ts.grad needs a scalar float "
                         "loss: reduce it (op.sum / op.mean), or use ts.vjp(fn, *args) and pass a cotangent")
    from ..backend import get_backend
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


def _trace(fn: Callable, args: tuple, argnums, fn_name: str, reduce: bool = True, bucket_mb: float | None = None):
    """Run ``fn`` with the leaves of ``args[argnums]`` traced; returns the pieces of a pullback."""
    _load_rules()
    if STATE.tape is not None:
        raise NotImplementedError(f"ts.grad({fn_name}) inside another ts.grad: higher-order gradients are "
                                  "not supported; compute the inner gradient outside, or use ts.checkpoint")
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for n in nums:
        if not -len(args) <= n < len(args):
            raise ValueError(f"ts.grad({fn_name}): argnums={argnums} but the function got {len(args)} arguments")
    tape = Tape()
    finisher = _Finisher(bucket_mb)
    args = list(args)
    leaf_groups = []
    for n in nums:
        leaves, paths, struct = tree_flatten(args[n], f"arg{n}")
        vs = []
        for x, p in zip(leaves, paths):
            _check_param(x, p, fn_name)
            v = Var(x, tape)
            v.name = p
            v.finish = finisher if reduce else None
            vs.append(v)
        args[n] = tree_unflatten(struct, vs)
        leaf_groups.append((vs, struct))
    finisher.plan([v.value for vs, _ in leaf_groups for v in vs])
    STATE.tape = tape
    try:
        out = fn(*args)
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


def value_and_grad(fn: Callable, argnums=0, *, has_aux: bool = False, allow_unused: bool = False,
                   bucket_mb: float | None = None):
    """``(loss, grads)`` of a function returning a scalar loss (or ``(loss, aux)`` with
    ``has_aux``).  ``grads`` mirrors ``args[argnums]`` (pytrees of arrays / DTensors); a
    DTensor's gradient has the DTensor's layout.  ``bucket_mb``: the gradient bucket cap for
    the pending sums' all-reduces (``autodiff.buckets``; None: ``$TESSERA_GRAD_BUCKET_MB`` or
    the default, 0: one all-reduce per parameter)."""
    name = getattr(fn, "__name__", "fn")
    if bucket_mb is not None:
        grad_bucket_bytes(bucket_mb)             # a bad cap fails here, not in the backward

    @functools.wraps(fn)
    def wrapped(*args):
        tape, finisher, out, groups, single = _trace(fn, args, argnums, name, bucket_mb=bucket_mb)
        aux = None
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ValueError(f"ts.value_and_grad({name}, has_aux=True): the function must return "
                                 f"(loss, aux), got {type(out).__name__}")
            out, aux = out
            from .tape import detach
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


def grad(fn: Callable, argnums=0, *, has_aux: bool = False, allow_unused: bool = False,
         bucket_mb: float | None = None):
    """The gradient of a scalar-valued ``fn`` with respect to ``args[argnums]``."""
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


def vjp(fn: Callable, *args, allow_unused: bool = True, reduce: bool = True):
    """``(out, pullback)``: ``pullback(cotangent)`` gives the gradient of ``<out, cotangent>``
    with respect to every argument (a tuple, one pytree per argument).  ``fn`` may return a
    tuple: ``pullback`` then takes a tuple of cotangents, one per output (None: zero), and
    sweeps once for their sum (a pipeline stage seeds its activation and its own loss term
    together).  ``reduce=False`` leaves DTensor gradients raw (pending sums over dp/tp not
    yet all-reduced), for callers that accumulate several pullbacks and reduce once
    (``reduce_grads``)."""
    name = getattr(fn, "__name__", "fn")
    tape, finisher, out, groups, _ = _trace(fn, args, tuple(range(len(args))), name, reduce)
    used = [False]
    many = type(out) is tuple
    outs = out if many else (out,)

    def pullback(ct):
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
            o.grad = c if o.grad is None else _add(o.grad, c)
        backward(tape, seeds[0][0], seeds[0][0].grad)
        return _collect(tape, finisher, groups, False, allow_unused, name)
    values = tuple(o.value if type(o) is Var else o for o in outs)
    return (values if many else values[0]), pullback


class _Leaf:
    __slots__ = ("value", "grad", "name")

    def __init__(self, value, grad, name):
        self.value, self.grad, self.name = value, grad, name


class _Reduction:
    """Handle of ``reduce_grads``: ``wait()`` returns the gradients in their parameters' layouts."""

    def __init__(self, leaves, finisher, struct):
        self._leaves, self._finisher, self._struct = leaves, finisher, struct

    def wait(self):
        self._finisher.wait()
        return tree_unflatten(self._struct, [leaf.grad for leaf in self._leaves])


def reduce_grads(params, grads) -> _Reduction:
    """Start bringing raw gradients (from ``vjp(..., reduce=False)``, possibly summed over
    micro-batches) into their parameters' layouts: the pending sums go out in gradient
    buckets (async all-reduces on the ``grad_reduce`` role), issued now; ``wait()`` on the
    handle returns the finished pytree (the same mechanism ``ts.grad`` uses)."""
    ps, paths, struct = tree_flatten(params)
    gs = tree_flatten(grads)[0]
    if len(gs) != len(ps):
        raise ValueError(f"reduce_grads: {len(gs)} gradients for {len(ps)} parameters")
    finisher = _Finisher()
    finisher.plan(ps)
    leaves = [_Leaf(p, g, path) for p, g, path in zip(ps, gs, paths)]
    for leaf in leaves:
        finisher(leaf)
    finisher.flush()
    return _Reduction(leaves, finisher, struct)


# --------------------------------------------------------------------------- checkpoint

def checkpoint(fn: Callable):
    """Activation rematerialization (seed 000 §3.5): the forward keeps only ``fn``'s inputs;
    the backward runs ``fn`` again to rebuild its activations and sweeps them at once.
    Traced values must come in as arguments (pytrees are fine), not from closures; ``fn``
    returns one array or DTensor."""
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
                raise ValueError(f"ts.checkpoint({name}): an argument belongs to another trace")
        with no_grad():
            out = fn(*args)
        if type(out) is Var or isinstance(out, (tuple, list, dict)):
            raise TypeError(f"ts.checkpoint({name}) must return one array or DTensor, got {type(out).__name__}")
        plain = tuple(x.value if type(x) is Var else x for x in leaves)
        v = Var(out, tape, "checkpoint", plain, {"fn": fn, "struct": struct}, parents)
        for _, p in parents:
            p.uses += 1
        tape.nodes.append(v)
        return v
    return wrapped


@vjp_rule("checkpoint")
def _checkpoint_vjp(g, out, args, kw, needs):
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
