"""``generate --kv-bits`` / ``--draft-model``: mlx-lm's own one-stream generation.

A quantized KV cache and speculative decoding exist in mlx-lm only for one stream
(``stream_generate``), not in the ``BatchGenerator`` mlxcel's engine batches requests with.
``generate`` serves one stream, so for these flags it hands the prompt to mlx-lm's path as is
(the model and adapter loaded as the engine loads them, the prompt built as the engine's is,
sampled by mlx-lm's sampler) and prints what ``mlx_lm generate`` prints.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mlxcel.base.errors import ConfigError
from mlxcel.config.mlx_lm import KV_GROUP_SIZES
from mlxcel.config.settings import GenerateSettings
from mlxcel.runtime.compute import ComputeThread
from mlxcel.serving.prompts import generate_messages


async def generate_one_stream(
    s: GenerateSettings, path: Path, draft_path: Path | None, prompt: str
) -> int:
    compute = ComputeThread()
    try:
        return await compute.run(_generate, s, path, draft_path, prompt)
    finally:
        compute.close()


def _generate(s: GenerateSettings, path: Path, draft_path: Path | None, prompt: str) -> int:
    """Compute thread: load, check the draft's tokenizer, stream the tokens to stdout."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from mlxcel.runtime.model import load_model

    loaded = load_model(path, adapter_path=s.adapter_path)
    draft = None
    if draft_path is not None:
        draft = load_model(draft_path)
        if _vocab(draft.tokenizer) != _vocab(loaded.tokenizer):
            raise ConfigError(
                "--draft-model",
                f"{draft.path}: its tokenizer differs from {loaded.path.name}'s (speculative "
                "decoding needs the same vocabulary)",
            )
    if s.kv_bits is not None:
        _check_groups(loaded, s.kv_group_size)
    ids = _prompt_ids(loaded.tokenizer, s, prompt)
    if s.seed is not None:
        mx.random.seed(s.seed)
    kv: dict[str, Any] = {}
    if s.kv_bits is not None:
        kv = {
            "kv_bits": s.kv_bits,
            "kv_group_size": s.kv_group_size,
            "quantized_kv_start": s.quantized_kv_start,
        }
    if draft is not None:
        kv["num_draft_tokens"] = s.num_draft_tokens
    elif s.max_kv_size is not None:
        kv["max_kv_size"] = s.max_kv_size
    last, accepted = None, 0
    for r in stream_generate(
        loaded.model,
        loaded.tokenizer,
        ids,
        max_tokens=s.max_tokens,
        draft_model=draft.model if draft is not None else None,
        sampler=make_sampler(s.temp, s.top_p, s.min_p, top_k=s.top_k),
        prefill_step_size=s.prefill_step_size,
        **kv,
    ):
        sys.stdout.write(r.text)
        sys.stdout.flush()
        accepted += bool(r.from_draft)
        last = r
    sys.stdout.write("\n")
    if last is not None:
        line = (
            f"prompt tokens: {last.prompt_tokens}, generated tokens: {last.generation_tokens}, "
            f"prefill: {last.prompt_tps:.1f} tok/s, decode: {last.generation_tps:.1f} tok/s"
        )
        if draft is not None:
            line += f", draft tokens accepted: {accepted} of {last.generation_tokens}"
        print(line, flush=True)
    return 0


def _check_groups(loaded: Any, group: int) -> None:
    """mx.quantize groups the KV cache along its head dimension: refused here, by name, not
    as MLX's error from inside the first quantized step."""
    from mlxcel.base.model_config import decoder_config

    cfg = decoder_config(loaded.config)
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if dim % group:
        fits = [str(g) for g in KV_GROUP_SIZES if dim % g == 0]
        what = f"use {' or '.join(fits)}" if fits else "none of 32, 64, 128 does, so it cannot"
        raise ConfigError(
            "--kv-group-size",
            f"{group} does not divide {loaded.path.name}'s head dimension {dim}: a quantized "
            f"KV cache groups along it ({what})",
        )


def _vocab(tokenizer: Any) -> dict[str, int]:
    return dict(getattr(tokenizer, "_tokenizer", tokenizer).get_vocab())


def _prompt_ids(tokenizer: Any, s: GenerateSettings, prompt: str) -> list[int]:
    """As the engine's ``generate`` builds it (the same messages, mlx-lm's encoding)."""
    messages = generate_messages(tokenizer, prompt, s.raw, s.system_prompt)
    if messages is None:
        return list(tokenizer.encode(prompt))
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
