"""The cache folder (``MLXCEL_HOME``, default ``~/.cache/mlxcel``) and the embedded models.

With no ``--model``, commands use a tiny checkpoint that mlxcel writes once under
``$MLXCEL_HOME/models/`` and reuses. Creation is atomic (written to a temporary folder, then
renamed), so concurrent first runs never see a half-written model.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_SHAPE = "tiny"
DEFAULT_FAMILY = "qwen3"


def home() -> Path:
    root = os.environ.get("MLXCEL_HOME")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "mlxcel"


def embedded_model(shape: str = DEFAULT_SHAPE, family: str = DEFAULT_FAMILY, seed: int = 0) -> Path:
    """Path of the embedded checkpoint, created on first use."""
    from mlxcel.process.progress import log_step
    from mlxcel.runtime.checkpoint import write_checkpoint

    target = home() / "models" / f"{shape}-{family}-s{seed}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        progress = log_step if shape != "tiny" else None
        write_checkpoint(tmp, shape, family, seed, progress=progress)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race only if the winner is done
                raise
        if progress is not None:
            progress(f"ready at {target}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


RANDOM_WEIGHTS_NOTE = (
    "the embedded model has random weights: its text is meaningless by design "
    "(it exists so that everything runs without a download); -m DIR uses a real checkpoint"
)


def is_embedded(path: Path) -> bool:
    """Whether ``path`` is one of the embedded random-weight checkpoints."""
    try:
        return path.resolve().parent == (home() / "models").resolve()
    except OSError:
        return False
