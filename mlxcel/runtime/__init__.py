"""MLX runtime through mlx-lm. Importing this package chooses the BLAS before MLX loads."""

from mlxcel.runtime.blas import ensure_blas

ensure_blas()
