"""Pipeline schedules and stage splits, single process: every schedule is deadlock-free
when its stages run against each other, 1F1B keeps at most pp micro-batches alive, the
simulated bubble equals the textbook figure, and splits follow the rules."""
import pytest

from tessera_rt.pipeline import SCHEDULES, schedule_for, simulate, split_layers, theory_bubble
from tessera_rt.pipeline.schedules import check_link_order

pytestmark = pytest.mark.timeout(60)
CASES = [(pp, m) for pp in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 16, 32)]


@pytest.mark.parametrize("pp,m", CASES)
def test_every_action_once_and_no_deadlock(pp, m):
    for name in ("gpipe", "1f1b"):
        acts = [SCHEDULES[name](pp, s, m) for s in range(pp)]
        for a in acts:
            assert sorted(a) == sorted([("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)])
        sim = simulate(name, pp, m)            # raises on a deadlock
        # forward 1, backward 2: every stage idles exactly (pp-1) slots of 3 units
        assert sim["bubble"] == pytest.approx([theory_bubble(name, pp, m)] * pp)
        if name == "1f1b":
            assert sim["peak_live"] == [min(pp - s, m) for s in range(pp)]
        else:
            assert sim["peak_live"] == [m] * pp


@pytest.mark.parametrize("pp,v", [(1, 2), (2, 2), (2, 3), (3, 2), (4, 2), (4, 4)])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_interleaved_is_complete_deadlock_free_and_bubbles_less(pp, v, k):
    m = k * pp
    for s in range(pp):
        acts = SCHEDULES["interleaved"](pp, s, m, v)
        want = [(f, c, i) for f in "FB" for c in range(v) for i in range(m)]
        assert sorted(acts) == sorted(want)
    sim = simulate("interleaved", pp, m, v)
    one = simulate("1f1b", pp, m)
    if pp > 1:
        # in chunk units the interleaved step is v times finer: its bubble is smaller
        assert max(sim["bubble"]) < max(one["bubble"])
        assert max(sim["bubble"]) <= theory_bubble("interleaved", pp, m, v) + 1e-9 or m == pp


def test_every_link_carries_its_messages_in_the_order_they_are_taken():
    # the runner sends boundary tensors untagged (NCCL has no tags): pp=2 interleaved sends
    # activations and gradients over the same link, paired only by issue order
    for name in SCHEDULES:
        for pp in (2, 3, 4, 8):
            for v in ((2, 3, 4) if name == "interleaved" else (1,)):
                for m in (pp, 2 * pp, 3 * pp, 8 * pp) if name == "interleaved" else (1, 2, 3, 7, 16):
                    check_link_order(name, pp, m, v)

    def swapped(pp, stage, m, v=1):          # stage 0 sends micro-batch 1 before micro-batch 0
        acts = SCHEDULES["gpipe"](pp, stage, m)
        if stage == 0:
            acts[0], acts[1] = acts[1], acts[0]
        return acts
    with pytest.raises(ValueError, match="message 0 from stage 0 to stage 1 is the activation of micro-batch 1 for "
                                         "virtual stage 1, but stage 1 takes the activation of micro-batch 0"):
        check_link_order("swapped", 2, 2, fn=swapped)


def test_interleaved_needs_microbatches_divisible_by_pp():
    with pytest.raises(ValueError, match="multiple of pp=3"):
        SCHEDULES["interleaved"](3, 0, 4, 2)


def test_unknown_schedule_lists_the_valid_ones():
    with pytest.raises(ValueError, match="'gpipe', '1f1b', 'interleaved'"):
        schedule_for("zb-h1")


def test_split_layers_even_uneven_and_explicit():
    assert split_layers(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_layers(5, 4) == [[0, 1], [2], [3], [4]]
    assert split_layers(4, 2, stage_of=[0, 1, 1, 1]) == [[0], [1, 2, 3]]
    with pytest.raises(ValueError, match="3 pipeline stages but only 2 layers"):
        split_layers(2, 3)
    with pytest.raises(ValueError, match="non-decreasing"):
        split_layers(3, 2, stage_of=[1, 0, 1])
    with pytest.raises(ValueError, match=r"leaves stages \[1\] without a layer"):
        split_layers(3, 3, stage_of=[0, 0, 2])
    with pytest.raises(ValueError, match="3 entries for 4 layers"):
        split_layers(4, 2, stage_of=[0, 1, 1])
