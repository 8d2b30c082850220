"""Model identity: the shape (config, file names and sizes, layers) and the weight digest, its
cache by path, size and modification time, and the comparison that refuses other weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mlxcel.bringup import identity
from mlxcel.bringup.identity import model_identity
from mlxcel.bringup.protocol import weights_mismatch
from mlxcel.runtime.checkpoint import write_checkpoint


@pytest.fixture()
def seeds(tmp_path: Path) -> tuple[Path, Path]:
    return (
        write_checkpoint(tmp_path / "s0", "tiny", "qwen3", seed=0),
        write_checkpoint(tmp_path / "s7", "tiny", "qwen3", seed=7),
    )


def test_other_weights_of_the_same_shape_have_the_same_shape_and_another_digest(
    seeds: tuple[Path, Path], tmp_path: Path
) -> None:
    cache = tmp_path / "digests.json"
    a, b = (model_identity(p, cache=cache) for p in seeds)
    assert a.sha256 == b.sha256 and a.n_layers == b.n_layers  # what identity saw before
    assert a.weights and b.weights and a.weights != b.weights
    why = weights_mismatch(b.weights, a.weights, "the coordinator's")
    assert why is not None
    assert f"the coordinator's weights have digest {b.weights[:16]}" in why
    assert f"this node's {a.weights[:16]}" in why
    assert weights_mismatch(a.weights, a.weights, "x") is None
    # One side trusts its copy (no digest): nothing to compare.
    assert weights_mismatch("", a.weights, "x") is None
    assert weights_mismatch(a.weights, "", "x") is None
    trusted = model_identity(seeds[0], weights=False, cache=cache)
    assert trusted.weights == "" and trusted.sha256 == a.sha256


def test_digests_are_cached_by_path_size_and_mtime_and_a_rewrite_is_hashed_again(
    seeds: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "digests.json"
    hashed: list[str] = []
    real = identity._hash_files

    def counting(files: list[Path]) -> dict[Path, str]:
        hashed.extend(f.name for f in files)
        return real(files)

    monkeypatch.setattr(identity, "_hash_files", counting)
    path = seeds[0]
    first = model_identity(path, cache=cache).weights
    assert hashed and json.loads(cache.read_text())
    hashed.clear()
    assert model_identity(path, cache=cache).weights == first  # a restart rehashes nothing
    assert hashed == []
    # The same file rewritten in place with other bytes of the same size, its mtime set back
    # (as `cp -p` or `rsync -a` do): its change time still moved, so it is hashed again.
    weights = sorted(path.glob("*.safetensors"))[0]
    other = sorted(seeds[1].glob("*.safetensors"))[0]
    st = weights.stat()
    weights.write_bytes(other.read_bytes())
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_mtime_ns == st.st_mtime_ns and weights.stat().st_size == st.st_size
    changed = model_identity(path, cache=cache).weights
    assert hashed == [weights.name] and changed != first
    # A damaged cache is not trusted: everything is hashed again, with the same answer.
    for damage in ("{not json", "[1, 2]", json.dumps({str(weights.resolve()): [1]})):
        cache.write_text(damage)
        hashed.clear()
        assert model_identity(path, cache=cache).weights == changed and hashed


def test_a_checkpoint_without_weight_files_has_no_digest(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    got = model_identity(tmp_path, cache=tmp_path / "c.json")
    assert got.weights == "" and got.n_layers == 4
