"""Progress for the slow one-off steps a user waits on: model loads, checkpoint writing.

Bars are tqdm's (installed with the Hub client) on stderr when it is a terminal and the log
format is text, and appear only for a step that takes more than a second. Messages go
through loguru like every other line.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from loguru import logger

DELAY = 1.0  # seconds before a bar appears


def bars_wanted() -> bool:
    """Bars are for a person at a terminal: not for a log file, a pipe, or JSON logs."""
    return sys.stderr.isatty() and os.environ.get("MLXCEL_LOG_FORMAT", "text") != "json"


def log_step(msg: str) -> None:
    logger.info("checkpoint: {}", msg)


@contextmanager
def slow_task(desc: str) -> Iterator[None]:
    """An elapsed-time bar for a step with no measurable progress (one library call)."""
    from tqdm import tqdm

    bar = tqdm(
        total=None,
        desc=desc,
        bar_format="{desc}: {elapsed}",
        delay=DELAY,
        file=sys.stderr,
        disable=not bars_wanted(),
    )
    done = threading.Event()

    def tick() -> None:
        while not done.wait(0.25):
            bar.update(0)  # redraws the elapsed time, once the delay has passed

    ticker = threading.Thread(target=tick, name="progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()


def step_bar(total: int, desc: str, enabled: bool) -> object:
    """A bar over ``total`` known steps (a no-op object when not ``enabled``)."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        delay=DELAY,
        file=sys.stderr,
        disable=not (enabled and bars_wanted()),
    )
