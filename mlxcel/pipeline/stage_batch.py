"""How steps leave a stage: a finished job's outputs as the messages that pass them on.

A step that came alone (a ``RunEntry`` or an ``Activation``: prompt chunks, and any peer that
speaks only the per-sequence forms) leaves alone, as an ``Activation`` or a ``RunResult``. The
rows of a ``StepEntry`` or ``StepActivation`` leave together: one ``StepActivation`` (their
hidden states as one tensor) or one ``StepResult`` per owner and micro-batch, so a decode step
of N sequences is one message per hop, not N. A row that failed is answered on its own (an
``Error`` to its owner, by the core); the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxcel.base.messages import (
    MAX_STEP_ROWS,
    Activation,
    Message,
    RunResult,
    StepActivation,
    StepEntry,
    StepResult,
    Tensor,
    join_rows,
    take_rows,
)
from mlxcel.pipeline.stage_protocol import Row, Sampled, Step, StepOutput


def rows_problem(m: StepEntry | StepActivation) -> str | None:
    """Why a batched message is malformed as a whole (refused before any row is read)."""
    n = len(m.request_ids)
    if not 1 <= n <= MAX_STEP_ROWS:
        return f"{type(m).__name__} with {n} rows (1..{MAX_STEP_ROWS})"
    columns = (m.start_pos, m.nonces) + ((m.token_ids,) if isinstance(m, StepEntry) else ())
    if any(len(c) != n for c in columns):
        return f"{type(m).__name__} columns of different lengths for {n} rows"
    if len(set(m.request_ids)) != n:
        return f"{type(m).__name__} names a request id twice"
    return None


def hidden_of(result: Tensor | Row) -> Tensor:
    """One step's hidden states as a tensor of its own."""
    return take_rows(result.tensor, [result.index]) if isinstance(result, Row) else result


@dataclass
class _Rows:
    """The rows of one batched message being gathered: steps and their outputs, in order."""

    steps: list[Step] = field(default_factory=list)
    outputs: list[Tensor | Row | Sampled] = field(default_factory=list)
    spent: int = 0


class Passing:
    """A finished job's outputs, gathered into the messages that carry them on: per-sequence
    messages for steps that came alone, one batched message per (owner, micro-batch) for
    rows. ``messages()`` returns (destination, message) pairs in the order of the job."""

    def __init__(self, downstream: str | None, is_last: bool) -> None:
        self.downstream = downstream
        self.is_last = is_last
        self._out: list[tuple[str, Message] | _Rows] = []
        self._groups: dict[tuple[str, int], _Rows] = {}

    def add(self, step: Step, result: StepOutput, spent: int) -> None:
        """``step`` ran to ``result`` (not a failure), with ``spent`` µs of compute in all."""
        if step.batched and (
            isinstance(result, Sampled) or (not self.is_last and isinstance(result, Tensor | Row))
        ):
            key = (step.owner, step.micro_batch)
            rows = self._groups.get(key)
            if rows is None:
                rows = self._groups[key] = _Rows()
                self._out.append(rows)
            rows.steps.append(step)
            rows.outputs.append(result)
            rows.spent = max(rows.spent, spent)  # the rows ran together: one step's compute
            return
        self._out.append(self._alone(step, result, spent))

    def messages(self) -> list[tuple[str, Message]]:
        return [self._batched(x) if isinstance(x, _Rows) else x for x in self._out]

    def _alone(self, step: Step, result: StepOutput, spent: int) -> tuple[str, Message]:
        rid = step.request_id
        if not self.is_last:
            assert self.downstream is not None and isinstance(result, Tensor | Row)
            hidden = hidden_of(result)
            act = Activation(
                rid,
                step.micro_batch,
                hidden,
                step.start_pos,
                step.sampling,
                step.nonce,
                step.sample,
                spent,
                step.owner,
            )
            return self.downstream, act
        tokens: tuple[int, ...] = ()
        logprobs = logits = None
        if not step.sample:
            pass  # a cache-filling prompt chunk: progress, no token
        elif isinstance(result, Tensor):
            logits = result
        elif isinstance(result, Sampled):
            tokens = (result.token,)
            logprobs = (result.logprob,) if step.sampling.logprobs else None
        top = result.top if isinstance(result, Sampled) and result.top else (None, None)
        res = RunResult(
            rid, step.micro_batch, tokens, None, step.nonce, logprobs, logits, spent, *top
        )
        return step.owner, res

    def _batched(self, rows: _Rows) -> tuple[str, Message]:
        steps, first = rows.steps, rows.steps[0]
        ids = tuple(s.request_id for s in steps)
        nonces = tuple(s.nonce for s in steps)
        if not self.is_last:
            assert self.downstream is not None
            act = StepActivation(
                first.micro_batch,
                ids,
                tuple(s.start_pos for s in steps),
                nonces,
                _hidden([r for r in rows.outputs if isinstance(r, Tensor | Row)]),
                rows.spent,
                first.owner,
            )
            return self.downstream, act
        picked = [r for r in rows.outputs if isinstance(r, Sampled)]
        tops = [r.top or ((), ()) for r in picked]
        any_top = any(r.top for r in picked)
        res = StepResult(
            first.micro_batch,
            ids,
            nonces,
            tuple(r.token for r in picked),
            tuple(r.logprob for r in picked),
            rows.spent,
            tuple(t[0] for t in tops) if any_top else (),
            tuple(t[1] for t in tops) if any_top else (),
        )
        return first.owner, res


def _hidden(outputs: list[Tensor | Row]) -> Tensor:
    """The rows' hidden states as one tensor, in row order: a run of rows of one job tensor is
    taken from it at once (usually the whole of it, as it is)."""
    parts: list[Tensor] = []
    i = 0
    while i < len(outputs):
        o = outputs[i]
        if not isinstance(o, Row):
            parts.append(o)
            i += 1
            continue
        idx = [o.index]
        while (
            i + len(idx) < len(outputs)
            and isinstance(nxt := outputs[i + len(idx)], Row)
            and nxt.tensor is o.tensor
        ):
            idx.append(nxt.index)
        parts.append(take_rows(o.tensor, idx))
        i += len(idx)
    return join_rows(parts)
