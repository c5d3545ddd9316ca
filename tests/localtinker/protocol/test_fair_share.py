"""Fair turns on the engine thread: equal time for every ready consumer, no credit banked while idle."""

from __future__ import annotations

from localtinker.protocol.fair_share import FairShare


def run(fair: FairShare, ready: list[str], costs: dict[str, float], turns: int) -> dict[str, float]:
    used = {name: 0.0 for name in ready}
    for _ in range(turns):
        chosen = fair.pick(ready)
        fair.charge(chosen, costs[chosen])
        used[chosen] += costs[chosen]
    return used


def test_a_slow_training_op_alternates_with_many_fast_decode_steps():
    used = run(FairShare(), ["train", "sampling"], {"train": 1.0, "sampling": 0.05}, turns=420)
    assert abs(used["train"] - used["sampling"]) <= 1.0  # equal engine time, whatever the cost per turn


def test_equals_take_turns_in_the_order_given():
    fair = FairShare()
    picks = []
    for _ in range(4):
        picks.append(fair.pick(["a", "b"]))
        fair.charge(picks[-1], 1.0)
    assert picks == ["a", "b", "a", "b"]


def test_a_consumer_back_from_idle_gets_no_banked_credit():
    fair = FairShare()
    run(fair, ["train"], {"train": 1.0}, turns=10)  # sampling idle all along
    used = run(fair, ["train", "sampling"], {"train": 1.0, "sampling": 1.0}, turns=10)
    assert used == {"train": 5.0, "sampling": 5.0}  # not 10 turns of sampling to "catch up"
