"""The router's record of worker-side request spans (router/timeline.py)."""

from __future__ import annotations

from mpspool.router.timeline import Timeline


def test_keeps_spans_in_order_and_clears_on_request() -> None:
    timeline = Timeline(capacity=10)
    timeline.record("cpu/s0", [100, 250])
    timeline.record("cpu/s1", (120, 300))
    first = timeline.take()
    assert first["spans"] == [["cpu/s0", 100, 250], ["cpu/s1", 120, 300]]
    assert first["dropped"] == 0 and first["now_us"] > 0
    assert timeline.take(clear=True)["spans"] == first["spans"]
    assert timeline.take()["spans"] == []


def test_bounded_and_counts_what_it_dropped() -> None:
    timeline = Timeline(capacity=3)
    for i in range(5):
        timeline.record("s", [i, i + 1])
    taken = timeline.take(clear=True)
    assert [span[1] for span in taken["spans"]] == [2, 3, 4]
    assert taken["dropped"] == 2
    assert timeline.take()["dropped"] == 0


def test_ignores_replies_without_a_well_formed_span() -> None:
    timeline = Timeline()
    for timing in (None, [], [1], [1, 2, 3], ["a", 2], [1.5, 2], "12"):
        timeline.record("s", timing)
    assert timeline.take()["spans"] == []
