"""mlxcel: distributed LLM inference on MLX.

Importing the package is cheap and never imports MLX: the runtime decides which BLAS to load
before MLX is first imported (see :mod:`mlxcel.runtime.blas`).
"""

__version__ = "0.1.0"
