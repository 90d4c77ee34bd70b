"""Micro-batch schedules: the ordered list of forward ("F") and backward ("B") actions each
pipeline stage runs in one step (seed 000 §5.2's wave).

* ``gpipe``: every forward, then every backward (m micro-batches of activations alive).
* ``1f1b``: ``pp - s - 1`` warm-up forwards, then one forward / one backward in turn, then
  the remaining backwards (PipeDream-flush / Megatron): at most ``pp - s`` micro-batches
  alive on stage ``s``, the same bubble as GPipe, ``(pp-1)/(m+pp-1)`` of the step.
* ``interleaved``: 1F1B over ``v`` chunks per rank (virtual stages ``c * pp + s``), in
  Megatron-core's order; the bubble falls to ``(pp-1)/(v*m+pp-1)`` for the price of ``v``
  times as many boundary messages.  Needs ``m % pp == 0``.

An action is ``(kind, chunk, microbatch)``.  ``simulate`` runs the schedules of all stages
against each other (a stage blocks on an input that is not there yet; sends never block),
so tests can prove a schedule deadlock-free and read its bubble and peak live activations.
``check_link_order`` proves that every stage sends along each link in the order the
receiving stage takes the messages: the runner sends untagged, as NCCL (which has no tags)
matches messages between two ranks in issue order.
"""
from __future__ import annotations

from collections.abc import Callable

__all__ = ["SCHEDULES", "check_link_order", "layout_problems", "gpipe", "one_f_one_b", "interleaved", "schedule_for", "simulate",
           "theory_bubble"]

Action = tuple  # (kind "F" | "B", chunk, microbatch)


def gpipe(pp: int, stage: int, m: int, v: int = 1) -> list[Action]:
    """GPipe: every forward, then every backward (m micro-batches of activations alive).

    Parameters
    ----------
    pp : int
        Pipeline stages (ranks on the pp axis).
    stage : int
        This stage's position.
    m : int
        Micro-batches per step.
    v : int
        Chunks per rank: unused (one chunk), taken so every schedule has one signature.

    Returns
    -------
    list of Action
        The stage's ``(kind, chunk, microbatch)`` actions in order.
    """
    return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]


def one_f_one_b(pp: int, stage: int, m: int, v: int = 1) -> list[Action]:
    """1F1B: ``pp - stage - 1`` warm-up forwards, then one forward / one backward in turn, then the
    remaining backwards.

    Parameters
    ----------
    pp : int
        Pipeline stages (ranks on the pp axis).
    stage : int
        This stage's position.
    m : int
        Micro-batches per step.
    v : int
        Chunks per rank: unused (one chunk), taken so every schedule has one signature.

    Returns
    -------
    list of Action
        The stage's ``(kind, chunk, microbatch)`` actions in order.
    """
    warm = min(pp - stage - 1, m)
    acts = [("F", 0, i) for i in range(warm)]
    for i in range(m - warm):
        acts += [("F", 0, warm + i), ("B", 0, i)]
    return acts + [("B", 0, i) for i in range(m - warm, m)]


def interleaved(pp: int, stage: int, m: int, v: int = 2) -> list[Action]:
    """Interleaved 1F1B over ``v`` chunks per rank (virtual stages ``c * pp + stage``), in
    Megatron-core's order; needs ``m % pp == 0``.

    Parameters
    ----------
    pp : int
        Pipeline stages (ranks on the pp axis).
    stage : int
        This stage's position.
    m : int
        Micro-batches per step.
    v : int
        Chunks per rank.

    Returns
    -------
    list of Action
        The stage's ``(kind, chunk, microbatch)`` actions in order.
    """
    if m % pp:
        raise ValueError(f"interleaved schedule: microbatches={m} must be a multiple of pp={pp}")
    total = m * v

    def at(k: int, backward: bool) -> tuple[int, int]:
        group, within = divmod(k, pp * v)
        chunk = within // pp
        return (v - 1 - chunk if backward else chunk), group * pp + within % pp

    warm = total if m == pp else min((pp - stage - 1) * 2 + (v - 1) * pp, total)
    acts = [("F",) + at(k, False) for k in range(warm)]
    for i in range(total - warm):
        acts += [("F",) + at(warm + i, False), ("B",) + at(i, True)]
    return acts + [("B",) + at(i, True) for i in range(total - warm, total)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}


def schedule_for(name: str) -> Callable[..., list[Action]]:
    """The schedule function of ``name``.

    Parameters
    ----------
    name : str
        A key of ``SCHEDULES`` ("gpipe", "1f1b", "interleaved").

    Returns
    -------
    callable
        ``fn(pp, stage, m, v) -> list of Action``; raises ValueError naming the schedules for
        another name.
    """
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown pipeline schedule {name!r}; the schedules are "
                         f"{', '.join(repr(k) for k in SCHEDULES)}") from None


def layout_problems(*, n_layers: int, pp: int = 1, microbatches: int = 1, schedule: str = "1f1b",
                    virtual: int = 1, batch: int | None = None, rows_multiple: int = 1, remat: str = "none",
                    moe: bool = False) -> list[str]:
    """Why a pipeline layout cannot run (empty: it can): the one rule book of ``Pipeline``,
    ``scripts/train.py`` and the planner's search (``tessera_rt.plan``), so the planner never
    ranks what the runtime refuses.  ``microbatches`` is the count per step over the whole
    batch; ``rows_multiple``: MoE blocks shard each micro-batch's rows over dp x ep ranks;
    ``remat`` with ``moe``: nn.Transformer does not rematerialize MoE blocks."""
    if schedule not in SCHEDULES:
        return [f"unknown pipeline schedule {schedule!r}; the schedules are {', '.join(map(repr, SCHEDULES))}"]
    bad = []
    if moe and remat != "none":
        bad.append(f"rematerializing MoE blocks is not supported (remat {remat!r}); use remat 'none'")
    if pp * virtual > n_layers:
        bad.append(f"pp={pp} x virtual stages={virtual} is more than the {n_layers} layers; every stage needs a "
                   f"layer: use pp <= {n_layers // virtual} or more layers")
    if schedule == "interleaved":
        if virtual < 2:
            bad.append("schedule='interleaved' needs virtual stages >= 2")
        if microbatches % pp:
            bad.append(f"schedule='interleaved' needs microbatches ({microbatches}) to be a multiple of pp={pp}")
        if n_layers % (pp * virtual):
            bad.append(f"{n_layers} layers do not divide over pp={pp} x virtual stages={virtual}; use a layer "
                       f"count that is a multiple of {pp * virtual}")
    elif virtual > 1:
        bad.append(f"virtual stages={virtual} need schedule='interleaved', not {schedule!r}")
    if batch is not None:
        if microbatches > batch:
            bad.append(f"microbatches ({microbatches}) is larger than the batch ({batch} sequences)")
        elif rows_multiple > 1:
            sizes = {batch // microbatches + (i < batch % microbatches) for i in range(microbatches)}
            if any(r % rows_multiple for r in sizes):
                bad.append(f"{microbatches} micro-batches of the batch of {batch} have {sorted(sizes)} sequences, but "
                           f"MoE blocks shard each micro-batch over dp x ep = {rows_multiple} ranks and need a "
                           f"multiple of {rows_multiple}")
    return bad


def check_link_order(name: str, pp: int, m: int, v: int = 1, fn=None) -> None:
    """Raise ValueError unless, on every link between two stages, the sender's boundary
    messages (activations and gradients alike) come in the order the receiver takes them.
    ``fn``: the schedule function (default: ``SCHEDULES[name]``)."""
    fn = fn or schedule_for(name)
    nv = pp * v
    sent: dict = {}                     # (from stage, to stage) -> messages in issue order
    taken: dict = {}                    # the same, in the order the receiver needs them
    for s in range(pp):
        for kind, c, mb in fn(pp, s, m, v):
            vs = c * pp + s
            dst = vs + 1 if kind == "F" else vs - 1
            if 0 <= dst < nv and dst % pp != s:                  # out along a link
                sent.setdefault((s, dst % pp), []).append((kind, dst, mb))
            src = vs - 1 if kind == "F" else vs + 1
            if 0 <= src < nv and src % pp != s:                  # in along a link
                taken.setdefault((src % pp, s), []).append((kind, vs, mb))

    def what(msgs, i):
        if i >= len(msgs):
            return "no message"
        kind, vs, mb = msgs[i]
        return f"the {'activation' if kind == 'F' else 'gradient'} of micro-batch {mb} for virtual stage {vs}"

    for link in sorted(set(sent) | set(taken)):
        a, b = sent.get(link, []), taken.get(link, [])
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise ValueError(
                f"pipeline schedule {name!r} (pp={pp}, m={m}, v={v}): message {i} from stage {link[0]} to stage "
                f"{link[1]} is {what(a, i)}, but stage {link[1]} takes {what(b, i)} there; boundary messages "
                "carry no tag (NCCL matches them in issue order), so a schedule must send along each link in "
                "the order the receiver takes the messages")


def theory_bubble(name: str, pp: int, m: int, v: int = 1) -> float:
    """The textbook idle fraction of a stage (equal forward/backward cost per layer).

    Parameters
    ----------
    name : str
        The schedule.
    pp : int
        Pipeline stages.
    m : int
        Micro-batches.
    v : int
        Chunks per rank.

    Returns
    -------
    float
        The idle fraction, e.g. ``(pp-1)/(m+pp-1)`` for 1F1B.
    """
    v = v if name == "interleaved" else 1
    return (pp - 1) / (v * m + pp - 1)


def simulate(name: str, pp: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 2.0) -> dict:
    """Run every stage's schedule against the others in simulated time (messages are free); raises
    RuntimeError on a deadlock (no stage can run its next action).

    Parameters
    ----------
    name : str
        The schedule.
    pp : int
        Pipeline stages.
    m : int
        Micro-batches.
    v : int
        Chunks per rank.
    t_f : float
        A forward's cost per chunk.
    t_b : float
        A backward's cost per chunk.

    Returns
    -------
    dict
        Per-stage finish time, busy time, bubble fraction and peak live activations.
    """
    fn = schedule_for(name)
    vv = v if name == "interleaved" else 1
    acts = [fn(pp, s, m, vv) for s in range(pp)]
    nv = pp * vv
    done: dict = {}                    # (kind, vs, mb) -> finish time
    pos, clock, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    live, peak = [0] * pp, [0] * pp
    left = sum(len(a) for a in acts)
    while left:
        progressed = False
        for s in range(pp):
            while pos[s] < len(acts[s]):
                kind, c, mb = acts[s][pos[s]]
                vs = c * pp + s
                deps = [("F", vs, mb)] if kind == "B" else []
                if kind == "F" and vs > 0:
                    deps.append(("F", vs - 1, mb))
                if kind == "B" and vs < nv - 1:
                    deps.append(("B", vs + 1, mb))
                if any(d not in done for d in deps):
                    break
                start = max([clock[s]] + [done[d] for d in deps])
                cost = t_f if kind == "F" else t_b
                clock[s] = start + cost
                busy[s] += cost
                done[(kind, vs, mb)] = clock[s]
                live[s] += 1 if kind == "F" else -1
                peak[s] = max(peak[s], live[s])
                pos[s] += 1
                left -= 1
                progressed = True
        if not progressed:
            stuck = {s: acts[s][pos[s]] for s in range(pp) if pos[s] < len(acts[s])}
            raise RuntimeError(f"schedule {name!r} (pp={pp}, m={m}, v={vv}) deadlocks: stages wait on {stuck}")
    end = max(clock)
    return {"finish": clock, "busy": busy, "bubble": [1 - b / end for b in busy], "peak_live": peak}
