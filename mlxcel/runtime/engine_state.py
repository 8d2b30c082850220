"""The engine's bookkeeping: a sequence in the core's table, the jobs the core hands the
compute thread, what a step hands back, and the check of a new entry. Pure: no MLX here."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mlxcel.base.handoff import Packed
from mlxcel.base.messages import RunEntry, prompt_problem
from mlxcel.base.model_config import context_length, vocab_size
from mlxcel.base.sampling_params import sampling_problem

# (request_id, token, finish_reason, logprob, (top ids, top logprobs) or None)
StepToken = tuple[str, int, str | None, float | None, tuple[list[int], list[float]] | None]


class EngineSeqState(enum.Enum):
    QUEUED = "queued"  # accepted, not yet handed to the compute side
    RUNNING = "running"  # on the compute side (prefill or decode)


@dataclass
class EngineSeq:
    entry: RunEntry
    source: str
    state: EngineSeqState = EngineSeqState.QUEUED
    uid: int | None = None
    generated: int = 0
    # Disaggregated serving: a sequence may start from a handed-off cache (decode node) or
    # keep its cache when it finishes (prefill node). The core only holds ``cache`` until
    # the job that inserts it; it never looks inside.
    cache: Any = None
    key_state: tuple[int, ...] = ()
    keep_cache: bool = False
    cached: int = 0  # prompt tokens the prompt cache supplied (reported with the first token)
    context: tuple[int, ...] = ()  # tokens before a handed-off cache's, for the penalties
    resumed: int = 0  # positions a handed-off cache brought
    min_cached: int = 0  # prompt tokens its prompt cache must supply (a continuation), or it ends


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
    cache: Any = None
    key_state: tuple[int, ...] = ()
    keep_cache: bool = False
    context: tuple[int, ...] = ()
    min_cached: int = 0


@dataclass(frozen=True)
class EngineJob:
    """One step for the compute side: join ``inserts``, drop ``removals`` (batch uids), then
    run decode steps. ``by_uid`` and ``want_lp`` are the core's table as of now (copies)."""

    id: int
    inserts: tuple[Insert, ...] = ()
    removals: tuple[int, ...] = ()
    by_uid: dict[int, str] = field(default_factory=dict)
    want_lp: dict[str, int] = field(default_factory=dict)  # request_id -> top_logprobs


@dataclass(frozen=True, slots=True)
class ResetJob:
    """Forget every sequence on the compute side (after a failed step): fresh caches."""

    id: int


@dataclass
class EngineStep:
    tokens: list[StepToken] = field(default_factory=list)
    prompt_tokens: int = 0
    steps: int = 0  # steps run: batched ones, and a lone sequence's (prefill chunks too)
    cached: dict[str, int] = field(default_factory=dict)  # request_id -> prompt tokens reused
    new_uids: dict[str, int] = field(default_factory=dict)
    moved: dict[str, int] = field(default_factory=dict)  # request_id -> its uid from now on
    failed: dict[str, str] = field(default_factory=dict)  # request_id -> why (its sampler)
    # request_id -> the prompt tokens the cache had, less than the entry's min_cached: it
    # never started
    uncached: dict[str, int] = field(default_factory=dict)
    stored: set[str] = field(default_factory=set)  # finished ones the prompt cache now keeps
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
