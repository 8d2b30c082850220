"""Log probabilities in the two shapes of the OpenAI API (chat and legacy completions)."""

from __future__ import annotations

from typing import Any

from mlxcel.frontend import Delta

# (token id, its logprob, its most likely alternatives as (id, logprob), best first)
Entry = tuple[int, float, tuple[tuple[int, float], ...]]


def entries(d: Delta) -> list[Entry]:
    if not d.logprobs:
        return []
    tops = d.top or tuple(() for _ in d.token_ids)
    return list(zip(d.token_ids, d.logprobs, tops, strict=False))


def _text(tokenizer: Any, t: int) -> str:
    return str(tokenizer.decode([t]))


def chat_logprobs(tokenizer: Any, items: list[Entry]) -> dict[str, Any]:
    def one(t: int, lp: float) -> dict[str, Any]:
        s = _text(tokenizer, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {
        "content": [
            {**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in top]} for t, lp, top in items
        ],
        "refusal": None,
    }


def completion_logprobs(tokenizer: Any, items: list[Entry], offset: int = 0) -> dict[str, Any]:
    """``offset``: characters of completion text before these tokens (for ``text_offset``)."""
    tokens = [_text(tokenizer, t) for t, _, _ in items]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in items],
        "top_logprobs": [{_text(tokenizer, a): alp for a, alp in top} for _, _, top in items],
        "text_offset": offsets,
    }
