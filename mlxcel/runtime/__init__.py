"""MLX runtime through mlx-lm. The BLAS is chosen by ``mlxcel/__init__.py`` before MLX loads."""
