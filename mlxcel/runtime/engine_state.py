"""The engine's bookkeeping: a sequence on the reactor's side, what the reactor hands the
compute thread for a step, what a step hands back, and the check of a new entry."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mlxcel.base.handoff import Packed
from mlxcel.base.messages import Error, RunEntry, RunResult, prompt_problem
from mlxcel.base.model_config import context_length, vocab_size
from mlxcel.runtime.sampling import sampling_problem

# (request_id, token, finish_reason, logprob, (top ids, top logprobs) or None)
StepToken = tuple[str, int, str | None, float | None, tuple[list[int], list[float]] | None]


class EngineSeqState(enum.Enum):
    QUEUED = "queued"  # accepted, not yet handed to the batch generator
    RUNNING = "running"  # inside the batch generator (prefill or decode)


Sink = Callable[[RunResult | Error], None]


@dataclass
class EngineSeq:
    entry: RunEntry
    source: str
    state: EngineSeqState = EngineSeqState.QUEUED
    uid: int | None = None
    generated: int = 0
    # Disaggregated serving: a sequence may start from a handed-off cache (decode node) or
    # keep its cache when it finishes (prefill node); its results go to ``sink``, not the bus.
    cache: list[Any] | None = None
    key_state: tuple[int, ...] = ()
    keep_cache: bool = False
    sink: Sink | None = None
    cached: int = 0  # prompt tokens the prompt cache supplied (reported with the first token)
    context: tuple[int, ...] = ()  # tokens before a handed-off cache's, for the penalties
    resumed: int = 0  # positions a handed-off cache brought


def kv_tokens(seqs: Iterable[EngineSeq]) -> int:
    """Positions the running sequences' caches hold (what the metrics call KV tokens)."""
    return sum(
        s.resumed + len(s.entry.token_ids) + s.generated
        for s in seqs
        if s.state is EngineSeqState.RUNNING
    )


@dataclass(frozen=True, slots=True)
class Insert:
    entry: RunEntry
    cache: list[Any] | None
    key_state: tuple[int, ...]
    keep_cache: bool
    context: tuple[int, ...] = ()


@dataclass
class EngineStep:
    tokens: list[StepToken] = field(default_factory=list)
    prompt_tokens: int = 0
    steps: int = 0  # steps run: batched ones, and a lone sequence's (prefill chunks too)
    cached: dict[str, int] = field(default_factory=dict)  # request_id -> prompt tokens reused
    new_uids: dict[str, int] = field(default_factory=dict)
    moved: dict[str, int] = field(default_factory=dict)  # request_id -> its uid from now on
    failed: dict[str, str] = field(default_factory=dict)  # request_id -> why (its sampler)
    kept: dict[str, tuple[Packed, tuple[int, ...]]] = field(default_factory=dict)


def entry_problem(e: RunEntry, config: dict[str, Any]) -> str | None:
    """Why the engine cannot run ``e`` on a model of this config (None: it can). Checked for
    every sender: the API validates the same ranges, this guards the cluster's messages."""
    vocab = vocab_size(config)
    problem = prompt_problem(e.token_ids, e.sampling.max_tokens, vocab, context_length(config))
    return problem if problem is not None else sampling_problem(e.sampling, vocab)


def by_sequence(tokens: list[StepToken]) -> dict[str, list[StepToken]]:
    """A run's tokens, grouped by sequence, each group in step order."""
    groups: dict[str, list[StepToken]] = {}
    for t in tokens:
        groups.setdefault(t[0], []).append(t)
    return groups
