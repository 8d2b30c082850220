"""Attribution only: the cluster transport with framing and no frame protection.

``bench pipeline`` measures what AES-256-GCM costs a remote pipeline end to end by running
the same pipeline twice in one run, the second time with every connection's protection
replaced by :class:`~mlxcel.wire.frames.Unprotected` (the framing alone, as ``bench frames``
compares the suites). Nothing in serving can reach this: the replacement happens only in a
process started as ``python -m mlxcel.bench.unprotected serve ...`` (the bench's stage
processes) and inside :func:`frames_unprotected` (the bench's own coordinator), and such a
node cannot talk to a protected one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

MODULE = "mlxcel.bench.unprotected"


@contextmanager
def frames_unprotected() -> Iterator[None]:
    """Connections opened in this process meanwhile carry their frames unprotected."""
    from mlxcel.net import listener, pool
    from mlxcel.wire.frames import Unprotected

    saved = pool.AeadProtection, listener.AeadProtection
    pool.AeadProtection = listener.AeadProtection = Unprotected  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        pool.AeadProtection, listener.AeadProtection = saved  # type: ignore[misc]


if __name__ == "__main__":
    import runpy

    with frames_unprotected():
        runpy.run_module("mlxcel", run_name="__main__")  # mlxcel's own command line
