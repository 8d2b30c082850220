"""Loading a local checkpoint through mlx-lm, and running any contiguous layer range of it.

:class:`LayerRange` is the unit every parallel mode is built from: a pipeline stage runs one
range, the single-process runtime runs ``[0, n)``. It reuses mlx-lm's own modules (embedding,
decoder layers, final norm, head, masks and KV caches); it only decides which of them run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from loguru import logger
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from mlxcel.errors import ModelLoadError
from mlxcel.logs import adopt_library_logging
from mlxcel.progress import slow_task

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3")
SUBMIT_MIN_LAYERS = 8  # a range this long submits its first half early (see LayerRange)


@dataclass
class LoadedModel:
    path: Path
    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict[str, Any]

    @property
    def family(self) -> str:
        return str(self.config.get("model_type"))

    @property
    def n_layers(self) -> int:
        return len(self.model.model.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def name(self) -> str:
        return self.path.name

    def eos_token_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)


def context_length(config: dict[str, Any]) -> int:
    """The longest sequence (prompt + generated tokens) the model's config allows."""
    return int(config.get("max_position_embeddings", 1 << 30))


def load_model(path: str | Path, lazy: bool = False) -> LoadedModel:
    """Load a checkpoint from a local folder, never from a hub.

    ``lazy`` leaves weights memory-mapped until first used: a pipeline stage then only ever
    reads the layers it runs.
    """
    from mlx_lm.utils import load

    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"{p}: no config.json (is this a model folder?)")
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{p}/config.json: {exc}") from None
    if not list(p.glob("*.safetensors")):
        raise ModelLoadError(f"{p}: no *.safetensors weights")
    size = sum(f.stat().st_size for f in p.glob("*.safetensors"))
    started = time.perf_counter()
    try:
        with slow_task(f"loading {p.name}"):
            model, tokenizer = load(str(p), lazy=lazy)
    except Exception as exc:  # mlx-lm raises ValueError, KeyError, FileNotFoundError...
        raise ModelLoadError(f"{p}: {type(exc).__name__}: {exc}") from None
    adopt_library_logging()
    logger.info(
        "loaded model {} ({:.1f} MiB of weights{}) in {:.2f}s",
        p,
        size / 2**20,
        ", mapped lazily" if lazy else "",
        time.perf_counter() - started,
    )
    return LoadedModel(p, model, tokenizer, config)


class LayerRange:
    """Runs layers ``[start, end)`` of a dense decoder.

    The first range embeds token ids; the last applies the final norm and the LM head and
    returns logits. Every other range maps hidden states to hidden states.
    """

    def __init__(self, loaded: LoadedModel, start: int, end: int) -> None:
        n = loaded.n_layers
        if not 0 <= start < end <= n:
            raise ValueError(f"layer range [{start}, {end}) is not inside [0, {n})")
        if loaded.family not in SUPPORTED_FAMILIES:
            raise ModelLoadError(
                f"family {loaded.family!r} has no layer-range executor "
                f"(supported: {', '.join(SUPPORTED_FAMILIES)})"
            )
        self.loaded = loaded
        self.start = start
        self.end = end
        inner = loaded.model.model
        self.layers = inner.layers[start:end]
        self.is_first = start == 0
        self.is_last = end == n
        self._embed = inner.embed_tokens
        self._norm = inner.norm
        self._window = getattr(inner, "sliding_window", None)
        # Decoder layers after which the hidden states are submitted for evaluation while the
        # rest of the graph is still being built (mlx-lm's loop overlaps building with the
        # previous step; a stage that must evaluate its step overlaps within it instead).
        self.submit_at = len(self.layers) // 2 if len(self.layers) >= SUBMIT_MIN_LAYERS else None
        top = loaded.model
        self._head = (
            top.lm_head
            if hasattr(top, "lm_head") and not top.args.tie_word_embeddings
            else inner.embed_tokens.as_linear
        )

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype hidden states travel in (the embedding's, as mlx-lm computes them)."""
        return getattr(self._embed, "scales", self._embed.weight).dtype  # quantized: scales

    def make_cache(self) -> list[Any]:
        """Fresh per-sequence KV caches for this range's layers (mlx-lm's cache types)."""
        return make_prompt_cache(self.loaded.model)[self.start : self.end]

    def __call__(self, x: mx.array, cache: list[Any] | None = None, head: str = "all") -> mx.array:
        """``x``: token ids ``[B, L]`` on the first range, hidden ``[B, L, D]`` otherwise.

        On the last range ``head`` picks what comes out: ``"all"`` logits for every position,
        ``"last"`` for the last position only (what sampling needs; the head is the largest
        matmul of a prompt chunk), ``"none"`` the final hidden states (a cache-filling chunk).
        """
        h = self._embed(x) if self.is_first else x
        if cache is None:
            cache = [None] * len(self.layers)
        masks: dict[bool, Any] = {}
        for i, (layer, c) in enumerate(zip(self.layers, cache, strict=True)):
            if i == self.submit_at:
                mx.async_eval(h)
            sliding = bool(getattr(layer, "use_sliding", False))
            if sliding not in masks:
                masks[sliding] = create_attention_mask(
                    h, c, window_size=self._window if sliding else None
                )
            h = layer(h, masks[sliding], cache=c)
        if self.is_last and head != "none":
            if head == "last":
                h = h[:, -1:, :]
            h = self._head(self._norm(h))
        return h


def split_even(n_layers: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal ranges covering ``[0, n_layers)``."""
    if not 1 <= parts <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {parts} ranges")
    base, extra = divmod(n_layers, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def load_tokenizer_only(path: str | Path) -> tuple[Any, dict[str, Any]]:
    """The tokenizer and config of a checkpoint without its weights (a coordinator's needs)."""
    from mlx_lm.utils import load_tokenizer

    p = Path(path).expanduser()
    try:
        config = json.loads((p / "config.json").read_text())
        tokenizer = load_tokenizer(p, eos_token_ids=config.get("eos_token_id"))
    except Exception as exc:
        raise ModelLoadError(f"{p}: {type(exc).__name__}: {exc}") from None
    adopt_library_logging()
    return tokenizer, config


def extract_row(batch: list[Any], row: int) -> list[Any]:
    """Row ``row`` of a batch cache (one BatchKVCache per layer) as one sequence's own caches
    (a KVCache per layer, without padding). Every layer of a batch has the same padding, so it
    is read from the device once, not once per layer as ``BatchKVCache.extract`` would."""
    pad = int(batch[0].left_padding[row].item())
    out = []
    for c in batch:
        one = KVCache()
        one.keys = mx.contiguous(c.keys[row : row + 1, :, pad : c._idx])
        one.values = mx.contiguous(c.values[row : row + 1, :, pad : c._idx])
        one.offset = one.keys.shape[2]
        out.append(one)
    return out


def merge_rows(caches: list[list[Any]]) -> list[Any]:
    """Several sequences' own caches (a KVCache per layer each) as one batch cache, rows in
    this order, left-padded to the longest (mlx-lm's ``BatchKVCache.merge``)."""
    return [BatchKVCache.merge(list(layer)) for layer in zip(*caches, strict=True)]
