"""How a request asks to be sampled: the value every generating node applies the same way
(the engine, a pipeline's final stage, a decode node), carried inside messages (re-exported
by :mod:`mlxcel.base.messages`, whose codec encodes it as a map of its fields). Pure data."""

from __future__ import annotations

from dataclasses import dataclass

FINISH_REASONS = ("stop", "length", "cancelled", "error")
MAX_SCHEMA = 32 << 10  # bytes of JSON schema a request may constrain its output with
MAX_GRAMMAR = 2 * MAX_SCHEMA  # the grammar text it becomes, as the cluster carries it


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the sampling stage turns logits into tokens. temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    logprobs: bool = False
    # The rest are what the OpenAI API calls them; see docs/http-api.md. Every sampling node
    # applies them (the engine, a pipeline's final stage, a decode node).
    top_logprobs: int = 0  # also return this many most likely tokens per step
    min_p: float = 0.0
    logit_bias_ids: tuple[int, ...] = ()  # parallel to logit_bias_values
    logit_bias_values: tuple[float, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # End-of-sequence tokens are held back (their logits set to -inf) for the first
    # ``min_tokens`` sampled tokens, or for all of them with ``ignore_eos`` (llama.cpp's and
    # vLLM's fields). A node that samples only some of a sequence's tokens (a disaggregated
    # prefill) hands on ``min_tokens`` less what it sampled.
    min_tokens: int = 0
    ignore_eos: bool = False
    # Structured output: llguidance's grammar (mlxcel.serving.grammar) the logits are masked to; empty:
    # none. What the API's response_format becomes.
    grammar: str = ""

    def extended(self) -> list[str]:
        """The EXTENDED_SAMPLING parameters these params ask for (non-neutral values)."""
        asked = {
            "top_logprobs": self.top_logprobs > 0,
            "min_p": self.min_p > 0,
            "logit_bias": bool(self.logit_bias_ids or self.logit_bias_values),
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "min_tokens": self.min_tokens > 0,
            "ignore_eos": self.ignore_eos,
            "response_format": bool(self.grammar),
        }
        return [name for name, on in asked.items() if on]


# SamplingParams fields beyond temperature/top-p/top-k/seed, by their API names. A serving
# mode that cannot apply one refuses requests that ask for it (see mlxcel.serving.stack.Serving).
EXTENDED_SAMPLING = frozenset(
    {
        "top_logprobs",
        "min_p",
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "response_format",
    }
)


def sampling_problem(p: SamplingParams, vocab: int) -> str | None:
    """Why these parameters cannot run on a model of ``vocab`` tokens (None: they can).

    Checked before a sequence joins a batch: a processor that raised inside mlx-lm's batched
    step would fail every sequence in it, and an out-of-range bias index would not raise at
    all. The API validates the same ranges; this guards the cluster's messages too."""
    if len(p.logit_bias_ids) != len(p.logit_bias_values):
        return "logit_bias ids and values differ in length"
    if any(not 0 <= t < vocab for t in p.logit_bias_ids):
        return f"logit_bias names a token outside the vocabulary [0, {vocab})"
    if len(set(p.logit_bias_ids)) != len(p.logit_bias_ids):
        return "logit_bias names a token twice"
    if any(not -100 <= v <= 100 for v in p.logit_bias_values):
        return "logit_bias values must be within [-100, 100]"
    if not 0 <= p.top_logprobs <= 20:
        return "top_logprobs must be within [0, 20]"
    if not 0 <= p.min_p <= 1:
        return "min_p must be within [0, 1]"
    if not 0 < p.repetition_penalty <= 10:
        return "repetition_penalty must be within (0, 10]"
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(p, name) <= 2:
            return f"{name} must be within [-2, 2]"
    if p.min_tokens < 0:
        return "min_tokens must not be negative"
    if len(p.grammar) > MAX_GRAMMAR:
        return f"the grammar is longer than {MAX_GRAMMAR} characters"
    return None
