"""Which prompt prefixes a split model has cached, and for whom: the index half of a prompt cache.

In one process mlx-lm's ``LRUPromptCache`` keeps a prefix's tokens and its KV together. In a
split model they live apart (DESIGN.md, "Caches, tenants and identities"): the node that
decides (a pipeline's coordinator) holds this index -- which token sequences are cached, under
which entry id, in which namespace, how old -- and the nodes that compute hold the KV of their
own layers under the same ids. Eviction is decided here, once, and carried out everywhere.

A **namespace** is a tenant's: entries are found only by requests of the same namespace, so
neither ``cached_tokens`` nor time to first token tells one tenant anything about another's
prompts (:func:`cache_namespace`).

Pure: no MLX, no clock (callers pass ``now``), no I/O.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

# The namespace of requests with no API key and no salt (an open server's one shared cache).
OPEN_NAMESPACE = ""


def cache_namespace(tenant: str, salt: str | None) -> str:
    """The prompt-cache namespace of a request from ``tenant`` (a label derived from its API
    key, "" without one) with vLLM's ``cache_salt`` ``salt``. A digest: fixed-size on the wire,
    and neither the key nor the salt can be read back from it."""
    if not tenant and salt is None:
        return OPEN_NAMESPACE
    h = hashlib.sha256(b"mlxcel prompt-cache namespace\0")
    h.update(tenant.encode() + b"\0")
    h.update(b"salt\0" + salt.encode("utf-8", "surrogatepass") if salt is not None else b"-")
    return h.hexdigest()[:32]


def tenant_of(api_key: str) -> str:
    """A stable label for an API key (the key itself never leaves the HTTP layer)."""
    return hashlib.sha256(b"mlxcel tenant\0" + api_key.encode()).hexdigest()[:16]


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens ``a`` and ``b`` share: blocks compare in C, then the first
    block that differs token by token."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i : i + _BLOCK] == b[i : i + _BLOCK]:
        i += _BLOCK
    while a[i] == b[i]:
        i += 1
    return i


_BLOCK = 256


@dataclass
class Entry:
    id: int
    namespace: str
    tokens: tuple[int, ...]
    used: float  # when it was stored or last served a request (the eviction order)
    pins: int = 0  # requests loading from it now: not evicted under them


@dataclass(frozen=True, slots=True)
class Hit:
    entry: int
    tokens: int  # positions of the entry the request starts from (at most the entry's)


class PrefixIndex:
    """Cached token sequences by namespace, bounded in positions (``capacity``: what every
    computing node's budget holds). Least recently used goes first; an entry that a request is
    loading from is pinned and stays."""

    def __init__(self, capacity: int, first_id: int = 1) -> None:
        self.capacity = capacity
        self.entries: dict[int, Entry] = {}
        self._by_namespace: dict[str, dict[int, Entry]] = {}  # a lookup reads its own only
        self.held = 0  # positions of every entry
        # Ids are never reused; a coordinator that restarts starts from a fresh random point,
        # so a node that kept an older coordinator's entry cannot take it for a new one.
        self._ids = itertools.count(first_id)
        self.hits = self.misses = self.reused = self.evicted = 0

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, namespace: str, tokens: tuple[int, ...], now: float) -> Hit | None:
        """The entry of ``namespace`` sharing the longest prefix with ``tokens``, leaving at
        least one token to compute (the model must see the last prompt token to produce the
        first new one); None when nothing is shared. The entry is refreshed and pinned: the
        caller unpins it once the request no longer needs it (:meth:`unpin`)."""
        best, best_n = None, 0
        for e in self._by_namespace.get(namespace, {}).values():
            n = common_prefix(e.tokens, tokens)
            if n > best_n:
                best, best_n = e, n
        best_n = min(best_n, len(tokens) - 1)
        if best is None or best_n < 1:
            self.misses += 1
            return None
        self.hits += 1
        self.reused += best_n
        best.used = now
        best.pins += 1
        return Hit(best.id, best_n)

    def unpin(self, entry: int) -> None:
        e = self.entries.get(entry)
        if e is not None and e.pins:
            e.pins -= 1

    def insert(self, namespace: str, tokens: tuple[int, ...], now: float) -> tuple[int, list[int]]:
        """Index ``tokens`` as a new entry of ``namespace``: its id (0: not kept -- longer than
        the capacity, or already covered by an entry that holds it whole) and the ids to evict
        everywhere: entries it makes redundant (prefixes of it), then the least recently used
        until it fits."""
        if not tokens or len(tokens) > self.capacity:
            return 0, []
        gone: list[Entry] = []
        for e in self._by_namespace.get(namespace, {}).values():
            n = common_prefix(e.tokens, tokens)
            if n == len(tokens):  # held whole by an entry as long or longer
                e.used = now
                return 0, []
            if n == len(e.tokens) and not e.pins:
                gone.append(e)
        room = self.held - sum(len(e.tokens) for e in gone)
        going = {e.id for e in gone}
        for e in sorted(self.entries.values(), key=lambda e: e.used):
            if room + len(tokens) <= self.capacity:
                break
            if not e.pins and e.id not in going:
                gone.append(e)
                room -= len(e.tokens)
        if room + len(tokens) > self.capacity:  # what is left is pinned: not now, evict none
            return 0, []
        for e in gone:
            self._remove(e.id)
        entry = Entry(next(self._ids), namespace, tuple(tokens), now)
        self.entries[entry.id] = entry
        self._by_namespace.setdefault(namespace, {})[entry.id] = entry
        self.held += len(tokens)
        self.evicted += len(gone)
        return entry.id, [e.id for e in gone]

    def drop(self, entry: int) -> bool:
        """Forget ``entry`` (a node answered that it does not hold it); whether it was here."""
        if entry not in self.entries:
            return False
        self._remove(entry)
        return True

    def namespace_of(self, entry: int) -> str | None:
        e = self.entries.get(entry)
        return None if e is None else e.namespace

    def clear(self) -> list[int]:
        """Forget every entry; their ids (to evict everywhere)."""
        gone = list(self.entries)
        self.entries.clear()
        self._by_namespace.clear()
        self.held = 0
        return gone

    def _remove(self, entry: int) -> None:
        e = self.entries.pop(entry)
        self.held -= len(e.tokens)
        mine = self._by_namespace[e.namespace]
        del mine[entry]
        if not mine:  # a namespace without entries takes no room (every salt is one)
            del self._by_namespace[e.namespace]

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "reused_tokens": self.reused,
            "entries": len(self.entries),
            "tokens": self.held,
            "capacity_tokens": self.capacity,
            "evicted": self.evicted,
        }


class PrefixAffinity:
    """Which node holds which cached prompts, as the nodes themselves reported them: a
    router's view of its prefill nodes' prompt caches. A node that said it keeps a prompt is
    recorded as holding it (in its tenant's namespace); a node that later served less of a
    recorded prefix than expected has evicted it, and the record goes. Bounded per node in
    positions, least recently used first; no record crosses namespaces."""

    def __init__(self, positions_per_node: int) -> None:
        self.positions_per_node = positions_per_node
        self._nodes: dict[str, PrefixIndex] = {}

    def held(self, node: str, namespace: str, tokens: tuple[int, ...], now: float) -> None:
        ix = self._nodes.setdefault(node, PrefixIndex(self.positions_per_node))
        ix.insert(namespace, tokens, now)

    def best(
        self, nodes: list[str], namespace: str, tokens: tuple[int, ...], now: float
    ) -> tuple[str, int, int] | None:
        """Among ``nodes``, the one holding the longest prefix of ``tokens`` in
        ``namespace``: (node, its record, positions), or None."""
        found = None
        for node in nodes:
            ix = self._nodes.get(node)
            hit = ix.lookup(namespace, tokens, now) if ix is not None else None
            if hit is None:
                continue
            assert ix is not None
            ix.unpin(hit.entry)  # a record, not a cache: nothing loads from it
            if found is None or hit.tokens > found[2]:
                found = (node, hit.entry, hit.tokens)
        return found

    def served(self, node: str, record: int, expected: int, cached: int) -> None:
        """``node`` took ``cached`` prompt tokens from its cache where ``record`` promised
        ``expected``: less means it evicted that prompt; the record goes."""
        ix = self._nodes.get(node)
        if ix is not None and cached < expected:
            ix.drop(record)

    def forget(self, node: str) -> None:
        """``node`` restarted (or went away): whatever it held is gone."""
        self._nodes.pop(node, None)

    def records(self, node: str) -> int:
        ix = self._nodes.get(node)
        return len(ix) if ix is not None else 0
