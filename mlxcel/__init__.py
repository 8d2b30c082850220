"""mlxcel: distributed LLM inference on MLX.

Importing the package never imports MLX, but it does choose the BLAS that MLX will bind to
(see :mod:`mlxcel.runtime.blas`): that choice only works before MLX's first import, and any
``import mlxcel.…`` runs this file first.
"""

from mlxcel.runtime.blas import MLX_FIRST as _MLX_FIRST
from mlxcel.runtime.blas import ensure_blas as _ensure_blas

__version__ = "0.1.0"

if _ensure_blas() == _MLX_FIRST:  # an embedding program imported mlx first: say so, once
    from loguru import logger as _logger

    _logger.warning("BLAS: {}", _MLX_FIRST)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """mlxcel's log format for a program that embeds it, in one call: every line (mlxcel's,
    its libraries', Python warnings) as ``HH:MM:SS.mmm LEVEL message`` on stderr, or one JSON
    object per line with ``fmt="json"``. It replaces loguru's default sink."""
    from mlxcel.logs import setup_logging as setup

    setup(level.upper(), fmt)
