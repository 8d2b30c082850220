"""The engine's prompt-cache side: the cache a new sequence starts from, and keeping a
finished or cancelled sequence's cache for later prompts that start alike.

A mixin of :class:`~mlxcel.runtime.engine.LocalEngine`; every method runs on the compute thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loguru import logger

from mlxcel.runtime.engine_state import Insert

if TYPE_CHECKING:
    from mlx_lm.generate import BatchGenerator

    from mlxcel.runtime.prompt_cache import PromptCache


class CacheSteps:
    """Mixed into LocalEngine, whose batch generator and prompt cache these methods use."""

    prompt_cache: PromptCache | None
    _gen: BatchGenerator | None

    def _keep_removed(self, uids: list[int]) -> None:
        assert self._gen is not None
        try:
            taken = self._gen.extract_cache(uids)
        except Exception as exc:  # the cache is an optimization: never fail a step on it
            logger.warning("prompt cache: could not take a cancelled sequence's cache: {}", exc)
            return
        for cache, tokens in taken.values():
            self._keep_prompt(list(tokens), cache)

    def _keep_prompt(self, tokens: list[int] | None, cache: list[Any] | None) -> None:
        """Compute thread: a finished sequence's cache, for later prompts that start alike."""
        if self.prompt_cache is not None and tokens and cache:
            self.prompt_cache.store(tokens, cache)

    def _start(self, i: Insert) -> tuple[list[Any] | None, int]:
        """Compute thread: the cache a sequence starts from and how many of its prompt
        tokens that cache covers. A handed-off cache covers what came before ``token_ids``;
        otherwise the prompt cache may cover a prefix of them."""
        if i.cache is not None or i.keep_cache or self.prompt_cache is None:
            return i.cache, 0
        return self.prompt_cache.fetch(i.entry.token_ids)
