"""The one fault vocabulary and scheduler (mlxcel.reactor.faults): what the simulator installs on its
virtual clock and the fault bench drives by what the cluster does."""

from __future__ import annotations

import random

import pytest

from mlxcel.reactor.faults import Fault, FaultPlan, applied, window


def _recorder() -> tuple[list[str], Fault]:
    log: list[str] = []
    return log, Fault("cut", lambda: log.append("on"), lambda: log.append("off"), tail=5.0)


def test_a_plan_installs_every_apply_and_undo_at_its_time() -> None:
    log, cut = _recorder()
    plan = FaultPlan()
    plan.add(cut, 2.0, 3.0)
    plan.add(Fault("dup", lambda: log.append("dup"), hurts=False), 1.0, 4.0)
    plan.add(Fault("crash", lambda: log.append("crash")), 6.0, None)  # never undone
    timeline: list[tuple[float, object]] = []
    plan.install(lambda t, fn: timeline.append((t, fn)))
    for _, fn in sorted(timeline, key=lambda x: x[0]):
        fn()  # type: ignore[operator]
    assert [t for t, _ in sorted(timeline, key=lambda x: x[0])] == [1.0, 2.0, 3.0, 4.0, 6.0]
    assert log == ["dup", "on", "off", "crash"]  # dup's undo does nothing


def test_harm_is_the_window_plus_its_tail_and_harmless_faults_explain_nothing() -> None:
    _, cut = _recorder()
    plan = FaultPlan()
    plan.add(cut, 2.0, 3.0)
    plan.add(Fault("reorder", print, hurts=False), 0.0, 100.0)
    plan.add(Fault("crash", print), 50.0, None)
    assert plan.harmful(horizon=60.0) == [(2.0, 8.0), (50.0, 60.0)]
    assert plan.harms(7.9, 9.0) and not plan.harms(8.1, 9.0)
    assert plan.unexplained(1.0, 2.5) is None
    why = plan.unexplained(10.0, 20.0)
    assert why == "though no fault touched it (harmless ones on: reorder)"
    assert plan.on_during(2.5, 2.6) == ["cut", "reorder"]
    with pytest.raises(ValueError, match="'cut': undone at 1.0 before applied at 2.0"):
        plan.add(cut, 2.0, 1.0)


def test_applied_undoes_the_fault_however_the_block_ends() -> None:
    log, cut = _recorder()
    with pytest.raises(RuntimeError), applied(cut):
        assert log == ["on"]
        raise RuntimeError("the check failed")
    assert log == ["on", "off"]


def test_windows_start_within_the_horizon_and_last_their_bounds() -> None:
    rng = random.Random(7)
    for _ in range(200):
        t0, t1 = window(rng, 30.0, 0.5, 2.0)
        assert 0.0 <= t0 <= 30.0 and 0.5 <= t1 - t0 <= 2.0


def test_installing_a_plan_again_schedules_only_what_was_added_since() -> None:
    log, cut = _recorder()
    plan = FaultPlan()
    plan.add(cut, 1.0, 2.0)
    times: list[float] = []
    plan.install(lambda t, fn: times.append(t))
    plan.add(Fault("drop", print), 3.0, 4.0)
    plan.install(lambda t, fn: times.append(t))
    plan.install(lambda t, fn: times.append(t))
    assert times == [1.0, 2.0, 3.0, 4.0]
