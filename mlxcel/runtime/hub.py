"""``-m org/name``: a model from the Hugging Face Hub, as ``mlx_lm generate`` finds it.

A ``-m`` value that is not a local folder but has the shape of a Hub id is fetched the way
mlx-lm's loader fetches it: ``snapshot_download`` with mlx-lm's file patterns, which answers
from the local Hub cache when it holds the snapshot (always, with ``HF_HUB_OFFLINE=1``) and
downloads with progress bars otherwise. Everything after this sees a local folder.
"""

from __future__ import annotations

import re
from pathlib import Path

from loguru import logger

from mlxcel.base.errors import ConfigError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt"]


def is_hub_id(value: str) -> bool:
    """``org/name`` that is not a local path (``./org/name`` or ``/x/y`` always are)."""
    return bool(_HUB_ID.match(value)) and not Path(value).expanduser().exists()


def resolve(value: str) -> Path:
    """A local model folder for ``value``: the folder itself, or the Hub snapshot."""
    local = Path(value).expanduser()
    if local.is_dir() or not is_hub_id(value):
        return local
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS as patterns
    except ImportError:  # an mlx-lm without the constant: the same list, written here
        patterns = _PATTERNS
    offline = constants.HF_HUB_OFFLINE
    logger.info("resolving {} on the Hugging Face Hub{}", value, " (offline)" if offline else "")
    try:
        path = Path(snapshot_download(value, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        where = "HF_HUB_OFFLINE is set and " if offline else "the Hub is unreachable and "
        raise ConfigError(
            "-m/--model",
            f"{value!r} is not a local folder; {where}the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) has no snapshot of it",
        ) from None
    except (HFValidationError, OSError, ValueError) as exc:
        # RepositoryNotFoundError, GatedRepoError and HTTP errors are OSErrors here.
        raise ConfigError(
            "-m/--model", f"{value!r} is not a local folder and the Hub cannot provide it: {exc}"
        ) from None
    if not (path / "config.json").is_file():
        raise ConfigError("-m/--model", f"{value!r}: the Hub snapshot at {path} has no config.json")
    return path
