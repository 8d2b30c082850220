"""The decode node's protocol core: verify a handoff, wait for the commit, stream the rest.

A ``KvHandoff`` from any authenticated member is checked (shapes, dtype, digest) on the
compute side, then acknowledged. It is *read* -- inserted into the decode batch -- only when
the prefill node that holds its lease answers with a commit verdict; an abort, a verdict
that never comes, or the prefill node's loss frees it unread. Tokens go to the router the
handoff names (the identity the prefill node authenticated the request from) -- if that
router has spoken to this node itself, or is one of its ``--router-peers``: an address a
payload merely names is never dialled -- numbered from 1 (the prefill node sent token 0). A
cancel from that router frees the slot at any point; a cancel that overtakes its handoff is
remembered for a while, so the late handoff is refused.

Before that, as a prompt starts, its prefill node asks for a slot (``SlotRequest``): one is
held, counted against ``max_sequences``, until the handoff comes; a full or draining node,
or a request for a router it does not serve, says why not while the prompt still runs. Every
refusal leaves a rate-limited line naming its sender (``decode-refusal``).

A decode node with a prompt cache keeps each finished conversation -- the prompt the handoff
carried and every token it generated -- in the request's namespace under the router it came
through (:func:`~mlxcel.disagg.protocol.decode_namespace`), and says so on the last token
(``kept``, when its engine did keep it). The next turn of that conversation comes from the router as a
``PrefillRequest`` (a *continuation*): this node runs it from its own cache, prefilling only
what is new, and streams every token from index 0 itself. The request names how many prompt
tokens the cache must supply; a cache that evicted the conversation answers
``prefix_not_cached`` before prefilling anything, and the router sends the turn the usual way.
Only a router this node serves may ask.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxcel.base.effects import Effect, FreeCache, Send, StartCompute, Warn
from mlxcel.base.errors import IllegalTransition
from mlxcel.base.handoff import header, join
from mlxcel.base.messages import (
    CancelRequest,
    Error,
    ErrorCode,
    HandoffAck,
    HandoffVerdict,
    KvHandoff,
    Message,
    PrefillRequest,
    QueryState,
    RunResult,
    SlotAnswer,
    SlotRequest,
    State,
    TokenResult,
    prompt_problem,
)
from mlxcel.disagg.protocol import (
    CONTINUE_MAX,
    MAX_PARTS,
    MAX_TOMBSTONES,
    PREFILL_TIMEOUT,
    SLOT_TABLE,
    TOMBSTONE_TTL,
    VERDICT_WAIT,
    ContinueJob,
    ResumeJob,
    SlotEvent,
    SlotState,
    VerifyJob,
    decode_namespace,
    min_cached,
)

MAX_ROUTERS = 64  # router identities remembered (the newest that spoke to this node)


@dataclass
class Slot:
    id: int
    prefill: str  # who sent the handoff (and holds its lease); "" for a continuation
    handoff: KvHandoff  # a continuation's: its header only (no lease, no tensors)
    state: SlotState = SlotState.VERIFYING
    continued: bool = False  # a conversation's next turn, run here from this node's cache
    deadline: float | None = None
    index: int = 1  # the next token's index (the prefill node sent index 0)
    pieces: dict[int, KvHandoff] = field(default_factory=dict)  # parts received so far
    elements: int = 0  # tensor elements those parts carry (bounded by the layout's)
    # The checked cache as the compute side loaded it, from the check until the commit hands
    # it to the engine (opaque here; it leaves with the slot).
    cache: Any = None

    @property
    def router(self) -> str:
        return self.handoff.router


@dataclass(frozen=True)
class DecodeConfig:
    vocab: int = 1 << 30
    max_len: int = 1 << 30
    max_sequences: int = 64
    verdict_wait: float = VERDICT_WAIT
    # (layers, kv heads, key dim, value dim) of this node's model: every part of a handoff is
    # checked against it on arrival, so a slot never holds more than one model's cache (None:
    # no check)
    dims: tuple[int, int, int, int] | None = None
    # The routers it serves (--router-peers); None: any router that polls this node.
    routers: frozenset[str] | None = None
    keeps: bool = False  # its engine keeps finished conversations (a prompt cache)


class DecodeCore:
    def __init__(self, config: DecodeConfig, counters: Callable[[], dict[str, int]] = dict) -> None:
        self.config = config
        self.counters = counters  # State fields the node keeps: its KV cache
        # Shutting down: said in State, so the router assigns it nothing new. Handoffs still
        # come for requests it was given before (their prompts were running): taken.
        self.draining = False
        self.told_draining = False  # a State saying so went out
        self.queried = False  # a router asked for a State: one may be sending it work
        self.slots: dict[int, Slot] = {}
        self._by_lease: dict[tuple[str, int], int] = {}
        # A request's one id (its router's) -> its slot: unique on this node, whichever
        # router named it, so the engine knows the stream by that id too.
        self._by_id: dict[str, int] = {}
        self._tombstones: dict[tuple[str, str], float] = {}
        # (prefill, lease) of handoffs that ended here, oldest first (bounded): a late or
        # repeated part of one never opens a new slot.
        self._ended: dict[tuple[str, int], None] = {}
        self._ids = itertools.count(1)
        self.counts: Counter[str] = Counter()
        # (prefill, lease) of every handoff read, newest last: what a simulation checks.
        self.reads: deque[tuple[str, int]] = deque(maxlen=100_000)
        # Slots promised to a prefill node's handoff before it ran the prompt: (prefill,
        # lease) -> when the promise lapses. They count against max_sequences.
        self.held: dict[tuple[str, int], float] = {}
        # Routers that spoke to this node over an authenticated connection (their figures
        # poll, QueryState): tokens go only to one of them (or to one of --router-peers),
        # never to an address a payload names.
        self.routers: dict[str, None] = {}

    @property
    def active(self) -> int:
        return len(self.slots)

    @property
    def tombstones(self) -> int:
        """How many cancelled requests it remembers (bounded)."""
        return len(self._tombstones)

    @property
    def ended(self) -> int:
        """How many ended handoffs it remembers (bounded)."""
        return len(self._ended)

    def next_timer(self) -> float | None:
        times = [s.deadline for s in self.slots.values() if s.deadline is not None]
        if self._tombstones:
            times.append(min(self._tombstones.values()))
        if self.held:
            times.append(min(self.held.values()))
        return min(times, default=None)

    # --- inputs -----------------------------------------------------------------------------
    def handle(self, msg: Message, source: str, now: float) -> list[Effect]:
        if isinstance(msg, KvHandoff):
            return self._handoff(msg, source, now)
        if isinstance(msg, HandoffVerdict):
            return self._verdict(msg, source)
        if isinstance(msg, SlotRequest):
            return self._slot_request(msg, source, now)
        if isinstance(msg, PrefillRequest):
            return self._continue(msg, source)
        if isinstance(msg, QueryState):
            self._router_seen(source)
        if isinstance(msg, QueryState):  # figures for the router's stats (no secrets)
            st = State("decode", (), self.active, self.draining, msg.nonce, **self.counters())
            self.told_draining |= self.draining
            self.queried = True
            return [Send(source, st)]
        if isinstance(msg, CancelRequest):
            sid = self._slot_of(msg.request_id, source)
            if sid is None:
                self._remember_cancel((source, msg.request_id), now)
                if self._serves(source):
                    return []  # a cancel that overtook its handoff: remembered
                why = "no router of this node sent it; remembered, nothing held was touched"
                return [self._refused("cancel", msg.request_id, source, why)]
            self.counts["cancelled"] += 1
            self._remember_cancel((source, msg.request_id), now)  # its late parts: refused
            return self._end(self.slots[sid], SlotEvent.CANCEL)
        return [Warn("debug", f"decode: ignoring {type(msg).__name__} from {source}")]

    def _serves(self, router: str) -> bool:
        """Whether tokens may go to ``router``: one this node was told of, else one that has
        spoken to it over an authenticated connection -- never a payload's mere address."""
        known = self.config.routers
        return router in known if known is not None else router in self.routers

    def _router_seen(self, source: str) -> None:
        self.routers.pop(source, None)
        self.routers[source] = None
        if len(self.routers) > MAX_ROUTERS:
            self.routers.pop(next(iter(self.routers)))

    def _slot_request(self, m: SlotRequest, source: str, now: float) -> list[Effect]:
        """A prefill node asks, as its prompt starts, whether a slot waits for the handoff."""
        key = (source, m.lease)
        why = ""
        if key not in self.held:
            why = self._no_slot(m.router)
        if why:
            self.counts["slots_refused"] += 1
            self._remember_end(key)  # the abort its prefill node may still send is expected
            return [
                self._refused("slot request", m.request_id, source, why),
                Send(source, SlotAnswer(m.request_id, m.lease, False, why)),
            ]
        self.held[key] = now + PREFILL_TIMEOUT  # the longest a prompt may take to run
        return [Send(source, SlotAnswer(m.request_id, m.lease, True))]

    def _no_slot(self, router: str) -> str:
        """Why no new request fits here ("" if one does)."""
        if self.draining:
            return "this decode node is shutting down"
        if not self._serves(router):
            return f"router {router} is not a router of this decode node"
        if len(self.slots) + len(self.held) >= self.config.max_sequences:
            return f"decode node full ({self.config.max_sequences} sequences)"
        return ""

    def _continue(self, m: PrefillRequest, source: str) -> list[Effect]:
        """A router sends a conversation's next turn here, where its history is cached."""
        c = self.config
        why = ""
        if (source, m.request_id) in self._tombstones:
            why = "the router cancelled this request"
        elif m.request_id in self._by_id:
            s = self.slots[self._by_id[m.request_id]]
            if s.continued and s.router == source and s.handoff.nonce == m.nonce:
                return []  # the same request again: it runs already
            why = "this node already decodes that request"
        elif not c.keeps:
            why = "this decode node keeps no conversations (no prompt cache)"
        else:
            why = self._no_slot(source)
        need = min_cached(m.cached, len(m.token_ids))
        if not why and (need < 1 or len(m.token_ids) - need > CONTINUE_MAX):
            # What a router never sends: a decode node prefills no long prompt.
            why = (
                f"a continuation prefills at most {CONTINUE_MAX} new tokens here; this one "
                f"would prefill {len(m.token_ids) - need}"
            )
        # Not now: the router sends the turn the usual way, through a prefill node. A malformed
        # prompt (the router checked it already: a member's) is a bad request instead.
        code = ErrorCode.DECODE_REFUSED
        if not why:
            why = prompt_problem(m.token_ids, m.sampling.max_tokens, c.vocab, c.max_len) or ""
            code = ErrorCode.BAD_REQUEST
        if why:
            self.counts["refused"] += 1
            return [
                self._refused("continuation", m.request_id, source, why),
                Send(source, Error(code, why, m.request_id, m.nonce)),
            ]
        head = KvHandoff(
            m.request_id, 0, source, m.nonce, 0, m.sampling, (), len(m.token_ids), (), (), b"",
            cache_ns=m.cache_ns,
        )  # fmt: skip
        s = Slot(next(self._ids), "", head, SlotState.DECODING, continued=True, index=0)
        self.slots[s.id] = s
        self._by_id[m.request_id] = s.id
        self.counts["continued"] += 1
        ns = decode_namespace(source, m.cache_ns)
        return [StartCompute(ContinueJob(s.id, m.request_id, m.token_ids, m.sampling, ns,
                                         need))]  # fmt: skip

    def _refused(self, what: str, request_id: str, source: str, why: str) -> Warn:
        """The line a refusal leaves in this node's log (rate limited), naming the sender."""
        return Warn(
            "decode-refusal",
            f"decode: refused a {what} from {source} (request {request_id[:80]!r}): {why}",
        )

    def _handoff(self, h: KvHandoff, source: str, now: float) -> list[Effect]:
        c = self.config
        sid = self._by_lease.get((source, h.lease))
        if sid is not None:
            return self._piece(self.slots[sid], h, now)
        if (source, h.lease) in self._ended:
            return []  # a late part of a handoff that already ended here
        self.held.pop((source, h.lease), None)  # the promise is kept now, or refused
        why = self._shape_problem(h) or self._refusal(h)
        if why:
            self.counts["refused"] += 1
            self._remember_end((source, h.lease))
            return [
                self._refused("handoff", h.request_id, source, why),
                Send(source, HandoffAck(h.request_id, h.lease, False, why)),
            ]
        s = Slot(next(self._ids), source, h, deadline=now + c.verdict_wait)
        self.slots[s.id] = s
        self._by_lease[(source, h.lease)] = s.id
        self._by_id[h.request_id] = s.id
        if h.parts == 1:
            return [StartCompute(VerifyJob(s.id, h))]
        s.state = SlotState.RECEIVING
        return self._piece(s, h, now)

    def _refusal(self, h: KvHandoff) -> str:
        """Why this node will not take a new handoff ("" if it will)."""
        c = self.config
        if (h.router, h.request_id) in self._tombstones:
            return "the router cancelled this request"
        if h.request_id in self._by_id:  # from this router, or another's under its id
            return "this node already decodes that request"
        if not self._serves(h.router):
            return f"router {h.router} is not a router of this decode node"
        if len(self.slots) + len(self.held) >= c.max_sequences:
            return f"decode node full ({c.max_sequences} sequences)"
        if not 0 <= h.first_token < c.vocab or h.sampling.max_tokens < 1:
            return "first token or max_tokens out of range"
        if h.prompt_len < 1 or h.prompt_len + 1 + h.sampling.max_tokens > c.max_len:
            return f"prompt and max_tokens exceed the model's context of {c.max_len}"
        return ""

    def _shape_problem(self, h: KvHandoff) -> str:
        """Cheap checks of one message of a handoff, before anything is kept."""
        if not 0 <= h.part < h.parts <= MAX_PARTS:
            return f"part {h.part} of {h.parts} (at most {MAX_PARTS} parts)"
        if len(h.context) > h.prompt_len or any(not 0 <= t < self.config.vocab for t in h.context):
            return "the handoff's prompt tokens are longer than its prompt or out of range"
        if h.parts > 1:
            return self._part_problem(h)
        if h.pieces or h.layout:
            return "a handoff in one message carries whole tensors, not pieces"
        layers = self.config.dims[0] if self.config.dims else len(h.keys)
        if not h.keys or len(h.keys) != len(h.values) or len(h.keys) != layers:
            return f"{len(h.keys)} key and {len(h.values)} value layers (the model has {layers})"
        if self.config.dims:
            _, heads, kdim, vdim = self.config.dims
            for ts, dim in ((h.keys, kdim), (h.values, vdim)):
                want = (1, heads, h.prompt_len, dim)
                for t in ts:
                    if tuple(t.shape) != want:
                        return f"handoff tensor shape {list(t.shape)}, expected {list(want)}"
        return ""

    def _part_problem(self, h: KvHandoff) -> str:
        """A part's pieces: row ranges of tensors the layout names, as wide as their tensor."""
        if h.part and h.context:
            return "the prompt's tokens travel in a handoff's first part only"
        n = len(h.layout)
        if not n or n % 2 or (self.config.dims and n != 2 * self.config.dims[0]):
            return f"a handoff layout of {n} tensors"
        if self.config.dims:
            _, heads, kdim, vdim = self.config.dims
            for i, shape in enumerate(h.layout):
                want = (1, heads, h.prompt_len, vdim if i % 2 else kdim)
                if tuple(shape) != want:
                    return f"handoff tensor shape {list(shape)}, expected {list(want)}"
        if h.values or not h.keys or len(h.pieces) != len(h.keys):
            return "a handoff part must hold pieces, each naming its tensor"
        for i, t in zip(h.pieces, h.keys, strict=True):
            if not 0 <= i < n:
                return f"a piece of tensor {i}, which the layout does not have"
            width = h.layout[i][-1] if h.layout[i] else 1
            if len(t.shape) != 2 or t.shape[1] != width:
                return f"a piece of shape {list(t.shape)} for a tensor {width} wide"
        return ""

    def _piece(self, s: Slot, h: KvHandoff, now: float) -> list[Effect]:
        """One part of a handoff split into several messages (a repeat changes nothing)."""
        if s.state is not SlotState.RECEIVING:
            return []
        why = self._shape_problem(h)
        if not why and header(h) != header(s.handoff):
            why = "the parts of the handoff disagree"
        if not why and h.part in s.pieces:
            return []  # a repeat
        if not why:
            s.elements += sum(math.prod(t.shape) for t in h.keys)
            if s.elements > sum(math.prod(shape) for shape in h.layout):
                why = "the parts hold more than the handoff's tensors"
        if not why:
            s.pieces[h.part] = h
            s.deadline = now + self.config.verdict_wait  # progress: wait for what comes next
            self.counts["parts"] += 1
            if len(s.pieces) < h.parts:
                return []
            whole = join([s.pieces[i] for i in range(h.parts)])
            s.pieces.clear()
            if not isinstance(whole, str):
                s.handoff = whole
                s.state = SLOT_TABLE.next(s.state, SlotEvent.RECEIVED)
                return [StartCompute(VerifyJob(s.id, whole))]
            why = whole
        self.counts["corrupt"] += 1
        ack = HandoffAck(h.request_id, h.lease, False, why)
        warn = self._refused("handoff part", h.request_id, s.prefill, why)
        return [warn, Send(s.prefill, ack)] + self._end(s, SlotEvent.FAIL)

    def verified(
        self, slot_id: int, problem: str | None, now: float, cache: Any = None
    ) -> list[Effect]:
        """The compute side checked and loaded the handoff (``cache``); ``problem`` says why
        not."""
        s = self.slots.get(slot_id)
        if s is None:
            return []  # ended while it was checked: its loaded cache goes with this call
        h = s.handoff
        if problem is not None:
            self.counts["corrupt"] += 1
            ack = HandoffAck(h.request_id, h.lease, False, problem)
            warn = self._refused("handoff", h.request_id, s.prefill, problem)
            return [warn, Send(s.prefill, ack)] + self._end(s, SlotEvent.FAIL)
        s.state = SLOT_TABLE.next(s.state, SlotEvent.VERIFIED)
        s.deadline = now + self.config.verdict_wait
        # The loaded cache replaces the bytes: the slot keeps what it acts on.
        s.handoff, s.cache = dataclasses.replace(h, keys=(), values=()), cache
        return [Send(s.prefill, HandoffAck(h.request_id, h.lease, True))]

    def _verdict(self, v: HandoffVerdict, source: str) -> list[Effect]:
        sid = self._by_lease.get((source, v.lease))
        if sid is None:
            if not v.commit and self.held.pop((source, v.lease), None) is not None:
                return []  # the prefill node will not hand it off after all: slot freed
            if (source, v.lease) in self._ended:
                return []  # a handoff that ended here (refused, timed out): its late verdict
            self.counts["stray_verdicts"] += 1
            why = "no handoff of that lease from that node is here"
            return [self._refused("verdict", v.request_id, source, why)]
        s = self.slots[sid]
        if s.state is SlotState.DECODING:
            return []  # committed already: a repeat, or a late "no such lease" for a repeated ack
        if not v.commit:
            self.counts["aborted"] += 1
            return self._end(s, SlotEvent.ABORT)
        try:
            s.state = SLOT_TABLE.next(s.state, SlotEvent.COMMIT)
        except IllegalTransition as exc:  # a commit before our ack: not from an honest prefill
            return [self._refused("verdict", v.request_id, source, str(exc))]
        s.deadline = None
        self.counts["committed"] += 1
        self.reads.append((s.prefill, s.handoff.lease))
        cache, s.cache = s.cache, None  # the engine holds it from now on
        return [StartCompute(ResumeJob(s.id, s.handoff, cache))]

    def token(self, slot_id: int, r: RunResult | Error, now: float) -> list[Effect]:
        """What the decode engine produced for ``slot_id``."""
        s = self.slots.get(slot_id)
        if s is None or s.state is not SlotState.DECODING:
            return []
        h = s.handoff
        if isinstance(r, Error) and r.code == ErrorCode.PREFIX_NOT_CACHED and s.continued:
            self.counts["not_cached"] += 1  # evicted since the router's record: it reroutes
            err = Error(r.code, r.message, h.request_id, h.nonce)
            return [Send(s.router, err)] + self._end(s, SlotEvent.FAIL)
        if isinstance(r, Error):
            err = Error(r.code, f"decode failed: {r.message}", h.request_id, h.nonce)
            return [Send(s.router, err)] + self._end(s, SlotEvent.FAIL)
        t = TokenResult(
            h.request_id,
            s.index,
            r.token_ids,
            r.finish_reason,
            h.nonce,
            r.logprobs,
            r.top_ids,
            r.top_logprobs,
            cached_tokens=r.cached_tokens if s.index == 0 else 0,
            kept=r.kept,  # the engine kept the conversation as it ended (it says so)
        )
        s.index += 1
        out: list[Effect] = [Send(s.router, t)]
        if r.finish_reason is not None:
            self.counts["completed"] += 1
            out += self._end(s, SlotEvent.FINISH)
        return out

    def on_timer(self, now: float) -> list[Effect]:
        for key in [k for k, t in self._tombstones.items() if t <= now]:
            del self._tombstones[key]
        for key in [k for k, t in self.held.items() if t <= now]:
            del self.held[key]  # promised, and no handoff came: the slot is free again
        out: list[Effect] = []
        for s in [s for s in self.slots.values() if s.deadline and s.deadline <= now]:
            self.counts["verdict_timeouts"] += 1
            wait = f"{self.config.verdict_wait:g}s"
            if s.state is SlotState.RECEIVING:
                why = f"only {len(s.pieces)} of {s.handoff.parts} handoff parts came in {wait}"
            else:
                why = f"the prefill node never committed the handoff within {wait}"
            out += self._error(s, ErrorCode.HANDOFF_TIMEOUT, f"{why}; it was not read")
        return out

    def peer_lost(self, identity: str, now: float) -> list[Effect]:
        out: list[Effect] = []
        # A lost router changes nothing here: the next token dials it again, and a send that
        # fails ends the slot (undeliverable). Only the prefill node's loss matters before the
        # commit, since the verdict can no longer come.
        for key in [k for k in self.held if k[0] == identity]:
            del self.held[key]
        for s in list(self.slots.values()):
            if s.prefill == identity and s.state is not SlotState.DECODING:
                out += self._error(
                    s,
                    ErrorCode.HANDOFF_FAILED,
                    "the prefill node was lost before it committed the handoff; not read",
                )
        return out

    def undeliverable(self, send: Send, reason: str, now: float) -> list[Effect]:
        m = send.msg
        if isinstance(m, (TokenResult, Error)):
            sid = self._slot_of(m.request_id or "", send.dest)
            if sid is not None:  # the router is unreachable: stop generating for nobody
                return self._end(self.slots[sid], SlotEvent.FAIL)
        return []

    # --- endings ----------------------------------------------------------------------------
    def _error(self, s: Slot, code: str, why: str) -> list[Effect]:
        h = s.handoff
        return [Send(s.router, Error(code, why, h.request_id, h.nonce))] + self._end(
            s, SlotEvent.FAIL
        )

    def _end(self, s: Slot, event: SlotEvent) -> list[Effect]:
        s.state = SLOT_TABLE.next(s.state, event)
        s.cache = None
        self.slots.pop(s.id, None)
        self._by_id.pop(s.handoff.request_id, None)
        if not s.continued:  # a handoff's lease: a late part or verdict of it changes nothing
            self._by_lease.pop((s.prefill, s.handoff.lease), None)
            self._remember_end((s.prefill, s.handoff.lease))
        return [FreeCache(s.handoff.request_id)]

    def _slot_of(self, request_id: str, router: str) -> int | None:
        """The slot decoding ``request_id`` for ``router`` (None: none does)."""
        sid = self._by_id.get(request_id)
        return sid if sid is not None and self.slots[sid].router == router else None

    def _remember_end(self, key: tuple[str, int]) -> None:
        self._ended[key] = None
        if len(self._ended) > MAX_TOMBSTONES:
            self._ended.pop(next(iter(self._ended)))

    def _remember_cancel(self, key: tuple[str, str], now: float) -> None:
        if len(self._tombstones) >= MAX_TOMBSTONES:
            self._tombstones.pop(next(iter(self._tombstones)))
        self._tombstones[key] = now + TOMBSTONE_TTL
