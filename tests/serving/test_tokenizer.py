"""The tokenizer a model-less process loads (router, coordinator): mlx-lm's own, without MLX."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import mlx_lm.models
import pytest
from mlx_lm.utils import _get_classes, _tokenizer_defaults
from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

from mlxcel.base.errors import ModelLoadError
from mlxcel.serving.tokenizer import load_tokenizer, model_module, tokenizer_defaults
from tests.conftest import ROOT

TEXT = "Tell me about foxes, dogs and <|im_end|> tokens: 12345 ünïcödé"


def test_a_process_that_loads_only_the_tokenizer_never_imports_mlx(tiny: Path) -> None:
    """Loaded in a fresh process: mlx.core is never imported, the tokenizer encodes and
    streams as mlx-lm's does, and a later ``import mlx_lm`` (an embedding program that also
    runs a model) gets the whole package."""
    code = f"""
import sys
from mlxcel.serving.tokenizer import load_tokenizer
tok, config = load_tokenizer({str(tiny)!r})
assert "mlx.core" not in sys.modules and "mlx_lm" not in sys.modules, sorted(sys.modules)
maps = open("/proc/self/maps").read()
assert "libmlx" not in maps
ids = tok.encode({TEXT!r})
d = tok.detokenizer
for t in ids:
    d.add_token(t)
d.finalize()
print(repr((ids, sorted(tok.eos_token_ids), type(d).__name__, d.text)))
from mlx_lm import load
from mlx_lm.tokenizer_utils import TokenizerWrapper
assert isinstance(tok, TokenizerWrapper) and callable(load)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    ids, eos, detok, text = eval(out.stdout.strip().splitlines()[-1])
    want = mlx_lm_load_tokenizer(tiny, eos_token_ids=[*eos])
    assert ids == want.encode(TEXT)
    assert eos == sorted(want.eos_token_ids)
    assert detok == type(want.detokenizer).__name__
    assert text == want.decode(ids)


def test_in_a_process_with_mlx_lm_it_is_mlx_lm_s_loader(tiny: Path) -> None:
    tok, config = load_tokenizer(tiny)
    assert config["model_type"] == "qwen3"
    assert tok.encode(TEXT) == mlx_lm_load_tokenizer(tiny).encode(TEXT)


def test_a_folder_without_a_tokenizer_is_a_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        load_tokenizer(tmp_path)


MODEL_TYPES = [
    {"model_type": "mistral"},
    {"model_type": "kimi_k2"},
    {"model_type": "qwen3"},
    {"model_type": "bailing_hybrid", "architectures": ["BailingMoeV3ForCausalLM"]},
    {"model_type": "bailing_hybrid", "architectures": "BailingMoeV3ForCausalLM"},
    {"model_type": "gemma4_unified"},
]


@pytest.mark.parametrize("config", MODEL_TYPES, ids=lambda c: c["model_type"])
def test_the_model_module_is_the_one_mlx_lm_runs(config: dict) -> None:
    assert f"mlx_lm.models.{model_module(config)}" == _get_classes(config)[0].__module__


def test_tokenizer_defaults_read_from_source_are_the_imported_modules(tmp_path: Path) -> None:
    """Every mlx-lm family that has TOKENIZER_DEFAULTS: the source says what the module does;
    one without has none (what mlx-lm's loader reads for both)."""
    with_defaults = []
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        source = Path(mlx_lm.models.__path__[0]) / f"{info.name}.py"
        if "TOKENIZER_DEFAULTS" not in source.read_text():
            continue
        module = importlib.import_module(f"mlx_lm.models.{info.name}")
        assert tokenizer_defaults({"model_type": info.name}) == module.TOKENIZER_DEFAULTS
        with_defaults.append(info.name)
    assert with_defaults  # mlx-lm has at least one (muse_spark), or this checks nothing
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    assert _tokenizer_defaults(tmp_path) is None
    assert tokenizer_defaults({"model_type": "qwen3"}) is None
    assert tokenizer_defaults({"model_type": "no_such_family"}) is None
