"""The deliberate bugs ``sim --inject`` plants in production code, from here: the simulator's
own tests show its invariants catch each one. Production code has no switch for them; for
one scenario this module replaces the one method or function each bug lives in, and puts
it back after.

- ``skip-owner-check``: a stage takes any identity for the owner of any sequence.
- ``accept-stale-nonce``: the coordinator takes a RunResult with an unknown nonce as the
  answer to any exchange of the same request.
- ``activate-early``: a ``--pp-auto`` coordinator ends a phase when one peer answered, not
  every peer.
- ``shared-prefix-index``: the prompt-cache index finds entries across namespaces (one
  tenant starts from another's cached prefix).
- ``prefill-drops-namespace``: a prefill node runs every prompt in the open namespace (its
  prompt cache serves one tenant's prefix to another).
- ``runner-drop-delivery``: the effect runner loses the first message a role takes off the
  network (:func:`mlxcel.sim.process.runner_bugs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from mlxcel.base.effects import Effect, StartCompute
from mlxcel.base.messages import RunResult
from mlxcel.base.prefix_index import PrefixIndex
from mlxcel.bringup.push_core import PushCore
from mlxcel.disagg.protocol import PrefillJob
from mlxcel.disagg.worker_service import PrefillService
from mlxcel.pipeline import coordinator_core
from mlxcel.pipeline.stage_gate import StageGate
from mlxcel.sim.process import runner_bugs


@contextmanager
def _replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _stale_matching(real: Any) -> Any:
    def match(m: RunResult, from_final: bool, exchanges: Any, *args: Any) -> Any:
        if from_final and exchanges.get(m.nonce) is None:
            for nonce, x in exchanges.items():
                if x.request_id == m.request_id and x.kind is RunResult:
                    return (nonce, x), None
        return real(m, from_final, exchanges, *args)

    return match


def _any_namespace(index: PrefixIndex, real: Any, tokens: tuple[int, ...], now: float) -> Any:
    """The best hit in any namespace (the bug), found by asking the real lookup per one."""
    hits = [real(index, ns, tokens, now) for ns in {e.namespace for e in index.entries.values()}]
    found = [h for h in hits if h is not None]
    for h in found[1:]:
        index.unpin(h.entry)
    return found[0] if found else None


def _open_namespace(real: Any) -> Any:
    def apply(self: PrefillService, effect: Effect) -> None:
        if isinstance(effect, StartCompute) and isinstance(effect.job, PrefillJob):
            effect = StartCompute(dataclasses.replace(effect.job, cache_ns=""))
        real(self, effect)

    return apply


@contextmanager
def planted(inject: frozenset[str]) -> Iterator[None]:
    """The bugs named in ``inject`` live in production code for the block."""
    with ExitStack() as stack:
        if "skip-owner-check" in inject:
            stack.enter_context(_replaced(StageGate, "owns", lambda self, seq, source: True))
        if "accept-stale-nonce" in inject:
            real = coordinator_core.match_result
            stack.enter_context(_replaced(coordinator_core, "match_result", _stale_matching(real)))
        if "shared-prefix-index" in inject:
            real_lookup = PrefixIndex.lookup
            anyone = lambda self, ns, tokens, now: _any_namespace(self, real_lookup, tokens, now)  # noqa: E731
            stack.enter_context(_replaced(PrefixIndex, "lookup", anyone))
        if "prefill-drops-namespace" in inject:
            real_apply = PrefillService.apply
            stack.enter_context(_replaced(PrefillService, "apply", _open_namespace(real_apply)))
        if "activate-early" in inject:
            early = staticmethod(lambda steps, step: step in steps)
            stack.enter_context(_replaced(PushCore, "all_reached", early))
        stack.enter_context(runner_bugs(inject))
        yield
