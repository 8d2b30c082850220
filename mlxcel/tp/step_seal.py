"""Rank 0's step messages, sealed: a ``TpStep`` carries a MAC under a key of this launch.

MLX's ring and NCCL authenticate nothing, so whoever reaches a rank's port could feed the
followers steps of its own (other prompts, other sampling). Every step rank 0 broadcasts
ends in a 16-byte HMAC-SHA256 tag over a step counter and the encoded step; a follower that
finds a tag wrong, or a step replayed or out of order, stops with that error (the group then
fails loudly, as for a lost rank). The activations the collectives carry are not covered:
only the control path is (docs/tensor-parallel.md).

The key is fresh for every launch: rank 0 draws it and sends it to each rank inside the
encrypted connection on which that rank proved the secret (:mod:`.rendezvous`).
"""

from __future__ import annotations

import hashlib
import hmac

from mlxcel.base.errors import StepForged

TAG = 16


class StepSeal:
    """One side's sealing (rank 0) or opening (a follower) of the launch's step sequence."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("a step key needs at least 16 bytes")
        self._key = key
        self._count = 0  # the step number the next tag covers: a replay or reorder fails

    def _tag(self, payload: bytes) -> bytes:
        mac = hmac.new(self._key, self._count.to_bytes(8, "big") + payload, hashlib.sha256)
        return mac.digest()[:TAG]

    def seal(self, payload: bytes) -> bytes:
        sealed = payload + self._tag(payload)
        self._count += 1
        return sealed

    def open(self, data: bytes) -> bytes:
        payload, tag = data[:-TAG], data[-TAG:]
        if len(data) < TAG or not hmac.compare_digest(tag, self._tag(payload)):
            raise StepForged(
                f"step {self._count} failed its MAC: the group's control traffic was altered "
                "or injected by something outside the group"
            )
        self._count += 1
        return payload
