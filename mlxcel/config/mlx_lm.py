"""What mlx-lm offers a model in one process, under mlx-lm's own flag names: a LoRA adapter
(``--adapter-path``), a bounded KV cache (``--max-kv-size``), a quantized KV cache
(``--kv-bits``, ``--kv-group-size``, ``--quantized-kv-start``) and speculative decoding
(``--draft-model``, ``--num-draft-tokens``). A part of ``generate``'s and ``serve``'s settings.

Each is mlx-lm's implementation, used where mlxcel runs mlx-lm's whole model in one process.
The adapter and the bounded cache serve batched requests (mlx-lm's ``BatchGenerator`` takes
them); the quantized cache and the draft model exist only in mlx-lm's one-stream generation,
so ``generate`` runs that path for them and ``serve`` refuses them by name. Anything split
over processes or devices refuses all of them: its nodes load their own weights and caches.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from mlxcel.config.sources import _Base, check_model

KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize takes
KV_GROUP_SIZES = (32, 64, 128)


def _one_stream(flag: str, what: str) -> str:
    return (
        f"{flag}: serve batches requests with mlx-lm's BatchGenerator, which has no {what}; "
        f"mlx-lm has it for one stream only (mlxcel generate {flag} ...)"
    )


class MlxLmSettings(_Base):
    adapter_path: Path | None = Field(
        None, description="a LoRA adapter folder (adapter_config.json + adapters.safetensors)"
    )
    max_kv_size: int | None = Field(
        None,
        ge=16,
        le=1 << 24,
        description="keep at most this many tokens of KV cache per sequence (mlx-lm's "
        "rotating cache: older tokens are dropped)",
    )
    kv_bits: int | None = Field(
        None, description="quantize the KV cache to this many bits (2-8; generate only)"
    )
    kv_group_size: int = Field(64, description="group size of the quantized KV cache")
    quantized_kv_start: int = Field(
        5000, ge=0, description="tokens before the KV cache is quantized (with --kv-bits)"
    )
    draft_model: str | None = Field(
        None, description="a smaller model with the same tokenizer for speculative decoding"
    )
    num_draft_tokens: int = Field(
        3, ge=1, le=64, description="tokens the draft model proposes per step"
    )

    @field_validator("adapter_path")
    @classmethod
    def _adapter(cls, v: Path | None) -> Path | None:
        if v is None:
            return v
        p = v.expanduser()
        if not p.is_dir():
            raise ValueError(f"{v}: no such folder")
        for name in ("adapter_config.json", "adapters.safetensors"):
            if not (p / name).is_file():
                raise ValueError(f"{v}: not a LoRA adapter folder (no {name})")
        try:
            cfg = json.loads((p / "adapter_config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{v}/adapter_config.json: {exc}") from None
        if not isinstance(cfg, dict) or "num_layers" not in cfg:
            raise ValueError(f"{v}/adapter_config.json: not an mlx-lm adapter (no num_layers)")
        return p

    @field_validator("kv_bits")
    @classmethod
    def _bits(cls, v: int | None) -> int | None:
        if v is not None and v not in KV_BITS:
            raise ValueError(f"{v} is not one of {', '.join(map(str, KV_BITS))}")
        return v

    @field_validator("kv_group_size")
    @classmethod
    def _group(cls, v: int) -> int:
        if v not in KV_GROUP_SIZES:
            raise ValueError(f"{v} is not one of {', '.join(map(str, KV_GROUP_SIZES))}")
        return v

    @field_validator("draft_model")
    @classmethod
    def _draft(cls, v: str | None) -> str | None:
        return check_model(v)

    @model_validator(mode="after")
    def _kv_flags_need_bits(self) -> MlxLmSettings:
        serve = getattr(self, "serves_batches", False)
        for field, flag, what in (
            ("kv_group_size", "--kv-group-size", "quantized KV cache"),
            ("quantized_kv_start", "--quantized-kv-start", "quantized KV cache"),
            ("num_draft_tokens", "--num-draft-tokens", "speculative decoding"),
        ):
            if serve and field in self.model_fields_set:
                raise ValueError(_one_stream(flag, what))
        for field, flag in (
            ("kv_group_size", "--kv-group-size"),
            ("quantized_kv_start", "--quantized-kv-start"),
        ):
            if field in self.model_fields_set and self.kv_bits is None:
                raise ValueError(f"{flag} is for a quantized KV cache: give --kv-bits")
        if "num_draft_tokens" in self.model_fields_set and self.draft_model is None:
            raise ValueError("--num-draft-tokens is for speculative decoding: give --draft-model")
        if self.draft_model is not None and self.max_kv_size is not None:
            raise ValueError(
                "--max-kv-size does not combine with --draft-model: mlx-lm's speculative "
                "decoding keeps the whole KV cache"
            )
        return self

    @model_validator(mode="after")
    def _one_process_only(self) -> MlxLmSettings:
        """Refused by name where the model is split, or (serve) where requests are batched."""
        split = (
            getattr(self, "tp_size", 1) > 1
            or getattr(self, "tp_hostfile", None) is not None
            or getattr(self, "pp_size", 1) > 1
            or getattr(self, "pp_layers", None) is not None
            or getattr(self, "distributed_config", None) is not None
            or getattr(self, "pp_auto", None) is not None
            or getattr(self, "pp_peer", False)
            or getattr(self, "node_role", "hybrid") != "hybrid"
        )
        flags = self.given("adapter_path", "max_kv_size", "kv_bits", "draft_model")
        if split and flags:
            raise ValueError(
                f"{flags[0]} is for one process (no tensor parallelism, pipeline or "
                "--node-role): there each node loads its own share of the weights and caches"
            )
        if getattr(self, "serves_batches", False):
            for flag, what in (
                ("--kv-bits", "quantized KV cache"),
                ("--draft-model", "speculative decoding"),
            ):
                if flag in self.given("kv_bits", "draft_model"):
                    raise ValueError(_one_stream(flag, what))
        if (
            self.max_kv_size is not None
            and "prompt_cache_bytes" in self.model_fields_set
            and getattr(self, "prompt_cache_bytes", 0)
        ):
            raise ValueError(
                "--prompt-cache-bytes does not combine with --max-kv-size: a rotated cache "
                "has no prefix left to reuse"
            )
        return self

    def given(self, *fields: str) -> list[str]:
        """The flags among ``fields`` this command was given (as the user typed them)."""
        on = {
            "adapter_path": self.adapter_path is not None,
            "max_kv_size": self.max_kv_size is not None,
            "kv_bits": self.kv_bits is not None,
            "draft_model": self.draft_model is not None,
        }
        return ["--" + f.replace("_", "-") for f in fields if on[f]]

    @property
    def one_stream_only(self) -> bool:
        """A quantized KV cache or a draft model: mlx-lm's one-stream generation only."""
        return self.kv_bits is not None or self.draft_model is not None
