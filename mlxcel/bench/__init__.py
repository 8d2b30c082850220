"""Benchmark commands (``python -m mlxcel bench ...``): they sit above the roles and the
network, and print figures with their reference measured in the same run."""
