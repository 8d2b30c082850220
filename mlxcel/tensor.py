"""The tensor values messages carry: a dense array as raw bytes, or -- inside one process --
as a device array.

bfloat16 has no NumPy dtype; :mod:`mlxcel.runtime.tensors` converts between these and MLX.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

# dtype name -> bytes per element. The names match MLX's dtype names.
DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "uint32": 4,
    "int32": 4,
    "uint64": 8,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
}


@dataclass(frozen=True, slots=True)
class Tensor:
    """A dense array as raw little-endian bytes. Validated on construction."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes = field(repr=False)

    def __post_init__(self) -> None:
        # Imported lazily to keep this module free of import cycles.
        from mlxcel.errors import TensorSizeError

        if self.dtype not in DTYPE_SIZES:
            raise TensorSizeError(f"unknown tensor dtype {self.dtype!r}")
        if any(d < 0 for d in self.shape):
            raise TensorSizeError(f"negative dimension in shape {self.shape}")
        want = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if len(self.data) != want:
            raise TensorSizeError(
                f"tensor {self.dtype}{list(self.shape)} needs {want} bytes, got {len(self.data)}"
            )

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True, slots=True)
class DeviceTensor(Tensor):
    """Hidden states that stay on the device: rows ``rows`` of ``array`` (along its first
    axis, in that order), an MLX array that may still be evaluating. Only stages of one process
    that share a compute thread pass these (the next stage's graph is then built on the array
    while the device still computes it: no synchronisation, no host copy). ``data`` is empty;
    the codec refuses to encode one, so a device tensor can never reach a socket."""

    array: object = field(default=None, repr=False, compare=False)
    rows: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if (
            self.dtype not in DTYPE_SIZES
            or any(d < 0 for d in self.shape)
            or not self.shape
            or len(self.rows) != self.shape[0]
        ):
            from mlxcel.errors import TensorSizeError

            raise TensorSizeError(f"bad device tensor {self.dtype}{list(self.shape)}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def take_rows(t: Tensor, rows: Sequence[int]) -> Tensor:
    """Rows ``rows`` of ``t`` (along its first axis, in that order) as one tensor; ``t`` itself
    when that is all of it in order. No MLX: a device tensor names the rows it takes."""
    if len(rows) == t.shape[0] and all(r == i for i, r in enumerate(rows)):
        return t
    shape = (len(rows), *t.shape[1:])
    if isinstance(t, DeviceTensor):
        return DeviceTensor(t.dtype, shape, b"", t.array, tuple(t.rows[r] for r in rows))
    size = len(t.data) // t.shape[0]
    return Tensor(t.dtype, shape, b"".join(t.data[r * size : (r + 1) * size] for r in rows))


def join_rows(parts: Sequence[Tensor]) -> Tensor:
    """``parts`` (each ``[k, ...]``, one dtype and row shape) stacked along the first axis.
    Device tensors join only rows of one array (a stage's job has one output array)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
    if isinstance(first, DeviceTensor):
        if any(not isinstance(p, DeviceTensor) or p.array is not first.array for p in parts):
            raise ValueError("device tensors of different arrays cannot be joined here")
        rows = tuple(r for p in parts for r in p.rows)  # type: ignore[attr-defined]
        return DeviceTensor(first.dtype, shape, b"", first.array, rows)
    return Tensor(first.dtype, shape, b"".join(p.data for p in parts))
