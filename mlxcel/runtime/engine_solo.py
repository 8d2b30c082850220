"""The engine's side of decoding one sequence alone (runtime/solo.py): when a sequence may,
starting it, stepping it, and handing it to the batch generator when another one arrives.

A mixin of :class:`~mlxcel.runtime.engine.LocalEngine`; every method runs on the compute thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_lm.models.cache import make_prompt_cache

from mlxcel.runtime.engine_state import EngineStep, Insert
from mlxcel.runtime.sampling import needs_processors
from mlxcel.runtime.solo import Solo

if TYPE_CHECKING:
    from mlx_lm.generate import BatchGenerator

    from mlxcel.runtime.model import LoadedModel


class SoloSteps:
    """Mixed into LocalEngine, whose state and helpers (``_start``, ``_guarded``,
    ``_record``, ``_keep_prompt``, ``batch_cache_rows``) these methods use."""

    loaded: LoadedModel
    eos: set[int]
    prefill_step_size: int
    solo_enabled: bool
    _solo: Solo | None
    _solo_uids: int
    _gen: BatchGenerator | None
    _started: set[int]

    def _may_solo(self, inserts: list[Insert]) -> bool:
        """A lone plain request on an idle engine decodes without the batch generator."""
        if not self.solo_enabled or len(inserts) != 1 or self.batch_cache_rows():
            return False
        i = inserts[0]
        return i.cache is None and not i.keep_cache and not needs_processors(i.entry.sampling)

    def _start_solo(self, i: Insert, out: EngineStep) -> None:
        cache, n = self._start(i)
        rid, tokens = i.entry.request_id, list(i.entry.token_ids)
        self._solo_uids -= 1  # negative: never one of the batch generator's uids
        self._solo = Solo(
            self.loaded.model,
            rid,
            self._solo_uids,
            tokens[n:],
            cache if cache is not None else make_prompt_cache(self.loaded.model),
            tokens[:n],
            self._guarded(i.entry, i.key_state),
            i.entry.sampling.max_tokens,
            self.eos,
            self.prefill_step_size,
        )
        out.new_uids[rid] = self._solo_uids
        out.prompt_tokens += len(tokens)
        if n:
            out.cached[rid] = n

    def _solo_step(self, solo: Solo, want_lp: dict[str, int], out: EngineStep) -> bool:
        t = solo.step()
        if t is None:
            return False  # a prefill chunk
        self._record(solo.request_id, t.token, t.finish, t.logprobs, want_lp, out)
        if t.finish is not None:  # kept before it lets go: the reactor sees it held till then
            self._keep_prompt(solo.fed, solo.cache)
            self._solo = None
        return t.first or t.finish is not None

    def _hand_over(
        self,
        solo: Solo,
        by_uid: dict[int, str],
        want_lp: dict[str, int],
        out: EngineStep,
    ) -> None:
        assert self._gen is not None
        t, rest = solo.hand_over()
        if t is not None:
            self._record(solo.request_id, t.token, t.finish, t.logprobs, want_lp, out)
        if rest is None:  # that token finished it
            self._keep_prompt(solo.fed, solo.cache)
            self._solo = None
            return
        (uid,) = self._gen.insert(
            [rest.prompt],
            max_tokens=[rest.max_tokens],
            caches=[rest.cache],
            all_tokens=[rest.fed],
            samplers=[solo.sampler],
        )
        self._solo = None
        by_uid[uid] = solo.request_id
        out.moved[solo.request_id] = uid
        if solo.generated:
            self._started.add(uid)  # its next token is not a first token
