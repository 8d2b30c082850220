"""What a checkpoint's config.json says about its decoder, read the same way everywhere.

Pure functions over the parsed JSON (no MLX, no files), so the partitioner -- which the
bring-up core plans with -- and the runtime read one model the same way.
"""

from __future__ import annotations

from typing import Any


def decoder_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json with the decoder's own fields on top: a multimodal-shaped checkpoint (Qwen
    3.5, Kimi K3) keeps them under ``text_config``."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    return {**config, **text, "model_type": config.get("model_type")}


def vocab_size(config: dict[str, Any]) -> int:
    """The model's vocabulary: the width of its logits."""
    return int(decoder_config(config)["vocab_size"])


def context_length(config: dict[str, Any]) -> int:
    """The longest sequence (prompt + generated tokens) the model's config allows."""
    return int(decoder_config(config).get("max_position_embeddings", 1 << 30))


def active_fraction(config: dict[str, Any]) -> float:
    """The share of an MoE layer's routed experts one token runs through (1: dense)."""
    experts = next(
        (
            int(config[k])
            for k in ("n_routed_experts", "num_experts", "num_local_experts")
            if config.get(k)
        ),
        0,
    )
    top_k = next(
        (int(config[k]) for k in ("num_experts_per_tok", "num_experts_per_token") if config.get(k)),
        0,
    )
    return min(1.0, top_k / experts) if experts and top_k else 1.0
