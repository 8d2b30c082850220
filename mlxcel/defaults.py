"""Tunables shared by several layers: one name and one default each.

The settings (:mod:`mlxcel.config`) take their defaults from here, and every layer below that
defaults a keyword argument to the same tunable uses the same constant, so the value a user
gets does not depend on which entry point built the stack. Pure: no imports.
"""

from __future__ import annotations

# Prompt tokens per prefill forward (mlx-lm's ``prefill_step_size``): the one-process engine's
# prompt step, a pipeline's prompt chunk, and the size a stage warms its kernels up for.
PREFILL_STEP_SIZE = 512
