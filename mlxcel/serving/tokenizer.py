"""A checkpoint's tokenizer without its weights, and without MLX.

A router, a pipeline coordinator or a bring-up coordinator serves HTTP and never runs the
model: it needs the tokenizer (chat template, prompt ids, streaming detokenizer, stop strings)
and nothing else. mlx-lm's tokenizer code (``mlx_lm.tokenizer_utils``, and the chat-template
and tool-parser modules it picks per checkpoint) needs only ``transformers``; but importing
any ``mlx_lm.<module>`` the usual way runs ``mlx_lm/__init__.py`` first, which imports its
generation code and with it MLX -- the Metal or CPU runtime, its start-up time and its
resident memory, in a process that holds no model.

So :func:`load_tokenizer` imports mlx-lm's tokenizer modules under a bare ``mlx_lm`` package
(the real package's module object and search path, its ``__init__`` not run) and removes that
bare package again once they are loaded. The submodules stay imported; a later ``import
mlx_lm`` in the same process (an embedding program that also runs a model) runs the real
``__init__`` then, and reuses them. A process that has already imported mlx-lm loads the
tokenizer through mlx-lm's own ``load_tokenizer``: both ways give the same tokenizer.
While it imports, ``sys.modules["mlx_lm"]`` is the bare package for the whole process, so it
runs where nothing else imports mlx-lm meanwhile: at a model-less node's start, before it
serves (a second or so, mostly ``transformers``).

The one thing mlx-lm's loader reads from model code is a family's ``TOKENIZER_DEFAULTS``
(chat template, tool parser and stop ids for checkpoints that do not carry them). Model
modules import MLX, so those defaults are read from the module's source text instead
(:func:`tokenizer_defaults`; a test checks them against the imported modules).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

from mlxcel.base.errors import ModelLoadError
from mlxcel.process.logs import adopt_library_logging
from mlxcel.runtime.families import read_config


def load_tokenizer(path: str | Path) -> tuple[Any, dict[str, Any]]:
    """The tokenizer (mlx-lm's ``TokenizerWrapper``) and ``config.json`` of a checkpoint."""
    p = Path(path).expanduser()
    config = read_config(p)
    try:
        eos = config.get("eos_token_id")
        if _mlx_lm_loaded():
            from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

            tokenizer = mlx_lm_load_tokenizer(p, eos_token_ids=eos)
        else:
            with _bare_mlx_lm():
                tokenizer_utils = importlib.import_module("mlx_lm.tokenizer_utils")
                tokenizer = tokenizer_utils.load(
                    p, eos_token_ids=eos, defaults=tokenizer_defaults(config)
                )
    except Exception as exc:
        raise ModelLoadError(f"{p}: {type(exc).__name__}: {exc}") from None
    adopt_library_logging()
    return tokenizer, config


def _mlx_lm_loaded() -> bool:
    """Whether this process imported the real mlx-lm package (its ``__init__`` ran)."""
    module = sys.modules.get("mlx_lm")
    return module is not None and hasattr(module, "load")


@contextmanager
def _bare_mlx_lm() -> Iterator[None]:
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None:
        raise ModuleNotFoundError("mlx_lm is not installed")
    bare = importlib.util.module_from_spec(spec)  # sets __path__; runs nothing
    sys.modules["mlx_lm"] = bare
    try:
        yield
    finally:
        if sys.modules.get("mlx_lm") is bare:
            del sys.modules["mlx_lm"]


def _package_dir() -> Path:
    spec = importlib.util.find_spec("mlx_lm")  # the loaded module's spec, if it is loaded
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("mlx_lm is not installed")
    return Path(spec.submodule_search_locations[0])


@cache
def _literal_dicts(source: Path, names: tuple[str, ...]) -> dict[str, Any]:
    """The module-level assignments ``NAME = {...literal...}`` of a source file, by name."""
    found: dict[str, Any] = {}
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id in names:
                found[target.id] = ast.literal_eval(node.value)
    return found


def model_module(config: dict[str, Any]) -> str:
    """The ``mlx_lm.models`` module mlx-lm runs a checkpoint with (mlx-lm's ``_get_classes``:
    the architecture remapping first, then the model-type remapping)."""
    tables = _literal_dicts(
        _package_dir() / "utils.py", ("MODEL_REMAPPING", "MODEL_ARCHITECTURE_REMAPPING")
    )
    model_type = str(config.get("model_type"))
    architectures = config.get("architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    by_arch = tables.get("MODEL_ARCHITECTURE_REMAPPING", {})
    for architecture in architectures:
        remapped = by_arch.get((model_type, architecture))
        if remapped is not None:
            return str(remapped)
    return str(tables.get("MODEL_REMAPPING", {}).get(model_type, model_type))


def tokenizer_defaults(config: dict[str, Any]) -> dict[str, Any] | None:
    """The model family's ``TOKENIZER_DEFAULTS``, read from its module's source (None: the
    family has none, or mlx-lm has no module for it: mlx-lm's loader says None then too)."""
    source = _package_dir() / "models" / f"{model_module(config)}.py"
    if not source.is_file():
        return None
    return _literal_dicts(source, ("TOKENIZER_DEFAULTS",)).get("TOKENIZER_DEFAULTS")
