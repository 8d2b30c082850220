"""One GPU per process when several mlxcel processes share a host.

MLX runs on device 0 of what a process can see. Processes the launchers start side by side --
pipeline stages on loopback, tensor-parallel ranks -- would all land on the same GPU, so on a
host with more than one GPU each gets its own (``CUDA_VISIBLE_DEVICES``, round robin over the
devices this process may use). Elsewhere -- CPU, Metal, one GPU -- nothing changes.
"""

from __future__ import annotations

import os


def usable_memory(cap: int = 0) -> int:
    """Bytes this process may hold for a model: MLX's memory limit on this device (a share of
    the GPU's memory, or of RAM on a CPU), or ``cap`` (``--usable-memory``) when smaller. A
    figure that does not move with what else is allocated, so one host plans one way."""
    import mlx.core as mx

    limit = int(mx.get_memory_limit())
    return min(limit, cap) if cap > 0 else limit


def gpu_ids() -> list[str]:
    """The CUDA devices this process may hand out (honouring its own CUDA_VISIBLE_DEVICES)."""
    import mlx.core as mx

    if not mx.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    return [str(i) for i in range(mx.device_count(mx.gpu))]


def device_env(index: int, env: dict[str, str]) -> dict[str, str]:
    """``env`` for the ``index``-th of several processes started on this host."""
    ids = gpu_ids()
    if len(ids) < 2:
        return env
    return {**env, "CUDA_VISIBLE_DEVICES": ids[index % len(ids)]}
