"""How many KV-cache tokens a node holds and how many more would fit: what /cluster,
``status`` and ``mlxcel_node_kv_*`` show.

mlx-lm's caches grow as sequences do, so a node has no fixed slot count: its capacity is the
tokens it holds plus the tokens that fit in the memory MLX may still allocate
(``mx.get_memory_limit()`` less what is allocated now), at what one token costs on this node
(keys and values of every layer it runs, for its share of the heads). An estimate that moves
with everything else the process allocates -- which is what an operator wants to watch.
"""

from __future__ import annotations

from typing import Any

from mlxcel.base.model_config import decoder_config

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def bytes_per_token(config: dict[str, Any], n_layers: int, shards: int = 1) -> int:
    """Bytes of keys and values one token takes in ``n_layers`` layers of this model, split
    over ``shards`` tensor-parallel ranks (0: the config does not say)."""
    kv_heads, head_dim = kv_heads_and_dim(config)
    dtype = _DTYPE_BYTES.get(str(decoder_config(config).get("torch_dtype", "bfloat16")), 2)
    per_layer = 2 * kv_heads * head_dim * dtype  # keys and values
    return per_layer * n_layers // max(shards, 1)


def kv_heads_and_dim(config: dict[str, Any]) -> tuple[int, int]:
    """(key/value heads, head dim) of an attention layer of this model, from its config."""
    config = decoder_config(config)
    heads = int(config.get("num_attention_heads") or 0)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or (int(config.get("hidden_size", 0)) // max(heads, 1)))
    return kv_heads, head_dim


def capacity(used_tokens: int, per_token: int) -> int:
    """Tokens held plus the tokens that fit in what MLX may still allocate (0: unknown)."""
    if per_token <= 0:
        return 0
    import mlx.core as mx

    free = max(0, mx.get_memory_limit() - mx.get_active_memory())
    return used_tokens + free // per_token


def figures(
    used_tokens: int, config: dict[str, Any], n_layers: int, shards: int = 1
) -> dict[str, int]:
    """``kv_tokens`` and ``kv_capacity``, as State, /cluster and the metrics name them."""
    per_token = bytes_per_token(config, n_layers, shards)
    return {"kv_tokens": used_tokens, "kv_capacity": capacity(used_tokens, per_token)}


def prompt_cache_positions(
    budget: int, config: dict[str, Any], stage_layers: list[int], one_process: bool
) -> int:
    """How many cached prompt positions a split model's index may hold when each node's
    prompt cache has ``budget`` bytes (``--prompt-cache-bytes``): the stages of one process
    share one budget; stage processes each have their own, and the one with most layers bounds
    it. 0: no cache (no budget, or a config that does not say what a token costs)."""
    if budget <= 0 or not stage_layers:
        return 0
    costs = [bytes_per_token(config, n) for n in stage_layers]
    per_token = sum(costs) if one_process else max(costs)
    return budget // per_token if per_token > 0 else 0
