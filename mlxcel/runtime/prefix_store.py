"""The data half of a split model's prompt cache: the KV of this node's layers for the prefixes
another node indexes (:mod:`mlxcel.base.prefix_index`).

A pipeline stage keeps, under the entry ids its coordinator chose, the caches of the sequences
the coordinator asked it to keep; a later sequence starts from a private copy of one, trimmed
to the prefix it shares. Eviction is the index's: it decides, once, for every node. The
store acts alone only to stay within its byte budget when the index's plan and this node
disagree (a smaller ``--prompt-cache-bytes`` here, or an eviction that never arrived): it
then drops its own least recently used entries to make room, and an entry larger than the
whole budget is not kept. Either way a later load of an entry gone answers "not cached" and
the request prefills in full; the coordinator then forgets that entry everywhere.

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
        self.made_room = 0  # entries this store evicted itself to stay in its budget

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
        if size > self.max_bytes:
            self.refused += 1
            return f"{size} bytes are more than this node's whole budget ({self.max_bytes})"
        for key in list(self._entries):  # oldest first: made room for the newest
            if self.nbytes + size <= self.max_bytes:
                break
            self.nbytes -= self._entries.pop(key)[2]
            self.made_room += 1
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
        self._entries[(owner, entry)] = self._entries.pop((owner, entry))  # most recent
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
            "made_room": self.made_room,
            "loaded": self.loaded,
            "missed": self.missed,
        }
