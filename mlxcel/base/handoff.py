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

from mlxcel.base.errors import TensorSizeError
from mlxcel.base.messages import DTYPE_SIZES, KvHandoff, Tensor

KV_DTYPES = frozenset({"float16", "bfloat16", "float32"})


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
        h.cache_ns,
    )
    d = hashlib.sha256(b"mlxcel-kv-handoff-2|")
    d.update(repr(fields).encode())
    d.update(tensors)
    return d.digest()


def check(h: KvHandoff, n_layers: int, kv_heads: int, key_dim: int, value_dim: int) -> str | None:
    """Why ``h`` cannot be resumed on a model whose cache has these dimensions (None: it can).
    Cheap checks first, then the digest over every byte: a decode node runs this on a worker
    thread, never on the compute thread that decodes its other streams (hashlib releases the
    GIL while it hashes)."""
    if len(h.keys) != n_layers or len(h.values) != n_layers:
        return f"handoff has {len(h.keys)}/{len(h.values)} layers, the model has {n_layers}"
    dtypes = {t.dtype for t in (*h.keys, *h.values)}
    if len(dtypes) != 1 or not dtypes <= KV_DTYPES:
        return f"handoff tensors must share one float dtype, got {sorted(dtypes)}"
    for ts, dim in ((h.keys, key_dim), (h.values, value_dim)):
        want = (1, kv_heads, h.prompt_len, dim)
        for t in ts:
            if tuple(t.shape) != want:
                return f"handoff tensor shape {list(t.shape)}, expected {list(want)}"
    if digest_of(h, tensor_digest(h.keys, h.values)) != h.digest:
        return "handoff digest mismatch: the KV cache is not the one the prefill node sent"
    return None


# One piece of a split handoff: rows [start, end) of tensor ``index`` (2l: layer l's keys,
# 2l + 1: its values), each tensor seen as rows of its last dimension.
Piece = tuple[int, int, int]


def tensors_of(h: KvHandoff) -> list[Tensor]:
    """``h``'s tensors in wire order: layer 0's keys, its values, layer 1's keys, ..."""
    return [t for kv in zip(h.keys, h.values, strict=True) for t in kv]


def plan_parts(h: KvHandoff, part_bytes: int) -> list[list[Piece]]:
    """How ``h`` travels in parts of at most ``part_bytes`` of tensor data (a part holds at
    least one row): consecutive row ranges, in wire order. Small parts are what let other
    handoffs to the same node go out between them, and what show a slow link's progress."""
    parts: list[list[Piece]] = [[]]
    room = part_bytes
    for i, t in enumerate(tensors_of(h)):
        row_bytes = _row_bytes(t)
        rows = t.nbytes // row_bytes if row_bytes else 0
        if rows == 0:  # no bytes at all (a dimension of 0): one empty piece keeps its place
            parts[-1].append((i, 0, 0))
            continue
        start = 0
        while start < rows:
            if room < row_bytes and parts[-1]:
                parts.append([])
                room = part_bytes
            take = min(rows - start, max(1, room // row_bytes))
            parts[-1].append((i, start, start + take))
            room -= take * row_bytes
            start += take
    return parts


def _row_bytes(t: Tensor) -> int:
    return (t.shape[-1] if t.shape else 1) * DTYPE_SIZES[t.dtype]


def part_of(h: KvHandoff, plan: list[list[Piece]], k: int) -> KvHandoff:
    """Part ``k`` of ``h`` as ``plan`` cuts it; ``h`` itself when the plan has one part. The
    prompt's tokens travel in part 0 only (a long prompt in every part would cost more than
    small parts' tensors); the digest binds them once the parts are joined."""
    if len(plan) == 1:
        return h
    tensors = tensors_of(h)
    chunks: list[Tensor] = []
    for i, start, end in plan[k]:
        t = tensors[i]
        row = _row_bytes(t)
        width = t.shape[-1] if t.shape else 1
        chunks.append(Tensor(t.dtype, (end - start, width), t.data[start * row : end * row]))
    return replace(
        h,
        keys=tuple(chunks),
        values=(),
        part=k,
        parts=len(plan),
        pieces=tuple(i for i, _, _ in plan[k]),
        layout=tuple(tuple(t.shape) for t in tensors),
        context=h.context if k == 0 else (),
    )


def header(h: KvHandoff) -> tuple[object, ...]:
    """What every part of one handoff must agree on (the prompt's tokens ride in part 0)."""
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
        h.layout,
        h.cache_ns,
    )


def join(parts: Sequence[KvHandoff]) -> KvHandoff | str:
    """The parts of one handoff, in order, as one; or why they do not make one (pieces
    missing, too many, or of another dtype than their tensor's first)."""
    layout = parts[0].layout
    data: list[list[bytes]] = [[] for _ in layout]
    dtypes: list[str | None] = [None] * len(layout)
    for p in parts:
        for i, chunk in zip(p.pieces, p.keys, strict=True):
            if dtypes[i] not in (None, chunk.dtype):
                return f"the pieces of handoff tensor {i} differ in dtype"
            dtypes[i] = chunk.dtype
            data[i].append(chunk.data)
    tensors: list[Tensor] = []
    for i, shape in enumerate(layout):
        dtype = dtypes[i]
        if dtype is None:
            return f"no piece of handoff tensor {i} arrived"
        try:
            tensors.append(Tensor(dtype, shape, b"".join(data[i])))
        except TensorSizeError as exc:
            return f"handoff tensor {i}: {exc}"
    return replace(
        parts[0],
        keys=tuple(tensors[0::2]),
        values=tuple(tensors[1::2]),
        part=0,
        parts=1,
        pieces=(),
        layout=(),
    )


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
