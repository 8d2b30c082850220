"""ReadDeadline: one timer for a reader's moving deadline, and it still fires on time."""

from __future__ import annotations

import asyncio

from mlxcel.net.read_deadline import ReadDeadline


async def test_reads_that_end_in_time_never_expire() -> None:
    expired: list[str] = []
    d = ReadDeadline(asyncio.get_running_loop(), expired.append)
    for _ in range(30):  # 0.3 s of reads, each far inside its 0.05 s
        d.start(0.05, "late")
        await asyncio.sleep(0.01)
        d.done()
    await asyncio.sleep(0.1)
    assert expired == []
    d.cancel()


async def test_a_read_that_overruns_expires_once_with_its_reason() -> None:
    loop = asyncio.get_running_loop()
    expired: list[tuple[str, float]] = []
    d = ReadDeadline(loop, lambda why: expired.append((why, loop.time())))
    d.start(5.0, "idle")  # armed for 5 s...
    d.done()
    t0 = loop.time()
    d.start(0.05, "frame late")  # ...and this read must end far earlier
    await asyncio.sleep(0.3)
    assert [why for why, _ in expired] == ["frame late"]
    assert 0.045 <= expired[0][1] - t0 < 0.25


async def test_a_later_read_after_an_early_timer_is_still_bounded() -> None:
    """The timer armed for an earlier read fires early; it must re-arm for the read now in
    progress, not forget it."""
    loop = asyncio.get_running_loop()
    expired: list[str] = []
    d = ReadDeadline(loop, expired.append)
    d.start(0.05, "first")
    await asyncio.sleep(0.02)
    d.done()
    d.start(0.1, "second")  # ends at ~0.12 s, after the timer armed for ~0.05 s
    await asyncio.sleep(0.06)
    assert expired == []
    await asyncio.sleep(0.15)
    assert expired == ["second"]


async def test_cancel_disarms() -> None:
    expired: list[str] = []
    d = ReadDeadline(asyncio.get_running_loop(), expired.append)
    d.start(0.03, "x")
    d.cancel()
    await asyncio.sleep(0.08)
    assert expired == []
