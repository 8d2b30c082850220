"""Tunables shared by several layers: one name and one default each.

The settings (:mod:`mlxcel.config.settings`) take their defaults from here, and every layer below that
defaults a keyword argument to the same tunable uses the same constant, so the value a user
gets does not depend on which entry point built the stack. Pure: no imports.
"""

from __future__ import annotations

# Prompt tokens per prefill forward (mlx-lm's ``prefill_step_size``): the one-process engine's
# prompt step, a pipeline's prompt chunk, and the size a stage warms its kernels up for.
PREFILL_STEP_SIZE = 512

# Admission and batching: requests generating at once, waiting for a slot, and how long one
# may take; sequences per batched forward pass.
PARALLEL = 8
QUEUE_SIZE = 64
REQUEST_TIMEOUT = 600.0
MAX_BATCH_SIZE = 8
# Decode steps the one-process engine runs per hand-off to the reactor (and so per burst of
# tokens to clients), divided among the batch's rows; a run also ends after about 25 ms.
STREAM_INTERVAL = 16

# Seconds to wait for pipeline stages, tensor-parallel ranks or disaggregated peers at start.
STARTUP_TIMEOUT = 60.0
# Seconds a cluster peer may go unheard before it counts as down.
PEER_TIMEOUT = 3.0
# A disaggregated router's seconds from dispatch to a prompt's first token.
PREFILL_TIMEOUT = 300.0
# prefill: a KV handoff's lease past its last progress, and its whole life at most
HANDOFF_LEASE = 10.0
HANDOFF_LEASE_MAX = 600.0
