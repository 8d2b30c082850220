"""The engine's bookkeeping types: a sequence on the reactor's side, what the reactor hands
the compute thread for a step, and what a step hands back."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxcel.disagg.handoff import Packed
from mlxcel.messages import Error, RunEntry, RunResult

# (request_id, token, finish_reason, logprob, (top ids, top logprobs) or None)
StepToken = tuple[str, int, str | None, float | None, tuple[list[int], list[float]] | None]


class SeqState(enum.Enum):
    QUEUED = "queued"  # accepted, not yet handed to the batch generator
    RUNNING = "running"  # inside the batch generator (prefill or decode)


Sink = Callable[[RunResult | Error], None]


@dataclass
class Seq:
    entry: RunEntry
    source: str
    state: SeqState = SeqState.QUEUED
    uid: int | None = None
    generated: int = 0
    # Disaggregated serving: a sequence may start from a handed-off cache (decode node) or
    # keep its cache when it finishes (prefill node); its results go to ``sink``, not the bus.
    cache: list[Any] | None = None
    key_state: tuple[int, ...] = ()
    keep_cache: bool = False
    sink: Sink | None = None
    cached: int = 0  # prompt tokens the prompt cache supplied (reported with the first token)


@dataclass(frozen=True, slots=True)
class Insert:
    entry: RunEntry
    cache: list[Any] | None
    key_state: tuple[int, ...]
    keep_cache: bool


@dataclass
class StepOutput:
    tokens: list[StepToken] = field(default_factory=list)
    prompt_tokens: int = 0
    steps: int = 0  # batch generator steps run
    cached: dict[str, int] = field(default_factory=dict)  # request_id -> prompt tokens reused
    new_uids: dict[str, int] = field(default_factory=dict)
    moved: dict[str, int] = field(default_factory=dict)  # request_id -> its uid from now on
    failed: dict[str, str] = field(default_factory=dict)  # request_id -> why (its sampler)
    kept: dict[str, tuple[Packed, tuple[int, ...]]] = field(default_factory=dict)
