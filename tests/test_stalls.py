"""The API's stall watch logs what holds every thread back (what makes /health late)."""

from __future__ import annotations

import gc
import logging
import threading
import time

import pytest

from tokenfleet.live.stalls import StallWatch, describe_busy_threads


def test_a_call_that_holds_the_interpreter_is_logged_as_a_stall(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = StallWatch(threshold_ms=30.0, tick_s=0.005).start()
    try:
        time.sleep(0.05)  # the watch thread is waiting
        t0 = time.perf_counter()
        sum(range(20_000_000))  # one C call: no other thread runs until it returns
        held_s = time.perf_counter() - t0
        deadline = time.monotonic() + 5
        while not watch.stalls and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        watch.stop()
    assert held_s > 0.03, "the machine summed too fast to hold the interpreter 30 ms"
    assert watch.stalls, "the stall was not seen"
    assert max(s for _, s in watch.stalls) >= 0.03
    assert "the process stalled" in caplog.text


def test_a_slow_collection_is_logged_with_its_generation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "tokenfleet.stalls")
    watch = StallWatch(threshold_ms=0.0).start()  # every collection counts as slow
    try:
        junk = [[i] for i in range(10_000)]
        gc.collect()
        del junk
    finally:
        watch.stop()
    assert any(gen == 2 for _, gen, _ in watch.collections)
    assert "garbage collection of generation 2" in caplog.text
    assert watch._on_gc not in gc.callbacks  # stop() takes the callback away


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        pass


def test_a_stall_names_the_code_the_busy_threads_run() -> None:
    stop = threading.Event()
    idle = threading.Event()
    threads = [threading.Thread(target=_spin, args=(stop,)) for _ in range(2)]
    threads.append(threading.Thread(target=idle.wait))  # waits: not named
    for t in threads:
        t.start()
    try:
        described = describe_busy_threads()
    finally:
        stop.set()
        idle.set()
        for t in threads:
            t.join()
    assert "test_stalls.py _spin x2" in described, described
    assert "wait" not in described


def test_the_watch_wakes_a_quarter_of_its_threshold_apart_within_bounds() -> None:
    """Each timed wake-up costs CPU: an idle worker's 250 ms threshold needs no
    50 wake-ups a second (the API's 100 ms gets 40)."""
    ticks = {ms: StallWatch(ms).tick_s for ms in (40.0, 100.0, 250.0, 1000.0)}
    assert ticks == {40.0: 0.02, 100.0: 0.025, 250.0: 0.0625, 1000.0: 0.1}
    assert StallWatch(250.0, tick_s=0.005).tick_s == 0.005
