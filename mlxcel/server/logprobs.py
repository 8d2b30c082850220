"""Log probabilities in the two shapes of the OpenAI API (chat and legacy completions).

A token is a run of bytes, not always whole characters: byte-level BPE splits "é" or an emoji
over several tokens. Each token's bytes come from mlx-lm's detokenizer tables (the same
mapping it streams text with), so ``bytes`` rebuilds the text exactly, a token that is not
valid UTF-8 alone is shown as ``bytes:\\xNN…`` (as OpenAI shows it), and ``text_offset``
counts the characters completed before each token.
"""

from __future__ import annotations

from typing import Any

from mlxcel.serving.frontend import Delta

# (token id, its logprob, its most likely alternatives as (id, logprob), best first)
Entry = tuple[int, float, tuple[tuple[int, float], ...]]
# What a token the distribution rules out (logprob -inf: a grammar's mask, a -100 bias) is
# reported as: -Infinity is not JSON, and strict parsers refuse the body (vLLM's value).
FLOOR = -9999.0

_SPM_SPACE = "\u2581".encode()
_tables: dict[int, tuple[Any, Any]] = {}  # id(tokenizer) -> (tokenizer, byte lookup)


def entries(d: Delta) -> list[Entry]:
    if not d.logprobs:
        return []
    tops = d.top or tuple(() for _ in d.token_ids)
    return [
        (t, max(lp, FLOOR), tuple((a, max(alp, FLOOR)) for a, alp in top))
        for t, lp, top in zip(d.token_ids, d.logprobs, tops, strict=False)
    ]


def prepare(tokenizer: Any) -> None:
    """Build the byte table (a pass over the whole vocabulary) ahead of use; the server runs
    this on a worker thread so the first logprobs request never stalls the reactor."""
    _lookup(tokenizer)


def _lookup(tokenizer: Any) -> Any:
    """token id -> bytes, built once per tokenizer from its streaming detokenizer."""
    hit = _tables.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

    det = tokenizer.detokenizer
    if isinstance(det, SPMStreamingDetokenizer):
        table = det.tokenmap

        def lookup(t: int) -> bytes:
            return bytes(table[t]).replace(_SPM_SPACE, b" ")

    elif isinstance(det, BPEStreamingDetokenizer):
        from mlx_lm.tokenizer_utils import _byte_decoder

        table, decoder = det.tokenmap, _byte_decoder()

        def lookup(t: int) -> bytes:
            out = bytearray()
            for c in table[t]:
                b = decoder.get(c)
                out.extend(bytes([b]) if b is not None else c.encode())
            return bytes(out)

    else:

        def lookup(t: int) -> bytes:
            return str(tokenizer.decode([t])).encode()

    _tables[id(tokenizer)] = (tokenizer, lookup)
    return lookup


def _shown(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_logprobs(tokenizer: Any, items: list[Entry]) -> dict[str, Any]:
    lookup = _lookup(tokenizer)

    def one(t: int, lp: float) -> dict[str, Any]:
        raw = lookup(t)
        return {"token": _shown(raw), "logprob": lp, "bytes": list(raw)}

    return {
        "content": [
            {**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in top]} for t, lp, top in items
        ],
        "refusal": None,
    }


def completion_logprobs(
    tokenizer: Any,
    items: list[Entry],
    before: bytearray | None = None,
    hidden: frozenset[int] = frozenset(),
) -> dict[str, Any]:
    """``before``: the completion's bytes so far (a stream passes the same buffer each chunk,
    and it grows by these tokens); ``hidden``: tokens whose text the completion leaves out
    (skip_special_tokens), which add nothing to the offsets."""
    lookup = _lookup(tokenizer)
    seen = before if before is not None else bytearray()
    tokens, offsets, tops = [], [], []
    for t, _, top in items:
        raw = lookup(t)
        offsets.append(len(seen.decode("utf-8", "ignore")))  # characters completed so far
        if t not in hidden:
            seen.extend(raw)
        tokens.append(_shown(raw))
        alternatives: dict[str, float] = {}
        for a, alp in top:  # best first: a later token shown the same way never overwrites
            alternatives.setdefault(_shown(lookup(a)), alp)
        tops.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in items],
        "top_logprobs": tops,
        "text_offset": offsets,
    }
