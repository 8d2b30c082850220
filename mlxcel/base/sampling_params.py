"""How a request asks to be sampled: the value every generating node applies the same way
(the engine, a pipeline's final stage, a decode node), carried inside messages (re-exported
by :mod:`mlxcel.base.messages`, whose codec encodes it as a map of its fields). Pure data."""

from __future__ import annotations

from dataclasses import dataclass

FINISH_REASONS = ("stop", "length", "cancelled", "error")


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
