from __future__ import annotations

from collections.abc import Callable

import pytest

from mlxcel.net.ratelimit import WarningLimiter


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make() -> tuple[WarningLimiter, Clock, list[tuple[str, str]]]:
    clock = Clock()
    lines: list[tuple[str, str]] = []
    return WarningLimiter(clock, emit=lambda level, msg: lines.append((level, msg))), clock, lines


def make_scheduled() -> tuple[
    WarningLimiter, Clock, list[tuple[str, str]], list[tuple[float, Callable[[], None]]]
]:
    """A limiter whose window-end timers are kept (delay, callback) for the test to fire."""
    clock = Clock()
    lines: list[tuple[str, str]] = []
    timers: list[tuple[float, Callable[[], None]]] = []
    lim = WarningLimiter(
        clock,
        emit=lambda level, msg: lines.append((level, msg)),
        schedule=lambda delay, fn: timers.append((delay, fn)),
    )
    return lim, clock, lines, timers


def test_five_warnings_per_class_per_minute_then_debug() -> None:
    lim, clock, lines = make()
    results = [lim.warn("noise", f"junk {i}") for i in range(8)]
    assert results == [True] * 5 + [False] * 3
    assert [lvl for lvl, _ in lines] == ["WARNING"] * 5 + ["DEBUG"] * 3
    # Another class has its own budget: noise cannot push diagnostics down to debug.
    assert lim.warn("diagnostic", "secret mismatch") is True
    assert lim.warn("at-capacity", "full") is True
    assert lim.warn("router-drop", "dropped") is True


def test_summary_after_a_suppressing_window() -> None:
    lim, clock, lines = make()
    for i in range(7):
        lim.warn("diagnostic", f"d{i}")
    clock.t += 200  # a quiet period well past the window
    lines.clear()
    assert lim.warn("diagnostic", "again") is True
    assert lines[0] == (
        "WARNING",
        "2 cluster warnings (diagnostic) were logged at debug during the 60s window that ended 140s ago",
    )
    assert lines[1] == ("WARNING", "again")
    lines.clear()
    clock.t += 61
    lim.warn("diagnostic", "no summary when nothing was suppressed")
    assert len(lines) == 1


def test_window_resets_budget() -> None:
    lim, clock, _ = make()
    for _ in range(5):
        assert lim.warn("noise", "x")
    assert not lim.warn("noise", "x")
    clock.t += 60
    assert lim.warn("noise", "x")
    assert lim.warned["noise"] == 6 and lim.debugged["noise"] == 1


def test_unknown_class() -> None:
    lim, _, _ = make()
    with pytest.raises(ValueError):
        lim.warn("chatter", "x")


def test_long_messages_are_cut_at_the_limit_and_say_how_much_was_cut() -> None:
    lim, _, lines = make()
    exact = "x" * 500
    lim.warn("noise", exact)
    lim.warn("noise", "y" * 600)
    assert lines == [("WARNING", exact), ("WARNING", "y" * 500 + "... (100 more chars)")]
    with pytest.raises(ValueError, match="^unknown warning class 'loud'$"):
        lim.warn("loud", "x")


def test_suppressed_lines_go_to_debug_with_their_text_and_are_counted() -> None:
    lim, _, lines = make()
    for i in range(7):
        lim.warn("router-drop", f"r{i}")
    assert lines[5:] == [("DEBUG", "r5"), ("DEBUG", "r6")]
    assert lim.debugged == {
        "noise": 0,
        "diagnostic": 0,
        "router-drop": 2,
        "at-capacity": 0,
        "coordinator-drop": 0,
        "stage-drop": 0,
        "http-cap": 0,
        "http-slow": 0,
        "discovery-drop": 0,
        "decode-refusal": 0,
        "http-evict": 0,
        "prefix-mismatch": 0,
    }
    assert lim.warned["router-drop"] == 5
    lines.clear()
    lim.debug("plain")
    assert lines == [("DEBUG", "plain")]


def test_given_a_scheduler_the_summary_comes_when_the_window_ends() -> None:
    """Not with the class's next warning (which may come minutes later, or never)."""
    lim, clock, lines, timers = make_scheduled()
    for i in range(8):
        clock.t += 1.0
        lim.warn("decode-refusal", f"r{i}")
    # One timer, at the end of the window: it began with the first warning (t0 + 1 s), the
    # first suppression came 5 s later.
    assert [d for d, _ in timers] == [55.0]
    lines.clear()
    clock.t += 55.0
    timers[0][1]()
    assert lines == [
        (
            "WARNING",
            "3 cluster warnings (decode-refusal) were logged at debug during the 60s window "
            "that just ended",
        )
    ]
    lines.clear()
    lim.warn("decode-refusal", "next")  # said already: the next warning carries no summary
    assert lines == [("WARNING", "next")]


def test_a_window_end_says_its_count_once_and_a_stale_timer_says_nothing() -> None:
    lim, clock, lines, timers = make_scheduled()
    for i in range(5):  # the budget, at the window's start
        lim.warn("noise", f"r{i}")
    clock.t += 59.5
    lim.warn("noise", "late")  # the first suppressed, half a second before the window ends
    assert [d for d, _ in timers] == [0.5]
    clock.t += 0.5
    lines.clear()
    timers[0][1]()
    timers[0][1]()  # said once: nothing more
    assert lines == [
        (
            "WARNING",
            "1 cluster warnings (noise) were logged at debug during the 60s window that just ended",
        )
    ]
    # A window whose summary went out with the next window's first warning: its timer,
    # firing late, says nothing.
    for i in range(6):
        lim.warn("noise", f"s{i}")  # a new window: five, then one suppressed
    clock.t += 61.0
    lines.clear()
    lim.warn("noise", "next")
    assert lines[0][1].startswith("1 cluster warnings (noise)")
    lines.clear()
    timers[1][1]()
    assert lines == []
