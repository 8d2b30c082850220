"""What "the same model" means between a coordinator and its peers.

A SHA-256 over config.json's own SHA-256, the name and size of every ``*.safetensors`` file,
and the layer count. It does not read the weights themselves (tens of gigabytes on the models
that need a pipeline): the same config and the same file sizes name the same checkpoint for
every practical purpose, and a peer with another checkpoint is refused before any stage runs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from mlxcel.errors import ModelLoadError


@dataclass(frozen=True)
class ModelIdentity:
    sha256: str
    n_layers: int

    @property
    def short(self) -> str:
        return f"{self.sha256[:12]} ({self.n_layers} layers)"


def n_layers_of(config: dict[str, object]) -> int:
    text = config.get("text_config")
    source = text if isinstance(text, dict) and "num_hidden_layers" in text else config
    return int(source["num_hidden_layers"])  # type: ignore[call-overload]


def model_identity(path: Path) -> ModelIdentity:
    """Hash ``path``'s identity (reads config.json and file sizes only: run it off the reactor
    anyway, a network filesystem can be slow)."""
    try:
        raw = (path / "config.json").read_bytes()
        n_layers = n_layers_of(json.loads(raw))
        files = sorted((f.name, f.stat().st_size) for f in path.glob("*.safetensors"))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{path}: cannot read the model identity: {exc}") from None
    h = hashlib.sha256()
    h.update(b"config.json\0" + hashlib.sha256(raw).digest())
    for name, size in files:
        h.update(f"{name}\0{size}\0".encode())
    h.update(f"layers\0{n_layers}".encode())
    return ModelIdentity(h.hexdigest(), n_layers)
