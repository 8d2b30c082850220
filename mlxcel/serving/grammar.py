"""Structured output (``response_format``) through llguidance, the constrained-decoding
library vLLM and llama.cpp use: a JSON schema becomes an llguidance grammar on the API side,
and every sampling node masks each step's logits to the tokens the grammar allows.

The grammar travels in :class:`~mlxcel.base.sampling_params.SamplingParams` as llguidance's own
text, so a pipeline's final stage applies it as the one-process engine does. Compiling one
costs up to a few hundred milliseconds on a large schema: each process compiles a grammar
once (the API's check does it on a worker thread, so in one process the engine's thread
never does) and hands every sequence a copy. llguidance is imported only when a request
asks for it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from mlxcel.base.sampling_params import MAX_GRAMMAR, MAX_SCHEMA

COMPILED = 32  # grammars kept compiled per process
# Compact JSON, as OpenAI's structured outputs write it: free whitespace would let a model
# spend its token budget on it (a schema can opt in through its "x-guidance" options).
JSON_OPTIONS = {"whitespace_flexible": False}

_tokenizers: dict[int, tuple[Any, Any]] = {}  # id(tokenizer) -> (tokenizer, llguidance's)
_compiled: OrderedDict[tuple[int, str], Any] = OrderedDict()
_lock = threading.Lock()  # the API's worker threads and the compute thread share the caches


def ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's view of an mlx-lm tokenizer, built once per tokenizer."""
    with _lock:
        hit = _tokenizers.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
    import llguidance.hf

    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ()) or None
    made = llguidance.hf.from_tokenizer(inner, eos_token=eos)
    with _lock:
        _tokenizers[id(tokenizer)] = (tokenizer, made)
    return made


def grammar_for(kind: str, schema: dict[str, Any] | None) -> str:
    """llguidance's grammar for a ``json_object`` (``schema`` None: any object) or a
    ``json_schema`` response format; ValueError when the schema is too large."""
    from llguidance import LLMatcher

    text = json.dumps(schema if schema is not None else {"type": "object"})
    if len(text.encode()) > MAX_SCHEMA:
        raise ValueError(f"the schema is larger than {MAX_SCHEMA >> 10} KiB")
    grammar = LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if len(grammar) > MAX_GRAMMAR:
        raise ValueError(f"the schema makes a grammar larger than {MAX_GRAMMAR >> 10} KiB")
    return grammar


def matcher_for(grammar: str, tokenizer: Any) -> Any:
    """A fresh matcher of ``grammar``: a copy of the one this process compiled (compiled now
    if it has not been, or was dropped as the least recently used)."""
    from llguidance import LLMatcher

    lt = ll_tokenizer(tokenizer)
    key = (id(lt), grammar)
    with _lock:
        base = _compiled.get(key)
        if base is not None:
            _compiled.move_to_end(key)
    if base is None:
        base = LLMatcher(lt, grammar, log_level=0)  # silent: errors are read, not printed
        if not base.is_error():
            with _lock:
                _compiled[key] = base
                while len(_compiled) > COMPILED:
                    _compiled.popitem(last=False)
    return base.deep_copy()


def check_grammar(grammar: str, tokenizer: Any) -> str | None:
    """Why ``grammar`` cannot constrain this tokenizer's output (None: it can). It is
    compiled and its first mask computed, where a grammar too complex for the parser or a
    schema that refers only to itself fails. Run it off the reactor."""
    m = matcher_for(grammar, tokenizer)
    if not m.is_error():
        m.compute_bitmask()
    if m.is_error():
        return m.get_error().strip().splitlines()[0][:300]
    return None
