"""Full collections of the API process run at quiet moments (tokenfleet/live/collector.py)."""

from __future__ import annotations

import gc

from tokenfleet.live.collector import NEVER, QuietCollector


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_full_collection_waits_for_a_quiet_moment_then_frees_the_cycles() -> None:
    now = [0.0]
    inflight = [2000]
    c = QuietCollector(
        lambda: inflight[0], quiet_at=64, every_s=60, at_most_s=900, clock=lambda: now[0]
    )
    gc.collect()
    gc.disable()  # no young collection frees them meanwhile
    try:
        for _ in range(1000):
            _Cycle()  # garbage only a collection frees
        now[0] = 30.0
        inflight[0] = 0
        assert not c.collect_if_due()  # quiet, but the last one was 30 s ago
        now[0] = 120.0
        inflight[0] = 2000
        assert not c.collect_if_due()  # due, but 2,000 streams are open
        inflight[0] = 10
        assert c.collect_if_due()  # quiet now
    finally:
        gc.enable()
    assert c.runs == 1 and c.freed >= 1000
    assert c.last_s == 120.0


def test_a_process_that_is_never_quiet_still_collects_after_the_longest_wait() -> None:
    now = [0.0]
    c = QuietCollector(lambda: 5000, every_s=60, at_most_s=900, clock=lambda: now[0])
    now[0] = 899.0
    assert not c.due()
    now[0] = 900.0
    assert c.collect_if_due() and c.runs == 1
    assert not c.due()  # the clock starts again


def test_while_it_runs_python_schedules_no_full_collection_and_stop_restores() -> None:
    before = gc.get_threshold()
    c = QuietCollector(lambda: 0, check_s=3600).start()
    try:
        assert gc.get_threshold() == (before[0], before[1], NEVER)
    finally:
        c.stop()
    assert gc.get_threshold() == before
