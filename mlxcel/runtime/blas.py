"""Pick a fast BLAS before MLX is first imported.

The Linux ``mlx[cpu]`` wheel carries a slow reference BLAS. A library exporting the standard
``cblas_*`` symbols that is loaded with ``RTLD_GLOBAL`` before ``import mlx`` wins the symbol
lookup, so MLX's matmuls run on it instead (10-30x faster on CPU).

``MLXCEL_BLAS`` picks: empty (automatic), ``bundled`` (opt out), ``mkl``, ``openblas``, or a
library path. Automatic tries Intel MKL first (the ``mkl`` wheel, a default dependency on
Linux x86_64 that needs nothing from the system), then OpenBLAS: Debian's
``libopenblas0-pthread``, anything the loader knows as ``openblas``, the ``cmeel-openblas``
wheel (the aarch64 route; both need ``libgfortran5``).

``MLXCEL_BLAS_THREADS`` caps the BLAS's threads; launchers that start several mlxcel processes
on one host set it so the processes split the cores instead of oversubscribing them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import site
import sys
import sysconfig
from pathlib import Path

_OPENBLAS_SYSTEM = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)

_state: dict[str, str] = {}
# What a program that imported mlx.core before mlxcel runs on (MLX binds its BLAS at import).
MLX_FIRST = (
    "bundled reference BLAS (slow): mlx.core was imported before mlxcel, so mlxcel could not "
    "load a faster one (10-30x on CPU); import mlxcel before mlx"
)


def _lib_dirs() -> list[Path]:
    """Where pip puts a wheel's ``data/lib`` files: the environment's and the user's ``lib``."""
    dirs = [Path(sys.prefix) / "lib", Path(sysconfig.get_config_var("LIBDIR") or sys.prefix)]
    user_base = getattr(site, "USER_BASE", None)
    if user_base:
        dirs.append(Path(user_base) / "lib")
    seen: list[Path] = []
    for d in dirs:
        if d not in seen:
            seen.append(d)
    return seen


def _mkl_candidates() -> list[str]:
    out = [str(p) for d in _lib_dirs() for p in sorted(d.glob("libmkl_rt.so*"))]
    found = ctypes.util.find_library("mkl_rt")
    return out + ([found] if found else [])


def _openblas_candidates() -> list[str]:
    out = list(_OPENBLAS_SYSTEM)
    found = ctypes.util.find_library("openblas")
    if found:
        out.append(found)
    for key in ("purelib", "platlib"):
        base = Path(sysconfig.get_paths()[key]) / "cmeel.prefix" / "lib"
        out += [str(p) for p in sorted(base.glob("libopenblas*.so*"))]
    return out


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads(processes: int) -> int:
    """BLAS threads for one of ``processes`` mlxcel processes sharing this host's cores."""
    return max(1, _cores() // max(1, processes))


def _thread_env() -> None:
    """Apply ``MLXCEL_BLAS_THREADS`` and quiet idle threads; the user's own settings win.

    Alone on a host, OpenBLAS keeps its default (every core) and MKL leaves one core free:
    MKL's threading costs more than it saves on small decode matmuls (on 2 cores, batch-8
    decode ran 28% faster on one MKL thread than on two, while OpenBLAS ran 10% faster on
    two; docs/benchmarks.md)."""
    threads = os.environ.get("MLXCEL_BLAS_THREADS", "").strip()
    if threads and not (threads.isascii() and threads.isdigit() and int(threads) > 0):
        _state["threads_note"] = f"MLXCEL_BLAS_THREADS={threads!r} is not a positive integer"
        threads = ""
    os.environ.setdefault("MKL_NUM_THREADS", threads or str(max(1, _cores() - 1)))
    if threads:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", threads)
    # Intel's OpenMP spins 200 ms after each parallel region by default, stealing the cores
    # MLX's own CPU work and co-located processes need between two matmuls; sleep at once.
    os.environ.setdefault("KMP_BLOCKTIME", "0")


def _describe_mkl(lib: ctypes.CDLL, path: str) -> str:
    buf = ctypes.create_string_buffer(256)
    try:
        lib.mkl_get_version_string(buf, len(buf))
        text = buf.value.decode(errors="replace")  # "... Library Version 2026.2-Product Build ..."
        version = text.split("Version ", 1)[-1].split("-Product", 1)[0].strip() or "?"
    except (AttributeError, OSError):
        version = "?"
    try:
        threads = int(lib.MKL_Get_Max_Threads())
    except (AttributeError, OSError):
        threads = 0
    return f"mkl {version} ({path}), {threads} threads"


def _describe_openblas(lib: ctypes.CDLL, path: str) -> str:
    try:
        threads = int(lib.openblas_get_num_threads())
    except (AttributeError, OSError):
        return f"openblas ({path})"
    return f"openblas ({path}), {threads} threads"


def _try(paths: list[str], describe, errors: list[str]) -> str | None:  # type: ignore[no-untyped-def]
    for path in paths:
        if "/" in path and not os.path.exists(path):
            continue
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            lib.cblas_sgemm  # noqa: B018 - proves the cblas symbols are exported
        except (OSError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
            continue
        return describe(lib, path)
    return None


def ensure_blas() -> str:
    """Load the fastest BLAS found; return a one-line description of the BLAS in use."""
    if "desc" in _state:
        return _state["desc"]
    _state["desc"] = _choose()
    return _state["desc"]


def _choose() -> str:
    if sys.platform != "linux":
        return "platform BLAS (Accelerate/Metal)" if sys.platform == "darwin" else "bundled BLAS"
    if "mlx.core" in sys.modules:
        return MLX_FIRST
    choice = os.environ.get("MLXCEL_BLAS", "").strip()
    if choice.lower() in ("bundled", "mkl", "openblas"):
        choice = choice.lower()
    if choice == "bundled":
        return "bundled reference BLAS (MLXCEL_BLAS=bundled)"
    _thread_env()
    errors: list[str] = []
    if choice not in ("", "mkl", "openblas"):
        is_mkl = "mkl" in Path(choice).name
        desc = _try([choice], _describe_mkl if is_mkl else _describe_openblas, errors)
    else:
        desc = None
        if choice in ("", "mkl"):
            desc = _try(_mkl_candidates(), _describe_mkl, errors)
        if desc is None and choice in ("", "openblas"):
            desc = _try(_openblas_candidates(), _describe_openblas, errors)
    if desc is not None:
        return desc
    hint = "bundled reference BLAS (slow); hint: " + (
        "`pip install mkl` (Linux x86_64), or "
        "install Debian's libopenblas0-pthread or `pip install cmeel-openblas` "
        "(both need libgfortran5)"
    )
    if choice:
        hint += f"; MLXCEL_BLAS={choice} was not usable"
    if errors:
        hint += f"; tried: {errors[0]}"
    return hint


def blas_problem() -> str | None:
    """What an operator should fix about the BLAS choice (None: nothing): a setting that could
    not be used, or a slow fallback that was not asked for."""
    desc = ensure_blas()
    if "threads_note" in _state:
        return _state["threads_note"] + "; the default thread count is used"
    if desc.startswith("bundled reference BLAS (slow)"):
        return desc
    return None


def blas_name() -> str:
    """Short name for reports: ``mkl``, ``openblas`` or ``bundled``."""
    desc = ensure_blas()
    for name in ("mkl", "openblas"):
        if desc.startswith(name):
            return name
    return "bundled"


def colocated_env(processes: int) -> dict[str, str]:
    """The environment for one of ``processes`` mlxcel processes started on this host.

    They take turns on the same cores: each gets its share of BLAS threads, and OpenBLAS's
    idle worker threads sleep after a short spin (2^4 cycles) instead of busy-waiting, which
    would steal the cores the working process needs. Values the user set win. The process
    also goes when this one goes (:func:`mlxcel.process.loop.die_with_parent`).
    """
    env = dict(os.environ)
    env["MLXCEL_PARENT_PID"] = str(os.getpid())
    env.setdefault("MLXCEL_BLAS_THREADS", str(default_threads(processes)))
    env.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    return env
