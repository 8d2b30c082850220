"""The stage's gate: who a message is from, and how a refusal is answered.

:class:`StageGate` is the part of :class:`~mlxcel.pipeline.stage_core.StageCore` that applies
``MAY_SEND`` (commands only from the coordinator, activations only from upstream) and the
owner check (the identity that prepared a request id owns it), bounds
tensors before anything is built from them, and turns refusals into ``Error`` replies to the
right identity -- counted by code, warned about at a limited rate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxcel.base.effects import Effect, Send, Warn
from mlxcel.base.errors import ProtocolError
from mlxcel.base.messages import (
    MAX_STEP_ROWS,
    Activation,
    Error,
    ErrorCode,
    Message,
    StepActivation,
    StepEntry,
    Tensor,
    Undecodable,
)
from mlxcel.pipeline.stage_protocol import (
    FLOAT_DTYPES,
    MAX_ACTIVATION_TOKENS,
    MAY_SEND,
    REFUSAL,
    Sender,
    Seq,
    StageConfig,
    StageStats,
    Step,
)


class StageGate:
    config: StageConfig
    width: int
    seqs: dict[str, Seq]
    stats: StageStats
    handle_many: Callable[[tuple[Message, ...], str, float], list[Effect]]  # the core's

    @property
    def _me(self) -> str:
        return f"stage {self.config.index}"

    def is_coordinator(self, source: str) -> bool:
        want = self.config.coordinator
        if source == want:
            return True
        host, _, port = want.rpartition(":")
        if host.strip("[]") not in ("0.0.0.0", "::"):
            return False
        return source.rpartition(":")[2] == port

    def handle_bundle(self, msgs: tuple[Message, ...], source: str, now: float) -> list[Effect]:
        """A Bundle's items, each authorised and handled as if alone; the next job is chosen
        after the last, so a micro-batch that arrived together runs together. Only a peer
        may bundle (a stranger's Bundle gets one refusal, not one per item), and an item of a
        kind a stage never takes is dropped unanswered: an Error answering an Error would let
        one Bundle start an endless exchange of refusals between two stages."""
        if len(msgs) > 1 and not self.is_peer(source):
            out: list[Effect] = []
            self._refuse(out, msgs[0], source, ErrorCode.BAD_MESSAGE, "a Bundle from a stranger")
            return out
        taken = tuple(m for m in msgs if type(m) in MAY_SEND or isinstance(m, Undecodable))
        self.stats.dropped += len(msgs) - len(taken)
        return self.handle_many(taken, source, now)

    def is_peer(self, dest: str) -> bool:
        return dest in (self.config.upstream, self.config.downstream) or self.is_coordinator(dest)

    def _sender_ok(self, msg: Message, source: str) -> bool:
        role = MAY_SEND[type(msg)]
        if role is Sender.COORDINATOR:
            return self.is_coordinator(source)
        return source == self.config.upstream

    def _check_hidden(self, t: Tensor, rows: int | None = None) -> str | None:
        """Why ``t`` cannot be an activation's hidden states: ``[1, n, width]``, or with
        ``rows`` (a StepActivation's) ``[rows, 1, width]``."""
        if t.dtype not in FLOAT_DTYPES:
            return f"hidden states must be float, got {t.dtype}"
        if rows is not None and (len(t.shape) != 3 or t.shape[:2] != (rows, 1)):
            return f"hidden states must be [{rows}, 1, width] for {rows} rows, got {list(t.shape)}"
        if len(t.shape) != 3 or (rows is None and t.shape[0] != 1):
            return f"hidden states must be [1, n, width], got {list(t.shape)}"
        if not 1 <= t.shape[1] <= MAX_ACTIVATION_TOKENS:
            return f"hidden states claim {t.shape[1]} tokens (1..{MAX_ACTIVATION_TOKENS})"
        if t.shape[2] != self.width:
            return f"hidden width {t.shape[2]} differs from the model's {self.width}"
        return None

    def _send(self, out: list[Effect], dest: str, msg: Message) -> None:
        out.append(Send(dest, msg, self.is_peer(dest)))

    def owns(self, seq: Seq, source: str) -> bool:
        """Whether ``source`` owns ``seq``: the identity that prepared a request id here."""
        return seq.owner == source

    def _owned(self, msg: Any, source: str) -> Seq | None:
        """The sequence named by ``msg`` if ``source`` owns it; raises for another owner (the
        identity that prepared a request id owns it here)."""
        return self._owned_id(msg.request_id, source)

    def _owned_id(self, rid: str, source: str) -> Seq | None:
        seq = self.seqs.get(rid)
        if seq is not None and not self.owns(seq, source):
            raise ProtocolError(
                ErrorCode.NOT_OWNER, f"request {seq.key[0]!r} is owned by another identity"
            )
        return seq

    def _joinable(self, rid: str, owner: str, out: list[Effect]) -> Seq | None:
        """The sequence an activation's row runs on, if it is here and ``owner``'s."""
        seq = self.seqs.get(rid)
        if seq is None:
            self.stats.dropped += 1
            self._warn(out, f"activation for unprepared request {rid[:64]!r}; dropped")
            return None
        if not self.owns(seq, owner):
            # The entry stage ran this for another identity than the one that prepared it
            # here: joining the two would feed one owner's tokens into the other's cache.
            self._count_refusal(ErrorCode.NOT_OWNER)
            self._warn(out, f"activation for {rid[:64]!r} of another owner; dropped")
            return None
        return seq

    def _fail_to_owner(self, out: list[Effect], seq: Seq, step: Step, code: str, why: str) -> None:
        """A step of ``seq`` failed here: its owner hears why, with the step's nonce."""
        self.stats.errors += 1
        self._send(out, seq.owner, Error(code, f"{self._me}: {why}", step.request_id, step.nonce))

    def _say(self, out: list[Effect], text: str) -> None:
        """A one-off warning line (not rate limited): what a command changed, and who sent it."""
        out.append(Warn("warning", f"{self._me}: {text}"))

    def _warn(self, out: list[Effect], text: str) -> None:
        out.append(Warn("stage-drop", f"{self._me}: {text}"))

    def _count_refusal(self, code: str) -> None:
        self.stats.refused += 1
        self.stats.by_code[code] = self.stats.by_code.get(code, 0) + 1

    def _refuse(self, out: list[Effect], msg: Message, source: str, code: str, why: str) -> None:
        if isinstance(msg, StepEntry) and self.is_coordinator(source):
            # Refused whole: every row's exchange hears it (each distinct row once, at most
            # MAX_STEP_ROWS), so none waits out its deadline.
            rows = zip(msg.request_ids[:MAX_STEP_ROWS], msg.nonces[:MAX_STEP_ROWS], strict=False)
            self._count_refusal(code)
            self._warn(out, f"refusing StepEntry from {source}: {why}")
            for rid, nonce in dict.fromkeys(rows) or {(None, None): None}:
                self._send(out, source, Error(code, why, rid, nonce))
            return
        rid = getattr(msg, "request_id", None)
        self._refuse_row(out, msg, source, code, why, rid, getattr(msg, "nonce", None))

    def _refuse_row(
        self,
        out: list[Effect],
        msg: Message,
        source: str,
        code: str,
        why: str,
        rid: str | None,
        nonce: int | None,
    ) -> None:
        """Refuse ``msg`` (or one row of it: ``rid`` and ``nonce``) to ``source``."""
        self._count_refusal(code)
        self._warn(out, f"refusing {type(msg).__name__} from {source}: {why}")
        self._send(out, source, Error(code, why, rid, nonce))

    def _refused_sender(self, out: list[Effect], msg: Message, source: str) -> None:
        code = REFUSAL[MAY_SEND[type(msg)]]
        if not isinstance(msg, Activation | StepActivation):
            self._refuse(
                out,
                msg,
                source,
                code,
                f"{type(msg).__name__} is accepted only from the {MAY_SEND[type(msg)].value}",
            )
            return
        # Only the upstream stage feeds this one. Tell the owner if there is one to tell,
        # without the sender's nonce: a stranger must not fail a live exchange by guessing it.
        self._count_refusal(code)
        self._warn(out, f"activation from {source} is not from the upstream stage")
        ids = (msg.request_id,) if isinstance(msg, Activation) else msg.request_ids
        for rid in dict.fromkeys(ids[:MAX_STEP_ROWS]):  # each named sequence's owner once
            if (seq := self.seqs.get(rid)) is not None:
                self._send(out, seq.owner, Error(code, f"activation from {source} refused", rid))

    def _on_undecodable(self, m: Undecodable, source: str, out: list[Effect]) -> None:
        """A message that failed to decode: answer its exchange (each of a batched message's
        rows) now instead of at its deadline."""
        why = f"{self._me}: undecodable message (kind {m.kind}): {m.reason}"
        self.stats.errors += 1
        rows = m.rows or ((m.request_id, m.nonce),)
        told = False
        for rid, nonce in rows:
            seq = self.seqs.get(rid) if rid is not None else None
            err = Error(ErrorCode.BAD_MESSAGE, why, rid, nonce)
            if source == self.config.upstream and seq is not None:
                self._send(out, seq.owner, err)  # a bad activation: its owner's exchange fails
                told = True
            elif self.is_coordinator(source):
                self._send(out, source, err)
                told = True
        if not told:
            self._warn(out, f"undecodable message from {source}: {m.reason}")
