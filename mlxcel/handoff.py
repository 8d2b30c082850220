"""The KV handoff's digest and the packed cache a prefill node's lease holds (no MLX here).

Two levels, so the megabytes are hashed once, on a compute thread, and the cores only hash a
few hundred bytes: :func:`tensor_digest` covers every layer's keys and values (dtype, shape,
bytes); :func:`digest_of` binds that to everything else the decode node acts on -- the
request id, the router, the nonce, the first token, the sampling parameters, the PRNG key and
the prompt length. The decode node recomputes both before it acknowledges.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import astuple, dataclass, replace

from mlxcel.messages import KvHandoff, Tensor


def tensor_digest(keys: Sequence[Tensor], values: Sequence[Tensor]) -> bytes:
    h = hashlib.sha256()
    h.update(f"mlxcel-kv-tensors-1|{len(keys)}|{len(values)}".encode())
    for t in (*keys, *values):
        h.update(f"|{t.dtype}{list(t.shape)}|{len(t.data)}|".encode())
        h.update(t.data)
    return h.digest()


def digest_of(h: KvHandoff, tensors: bytes) -> bytes:
    """What ``h.digest`` must be, given the tensor digest of its keys and values."""
    fields = (
        h.request_id,
        h.router,
        h.nonce,
        h.first_token,
        astuple(h.sampling),
        tuple(h.rng_key),
        h.prompt_len,
        tuple(h.context),
    )
    d = hashlib.sha256(b"mlxcel-kv-handoff-1|")
    d.update(repr(fields).encode())
    d.update(tensors)
    return d.digest()


def split(h: KvHandoff, part_bytes: int) -> list[KvHandoff] | None:
    """``h`` as parts of consecutive layers, each at most ``part_bytes`` of tensor data
    (None: one layer alone is larger)."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, (k, v) in enumerate(zip(h.keys, h.values, strict=True)):
        n = k.nbytes + v.nbytes
        if n > part_bytes:
            return None
        if groups[-1] and size + n > part_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    if len(groups) == 1:
        return [h]
    return [
        replace(
            h,
            keys=tuple(h.keys[i] for i in g),
            values=tuple(h.values[i] for i in g),
            part=p,
            parts=len(groups),
        )
        for p, g in enumerate(groups)
    ]


def header(h: KvHandoff) -> tuple[object, ...]:
    """What every part of one handoff must agree on."""
    return (
        h.request_id,
        h.lease,
        h.router,
        h.nonce,
        h.first_token,
        h.sampling,
        h.rng_key,
        h.prompt_len,
        h.digest,
        h.parts,
    )


def join(parts: Sequence[KvHandoff]) -> KvHandoff:
    """The parts of one handoff, in order, as one."""
    keys = tuple(t for p in parts for t in p.keys)
    values = tuple(t for p in parts for t in p.values)
    return replace(parts[0], keys=keys, values=values, part=0, parts=1)


@dataclass(frozen=True, slots=True)
class Packed:
    """A prefilled cache ready to send: every layer trimmed to the prompt, dtype unchanged."""

    prompt_len: int
    first_token: int
    keys: tuple[Tensor, ...]
    values: tuple[Tensor, ...]
    tensors: bytes  # tensor_digest(keys, values)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.keys, *self.values))
