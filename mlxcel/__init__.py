"""mlxcel: distributed LLM inference on MLX.

Importing the package never imports MLX, but it does choose the BLAS that MLX will bind to
(see :mod:`mlxcel.runtime.blas`): that choice only works before MLX's first import, and any
``import mlxcel.…`` runs this file first.

The embedding API is re-exported here (``from mlxcel import assemble, LocalSpec, NodeRunner``),
imported when first used. The package's layers are its folders (docs/architecture.md); the
modules that sat at the top before they were (``mlxcel.assembly``, ``mlxcel.runner``,
``mlxcel.bus``, ``mlxcel.messages`` ...) still import under their old names, as the very same
modules.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

from mlxcel.runtime.blas import MLX_FIRST as _MLX_FIRST
from mlxcel.runtime.blas import ensure_blas as _ensure_blas

__version__ = "0.1.0"

if _ensure_blas() == _MLX_FIRST:  # an embedding program imported mlx first: say so, once
    from loguru import logger as _logger

    _logger.warning("BLAS: {}", _MLX_FIRST)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """mlxcel's log format for a program that embeds it, in one call: every line (mlxcel's,
    its libraries', Python warnings) as ``HH:MM:SS.mmm LEVEL message`` on stderr, or one JSON
    object per line with ``fmt="json"``. It replaces loguru's default sink."""
    from mlxcel.process.logs import setup_logging as setup

    setup(level.upper(), fmt)


# name -> the module that defines it: the embedding API (docs/embedding.md).
_API = {
    "assemble": "mlxcel.serving.assembly",
    "start": "mlxcel.serving.assembly",
    "Generation": "mlxcel.serving.specs",
    "LocalSpec": "mlxcel.serving.specs",
    "TensorParallelSpec": "mlxcel.serving.specs",
    "PipelineSpec": "mlxcel.serving.specs",
    "CoordinatorSpec": "mlxcel.serving.specs",
    "StageSpec": "mlxcel.serving.specs",
    "DisaggSpec": "mlxcel.serving.specs",
    "Stack": "mlxcel.serving.stack",
    "NodeRunner": "mlxcel.serving.runner",
    "HttpOptions": "mlxcel.serving.runner",
    "openai_app": "mlxcel.serving.runner",
    "Node": "mlxcel.reactor.bus",
    "Envelope": "mlxcel.reactor.bus",
    "Overflow": "mlxcel.reactor.bus",
    "Origin": "mlxcel.reactor.bus",
    "SamplingParams": "mlxcel.base.messages",
    "RunResult": "mlxcel.base.messages",
    "deadline_in": "mlxcel.base.deadlines",
    "Fault": "mlxcel.reactor.faults",
    "FaultPlan": "mlxcel.reactor.faults",
    "MlxcelError": "mlxcel.base.errors",
}
__all__ = ["__version__", "setup_logging", *_API]


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'mlxcel' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


# Where each module that sat at the package's top now lives.
_MOVED = {
    "messages": "base.messages", "error_codes": "base.error_codes", "tensor": "base.messages",
    "sampling_params": "base.sampling_params", "errors": "base.errors", "effects": "base.effects",
    "fsm": "base.fsm", "deadlines": "base.deadlines", "defaults": "base.defaults",
    "handoff": "base.handoff", "membership": "base.membership", "model_config": "base.model_config",
    "topology": "base.topology", "bus": "reactor.bus", "adapter": "reactor.adapter",
    "endpoint": "reactor.endpoint", "faults": "reactor.faults", "specs": "serving.specs",
    "assembly": "serving.assembly", "stack": "serving.stack", "runner": "serving.runner",
    "frontend": "serving.frontend", "prompts": "serving.prompts", "grammar": "serving.grammar",
    "config_cli": "config.cli", "config_http": "config.http", "config_mlx_lm": "config.mlx_lm",
    "config_sources": "config.sources", "config_tools": "config.tools", "loop": "process.loop",
    "logs": "process.logs", "progress": "process.progress", "home": "process.home",
    "platform_guard": "process.platform_guard", "addresses": "net.network",
}  # fmt: skip


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import mlxcel.assembly`` gives ``mlxcel.serving.assembly`` itself (one module, two
    names), so a program written against the old layout keeps working."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(f"{__name__}.{_MOVED[spec.name.rpartition('.')[2]]}")
        # The import machinery is about to give the module the old name's spec: it keeps
        # its own (reload, and tools that read the spec, see the module where it lives).
        spec.loader_state = (module.__spec__, module.__loader__)
        return module

    def exec_module(self, module: Any) -> None:
        # It ran when it was imported under its own name; only its own spec goes back.
        module.__spec__, module.__loader__ = module.__spec__.loader_state


if not any(isinstance(f, _OldNames) for f in sys.meta_path):
    sys.meta_path.append(_OldNames())
