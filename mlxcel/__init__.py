"""mlxcel: distributed LLM inference on MLX.

Importing the package never imports MLX, but it does choose the BLAS that MLX will bind to
(see :mod:`mlxcel.runtime.blas`): that choice only works before MLX's first import, and any
``import mlxcel.…`` runs this file first.
"""

from mlxcel.runtime.blas import ensure_blas as _ensure_blas

__version__ = "0.1.0"

_ensure_blas()
