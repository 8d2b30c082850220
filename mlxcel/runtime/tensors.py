"""Conversion between MLX arrays and wire :class:`~mlxcel.base.messages.Tensor` values.

bfloat16 has no NumPy dtype, so it travels as its raw 16-bit patterns (a ``view`` as
uint16): bit-exact both ways.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxcel.base.messages import Tensor


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def _on_host(a: mx.array) -> np.ndarray:
    """``a`` evaluated and on the host, bfloat16 as its raw 16-bit patterns."""
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a, copy=False)


def to_tensor(a: mx.array) -> Tensor:
    data = np.ascontiguousarray(_on_host(a)).tobytes()
    return Tensor(dtype_name(a.dtype), tuple(a.shape), data)


def row_tensors(a: mx.array, rows: list[int]) -> list[Tensor]:
    """``a[r : r + 1]`` for each of ``rows`` as Tensors, from one copy to the host (on a GPU a
    copy per row would be a transfer and a synchronisation per row)."""
    name, host, shape = dtype_name(a.dtype), _on_host(a), (1, *a.shape[1:])
    return [Tensor(name, shape, np.ascontiguousarray(host[r : r + 1]).tobytes()) for r in rows]


def from_tensor(t: Tensor) -> mx.array:
    if t.dtype == "bfloat16":
        arr = np.frombuffer(t.data, dtype=np.uint16).reshape(t.shape)
        return mx.array(arr).view(mx.bfloat16)
    return mx.array(np.frombuffer(t.data, dtype=np.dtype(t.dtype)).reshape(t.shape))
