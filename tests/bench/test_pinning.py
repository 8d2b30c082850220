"""``bench pipeline --pin``: one device against two on a CPU host, by pinning processes to
cores thread by thread."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from mlxcel.base.errors import ConfigError
from mlxcel.bench import pinning


def test_this_process_is_pinned_for_the_block_then_back_where_it_was() -> None:
    first, _ = pinning.two_cores()
    before = os.sched_getaffinity(0)
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait)
    helper.start()  # a thread that exists before the pinning is pinned with the rest
    try:
        with pinning.pinned({first}):
            assert os.sched_getaffinity(0) == {first}
            assert os.sched_getaffinity(helper.native_id) == {first}
        assert os.sched_getaffinity(0) == before
        assert os.sched_getaffinity(helper.native_id) == before
    finally:
        stop.set()
        helper.join()


def test_every_thread_of_another_process_is_pinned() -> None:
    _, second = pinning.two_cores()
    child = subprocess.Popen(
        [sys.executable, "-c", "import threading,time\n"
         "[threading.Thread(target=time.sleep, args=(30,), daemon=True).start() for _ in range(3)]\n"
         "print('up', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        pinning.pin(child.pid, {second})
        tids = os.listdir(f"/proc/{child.pid}/task")
        assert len(tids) == 4
        assert all(os.sched_getaffinity(int(t)) == {second} for t in tids)
    finally:
        child.kill()
        child.wait()


def test_one_core_is_not_two_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    with pytest.raises(ConfigError, match="--pin: one device against two needs two cores"):
        pinning.two_cores()
