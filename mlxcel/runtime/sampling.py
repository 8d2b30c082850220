"""Per-request samplers built from mlx-lm's sampling pieces, plus stop-string matching.

mlx-lm's ``make_sampler`` draws from MLX's global random state. Here every sampled request
carries its own PRNG key (from its seed, or a fresh random one) and splits it once per token:
two requests with the same seed reproduce inside a shared batch, and no request -- even one
whose step fails half-built -- can leave the process-wide random state broken for the others.
The filtering (top-p, top-k) is mlx-lm's; ``top_k`` at or above the vocabulary size keeps
every token (it is clamped, not an error).

Call :func:`make_sampler` on the thread that will run the sampler: the key is an MLX array.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Collection, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from mlxcel.base.messages import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def make_sampler(p: SamplingParams, key_state: Sequence[int] = ()) -> Sampler | None:
    """``None`` means greedy (the batch generator's shared argmax path). ``key_state`` resumes
    a sequence another node started (a disaggregated handoff carries its key)."""
    if p.temperature == 0:
        return None
    inv_temp = 1.0 / p.temperature
    if key_state:
        start = mx.array(list(key_state), dtype=mx.uint32)
    else:
        start = mx.random.key(p.seed if p.seed is not None else secrets.randbits(63))
    key = [start]

    def sample(logprobs: mx.array) -> mx.array:
        if 0 < p.min_p <= 1:
            logprobs = apply_min_p(logprobs, p.min_p)
        if 0 < p.top_p < 1:
            logprobs = apply_top_p(logprobs, p.top_p)
        if 0 < p.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, p.top_k)
        key[0], sub = mx.random.split(key[0])
        if len(key) == 1:
            key.append(key[0])  # the key after the first token: what a handoff carries
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    sample.key = key  # type: ignore[attr-defined]  # read by key_after_first()
    return sample


LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def needs_processors(p: SamplingParams) -> bool:
    """Whether :func:`logits_processors` would return any (without building them)."""
    asked = set(p.extended())
    return bool(asked - {"top_logprobs", "min_p"})


def logits_processors(
    p: SamplingParams, eos: Collection[int], tokenizer: Any = None
) -> list[LogitsProcessor]:
    """mlx-lm's processors for logit_bias and the three penalties, then the hold on the
    end-of-sequence tokens ``eos`` that min_tokens and ignore_eos ask for, then the mask of
    a structured output's grammar (over ``tokenizer``'s tokens); empty: none.

    They see the sequence's tokens (prompt included) and run before the logprobs are taken,
    so the returned logprobs are those of the distribution actually sampled, as in mlx-lm.
    Build them once per sequence: the EOS hold counts the tokens it was applied to."""
    procs = make_logits_processors(
        logit_bias=dict(zip(p.logit_bias_ids, p.logit_bias_values, strict=True)) or None,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None,
        presence_penalty=p.presence_penalty or None,
        frequency_penalty=p.frequency_penalty or None,
    )
    if eos and (p.ignore_eos or p.min_tokens > 0):
        procs.append(EosHold(eos, None if p.ignore_eos else p.min_tokens))
    if p.grammar:
        from mlxcel.runtime.grammar_mask import GrammarMask

        procs.append(GrammarMask(p.grammar, tokenizer))
    return procs


class EosHold:
    """Sets the end-of-sequence tokens' logits to -inf for the next ``steps`` sampled tokens
    (None: for every token), so the sequence cannot end before then.

    It counts its own calls, one per sampled token, instead of reading the token history:
    the history a node passes differs (the whole sequence in the engine, a recent window at a
    pipeline's final stage, the rest after a handoff). Applied after logit_bias, a bias on an
    EOS token cannot undo it."""

    def __init__(self, eos: Collection[int], steps: int | None) -> None:
        self.ids = mx.array(sorted(eos), dtype=mx.int32)
        self.left = steps

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.left is not None:
            if self.left <= 0:
                return logits
            self.left -= 1
        return logits.at[:, self.ids].add(-mx.inf)


def top_alternatives(logprobs: mx.array, k: int) -> tuple[list[int], list[float]]:
    """The ``k`` most likely tokens of one step's logprob vector, most likely first."""
    k = min(k, logprobs.shape[-1])
    idx = mx.argpartition(-logprobs, kth=k - 1)[:k]
    vals = logprobs[idx]
    order = mx.argsort(-vals)
    return idx[order].tolist(), vals[order].tolist()


def key_after_first(sampler: Sampler | None) -> tuple[int, ...]:
    """The PRNG key as it was right after the first token was sampled (empty for greedy).

    A prefill node hands a sequence off after its first token, but mlx-lm's batch generator
    samples one step ahead, so the live key may already be split again: the decode node must
    go on from the key after token 0, as a single node would."""
    inner = getattr(sampler, "inner", sampler)
    key = getattr(inner, "key", None)
    if key is None or len(key) < 2:
        return ()
    return tuple(int(x) for x in key[1].tolist())


class GuardedSampler:
    """Runs one sequence's sampler; if building its graph raises, that sequence alone fails.

    mlx-lm samples a whole batch in one step, so an exception from one request's sampler
    would abort the step for every sequence in it. The guard records the error, answers a
    stand-in token (argmax) so the batch step completes, and the engine then ends that one
    sequence with the recorded error.
    """

    def __init__(self, inner: Sampler, failures: dict[str, str], key: str) -> None:
        self.inner = inner
        self.failures = failures
        self.key = key

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self.key not in self.failures:
            try:
                return self.inner(logprobs)
            except Exception as exc:
                self.failures[self.key] = f"sampling failed: {type(exc).__name__}: {exc}"
        return mx.argmax(logprobs, axis=-1)


def guarded_sampler(
    p: SamplingParams, failures: dict[str, str], key: str, key_state: Sequence[int] = ()
) -> Sampler | None:
    """The request's sampler behind a :class:`GuardedSampler` (None: greedy, nothing to guard)."""
    inner = make_sampler(p, key_state) if key_state else make_sampler(p)
    return None if inner is None else GuardedSampler(inner, failures, key)
