"""Structured output (``response_format``) through llguidance, the constrained-decoding
library vLLM and llama.cpp use: a JSON schema becomes an llguidance grammar on the API side,
and every sampling node masks each step's logits to the tokens the grammar allows.

The grammar travels in :class:`~mlxcel.sampling_params.SamplingParams` as llguidance's own
text, so a pipeline's final stage applies it as the one-process engine does. llguidance is
imported only when a request asks for it.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

MAX_GRAMMAR = 64 << 10  # bytes of grammar text a request may carry to the sampling nodes

_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's view of an mlx-lm tokenizer, built once per tokenizer."""
    found = _TOKENIZERS.get(tokenizer)
    if found is None:
        import llguidance.hf

        inner = getattr(tokenizer, "_tokenizer", tokenizer)
        eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ()) or None
        found = _TOKENIZERS[tokenizer] = llguidance.hf.from_tokenizer(inner, eos_token=eos)
    return found


def grammar_for(response_format: dict[str, Any]) -> str:
    """llguidance's grammar for an OpenAI ``response_format`` of type ``json_object`` or
    ``json_schema``; ValueError naming what is wrong (the schema is compiled by
    :func:`check_grammar`)."""
    from llguidance import LLMatcher

    kind = response_format.get("type")
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("type 'json_schema' needs json_schema.schema, a JSON schema object")
        schema = spec["schema"]
    else:
        raise ValueError(f"type {kind!r} is not one of 'text', 'json_object', 'json_schema'")
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema))
    if len(grammar.encode()) > MAX_GRAMMAR:
        raise ValueError(f"the schema is larger than {MAX_GRAMMAR >> 10} KiB")
    return grammar


def check_grammar(grammar: str, tokenizer: Any) -> str | None:
    """Why ``grammar`` cannot constrain this tokenizer's output (None: it can). Compiling
    it costs time on large schemas: run it off the reactor."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(grammar, ll_tokenizer(tokenizer)) or None
