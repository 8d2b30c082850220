"""The router's protocol core: node registry, balancing, failover, admission, result demux.

Pure: ``handle(msg, source, now)``, ``on_timer(now)``, ``probe_result(...)``, ``peer_lost``
and ``undeliverable`` return effects (see :mod:`mlxcel.base.effects`). The frontend's ``RunEntry``
and ``CancelRequest`` arrive with source ``local``; results arrive from the network with the
sender's handshake-bound identity, and count only when that identity is one of the configured
peers *and* the node this request was given to.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

from mlxcel.base.effects import Deliver, Effect, Send, Warn
from mlxcel.base.membership import MembershipLog
from mlxcel.base.messages import (
    LOCAL,
    CancelRequest,
    Error,
    ErrorCode,
    Message,
    PrefillRequest,
    Progress,
    QueryState,
    RunEntry,
    RunResult,
    State,
    TokenResult,
    prompt_problem,
)
from mlxcel.base.prefix_index import PrefixAffinity
from mlxcel.disagg.protocol import (
    CONTINUE_MAX,
    DROP_GRACE,
    HANDOFF_TIMEOUT,
    MAX_EARLY,
    MAX_RESTARTS,
    NODE_CAPACITY,
    PREFILL_TIMEOUT,
    ROUTE_TABLE,
    SEND_WAIT,
    RouteEvent,
    RouteState,
    min_cached,
)
from mlxcel.disagg.route import Route
from mlxcel.disagg.router_nodes import NodeTable, PeerNode, figures_of, node_stats

FIGURES_WAIT = 2.0  # a State query not sent by then is not worth sending
# Cache-aware routing: a prefix this long at least, on a node this many requests busier than
# the least busy one at most; the positions of prompts recorded per node.
MIN_AFFINITY = 16
AFFINITY_SLACK = 2
AFFINITY_POSITIONS = 1 << 22
# Errors from a node that say a handoff between the two nodes failed (the link, or one of them)
HANDOFF_CODES = frozenset(
    {ErrorCode.HANDOFF_TIMEOUT, ErrorCode.HANDOFF_FAILED, ErrorCode.NODE_UNREACHABLE}
)
# A decode node's answers to a continuation that mean "not here, not now" (it ran nothing)
CONTINUE_DECLINED = frozenset({ErrorCode.PREFIX_NOT_CACHED, ErrorCode.DECODE_REFUSED})


class RouterCore:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        *,
        first_nonce: int = 1,
        prefill_timeout: float = PREFILL_TIMEOUT,
        handoff_timeout: float = HANDOFF_TIMEOUT,
        capacity: int = NODE_CAPACITY,
        vocab: int = 1 << 30,
        max_len: int = 1 << 30,
        affinity_positions: int = AFFINITY_POSITIONS,
    ) -> None:
        self.vocab, self.max_len = vocab, max_len
        # Which prefill node holds which prompts (their own reports): a conversation's next
        # turn goes where its history is cached, when that node is not much busier.
        self.affinity = PrefixAffinity(affinity_positions)
        self.table = NodeTable(prefill, decode, capacity)
        self.nodes = self.table.by_address
        self._nonces = itertools.count(first_nonce)
        self.prefill_timeout = prefill_timeout
        self.handoff_timeout = handoff_timeout
        self.capacity = capacity
        self.routes: dict[str, Route] = {}  # by the frontend's request id
        self._wire: dict[str, str] = {}  # wire id -> the frontend's request id
        self.counts: Counter[str] = Counter()  # routed, completed, failed, rejected, ...
        self.membership = MembershipLog("router")

    # --- introspection ----------------------------------------------------------------------
    @property
    def active(self) -> int:
        return len(self.routes)

    @property
    def wire_ids(self) -> dict[str, str]:
        """Each request in flight by the id it travels under (wire id -> request id)."""
        return dict(self._wire)

    def online(self, role: str) -> list[str]:
        return [a for a in self.table.by_role[role] if self.nodes[a].online]

    def next_timer(self) -> float | None:
        times = [r.deadline for r in self.routes.values()]
        times += [r.quiet_by for r in self.routes.values() if r.quiet_by is not None]
        return min(times, default=None)

    # --- inputs -----------------------------------------------------------------------------
    def handle(self, msg: Message, source: str, now: float) -> list[Effect]:
        if source == LOCAL:
            if isinstance(msg, RunEntry):
                return self._admit(msg, now)
            if isinstance(msg, CancelRequest):
                return self._cancel(msg.request_id)
            return []
        if isinstance(msg, (TokenResult, Error)):
            return self._result(msg, source, now)
        if isinstance(msg, Progress) and source in self.nodes:
            moving = set(msg.nonces)  # a prefill node still writes these handoffs
            for r in self.routes.values():
                if r.prefill == source and r.state is RouteState.HANDOFF and r.nonce in moving:
                    r.deadline = max(r.deadline, now + self.handoff_timeout)
            return []
        if isinstance(msg, State) and source in self.nodes:
            self.nodes[source].figures = figures_of(msg)
            self.nodes[source].draining = msg.draining
            return []
        self.counts["unexpected"] += 1
        return [Warn("debug", f"router: ignoring {type(msg).__name__} from {source}")]

    def on_timer(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        for r in [r for r in self.routes.values() if r.quiet_by is not None and r.quiet_by <= now]:
            why = (
                f"decode node {self.nodes[r.decode].id} dropped its connection and sent no "
                f"token in the {DROP_GRACE:g}s since (tokens may have been lost with it)"
            )
            out += self._fail(r, ErrorCode.NODE_UNREACHABLE, why, cancel=(r.prefill, r.decode))
        for r in [r for r in self.routes.values() if r.deadline <= now]:
            p, d = self.nodes[r.prefill].id, self.nodes[r.decode].id
            why = r.missed(p, d, self.prefill_timeout, self.handoff_timeout)
            if r.state is RouteState.HANDOFF:
                out += self._handoff_failed(r, why, now)
            out += self._fail(r, ErrorCode.HANDOFF_TIMEOUT, why, cancel=(r.prefill, r.decode))
        return out

    def ask_figures(self, address: str, now: float) -> list[Effect]:
        """After a probe answered: ask the node for its State (KV cache, handoffs), which
        /router/stats, /cluster and the metrics show. Best effort, like the probe itself."""
        if address not in self.nodes or not self.nodes[address].online:
            return []
        return [Send(address, QueryState(0), deadline=now + FIGURES_WAIT)]

    def probe_result(
        self, address: str, ok: bool, reason: str, now: float, lost: bool = False
    ) -> list[Effect]:
        """The liveness probe's verdict on one node (a round trip on its connection, or a
        fresh connect and handshake). A failed probe right after a lost connection, or one
        whose open connection went silent (``lost``), means the node is gone: its requests
        end or start over at once. Any other failed probe only marks it down."""
        node = self.nodes.get(address)
        if node is None:
            return []
        suspect, node.suspect = node.suspect, False
        if ok:
            node.seen_at = now
            out: list[Effect] = []
            was_down = not node.online
            if was_down:
                node.online, node.draining = True, False  # back: its next State says more
                if node.down_since is None:
                    out += self.membership.joined(node.id, "", now)
                else:
                    out += self.membership.back(node.id, node.last_error, now)
                node.last_error, node.down_since = "", None
            if suspect and was_down:
                # It answers again, but it was down and a connection with it dropped: what
                # was sent on that one may be gone. A request with no token out yet starts
                # over (cancelled there first, so nothing runs twice under one wire id). (A
                # connection dropped while the node stayed up -- anyone on its IP holding the
                # secret can do that -- restarts nothing.)
                for r in [r for r in self.routes.values() if r.state is RouteState.PREFILLING]:
                    if address in (r.prefill, r.decode) and r.restarts < MAX_RESTARTS:
                        out += self._restart(r, node, now, avoid=False)
            return out
        out = self._mark_down(node, reason, now)
        return out + self._requests_lost_with(node, now) if suspect or lost else out

    def peer_lost(self, identity: str, now: float) -> list[Effect]:
        """A connection with ``identity`` dropped. Anyone on that IP holding the secret can
        open and drop a connection under a node's address, so this alone fails nothing at
        once: the adapter probes the node now, and :meth:`probe_result` decides. But tokens
        it sent on that connection may be lost (a short partition), so a stream it decodes
        must go on within DROP_GRACE, or end with a clear error instead of a 30 s wait."""
        node = self.nodes.get(identity)
        if node is not None:
            node.suspect = True
            for r in self.routes.values():  # streams on it must go on soon (see Route)
                streaming = r.state is RouteState.DECODING or (
                    r.continued and r.state is RouteState.HANDOFF  # its token 0 came from there
                )
                if r.decode == identity and streaming and r.quiet_by is None:
                    r.quiet_by = now + DROP_GRACE
        return []

    def _requests_lost_with(self, node: PeerNode, now: float) -> list[Effect]:
        """The requests ``node`` was serving, now that it is gone. One whose client has seen
        no token yet starts over on other nodes (invisible to the client); one already
        streaming ends with an error (its tokens cannot be taken back)."""
        identity = node.address
        out: list[Effect] = []
        for r in list(self.routes.values()):
            # A lost prefill matters until its first token is in (the decode node may already
            # hold the committed cache after that); a lost decode node matters throughout.
            lost_prefill = r.prefill == identity and r.state is RouteState.PREFILLING
            if not (lost_prefill or r.decode == identity):
                continue
            if r.state is RouteState.PREFILLING and r.restarts < MAX_RESTARTS:
                out += self._restart(r, node, now)
                continue
            other = r.decode if lost_prefill else r.prefill
            out += self._fail(
                r,
                ErrorCode.NODE_UNREACHABLE,
                f"{node.role} node {node.id} was lost while serving this request",
                cancel=(other,),
            )
        return out

    def _restart(
        self,
        r: Route,
        lost: PeerNode,
        now: float,
        avoid: bool = True,
        why: str = "",
        counted: bool = True,
    ) -> list[Effect]:
        """Start ``r`` again under a new wire id, on nodes other than ``lost`` (``avoid``) or
        on any; what the old nodes hold of it is cancelled (their late results no longer
        match anything). ``counted``: it uses up one of MAX_RESTARTS (a turn its decode node
        no longer keeps starts over the usual way without)."""
        skip = {lost.address} if avoid else set()
        why = why or ("was lost" if avoid else "dropped its connection")
        p, expected = self._prefill_for(r.entry, now, skip)
        d = self.table.pick("decode", now, exclude=skip)
        if p is None or d is None:
            role = "prefill" if p is None else "decode"
            return self._fail(
                r,
                ErrorCode.NO_NODE_AVAILABLE,
                f"{lost.role} node {lost.id} {why} before this request's first token and "
                f"no other {role} node can take it",
                cancel=tuple(a for a in (r.prefill, r.decode) if a != lost.address),
            )
        out = self._cancels(r, (r.prefill, r.decode), f"{lost.id} {why}; restarted")
        self._end(r)  # frees the old nodes' counts and the old wire id
        nonce = next(self._nonces)
        r.nonce, r.wire = nonce, f"{r.request_id}@{nonce:x}"
        r.prefill, r.decode, r.prefill_busy = p, d, True
        r.deadline = now + self.prefill_timeout
        r.early.clear()
        r.tried = {p}
        r.restarts += int(counted)
        r.expected = expected
        self.routes[r.request_id] = r
        self._wire[r.wire] = r.request_id
        self.nodes[d].active += 1
        self.nodes[d].dispatched += 1
        self.counts["restarted"] += 1
        out.append(
            Warn(
                "info",
                f"router: request {r.request_id} restarted on {self.nodes[p].id} and "
                f"{self.nodes[d].id}: {lost.id} {why} before its first token",
            )
        )
        return out + self._dispatch(r, now)

    def undeliverable(
        self, send: Send, reason: str, now: float, unsent: bool = False
    ) -> list[Effect]:
        """``unsent``: the message certainly never left (the connection could not be made);
        otherwise the node may have it, and nothing is sent again."""
        if isinstance(send.msg, QueryState):
            return []  # only figures: the probe, not this, judges the node
        node = self.nodes.get(send.dest)
        out = self._mark_down(node, reason, now) if node is not None else []
        msg = send.msg
        if not isinstance(msg, PrefillRequest):
            return out  # a cancel that could not be sent: the node is gone anyway
        r = self.routes.get(self._wire.get(msg.request_id, ""))
        if r is None or r.nonce != msg.nonce or r.prefill != send.dest or r.next_index:
            return out
        if not unsent:
            return out + self._fail(
                r,
                ErrorCode.NODE_UNREACHABLE,
                f"sending the prompt to {self.nodes[send.dest].id} failed: {reason}",
                cancel=(r.decode,),
            )
        # The request never reached that prefill node: another one may take it (a failover of
        # an unsent request, never a recomputation).
        return out + self._failover(r, reason, now)

    def _failover(self, r: Route, reason: str, now: float) -> list[Effect]:
        """``r``'s prefill node did not run it (never reached, or refused it unrun)."""
        if r.continued:  # the decode node meant to run it all: the turn starts over elsewhere
            return self._restart(r, self.nodes[r.decode], now, why=f"did not take it ({reason})")
        r.tried.add(r.prefill)
        nxt = self.table.pick("prefill", now, exclude=r.tried)
        if nxt is None:
            return self._fail(
                r,
                ErrorCode.NODE_UNREACHABLE,
                f"no prefill node reachable (last: {self.nodes[r.prefill].id}: {reason})",
                cancel=(r.decode,),
            )
        self.nodes[r.prefill].active -= 1
        r.prefill = nxt
        self.counts["failovers"] += 1
        return self._dispatch(r, now)

    # --- admission and dispatch -----------------------------------------------------------
    def _admit(self, e: RunEntry, now: float) -> list[Effect]:
        problem = ""
        if e.request_id in self.routes:
            problem = "duplicate request id"
        else:
            max_tokens = e.sampling.max_tokens
            problem = prompt_problem(e.token_ids, max_tokens, self.vocab, self.max_len) or ""
        if problem:  # refused here, as a single node would: no node sees it
            return [Deliver(Error(ErrorCode.BAD_REQUEST, problem, e.request_id, e.nonce))]
        expected = self._continuation(e, now)
        if expected is not None:  # its decode node prefills the new part itself
            p = d = expected[0]
        else:
            p, expected = self._prefill_for(e, now)
            d = self.table.pick("decode", now)
        if p is None or d is None:
            self.counts["rejected"] += 1
            role = "prefill" if p is None else "decode"
            state = ", ".join(
                f"{self.nodes[a].id}: {self.nodes[a].why_not()}" for a in self.table.by_role[role]
            )
            why = f"no {role} node can take the request ({state})"
            return [Deliver(Error(ErrorCode.NO_NODE_AVAILABLE, why, e.request_id, e.nonce))]
        nonce = next(self._nonces)
        r = Route(
            e.request_id, f"{e.request_id}@{nonce:x}", e, nonce, p, d, now + self.prefill_timeout
        )
        r.tried.add(p)
        r.expected = expected
        self.routes[r.request_id] = r
        self._wire[r.wire] = r.request_id
        self.nodes[d].active += 1
        self.nodes[d].dispatched += 1
        self.counts["routed"] += 1
        return self._dispatch(r, now)

    def _prefill_for(
        self, e: RunEntry, now: float, exclude: set[str] | None = None
    ) -> tuple[str | None, tuple[str, int, int] | None]:
        """The prefill node for ``e``: the one whose prompt cache holds the longest prefix of
        it (in its tenant's namespace) while that node is at most AFFINITY_SLACK requests
        busier than the least busy one; otherwise the next by load (SGLang's cache-aware
        policy, with the nodes' own reports in place of its approximate tree)."""
        skip = exclude or set()
        ready = [
            a
            for a in self.table.by_role["prefill"]
            if self.table.can_take(a, now) and a not in skip
        ]
        hit = self.affinity.best(ready, e.cache_ns, e.token_ids, now)
        if hit is not None and hit[2] >= MIN_AFFINITY:
            node, record, n = hit
            least = min(self.nodes[a].active for a in ready)
            if self.nodes[node].active <= least + AFFINITY_SLACK:
                self.counts["cache_routed"] += 1
                return node, (node, record, n)
        return self.table.pick("prefill", now, exclude=skip), None

    def _continuation(self, e: RunEntry, now: float) -> tuple[str, int, int] | None:
        """The decode node that keeps the longest prefix of ``e`` (a conversation it decoded
        before, in its tenant's namespace), if at most CONTINUE_MAX of ``e``'s tokens are new
        there and that node is at most AFFINITY_SLACK requests busier than the least busy
        one: (node, its record, positions). The next turn then needs no prefill node and no
        handoff."""
        ready = [a for a in self.table.by_role["decode"] if self.table.can_take(a, now)]
        hit = self.affinity.best(ready, e.cache_ns, e.token_ids, now)
        if hit is None or hit[2] < MIN_AFFINITY or len(e.token_ids) - hit[2] > CONTINUE_MAX:
            return None
        least = min(self.nodes[a].active for a in ready)
        if self.nodes[hit[0]].active > least + AFFINITY_SLACK:
            return None
        self.counts["continued"] += 1
        return hit

    def _dispatch(self, r: Route, now: float) -> list[Effect]:
        node = self.nodes[r.prefill]
        node.active += 1  # (a continuation's node counts twice until its token 0)
        node.dispatched += int(not r.continued)  # counted once, as its decode node
        # A continuation goes to the decode node that keeps the conversation: no decode target,
        # and the prompt tokens its cache must supply.
        target, need = r.decode, 0
        if r.continued:
            assert r.expected is not None
            target, need = "", min_cached(r.expected[2], len(r.entry.token_ids))
        e = r.entry
        req = PrefillRequest(r.wire, e.token_ids, e.sampling, target, r.nonce, e.cache_ns, need)
        return [Send(r.prefill, req, deadline=min(r.deadline, now + SEND_WAIT))]

    def _cancel(self, request_id: str) -> list[Effect]:
        r = self.routes.get(request_id)
        if r is None:
            return []
        self.counts["cancelled"] += 1
        return self._end(r) + self._cancels(r, (r.prefill, r.decode), "cancelled")

    # --- results ----------------------------------------------------------------------------
    def _result(self, msg: TokenResult | Error, source: str, now: float) -> list[Effect]:
        if source not in self.nodes:
            self.counts["router_drop"] += 1
            return [
                Warn(
                    "router-drop",
                    f"router: dropping result frame from {source}: not a configured "
                    "--prefill-peers or --decode-peers address",
                )
            ]
        r = self.routes.get(self._wire.get(msg.request_id or "", ""))
        if r is None or msg.nonce != r.nonce or source not in (r.prefill, r.decode):
            # A finished request, or a node it was not given to: if that node is still
            # generating for it (its cancel was lost), tell it again.
            self.counts["stale"] += 1
            if isinstance(msg, TokenResult) and msg.finish_reason is None:
                return [Send(source, CancelRequest(msg.request_id or "", "no such request"))]
            return []
        if isinstance(msg, Error):
            node = self.nodes[source]
            if msg.code == ErrorCode.DRAINING and source == r.prefill and not r.next_index:
                node.draining = True  # shutting down, and it ran nothing: another one may
                return self._failover(r, msg.message, now)
            if r.continued and not r.next_index and msg.code in CONTINUE_DECLINED:
                # The decode node evicted the conversation since its record, or will not run
                # the turn now (full, draining, restarted without a cache): never an error,
                # never a failed handoff; the record goes and the turn goes the usual way (a
                # prefill node, a handoff), which never comes back here.
                assert r.expected is not None
                self.affinity.served(r.decode, r.expected[1], r.expected[2], 0)
                self.counts["continue_missed"] += 1
                why = (
                    "no longer keeps the conversation"
                    if msg.code == ErrorCode.PREFIX_NOT_CACHED
                    else f"declined the turn ({msg.message[:200]})"
                )
                return self._restart(r, node, now, avoid=False, why=why, counted=False)
            refused = msg.code == ErrorCode.DECODE_REFUSED and source == r.prefill
            if refused and not r.next_index and r.restarts < MAX_RESTARTS:
                # The decode node will not take it (full, draining), and the client has seen
                # nothing: the request starts over on another decode node.
                line = self.nodes[r.decode].handoff_failed(msg.message, now)  # not the prefill's
                lines: list[Effect] = [Warn("warning", line)] if line else []
                why = f"refused the handoff ({msg.message[:200]})"
                return lines + self._restart(r, self.nodes[r.decode], now, why=why)
            other = r.decode if source == r.prefill else r.prefill
            out = self._handoff_failed(r, msg.message, now) if msg.code in HANDOFF_CODES else []
            return out + self._fail(r, msg.code, f"{node.id}: {msg.message}", cancel=(other,))
        expected = r.prefill if msg.index == 0 else r.decode
        if source != expected or msg.index < r.next_index:
            self.counts["stale"] += 1
            return []
        if msg.index > r.next_index:  # overtook an earlier token on another connection
            if len(r.early) >= MAX_EARLY:
                return self._fail(
                    r, ErrorCode.HANDOFF_FAILED, "tokens arrived too far out of order", (source,)
                )
            r.early[msg.index] = msg
            return []
        out: list[Effect] = []
        nxt: TokenResult | None = msg
        while nxt is not None and r.request_id in self.routes:
            out += self._deliver(r, nxt, now)
            nxt = r.early.pop(r.next_index, None)
        return out

    def _deliver(self, r: Route, t: TokenResult, now: float) -> list[Effect]:
        event = RouteEvent.FIRST_TOKEN if t.index == 0 else RouteEvent.DECODE_TOKEN
        if t.finish_reason is not None:
            event = RouteEvent.FINISH
        r.state = ROUTE_TABLE.next(r.state, event)
        r.next_index += 1
        r.quiet_by = None  # it goes on
        if t.index == 0 and r.prefill_busy:  # the prefill node's part is done
            r.prefill_busy = False
            self.nodes[r.prefill].active -= 1
        if t.index == 0:  # what the node that ran the prompt says of its prompt cache
            if r.expected is not None and r.expected[0] == r.prefill:  # not failed over
                self.affinity.served(r.prefill, r.expected[1], r.expected[2], t.cached_tokens)
        from_decode = t.index > 0 or r.continued
        if t.kept and not from_decode:  # a prefill node keeps the prompt
            self.affinity.held(r.prefill, r.entry.cache_ns, r.entry.token_ids, now)
        r.generated.extend(t.token_ids)
        if t.kept and from_decode and t.finish_reason is not None:
            # The decode node keeps the conversation: the prompt and what it generated (the
            # last token may not have run through the model yet: the record claims it not).
            kept = (*r.entry.token_ids, *r.generated[:-1])
            self.affinity.held(r.decode, r.entry.cache_ns, kept, now)
        r.deadline = now + self.handoff_timeout
        out: list[Effect] = [
            Deliver(
                RunResult(
                    r.request_id,
                    0,
                    t.token_ids,
                    t.finish_reason,
                    r.entry.nonce,
                    t.logprobs,
                    top_ids=t.top_ids,
                    top_logprobs=t.top_logprobs,
                    cached_tokens=t.cached_tokens if t.index == 0 else 0,
                )
            )
        ]
        if r.state is RouteState.DONE:
            self.counts["completed"] += 1
            for a in dict.fromkeys((r.prefill, r.decode)):  # one node, for a continuation
                self.nodes[a].completed += 1
                if not r.continued:
                    self.nodes[a].handoff_done()
            out += self._end(r)
        return out

    # --- endings ----------------------------------------------------------------------------
    def _handoff_failed(self, r: Route, why: str, now: float) -> list[Effect]:
        """A handoff between ``r``'s nodes failed: a node whose handoffs keep failing (a slow
        or broken link, a full or faulty decode node) is routed around for a while."""
        lines = (
            self.nodes[a].handoff_failed(why, now) for a in dict.fromkeys((r.prefill, r.decode))
        )
        return [Warn("warning", line) for line in lines if line]

    def _fail(self, r: Route, code: str, why: str, cancel: tuple[str, ...] = ()) -> list[Effect]:
        r.state = ROUTE_TABLE.next(r.state, RouteEvent.FAIL)
        self.counts["failed"] += 1
        for a in dict.fromkeys((r.prefill, r.decode)):
            self.nodes[a].failed += 1
        # The client learns which node (by id), never its address: what /router/stats hides
        # must not leak through an error message. The log keeps the addresses.
        out: list[Effect] = [
            Deliver(Error(code, self.redact(why), r.request_id, r.entry.nonce)),
            Warn("warning", f"router: request {r.request_id} failed: {why}"),
        ]
        return out + self._end(r) + self._cancels(r, cancel, why)

    def redact(self, text: str) -> str:
        return self.table.redact(text)

    def _end(self, r: Route) -> list[Effect]:
        self.routes.pop(r.request_id, None)
        self._wire.pop(r.wire, None)
        if r.prefill_busy:
            self.nodes[r.prefill].active -= 1
        self.nodes[r.decode].active -= 1
        return []

    def _cancels(self, r: Route, dests: tuple[str, ...], why: str) -> list[Effect]:
        # Frees the cache on every node the request touched; best effort (a lost node has
        # nothing left to free), and sent even to a node marked down: it may only have
        # missed a probe.
        return [Send(d, CancelRequest(r.wire, why[:200])) for d in dict.fromkeys(dests)]

    def _mark_down(self, node: PeerNode, reason: str, now: float) -> list[Effect]:
        node.last_error = reason[:300] or "unreachable (no reason given)"
        if not node.online:
            return []
        node.online, node.down_since = False, now
        node.figures = {}  # a lost node's last figures are not its figures
        self.affinity.forget(node.address)  # nor its prompt cache, once it is back
        return list(self.membership.lost(node.id, node.last_error, now))

    def stats(self) -> dict[str, Any]:
        return node_stats(self.nodes.values(), self.active, self.counts)
