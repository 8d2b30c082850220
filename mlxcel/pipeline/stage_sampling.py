"""What the final stage adds to sampling so that a pipeline serves every parameter one process
does: mlx-lm's logits processors (logit_bias and the three penalties) over each sequence's
recent tokens, and the top_logprobs alternatives of each sampled token.

The penalties look back on the last tokens of the prompt too, which the final stage never
sees (it gets hidden states): the coordinator sends the prompt's tail with PrepareSequence
(``Step.context``), and this keeps each sequence's history from there. Compute thread only.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import mlx.core as mx

from mlxcel.pipeline.stage_protocol import SeqKey, Step
from mlxcel.runtime.sampling import logits_processors, top_alternatives

HISTORY = 20  # tokens the penalties look back on (mlx-lm's default context size)


class SamplingExtras:
    def __init__(self, eos: Collection[int], tokenizer: Any = None) -> None:
        self.eos = eos  # the tokens min_tokens and ignore_eos hold back
        self.tokenizer = tokenizer  # what a structured output's grammar is over
        self._procs: dict[SeqKey, list[Any]] = {}
        self._history: dict[SeqKey, list[int]] = {}

    def free(self, key: SeqKey) -> None:
        self._procs.pop(key, None)
        self._history.pop(key, None)

    def _processors(self, step: Step) -> list[Any]:
        procs = self._procs.get(step.key)
        if procs is None:
            procs = self._procs[step.key] = logits_processors(
                step.sampling, self.eos, self.tokenizer
            )
            self._history[step.key] = list(step.context[-HISTORY:])
        return procs

    def process(self, steps: tuple[Step, ...], logits: mx.array) -> mx.array:
        """``logits`` ([B, vocab], the rows in step order) after each sampled row's processors,
        as the one-process engine applies them: before the logprobs are taken."""
        rows = [(i, self._processors(s)) for i, s in enumerate(steps) if s.sample]
        if not any(procs for _, procs in rows):
            return logits
        parts = [logits[i : i + 1] for i in range(logits.shape[0])]
        for i, procs in rows:
            if procs:
                seen = mx.array(self._history[steps[i].key], dtype=mx.int32)
                for proc in procs:
                    parts[i] = proc(seen, parts[i])
        return mx.concatenate(parts, axis=0)

    def record(self, step: Step, token: int) -> None:
        """The token ``step`` sampled joins its sequence's history (the penalties' view)."""
        history = self._history.get(step.key)
        if history is not None:
            history.append(token)
            del history[:-HISTORY]

    @staticmethod
    def top(step: Step, logprobs_row: mx.array) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
        """The row's ``top_logprobs`` most likely tokens, when the request asked for them."""
        k = step.sampling.top_logprobs
        if not step.sample or k <= 0:
            return None
        ids, vals = top_alternatives(logprobs_row.reshape(-1), k)
        return tuple(ids), tuple(vals)
