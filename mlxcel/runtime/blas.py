"""Pick a fast BLAS before MLX is first imported.

The Linux ``mlx[cpu]`` wheel carries a slow reference BLAS. If an OpenBLAS exporting the
standard ``cblas_*`` symbols is loaded with ``RTLD_GLOBAL`` before ``import mlx``, MLX binds to
it instead (10-20x faster matmuls on CPU). We look, in order, at ``MLXCEL_BLAS`` (a path, or
``bundled`` to opt out), Debian's ``libopenblas0-pthread``, anything ``ldconfig`` knows as
``openblas``, and the ``cmeel-openblas`` wheel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import sysconfig
from pathlib import Path

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)

_state: dict[str, str] = {}


def _cmeel_paths() -> list[str]:
    out = []
    for key in ("purelib", "platlib"):
        base = Path(sysconfig.get_paths()[key]) / "cmeel.prefix" / "lib"
        out += [str(p) for p in sorted(base.glob("libopenblas*.so*"))]
    return out


def ensure_blas() -> str:
    """Load an OpenBLAS if one is found; return a one-line description of the BLAS in use."""
    if "desc" in _state:
        return _state["desc"]
    if sys.platform != "linux":
        desc = "platform BLAS (Accelerate/Metal)" if sys.platform == "darwin" else "bundled BLAS"
        _state["desc"] = desc
        return desc
    if "mlx.core" in sys.modules:
        _state["desc"] = "bundled reference BLAS (mlx was imported before mlxcel could choose)"
        return _state["desc"]
    choice = os.environ.get("MLXCEL_BLAS", "").strip()
    if choice == "bundled":
        _state["desc"] = "bundled reference BLAS (MLXCEL_BLAS=bundled)"
        return _state["desc"]
    candidates = [choice] if choice else []
    candidates += list(_CANDIDATES)
    found = ctypes.util.find_library("openblas")
    if found:
        candidates.append(found)
    candidates += _cmeel_paths()
    errors = []
    for path in candidates:
        if "/" in path and not os.path.exists(path):
            continue
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            lib.cblas_sgemm  # noqa: B018 - proves the cblas symbols are exported
        except (OSError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
            continue
        _state["desc"] = f"openblas ({path})"
        return _state["desc"]
    hint = (
        "bundled reference BLAS (slow); hint: install Debian's libopenblas0-pthread "
        "or `pip install cmeel-openblas` (both need libgfortran5)"
    )
    if errors:
        hint += f"; tried: {errors[0]}"
    _state["desc"] = hint
    return hint


def blas_name() -> str:
    """Short name for reports: ``openblas`` or ``bundled``."""
    return "openblas" if ensure_blas().startswith("openblas") else "bundled"
