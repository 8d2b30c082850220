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
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from mlxcel.base.errors import ConfigError, ModelLoadError
from mlxcel.base.model_config import decoder_config, vocab_size
from mlxcel.process.logs import adopt_library_logging
from mlxcel.process.progress import slow_task
from mlxcel.runtime.families import MaskKind, require_family

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
        return int(decoder_config(self.config)["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return vocab_size(self.config)

    @property
    def name(self) -> str:
        return self.path.name

    def eos_token_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)


def load_model(
    path: str | Path, lazy: bool = False, adapter_path: Path | None = None
) -> LoadedModel:
    """Load a checkpoint from a local folder, never from a hub.

    ``lazy`` leaves weights memory-mapped until first used: a pipeline stage then only ever
    reads the layers it runs. ``adapter_path``: a LoRA adapter mlx-lm applies on load.
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
    if adapter_path is not None:
        from mlx_lm.tuner.utils import load_adapters

        try:  # as mlx-lm's load(adapter_path=) does, with the failure named by its flag
            model = load_adapters(model, str(adapter_path))
        except Exception as exc:  # an adapter for another model: shapes or names differ
            raise ConfigError(
                "--adapter-path", f"{adapter_path} does not fit {p.name}: {exc}"
            ) from None
        model.eval()
    adopt_library_logging()
    logger.info(
        "loaded model {} ({:.1f} MiB of weights{}{}) in {:.2f}s",
        p,
        size / 2**20,
        ", mapped lazily" if lazy else "",
        f", LoRA adapter {adapter_path}" if adapter_path is not None else "",
        time.perf_counter() - started,
    )
    return LoadedModel(p, model, tokenizer, config)


class LayerRange:
    """Runs layers ``[start, end)`` of any supported family (see :mod:`.families`).

    The first range embeds token ids; the last applies the final norm and the LM head and
    returns logits. Every other range maps an activation to an activation: the hidden states,
    plus whatever state the family carries from layer to layer (packed beside them).
    """

    def __init__(self, loaded: LoadedModel, start: int, end: int) -> None:
        n = loaded.n_layers
        if not 0 <= start < end <= n:
            raise ValueError(f"layer range [{start}, {end}) is not inside [0, {n})")
        family = require_family(loaded.config)
        self.family = family
        self.loaded = loaded
        self.start = start
        self.end = end
        self._decoder = family.decoder(loaded.model)
        self.layers = self._decoder.layers[start:end]
        self.is_first = start == 0
        self.is_last = end == n
        self._kinds = [family.mask_kind(self._decoder, i) for i in range(start, end)]
        # Width of the activation this range takes (0: token ids): the hidden size, or more
        # where the family carries state across the boundary (what the stage gate checks).
        self.in_width = 0 if self.is_first else family.boundary_width(loaded.config, start)
        # Decoder layers after which the hidden states are submitted for evaluation while the
        # rest of the graph is still being built (mlx-lm's loop overlaps building with the
        # previous step; a stage that must evaluate its step overlaps within it instead).
        self.submit_at = len(self.layers) // 2 if len(self.layers) >= SUBMIT_MIN_LAYERS else None

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype hidden states travel in (the embedding's, as mlx-lm computes them)."""
        embed = self._decoder.embed_tokens
        return getattr(embed, "scales", embed.weight).dtype  # quantized: scales

    def make_cache(self) -> list[Any]:
        """Fresh per-sequence caches for this range's layers: the family's own cache types
        (``make_cache()`` where it defines one: rotating, linear-attention state ...)."""
        return make_prompt_cache(self.loaded.model)[self.start : self.end]

    def __call__(self, x: mx.array, cache: list[Any] | None = None, head: str = "all") -> mx.array:
        """``x``: token ids ``[B, L]`` on the first range, an activation ``[B, L, in_width]``
        otherwise.

        On the last range ``head`` picks what comes out: ``"all"`` logits for every position,
        ``"last"`` for the last position only (what sampling needs; the head is the largest
        matmul of a prompt chunk), ``"none"`` the final hidden states (a cache-filling chunk).
        """
        fam, dec = self.family, self._decoder
        if self.is_first:
            h, carry = fam.embed(dec, x), fam.start_carry(dec)
        else:
            h, carry = fam.unpack(dec, x)
        if cache is None:
            cache = [None] * len(self.layers)
        masks: dict[MaskKind, Any] = {}
        for i, (layer, kind, c) in enumerate(zip(self.layers, self._kinds, cache, strict=True)):
            if i == self.submit_at:
                mx.async_eval(h)
            if kind not in masks:
                masks[kind] = kind.make(h, c)
            h, carry = fam.run_layer(layer, h, masks[kind], c, carry)
        if not self.is_last:
            return fam.pack(h, carry)
        h = fam.finish(dec, h, carry)
        if head == "none":
            return h
        if head == "last":
            h = h[:, -1:, :]
        return fam.head(self.loaded.model, h)


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


def extract_row(batch: list[Any], row: int) -> list[Any]:
    """Row ``row`` of a batch cache (one batch cache per layer) as one sequence's own caches,
    without padding. A plain batch KV cache has the same padding in every layer, so it is read
    from the device once, not once per layer as ``BatchKVCache.extract`` would; other cache
    types (rotating, linear-attention state) extract themselves."""
    if not all(type(c) is BatchKVCache for c in batch):
        return [c.extract(row) for c in batch]
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
    """Several sequences' own caches (one per layer each) as one batch cache, rows in this
    order: each layer's cache type merges itself (mlx-lm's ``merge``: a KV cache left-padded
    to the longest, a rotating one per its window, recurrent state row by row)."""
    return [type(layer[0]).merge(list(layer)) for layer in zip(*caches, strict=True)]


def cache_arrays(cache: list[Any]) -> list[mx.array]:
    """Every array a list of layer caches holds (to evaluate them)."""
    from mlx.utils import tree_flatten

    return [a for _, a in tree_flatten([c.state for c in cache]) if isinstance(a, mx.array)]
