"""Progress for the slow one-off steps a user waits on: model loads, checkpoint writing.

Bars are tqdm's (installed with the Hub client) on stderr when it is a terminal and the log
format is text, and appear only for a step that takes more than a second; without a terminal,
a step still running says so in a log line every 10 s. Messages go through loguru like every
other line.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from loguru import logger

DELAY = 1.0  # seconds before a bar appears
LINE_EVERY = 10.0  # seconds between progress lines when there is no terminal for a bar


def bars_wanted() -> bool:
    """Bars are for a person at a terminal: not for a log file, a pipe, or JSON logs."""
    from mlxcel.process import logs

    return sys.stderr.isatty() and logs.FORMAT != "json"


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
    started = time.monotonic()
    quiet = not bars_wanted()
    next_line = started + LINE_EVERY

    def tick() -> None:
        nonlocal next_line
        while not done.wait(0.25):
            if not quiet:
                bar.update(0)  # redraws the elapsed time, once the delay has passed
            elif time.monotonic() >= next_line:  # a log file: a line now and then instead
                next_line += LINE_EVERY
                logger.info("{}: still running ({:.0f} s)", desc, time.monotonic() - started)

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
