"""What differs between model families when a forward pass is cut into layer ranges.

mlx-lm's own ``Model.__call__`` runs every layer in one loop; a pipeline stage runs only a
contiguous range of them and hands the hidden states on. A family's forward pass differs from
the next in a few places only, and those places -- and nothing else -- are what a
:class:`Family` adapter says:

- where the decoder lives (``model.model``, or ``model.language_model.model`` for the
  multimodal-shaped checkpoints of Qwen 3.5 and Kimi K3);
- how tokens are embedded (Gemma scales the embedding by sqrt(hidden));
- which mask each layer takes: full causal attention, a sliding window (and its size), the
  linear-attention / SSM mask of hybrid models, or an array mask (MLA attention needs one);
- how a layer is called, and any state besides the hidden states that flows from layer to
  layer (Kimi K3's attention residuals keep every block's input), which then also crosses the
  stage boundary;
- whether mlx-lm can shard the family for tensor parallelism (``Model.shard``), and which of its
  sizes a rank count must divide.

Everything else -- the layers, their caches (``model.make_cache()`` where the family defines
it), the masks themselves, the final norm and the LM head -- is mlx-lm's own code, so a new
mlx-lm family costs an adapter here, not a new executor. The families' forwards follow mlx-lm's
``PipelineMixin`` models, which cut at exactly these places.

Which families run, and whether a checkpoint splits, is read from config.json alone
(:func:`check_splittable`): a pipeline coordinator plans a split with it and never runs a
layer. So MLX is imported inside the few methods that compute, not with this module, and a
coordinator that holds no model never loads MLX.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxcel.base.errors import ModelLoadError
from mlxcel.base.model_config import decoder_config

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn


@dataclass(frozen=True)
class MaskKind:
    """Which mask a layer takes. Layers of one kind share one mask, made from the cache of the
    first of them in the range (every layer of a kind has the same cache type and offset)."""

    linear: bool = False  # linear attention / SSM (create_ssm_mask)
    window: int | None = None  # sliding-window attention of this many positions
    array: bool = False  # a boolean array even where "causal" would do (MLA attention)

    def make(self, h: mx.array, cache: Any) -> Any:
        from mlx_lm.models.base import create_attention_mask, create_ssm_mask

        if self.linear:
            return create_ssm_mask(h, cache)
        return create_attention_mask(h, cache, window_size=self.window, return_array=self.array)


FULL = MaskKind()


class Family:
    """The dense decoder shape most families share (Llama, Qwen 2/3, Mixtral, Phi-3, the
    MoE families whose layers differ only inside): tokens embedded, every layer
    ``layer(h, mask, cache)`` under the full causal mask, a final norm, then the LM head (or
    the embedding as a linear layer when tied)."""

    names: tuple[str, ...] = ()
    # The checkpoint is multimodal-shaped: the decoder and head live under ``language_model``.
    multimodal = False
    # Config sizes a tensor-parallel rank count must divide (None: mlx-lm cannot shard it).
    tp_sizes: tuple[str, ...] | None = None

    # --- where things are -------------------------------------------------------------------------
    def text_model(self, model: nn.Module) -> nn.Module:
        """The module holding the decoder (``.model``) and the LM head."""
        return model.language_model if self.multimodal else model

    def decoder(self, model: nn.Module) -> nn.Module:
        return self.text_model(model).model

    def text_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The part of config.json that describes the decoder."""
        return decoder_config(config)

    # --- the forward pass ---------------------------------------------------------------------------
    def embed(self, decoder: nn.Module, tokens: mx.array) -> mx.array:
        return decoder.embed_tokens(tokens)

    def mask_kind(self, decoder: nn.Module, index: int) -> MaskKind:
        """The mask of layer ``index`` (absolute)."""
        return FULL

    def start_carry(self, decoder: nn.Module) -> Any:
        """State beside the hidden states that the first layer starts from (None: none)."""
        return None

    def run_layer(
        self, layer: nn.Module, h: mx.array, mask: Any, cache: Any, carry: Any
    ) -> tuple[mx.array, Any]:
        return layer(h, mask, cache), carry

    def finish(self, decoder: nn.Module, h: mx.array, carry: Any) -> mx.array:
        """The last layer's output as the final norm takes it."""
        return h

    def head(self, model: nn.Module, h: mx.array) -> mx.array:
        """Final norm and LM head: the family's own, or the embedding when tied."""
        import mlx.nn as nn

        text = self.text_model(model)
        h = text.model.norm(h)
        # mlx-lm builds an LM head exactly when the family's forward uses one: only when untied
        # for most, always for DeepSeek, GLM and gpt-oss; Gemma drops its own when the
        # checkpoint has none, Kimi K3 sets it to None.
        lm_head = getattr(text, "lm_head", None)
        if isinstance(lm_head, nn.Module):
            return lm_head(h)
        return text.model.embed_tokens.as_linear(h)

    # --- what crosses a stage boundary ------------------------------------------------------------
    def boundary_width(self, config: dict[str, Any], layer: int) -> int:
        """Width of the activation entering layer ``layer`` (> 0) from an upstream stage."""
        return int(self.text_config(config)["hidden_size"])

    def pack(self, h: mx.array, carry: Any) -> mx.array:
        """Hidden states (and any carry) as one ``[B, L, width]`` activation."""
        return h

    def unpack(self, decoder: nn.Module, x: mx.array) -> tuple[mx.array, Any]:
        return x, self.start_carry(decoder)

    def tp_checks(self, config: dict[str, Any]) -> dict[str, int]:
        """The sizes a tensor-parallel rank count must divide, by name (what the family's
        ``shard()`` splits: heads, MLP and expert widths, linear-attention heads ...)."""
        text = self.text_config(config)
        want = self.tp_sizes or ()
        return {
            name: int(text[key])
            for name, key in _TP_KEYS.items()
            if key in want and text.get(key) is not None
        }

    def tp_problems(self, config: dict[str, Any], n: int) -> list[str]:
        """What keeps ``shard()`` from splitting this model over ``n`` ranks ([]: nothing):
        each size it splits must divide by ``n``, and in a quantized checkpoint each rank's
        slice of a width must be whole quantization groups (the scales split with it)."""
        bad = [
            f"{name} {value} not divisible by {n}"
            for name, value in self.tp_checks(config).items()
            if value % n
        ]
        group = int((config.get("quantization") or {}).get("group_size") or 0)
        if group and not bad:
            text = self.text_config(config)
            widths = {k: v for k, v in self.tp_checks(config).items() if "heads" not in k}
            heads = int(text.get("num_attention_heads") or 0)
            head_dim = int(text.get("head_dim") or text.get("v_head_dim") or 0)
            if heads and head_dim and "num_attention_heads" in (self.tp_sizes or ()):
                widths["attention output width"] = heads * head_dim
            bad += [
                f"{name} {value} / {n} = {value // n} is not a whole number of "
                f"{group}-wide quantization groups"
                for name, value in widths.items()
                if (value // n) % group
            ]
        return bad


_TP_KEYS = {
    "attention heads": "num_attention_heads",
    "key/value heads": "num_key_value_heads",
    "MLP intermediate size": "intermediate_size",
    "MoE intermediate size": "moe_intermediate_size",
    "linear-attention key heads": "linear_num_key_heads",
    "linear-attention value heads": "linear_num_value_heads",
}
_DENSE_TP = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


class Llama(Family):
    """Llama and Mistral (which mlx-lm runs as Llama): optional sliding-window layers."""

    names = ("llama", "mistral")
    tp_sizes = _DENSE_TP

    def mask_kind(self, decoder: nn.Module, index: int) -> MaskKind:
        if getattr(decoder.layers[index], "use_sliding", False):
            return MaskKind(window=decoder.sliding_window)
        return FULL


class Dense(Family):
    names = ("qwen2", "qwen3")
    tp_sizes = _DENSE_TP


class Qwen3Moe(Family):
    names = ("qwen3_moe",)
    # mlx-lm shards each expert's matrices across ranks (every rank keeps every expert).
    tp_sizes = ("num_attention_heads", "num_key_value_heads", "moe_intermediate_size")

    def tp_checks(self, config: dict[str, Any]) -> dict[str, int]:
        out = super().tp_checks(config)
        text = self.text_config(config)
        if text.get("mlp_only_layers") or int(text.get("decoder_sparse_step") or 1) > 1:
            out["MLP intermediate size"] = int(text["intermediate_size"])  # its dense layers
        return out


class PlainFamily(Family):
    """Families mlx-lm runs whole but cannot shard for tensor parallelism."""

    names = ("mixtral", "phi3")


class DeepseekV3(Family):
    """DeepSeek-V3 and Kimi K2: MLA attention (an array mask), dense first layers
    (``first_k_dense_replace``), then routed and shared experts."""

    names = ("deepseek_v3", "kimi_k2")
    tp_sizes = ("num_attention_heads", "moe_intermediate_size", "intermediate_size")

    def mask_kind(self, decoder: nn.Module, index: int) -> MaskKind:
        return MaskKind(array=True)


class Glm4Moe(Family):
    names = ("glm4_moe",)
    tp_sizes = (
        "num_attention_heads",
        "num_key_value_heads",
        "moe_intermediate_size",
        "intermediate_size",
    )


class GptOss(Family):
    """gpt-oss: sliding and full attention layers alternate as ``layer_types`` says."""

    names = ("gpt_oss",)
    tp_sizes = ("num_attention_heads", "num_key_value_heads", "intermediate_size")

    def mask_kind(self, decoder: nn.Module, index: int) -> MaskKind:
        if decoder.layer_types[index] == "full_attention":
            return FULL
        return MaskKind(window=decoder.window_size)


class Gemma3(Family):
    """Gemma 3: the embedding scaled by sqrt(hidden) (rounded through bfloat16, as mlx-lm
    does), five sliding-window layers to each full one."""

    names = ("gemma3_text",)

    def embed(self, decoder: nn.Module, tokens: mx.array) -> mx.array:
        import mlx.core as mx

        h = decoder.embed_tokens(tokens)
        return h * mx.array(decoder.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)

    def mask_kind(self, decoder: nn.Module, index: int) -> MaskKind:
        pattern = decoder.sliding_window_pattern
        if index % pattern == pattern - 1:
            return FULL
        return MaskKind(window=decoder.window_size)


class Qwen35(Family):
    """Qwen 3.5, dense and MoE: three gated-delta (linear attention) layers to each full
    attention layer; the checkpoint is multimodal-shaped (the decoder under
    ``language_model``)."""

    names = ("qwen3_5", "qwen3_5_moe")
    multimodal = True
    tp_sizes = (
        "num_attention_heads",
        "intermediate_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "linear_num_key_heads",
        "linear_num_value_heads",
    )

    def mask_kind(self, decoder: nn.Module, index: int) -> MaskKind:
        return MaskKind(linear=True) if decoder.layers[index].is_linear else FULL

    def tp_checks(self, config: dict[str, Any]) -> dict[str, int]:
        out = super().tp_checks(config)
        text = self.text_config(config)
        # mlx-lm reads the decoder's own flag (text_config's, default untied); an untied head
        # is split by vocabulary
        if not config.get("text_config", config).get("tie_word_embeddings", False):
            out["vocabulary size"] = int(text["vocab_size"])
        return out

    def tp_problems(self, config: dict[str, Any], n: int) -> list[str]:
        # Fewer key/value heads than ranks are repeated (mlx-lm's repeat_kv_layer_inplace):
        # they must divide the rank count, or it them.
        kv = int(self.text_config(config).get("num_key_value_heads") or 0)
        bad = (
            [f"key/value heads {kv} neither divide nor are divisible by {n}"]
            if kv and kv % n and n % kv
            else []
        )
        return bad + super().tp_problems(config, n)


class KimiK3(Family):
    """Kimi K3: Kimi delta attention (linear) and MLA layers, a dense first layer, then
    experts; with attention residuals every layer mixes the inputs of all earlier blocks, so
    those inputs travel with the hidden states from layer to layer and across stages, packed
    beside them on the last axis (``[B, L, (blocks + 1) * hidden]``)."""

    names = ("kimi_k3",)
    multimodal = True
    tp_sizes = ("num_attention_heads", "moe_intermediate_size", "intermediate_size")

    def mask_kind(self, decoder: nn.Module, index: int) -> MaskKind:
        return MaskKind(linear=True) if decoder.layers[index].is_linear else MaskKind(array=True)

    def tp_checks(self, config: dict[str, Any]) -> dict[str, int]:
        out = super().tp_checks(config)
        linear = self.text_config(config).get("linear_attn_config") or {}
        if "num_heads" in linear:
            out["linear-attention heads"] = int(linear["num_heads"])
        return out

    def start_carry(self, decoder: nn.Module) -> Any:
        if not decoder.use_attn_res:
            return None
        from mlx_lm.models.kimi_k3 import ResidualBlocks

        return ResidualBlocks(decoder.args.rms_norm_eps)

    def run_layer(
        self, layer: nn.Module, h: mx.array, mask: Any, cache: Any, carry: Any
    ) -> tuple[mx.array, Any]:
        return layer(h, mask=mask, cache=cache, blocks=carry)

    def finish(self, decoder: nn.Module, h: mx.array, carry: Any) -> mx.array:
        import mlx.core as mx
        from mlx_lm.models.kimi_k3 import _attn_res_mix

        if carry is None:
            return h

        if decoder._output_res_w_eff is None:
            decoder._output_res_w_eff = decoder.output_attn_res_norm.weight.astype(
                mx.float32
            ) * decoder.output_attn_res_proj.weight.reshape(-1)
        return _attn_res_mix(carry, h, decoder._output_res_w_eff, decoder.args.rms_norm_eps)

    def boundary_width(self, config: dict[str, Any], layer: int) -> int:
        text = self.text_config(config)
        hidden = int(text["hidden_size"])
        block = text.get("attn_res_block_size")
        return hidden if not block else hidden * (math.ceil(layer / int(block)) + 1)

    def pack(self, h: mx.array, carry: Any) -> mx.array:
        import mlx.core as mx

        if carry is None or carry.raw is None:
            return h
        raw = carry.raw.astype(h.dtype)  # [K, B, L, D]
        k, b, n, d = raw.shape
        flat = raw.transpose(1, 2, 0, 3).reshape(b, n, k * d)
        return mx.concatenate([flat, h], axis=-1)

    def unpack(self, decoder: nn.Module, x: mx.array) -> tuple[mx.array, Any]:
        import mlx.core as mx

        carry = self.start_carry(decoder)
        d = decoder.args.hidden_size
        if carry is None or x.shape[-1] == d:
            return x, carry
        b, n, width = x.shape
        k = width // d - 1
        parts = x.reshape(b, n, k + 1, d)
        carry.raw = parts[:, :, :k, :].transpose(2, 0, 1, 3)
        xf = carry.raw.astype(mx.float32)
        carry.inv_rms = mx.rsqrt((xf * xf).mean(axis=-1) + decoder.args.rms_norm_eps)
        return parts[:, :, k, :], carry


_ADAPTERS: tuple[Family, ...] = (
    Llama(),
    Dense(),
    Qwen3Moe(),
    PlainFamily(),
    DeepseekV3(),
    Glm4Moe(),
    GptOss(),
    Gemma3(),
    Qwen35(),
    KimiK3(),
)
FAMILIES: dict[str, Family] = {name: a for a in _ADAPTERS for name in a.names}
SUPPORTED_FAMILIES = tuple(FAMILIES)
TP_FAMILIES = tuple(name for name, a in FAMILIES.items() if a.tp_sizes is not None)


def family_of(config: dict[str, Any]) -> str:
    return str(config.get("model_type"))


def adapter_for(config: dict[str, Any]) -> Family | None:
    return FAMILIES.get(family_of(config))


def read_config(path: str | Path) -> dict[str, Any]:
    """A checkpoint's config.json, which must be a JSON object."""
    p = Path(path).expanduser() / "config.json"
    try:
        config = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{p}: {exc}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{p}: not a JSON object but a {type(config).__name__}")
    return config


def layer_count(config: dict[str, Any]) -> int:
    """The decoder's layer count, which must be a positive integer."""
    n = decoder_config(config).get("num_hidden_layers")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ModelLoadError(
            f"config.json: num_hidden_layers must be a positive integer, not {n!r}"
        )
    return n


def check_splittable(path: str | Path) -> dict[str, Any]:
    """The config.json of the checkpoint at ``path``, once its family is known to have a
    layer-range executor: a family none runs is refused before any weight loads."""
    config = read_config(path)
    require_family(config)
    layer_count(config)
    return config


def require_family(config: dict[str, Any]) -> Family:
    """The family's adapter, or a ModelLoadError naming the family and the supported list
    (checked from config.json, before any weight loads)."""
    if not config.get("model_type"):
        raise ModelLoadError(
            f"config.json names no model_type (supported: {', '.join(SUPPORTED_FAMILIES)})"
        )
    family = adapter_for(config)
    if family is None:
        raise ModelLoadError(
            f"family {family_of(config)!r} has no layer-range executor "
            f"(supported: {', '.join(SUPPORTED_FAMILIES)})"
        )
    return family
