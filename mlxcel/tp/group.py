"""Tensor-parallel groups on MLX's own distributed layer (the ring backend over TCP).

Ranks are processes. Weights are sharded by mlx-lm's ``Model.shard(group)``; the collectives
inside the sharded layers are MLX's. Rank 0 drives: before each batch step it sends the
other ranks a :class:`~mlxcel.messages.TpStep` (CBOR) through the same group, so every rank
runs the identical batched forward pass.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from mlxcel.errors import ConfigError
from mlxcel.messages import TpStep
from mlxcel.wire.codec import decode, encode

TP_FAMILIES = ("llama", "qwen2", "qwen3")
MODES = ("replicated", "sharded")


def check_modes(moe: str, embedding: str, lm_head: str) -> None:
    for flag, value in (
        ("--tp-moe-mode", moe),
        ("--tp-embedding-mode", embedding),
        ("--tp-lm-head-mode", lm_head),
    ):
        if value != "replicated":
            raise ConfigError(
                flag, f"mode {value!r} is not implemented yet; only 'replicated' is available"
            )


def check_shardable(config: dict[str, Any], n: int) -> None:
    """Refuse a model that does not split evenly over ``n`` ranks, before any weights load."""
    family = str(config.get("model_type"))
    if family not in TP_FAMILIES:
        raise ConfigError(
            "--tp-size",
            f"family {family!r} has no tensor-parallel path (supported: {', '.join(TP_FAMILIES)})",
        )
    checks = {
        "attention heads": int(config["num_attention_heads"]),
        "key/value heads": int(config.get("num_key_value_heads", config["num_attention_heads"])),
        "MLP intermediate size": int(config["intermediate_size"]),
    }
    bad = [f"{name} {value}" for name, value in checks.items() if value % n]
    if bad:
        raise ConfigError(
            "--tp-size",
            f"the model does not shard evenly over {n} ranks: {', '.join(bad)} "
            f"not divisible by {n}",
        )


def write_local_hostfile(n: int, folder: Path) -> Path:
    """A ring hostfile for ``n`` ranks on this host (free ports on 127.0.0.1)."""
    ports = []
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    path = folder / "tp-hostfile.json"
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    return path


def init_group(rank: int, hostfile: Path) -> Any:
    """Join the ring. Every rank must call this; it blocks until all are connected."""
    import mlx.core as mx

    os.environ["MLX_RANK"] = str(rank)
    os.environ["MLX_HOSTFILE"] = str(hostfile)
    return mx.distributed.init(backend="ring", strict=True)


def broadcast_step(group: Any, step: TpStep | None) -> TpStep:
    """Rank 0 passes its step; the others pass None and receive it (two small all_sums).

    The batch generator leaves the next forward pass (with its own collectives) running
    asynchronously on its stream; issuing these all_sums on that same stream keeps every
    rank's collectives in one order.
    """
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generation_stream

    with mx.stream(generation_stream):
        return _broadcast(group, step, mx, np)


def _broadcast(group: Any, step: TpStep | None, mx: Any, np: Any) -> TpStep:
    payload = encode(step) if step is not None else b""
    n = mx.distributed.all_sum(mx.array([len(payload)], dtype=mx.int32), group=group)
    size = int(n.item())
    buf = np.zeros(size, dtype=np.int32)
    if step is not None:
        buf[:] = np.frombuffer(payload, dtype=np.uint8)
    got = mx.distributed.all_sum(mx.array(buf), group=group)
    data = np.array(got).astype(np.uint8).tobytes()
    msg = decode(data)
    if not isinstance(msg, TpStep):  # pragma: no cover - only rank 0 writes here
        raise RuntimeError(f"expected a TpStep, got {type(msg).__name__}")
    return msg


def load_sharded(path: Path, group: Any) -> Any:
    """Load a checkpoint lazily, shard it with mlx-lm, and materialise this rank's part."""
    import mlx.core as mx

    from mlxcel.runtime.model import load_model

    loaded = load_model(path, lazy=True)
    loaded.model.shard(group)
    mx.eval(loaded.model.parameters())
    return loaded
