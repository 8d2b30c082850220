"""Deterministic random-weight checkpoints in the Hugging Face layout.

Tests and benchmarks need real checkpoints without a model hub: real config.json, sharded
safetensors with an index, and a real byte-level BPE tokenizer (trained with the
``tokenizers`` library on a generated corpus) with a chat template. The model object comes
from mlx-lm's own architecture classes, so what we write is exactly what mlx-lm loads.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlxcel.base.model_config import decoder_config
from mlxcel.process.progress import slow_task, step_bar

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as Qwen's, with its tool calling: offered tools are listed in a system turn, and a
# call is JSON between <tool_call> markers (from which mlx-lm picks its json_tools parser).
# Without tools it renders exactly the plain ChatML turns.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions. Signatures:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\nFor each call, reply with a JSON object between markers:\n'"
    ' + \'<tool_call>{"name": NAME, "arguments": ARGS}</tool_call><|im_end|>\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response>"
    "<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for tool_call in message.get('tool_calls') or [] %}"
    "{% if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}"
    '{{ \'<tool_call>{"name": "\' + tool_call.name + \'", "arguments": \' '
    "+ (tool_call.arguments | tojson) + '}</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endif %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PROJ_SCALE = 2.5


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int  # model vocabulary (>= the tokenizer's)
    tokenizer_vocab: int
    dtype: str
    max_positions: int
    tied: bool = True  # the LM head shares the embedding's weights (small Qwen3s do; 8B+ do not)
    experts: int = 0  # routed experts of an MoE family at this shape (0: the family's own)
    moe_intermediate: int = 0  # each expert's MLP width (0: a quarter of ``intermediate``)


SHAPES: dict[str, Shape] = {
    "tiny": Shape(64, 4, 4, 2, 16, 128, 512, 512, "float32", 4096),
    "small": Shape(512, 8, 8, 4, 64, 1536, 8192, 8192, "float32", 8192),
    # The real Qwen3-0.6B shapes (vocabulary padded past our small tokenizer, as real ones are).
    "qwen3-0.6b": Shape(1024, 28, 16, 8, 128, 3072, 151936, 8192, "bfloat16", 40960),
    # The shapes a user would split over stages or GPUs (Qwen3-8B: 16 GB in bf16, 14B: 30 GB).
    "qwen3-8b": Shape(4096, 36, 32, 8, 128, 12288, 151936, 8192, "bfloat16", 40960, False),
    "qwen3-14b": Shape(5120, 40, 40, 8, 128, 17408, 151936, 8192, "bfloat16", 40960, False),
    # Qwen3-30B-A3B (with --family qwen3_moe): 128 experts of width 768, 8 per token; 61 GB
    # in bf16, 3.3B parameters active per token.
    "qwen3-30b-a3b": Shape(
        2048, 48, 32, 4, 128, 6144, 151936, 8192, "bfloat16", 40960, False, 128, 768
    ),
}

_SYLLABLES = [
    c + v
    for c in ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w"]
    for v in ["a", "e", "i", "o", "u", "ai", "ou", "er"]
]
_SEED_TEXT = (
    "The quick brown fox jumps over the lazy dog. Hello, world! Distributed inference "
    "splits one model over several machines. Pipeline stages pass activations; tensor "
    "parallel ranks share each layer. 0123456789 + - * / = ( ) [ ] { } < > ; : ' \" ? !\n"
)


def _corpus(n_words: int) -> list[str]:
    rng = random.Random(1234)  # fixed: the tokenizer does not depend on --seed
    words = ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(4000)]
    lines = [_SEED_TEXT] * 50
    line: list[str] = []
    for _ in range(n_words):
        line.append(rng.choice(words) if rng.random() < 0.9 else str(rng.randint(0, 999)))
        if len(line) >= 12:
            lines.append(" ".join(line) + ".\n")
            line = []
    return lines


def build_tokenizer(vocab_size: int) -> Any:
    """Train a byte-level BPE of exactly ``vocab_size`` tokens (specials included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(max(20000, vocab_size * 40)), trainer=trainer)
    return tok


def model_config(shape: Shape, family: str) -> dict[str, Any]:
    """config.json for ``family`` at ``shape``: the dense fields every family shares, then the
    family's own structure (experts, MLA, sliding windows, linear attention) shrunk to fit."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0 if family != "llama" else 500000.0,
        "tie_word_embeddings": shape.tied and family not in UNTIED,
        "hidden_act": "silu",
        "torch_dtype": shape.dtype,
        "bos_token_id": 0,
        "pad_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>"),
        "attention_bias": family == "qwen2",
    }
    structure = _STRUCTURE.get(family)
    if structure is not None:
        cfg.update(structure(shape))
    if family in NESTED:  # multimodal-shaped checkpoints keep the decoder under text_config
        top = {k: cfg.pop(k) for k in ("architectures", "model_type", "torch_dtype")}
        top["eos_token_id"] = cfg["eos_token_id"]
        top["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        return {**top, "text_config": {**cfg, "model_type": f"{family}_text"}}
    return cfg


def _experts(shape: Shape, n: int = 4) -> int:
    """Experts of a shrunk MoE: several (top-k > 1 picks among them), each narrow."""
    return shape.experts or (4 if shape.hidden <= 512 else n)


def _moe_width(shape: Shape) -> int:
    return shape.moe_intermediate or max(16, shape.intermediate // 4)


def _mla(shape: Shape) -> dict[str, Any]:
    """Multi-head latent attention, shrunk: low-rank queries and a compressed KV latent."""
    return {
        "q_lora_rank": shape.hidden // 2 + shape.hidden // 4,
        "kv_lora_rank": shape.hidden // 2,
        "qk_rope_head_dim": max(8, shape.head_dim // 2),
        "qk_nope_head_dim": shape.head_dim,
        "v_head_dim": shape.head_dim,
        "num_key_value_heads": shape.heads,
    }


def _qwen3_moe(shape: Shape) -> dict[str, Any]:
    return {
        "num_experts": _experts(shape, 128),
        "num_experts_per_tok": 8 if shape.experts >= 64 else 2,
        "moe_intermediate_size": _moe_width(shape),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    }


def _deepseek_v3(shape: Shape) -> dict[str, Any]:
    return {
        **_mla(shape),
        "n_routed_experts": _experts(shape, 256),
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": _moe_width(shape),
        "first_k_dense_replace": 1,  # a dense first layer before the expert layers
        "moe_layer_freq": 1,
        "n_group": 2,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
    }


def _glm4_moe(shape: Shape) -> dict[str, Any]:
    return {
        "n_routed_experts": _experts(shape, 160),
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": _moe_width(shape),
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "use_qk_norm": True,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
        "rope_scaling": None,
    }


def _gpt_oss(shape: Shape) -> dict[str, Any]:
    return {
        "num_local_experts": _experts(shape, 128),
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"] * (shape.layers // 2),
        "rope_theta": 150000,
    }


def _mixtral(shape: Shape) -> dict[str, Any]:
    return {"num_local_experts": _experts(shape, 8), "num_experts_per_tok": 2}


def _gemma3(shape: Shape) -> dict[str, Any]:
    return {
        "sliding_window": 8,  # short, so test prompts outgrow it and the cache rotates
        "sliding_window_pattern": 6,  # five sliding layers to each full one, as released
        "query_pre_attn_scalar": shape.head_dim,
        "rope_local_base_freq": 10000.0,
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _qwen3_5(shape: Shape) -> dict[str, Any]:
    return {
        "full_attention_interval": 4,  # three gated-delta layers to each attention layer
        "linear_num_value_heads": shape.heads,
        "linear_num_key_heads": max(1, shape.heads // 2),
        "linear_key_head_dim": shape.head_dim,
        "linear_value_head_dim": shape.head_dim,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {
            "type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
        },
    }


def _qwen3_5_moe(shape: Shape) -> dict[str, Any]:
    """Qwen 3.5's hybrid layers with routed experts and a shared expert in every layer."""
    return {
        **_qwen3_5(shape),
        "num_experts": _experts(shape, 256),
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": _moe_width(shape),
        "shared_expert_intermediate_size": _moe_width(shape),
        "norm_topk_prob": True,
    }


def _kimi_k3(shape: Shape) -> dict[str, Any]:
    n = shape.layers
    return {
        **_mla(shape),
        "hidden_act": "situ",
        "activation_situ_beta": 1.0,
        # Kimi delta attention (linear) layers, 1-based; every fourth layer is MLA.
        "linear_attn_config": {
            "kda_layers": [i for i in range(1, n + 1) if i % 4],
            "num_heads": shape.heads,
            "head_dim": shape.head_dim,
            "short_conv_kernel_size": 4,
        },
        "attn_res_block_size": 2,
        "num_experts": _experts(shape, 384),
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": _moe_width(shape),
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
    }


_STRUCTURE = {
    "qwen3_moe": _qwen3_moe,
    "deepseek_v3": _deepseek_v3,
    "kimi_k2": _deepseek_v3,
    "glm4_moe": _glm4_moe,
    "gpt_oss": _gpt_oss,
    "mixtral": _mixtral,
    "gemma3_text": _gemma3,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
    "kimi_k3": _kimi_k3,
}
ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "gemma3_text": "Gemma3ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
    "kimi_k3": "KimiK3ForConditionalGeneration",
    "glm4_moe": "Glm4MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
FAMILIES = tuple(ARCHITECTURES)
# Families whose released checkpoints keep a separate LM head whatever the size.
UNTIED = frozenset(
    {
        "llama",
        "mistral",
        "qwen3_moe",
        "qwen3_5_moe",
        "deepseek_v3",
        "kimi_k2",
        "kimi_k3",
        "glm4_moe",
        "gpt_oss",
        "mixtral",
        "phi3",
    }
)
NESTED = frozenset({"qwen3_5", "qwen3_5_moe", "kimi_k3"})
# The fewest layers that show a family's structure: a full layer after its sliding ones
# (Gemma 3), after its linear ones (Qwen 3.5, Kimi K3), a dense layer before expert layers.
MIN_LAYERS = {"gemma3_text": 6, "qwen3_5": 8, "qwen3_5_moe": 8, "kimi_k3": 8, "gpt_oss": 4}


def _random_model(model_cls: Any, args_cls: Any, config: dict[str, Any], dtype: str) -> Any:
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    model = model_cls(args_cls.from_dict(config))
    # mlx's default init leaves a random model collapsing onto one repeated token; wider
    # projections make greedy output depend on the prompt, which makes equality tests bite.
    model.update(
        tree_map_with_path(
            lambda path, a: a * PROJ_SCALE if path.endswith("proj.weight") else a,
            model.parameters(),
        )
    )
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model


def write_checkpoint(
    out: Path,
    shape_name: str,
    family: str = "qwen3",
    seed: int = 0,
    quantize: int | None = None,
    progress: Callable[[str], None] | None = None,
    shard_bytes: int = 512 << 20,
) -> Path:
    """Write a checkpoint to ``out`` and return it. Same arguments, same bytes."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, quantize_model, save_config

    if shape_name not in SHAPES:
        raise ValueError(f"unknown shape {shape_name!r}; choose one of {', '.join(SHAPES)}")
    if quantize not in (None, 4, 8):
        raise ValueError("quantize must be 4 or 8")
    say = progress or (lambda _msg: None)
    shape = SHAPES[shape_name]
    out.mkdir(parents=True, exist_ok=True)

    say(f"training a {shape.tokenizer_vocab}-token byte-level BPE tokenizer")
    tok = build_tokenizer(shape.tokenizer_vocab)
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": shape.max_positions,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2)
    )

    shape = replace(shape, layers=max(shape.layers, MIN_LAYERS.get(family, 0)))
    config = model_config(shape, family)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    say(f"initialising {shape.layers} layers ({family}, hidden {shape.hidden}) with seed {seed}")
    with slow_task("initialising weights") if progress is not None else nullcontext():
        model = _random_model(model_cls, args_cls, config, shape.dtype)
    if quantize:
        model, config = quantize_model(model, config, group_size=64, bits=quantize)
    weights = dict(tree_flatten(model.parameters()))
    weights = {k: v for k, v in weights.items() if "rotary_emb" not in k}
    if decoder_config(config).get("tie_word_embeddings"):  # a tied head has no weights of its own
        weights = {k: v for k, v in weights.items() if not k.rpartition("lm_head.")[1]}

    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name in sorted(weights):
        arr = weights[name]
        if shards[-1] and size + arr.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    weight_map: dict[str, str] = {}
    total = 0
    bar = step_bar(len(shards), "writing weights", enabled=progress is not None)
    for i, shard in enumerate(shards):
        fname = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        mx.save_safetensors(str(out / fname), shard, metadata={"format": "mlx"})
        nbytes = sum(a.nbytes for a in shard.values())
        total += nbytes
        weight_map.update({k: fname for k in shard})
        bar.update(1)  # type: ignore[attr-defined]
        say(f"wrote {fname} ({nbytes / 2**20:.1f} MiB, shard {i + 1}/{len(shards)})")
    bar.close()  # type: ignore[attr-defined]
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    save_config(config, out / "config.json")
    del model
    say(f"checkpoint written ({total / 2**20:.1f} MiB)")
    return out
