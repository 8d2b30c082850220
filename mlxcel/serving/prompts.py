"""Prompt text to token ids, with the context checked before the memory is spent.

A fast tokenizer holds far more than the ids while it works (the token strings, offsets and
masks of every token): about 190 bytes per input character, so one 4 MB prompt far over
any context costs some 730 MiB before its length can be refused. Text longer than
:data:`CHUNK_CHARS` is therefore first counted in pieces of that size, and refused as soon
as the count is over the context; only a prompt that fits is tokenized whole (its ids must
be exactly what one pass gives, which pieces cannot promise at their seams).

Counting in pieces over-counts a little at each seam (a word or special token cut in two);
the refusal allows :data:`SEAM_SLACK` tokens per seam so that a prompt that fits is never
refused, and the exact check on the whole prompt's ids follows anyway.

Chat messages are rendered by the template to text first and counted the same way;
``apply_chat_template(tokenize=True)`` is that text encoded without added special tokens.
"""

from __future__ import annotations

import weakref
from typing import Any

from mlxcel.base.errors import ConfigError, RequestError

CHUNK_CHARS = 1 << 16
SEAM_SLACK = 32  # a special token's text cut at a seam encodes as a few ordinary tokens


def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=special))


def encode_within(
    tokenizer: Any, text: str, limit: int | None, *, special: bool = True, param: str = "prompt"
) -> list[int]:
    """``text``'s token ids; :class:`RequestError` (``context_length_exceeded``) as soon as
    its pieces count more than ``limit`` tokens. ``special``: add the tokenizer's BOS/EOS
    as a plain prompt does (a rendered chat template already holds them)."""
    if limit is not None and len(text) > CHUNK_CHARS:
        counted = 0
        for seams, start in enumerate(range(0, len(text), CHUNK_CHARS)):
            counted += len(_encode(tokenizer, text[start : start + CHUNK_CHARS], False))
            if counted > limit + SEAM_SLACK * seams:
                seen = min(start + CHUNK_CHARS, len(text))
                raise RequestError(
                    f"the prompt is longer than the context of {limit} tokens: its first "
                    f"{seen} of {len(text)} characters already hold more than {limit} tokens",
                    param=param,
                    code="context_length_exceeded",
                )
    return _encode(tokenizer, text, special)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """The chat template's text for ``messages`` (``kwargs``: tools, chat_template, ...)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    if not isinstance(text, str):  # a template that renders a batch, or a wrapper's dict
        raise TypeError(f"the chat template rendered {type(text).__name__}, not text")
    return text


_SPECIAL: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids whose text ``skip_special_tokens`` leaves out: the tokenizer's named special
    tokens and every added token marked special (``<|im_start|>`` is one, though not named),
    as ``decode(skip_special_tokens=True)`` drops them. Worked out once per tokenizer."""
    found = _SPECIAL.get(tokenizer)
    if found is None:
        inner = getattr(tokenizer, "_tokenizer", tokenizer)
        ids = set(getattr(inner, "all_special_ids", ()))
        added = getattr(inner, "added_tokens_decoder", {})
        ids.update(i for i, tok in added.items() if getattr(tok, "special", False))
        found = _SPECIAL[tokenizer] = frozenset(ids)
    return found


def generate_messages(
    tokenizer: Any, prompt: str, raw: bool, system: str | None
) -> list[dict[str, str]] | None:
    """What ``generate`` feeds the model, as ``mlx_lm generate`` does: the prompt as chat
    messages for the template when the tokenizer has one and ``raw`` is off, else None (the
    prompt as is). A system message needs the template."""
    if raw or getattr(tokenizer, "chat_template", None) is None:
        if system is not None:
            raise ConfigError("--system-prompt", "this model's tokenizer has no chat template")
        return None
    messages = [{"role": "user", "content": prompt}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return messages
