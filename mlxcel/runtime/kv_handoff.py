"""The KV cache a prefill node hands to a decode node: pack and digest it, unpack it.

Only a plain per-layer ``KVCache`` can travel: its state is two dense arrays per layer.
Rotating (sliding-window) caches, SSM/recurrent state and composite caches cannot be
serialised into that shape, so :func:`unsupported_reason` names them and the prefill node
refuses those requests before any work. Everything here runs on the compute thread (MLX
arrays belong to the thread that made them). Checking a received handoff needs no MLX and
runs elsewhere (:func:`mlxcel.base.handoff.check`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxcel.base.handoff import Packed, tensor_digest
from mlxcel.base.messages import KvHandoff
from mlxcel.runtime.tensors import from_tensor, to_tensor


def unsupported_reason(model: Any, family: str) -> str | None:
    """None when every layer's cache is a plain ``KVCache``; else why the family cannot hand off."""
    kinds = {type(c).__name__ for c in make_prompt_cache(model)}
    if kinds == {"KVCache"}:
        return None
    other = ", ".join(sorted(kinds - {"KVCache"}))
    return (
        f"model family {family!r} keeps {other} state, which cannot be handed off between "
        "nodes; disaggregated serving supports families with a plain KV cache in every layer "
        "(llama, mistral, qwen2, qwen3, qwen3_moe, deepseek_v3, kimi_k2, glm4_moe, mixtral, "
        "phi3); serve this one from one node or split it with --pp-size"
    )


def pack(cache: Sequence[Any], prompt_len: int, first_token: int) -> Packed:
    """Trim each layer to the prompt (the batch generator may already hold the first sampled
    token, and pads its buffers in steps) and copy it out, dtype unchanged."""
    keys, values = [], []
    for c in cache:
        if type(c) is not KVCache or c.keys is None or c.offset < prompt_len:
            raise ValueError(f"layer cache {type(c).__name__} does not hold the whole prompt")
        k = c.keys[..., :prompt_len, :]
        v = c.values[..., :prompt_len, :]
        mx.eval(k, v)
        keys.append(to_tensor(k))
        values.append(to_tensor(v))
    return Packed(prompt_len, first_token, tuple(keys), tuple(values), tensor_digest(keys, values))


def unpack(h: KvHandoff) -> list[KVCache]:
    caches = []
    for k, v in zip(h.keys, h.values, strict=True):
        c = KVCache()
        keys, values = from_tensor(k), from_tensor(v)
        mx.eval(keys, values)
        c.state = (keys, values, h.prompt_len)
        caches.append(c)
    return caches
