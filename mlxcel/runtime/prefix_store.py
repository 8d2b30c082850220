"""The data half of a split model's prompt cache: the KV of this node's layers for the prefixes
another node indexes (:mod:`mlxcel.base.prefix_index`).

A pipeline stage keeps, under the entry ids its coordinator chose, the caches of the sequences
the coordinator asked it to keep; a later sequence starts from a private copy of one, trimmed
to the prefix it shares. The store never evicts on its own -- the index decides, once, for
every node, so an entry is never present on one stage and gone on another by the store's
choice. What it can do alone is refuse: an entry that would take it past its byte budget is
not kept, and a later load of it answers "not cached" (the request then prefills in full).

Entries are the owner's: an entry is found only under the identity that asked for it to be
kept, so one coordinator (or a member claiming to be one) cannot load another's.

Compute thread only: entries hold MLX arrays.
"""

from __future__ import annotations

import copy
from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from mlxcel.runtime.prompt_cache import compact


def positions(cache: list[Any]) -> int | None:
    """Positions a sequence's caches hold (None: its cache types do not say)."""
    offsets = {int(c.offset) for c in cache if hasattr(c, "offset")}
    return offsets.pop() if len(offsets) == 1 else None


class PrefixStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: dict[tuple[str, int], tuple[list[Any], int, int]] = {}  # caches, len, bytes
        self.nbytes = 0
        self.kept = self.refused = self.loaded = self.missed = self.dropped = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, owner: str, entry: int, cache: list[Any], tokens: int) -> str | None:
        """Keep ``cache`` (holding exactly ``tokens`` positions) as ``owner``'s ``entry``;
        why not (None: kept)."""
        held = positions(cache)
        if held is not None and held != tokens:
            self.refused += 1
            return f"its cache holds {held} positions, not {tokens}"
        compact(cache)
        size = sum(int(c.nbytes) for c in cache)
        old = self._entries.pop((owner, entry), None)
        if old is not None:
            self.nbytes -= old[2]
        if self.nbytes + size > self.max_bytes:
            self.refused += 1
            return (
                f"{size} bytes would take this node's prompt cache past its budget "
                f"({self.nbytes} of {self.max_bytes} held)"
            )
        self._entries[(owner, entry)] = (cache, tokens, size)
        self.nbytes += size
        self.kept += 1
        return None

    def load(self, owner: str, entry: int, tokens: int) -> tuple[list[Any] | None, str]:
        """A private copy of ``owner``'s ``entry`` holding its first ``tokens`` positions, or
        (None, why it cannot be had)."""
        held = self._entries.get((owner, entry))
        if held is None:
            self.missed += 1
            return None, f"prompt-cache entry {entry} is not held here"
        cache, length, _ = held
        if tokens > length:
            self.missed += 1
            return None, f"prompt-cache entry {entry} holds {length} positions, not {tokens}"
        if tokens < length and not can_trim_prompt_cache(cache):
            self.missed += 1  # a rotating or recurrent state cannot be stepped back
            return None, f"prompt-cache entry {entry} cannot be cut to {tokens} positions"
        mine = copy.deepcopy(cache)
        if tokens < length:
            trim_prompt_cache(mine, length - tokens)
        self.loaded += 1
        return mine, ""

    def drop(self, owner: str, entries: tuple[int, ...] = ()) -> None:
        """Forget ``owner``'s ``entries`` (all of its entries: ())."""
        wanted = set(entries)
        keys = [k for k in self._entries if k[0] == owner and (not wanted or k[1] in wanted)]
        for k in keys:
            self.nbytes -= self._entries.pop(k)[2]
        self.dropped += len(keys)

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self._entries),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "kept": self.kept,
            "refused": self.refused,
            "loaded": self.loaded,
            "missed": self.missed,
        }
