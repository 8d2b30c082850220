"""Reuse the KV cache of a prompt's longest cached prefix across requests.

A multi-turn chat resends its whole history every turn; with this store the engine prefills
only what is new. Entries belong to a namespace -- a tenant's (API key, ``cache_salt``; see
:func:`mlxcel.base.prefix_index.cache_namespace`) -- and a prompt reuses only its own
namespace's: mlx-lm's trie is keyed by a "model" name, and the namespace is that key. The
store is mlx-lm's own ``LRUPromptCache`` (a token trie, the one
``mlx_lm.server`` uses), bounded in bytes; it evicts the least recently *stored* entry (a
lookup does not refresh one; a conversation's next turn stores a longer entry that replaces
it). This module adds what a server needs around it: the one-token rule on exact hits,
compaction, a per-entry size guard, counters, and failures that never fail a request.

Compute thread only: entries hold MLX arrays. The counters are plain ints the reactor may
read at any time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from loguru import logger
from mlx_lm.models.cache import (
    KVCache,
    LRUPromptCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)


class PromptCache:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("a prompt cache needs max_bytes >= 1 (0 means: no cache at all)")
        self.max_bytes = max_bytes
        # Entries are bounded by bytes only: a count limit would evict small, useful ones.
        self._lru = LRUPromptCache(max_size=1 << 62, max_bytes=max_bytes)
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0
        self.too_large = 0

    @property
    def nbytes(self) -> int:
        return int(self._lru.nbytes)

    @property
    def entries(self) -> int:
        return len(self._lru)

    def fetch(self, tokens: Sequence[int], namespace: str = "") -> tuple[list[Any] | None, int]:
        """A private copy of the cache of ``tokens``' longest prefix cached in ``namespace``
        and how many tokens it covers; ``(None, 0)`` on a miss. At least one token is always
        left to prefill: the model must see the last prompt token to produce the first new
        one."""
        toks = list(tokens)
        try:
            cache, rest = self._lru.fetch_nearest_cache(namespace, toks)
            if cache is not None and not rest:  # an exact hit: give back the last token
                if can_trim_prompt_cache(cache):
                    trim_prompt_cache(cache, 1)
                    rest = toks[-1:]
                else:  # a rotating cache cannot step back; prefill it all
                    cache, rest = None, toks
        except Exception as exc:  # the cache is an optimization: never fail a request on it
            logger.warning("prompt cache: lookup failed, prefilling instead: {}", exc)
            cache, rest = None, toks
        reused = len(toks) - len(rest)
        if cache is None or reused == 0:  # a one-token prompt shares nothing usable
            self.misses += 1
            return None, 0
        self.hits += 1
        self.reused_tokens += reused
        return cache, reused

    def fetch_exactly(self, tokens: Sequence[int], namespace: str, n: int) -> list[Any] | None:
        """A private copy of the cache of ``tokens``' first ``n`` tokens, or None when this
        cache cannot give exactly that (a tensor-parallel rank following rank 0's choice)."""
        cache, got = self.fetch(tokens, namespace)
        if cache is None or got < n:
            return None
        if got > n:
            if not can_trim_prompt_cache(cache):
                return None
            trim_prompt_cache(cache, got - n)
        return cache

    def store(self, tokens: Sequence[int], cache: list[Any], namespace: str = "") -> bool:
        """Keep ``cache`` (covering exactly ``tokens``) for later prompts of ``namespace``
        that start with them; whether it was kept. One entry larger than the whole budget is
        not kept (it would evict everything and then itself)."""
        if not tokens or not cache:
            return False
        try:
            compact(cache)
            if sum(c.nbytes for c in cache) > self.max_bytes:
                self.too_large += 1
                return False
            self._lru.insert_cache(namespace, list(tokens), cache)
            self._prune()
            return True
        except Exception as exc:  # the cache is an optimization: never fail a request on it
            logger.warning("prompt cache: could not keep a finished sequence: {}", exc)
            return False

    def _prune(self) -> None:
        """Drop the trie roots of namespaces left without an entry: mlx-lm's trie keeps an
        evicted "model"'s empty root, and every ``cache_salt`` is a namespace of its own, so
        a client sending a new salt each time would otherwise grow it without bound."""
        roots = self._lru._trie._trie
        for namespace in [ns for ns, root in roots.items() if not root]:
            del roots[namespace]

    def clear(self) -> None:
        self._lru.trim_to(n_sequences=0)
        self._prune()

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "reused_tokens": self.reused_tokens,
            "entries": self.entries,
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
        }


def covers(cache: list[Any], n: int) -> bool:
    """Whether ``cache`` holds exactly ``n`` positions, as far as its layers say (a recurrent
    layer keeps no count): what storing it under ``n`` tokens requires."""
    return all(c.offset == n for c in cache if isinstance(getattr(c, "offset", None), int))


def compact(cache: list[Any]) -> None:
    """Make ``cache`` hold exactly its tokens, evaluated. A cache taken out of the batch is
    an unevaluated slice that keeps the whole batch's buffer alive, and a sequence's own
    cache grows in 256-token steps: either way its real footprint would exceed the
    ``nbytes`` the bound counts."""
    for c in cache:
        if isinstance(c, KVCache) and c.keys is not None and c.offset < c.keys.shape[2]:
            c.keys = mx.contiguous(c.keys[..., : c.offset, :])
            c.values = mx.contiguous(c.values[..., : c.offset, :])
    mx.eval([c.state for c in cache])
