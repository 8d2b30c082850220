from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from loguru import logger

from mlxcel.base.errors import SecretError
from mlxcel.net.secret import ClusterSecret, keygen, load_cluster_secret
from tests.conftest import error_line

GOOD = "0123456789abcdef0123"


def write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_precedence(tmp_path: Path) -> None:
    cli = write(tmp_path / "cli", "cli-secret-0123456789\n")
    envf = write(tmp_path / "envf", "env-file-secret-0123456789\n")
    toml_dir = tmp_path / "conf"
    toml_dir.mkdir()
    write(toml_dir / "s.secret", "toml-secret-0123456789\n")
    toml = toml_dir / "cluster.toml"
    toml.write_text('[cluster]\nsecret_file = "s.secret"\n')
    env = {"MLXCEL_CLUSTER_SECRET_FILE": str(envf)}
    assert load_cluster_secret(cli, env, toml).value == b"cli-secret-0123456789"  # type: ignore[union-attr]
    assert load_cluster_secret(None, env, toml).value == b"env-file-secret-0123456789"  # type: ignore[union-attr]
    assert load_cluster_secret(None, {"MLXCEL_CLUSTER_SECRET": GOOD}, toml).value == GOOD.encode()  # type: ignore[union-attr]
    got = load_cluster_secret(None, {}, toml)
    assert (
        got is not None and got.value == b"toml-secret-0123456789" and "cluster.toml" in got.source
    )


def test_both_environment_variables_is_an_error(tmp_path: Path) -> None:
    f = write(tmp_path / "f", GOOD)
    with pytest.raises(SecretError, match="both"):
        load_cluster_secret(
            None, {"MLXCEL_CLUSTER_SECRET_FILE": str(f), "MLXCEL_CLUSTER_SECRET": GOOD}
        )


def test_missing_secret_names_every_source() -> None:
    with pytest.raises(SecretError) as info:
        load_cluster_secret(None, {}, None)
    for src in (
        "--cluster-secret-file",
        "MLXCEL_CLUSTER_SECRET_FILE",
        "MLXCEL_CLUSTER_SECRET",
        "[cluster]",
    ):
        assert src in str(info.value)
    assert load_cluster_secret(None, {}, None, required=False) is None


def test_length_and_one_trailing_newline(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match="15 bytes"):
        load_cluster_secret(write(tmp_path / "a", "x" * 15 + "\n"), {})
    s = load_cluster_secret(write(tmp_path / "b", "y" * 16 + "\n\n"), {})
    assert s is not None and s.value == b"y" * 16 + b"\n"  # only one newline is trimmed
    with pytest.raises(SecretError, match="at least 16"):
        load_cluster_secret(None, {"MLXCEL_CLUSTER_SECRET": "short"})


def test_group_readable_file_warns(tmp_path: Path) -> None:
    lines: list[str] = []
    sink = logger.add(lines.append, level="WARNING")
    try:
        load_cluster_secret(write(tmp_path / "g", GOOD, 0o640), {})
        assert any("readable by group or others" in line for line in lines)
        lines.clear()
        load_cluster_secret(write(tmp_path / "p", GOOD, 0o600), {})
        assert lines == []
    finally:
        logger.remove(sink)


def test_value_never_in_repr_or_errors(tmp_path: Path) -> None:
    s = ClusterSecret(b"super-secret-value-123", "test")
    assert "super-secret" not in repr(s) and "super-secret" not in str(s)
    with pytest.raises(SecretError) as info:
        load_cluster_secret(None, {"MLXCEL_CLUSTER_SECRET": "tiny-secret"})
    assert "tiny-secret" not in str(info.value)


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match="cannot read"):
        load_cluster_secret(tmp_path / "nope", {})


def test_keygen_writes_0600_and_refuses_to_overwrite(tmp_path: Path) -> None:
    out = keygen(tmp_path / "k")
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    text = out.read_text()
    assert len(text) == 65 and text.endswith("\n") and bytes.fromhex(text.strip())
    with pytest.raises(SecretError, match="--force"):
        keygen(out)
    assert out.read_text() == text
    keygen(out, force=True)
    assert out.read_text() != text
    assert len(load_cluster_secret(out, {}).value) == 64  # type: ignore[union-attr]


def test_keygen_cli(tmp_path: Path) -> None:
    out = tmp_path / "cluster.secret"

    def run(*a):
        return subprocess.run(
            [sys.executable, "-m", "mlxcel", "keygen", *a],
            capture_output=True,
            text=True,
            env=os.environ,
            timeout=60,
        )

    assert run("--out", str(out)).returncode == 0
    again = run("--out", str(out))
    assert again.returncode == 1 and "--force" in again.stderr
    assert run("--out", str(out), "--force").returncode == 0


def _stage(tmp_path: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    """``serve --distributed-config`` for stage-0 with exactly ``env`` as the secret sources."""
    toml = tmp_path / "cluster.toml"
    toml.write_text(
        'pipeline_parallel_size = 2\n[[nodes]]\nid = "coordinator"\nrole = "coordinator"\n'
        'address = "127.0.0.1:1"\n[[nodes]]\nid = "stage-0"\nrole = "stage"\n'
        'address = "127.0.0.2:1"\n[[nodes]]\nid = "stage-1"\nrole = "stage"\n'
        'address = "127.0.0.3:1"\n'
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLXCEL_CLUSTER_SECRET")}
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", "serve", "--distributed-config", str(toml)]
        + ["--node-id", "stage-0", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **env},
    )


def test_serve_refuses_both_secret_variables_from_the_real_environment(tmp_path: Path) -> None:
    f = write(tmp_path / "env.secret", GOOD)
    r = _stage(tmp_path, {"MLXCEL_CLUSTER_SECRET_FILE": str(f), "MLXCEL_CLUSTER_SECRET": GOOD})
    assert r.returncode == 1
    assert "both MLXCEL_CLUSTER_SECRET_FILE and MLXCEL_CLUSTER_SECRET are set" in r.stderr


def test_serve_labels_the_secret_file_variable_as_its_source(tmp_path: Path) -> None:
    short = write(tmp_path / "short.secret", "too-short")
    r = _stage(tmp_path, {"MLXCEL_CLUSTER_SECRET_FILE": str(short)})
    assert r.returncode == 1
    assert "cluster secret from MLXCEL_CLUSTER_SECRET_FILE" in r.stderr
    # The flag still wins over the variable, and is named as the source.
    r = _stage(
        tmp_path, {"MLXCEL_CLUSTER_SECRET_FILE": str(short)}, "--cluster-secret-file", str(short)
    )
    assert r.returncode == 1 and "cluster secret from --cluster-secret-file" in r.stderr


def test_keygen_refuses_symlinks_and_missing_folders(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("precious\n")
    link = tmp_path / "link.secret"
    link.symlink_to(target)
    dangling = tmp_path / "dangling.secret"
    dangling.symlink_to(tmp_path / "nowhere")
    for path in (link, dangling):
        for force in (False, True):
            with pytest.raises(SecretError, match="symbolic link"):
                keygen(path, force=force)
    assert target.read_text() == "precious\n" and not (tmp_path / "nowhere").exists()
    r = subprocess.run(
        [sys.executable, "-m", "mlxcel", "keygen", "--out", str(tmp_path / "no" / "such" / "s")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert error_line(r.stderr) == (
        f"cannot write {tmp_path / 'no' / 'such' / 's'}: the folder "
        f"{tmp_path / 'no' / 'such'} does not exist"
    )
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_secret_file_from_a_config_file_is_named_as_such(tmp_path: Path) -> None:
    short = write(tmp_path / "short.secret", "too-short")
    conf = tmp_path / "settings.toml"
    conf.write_text(f'cluster_secret_file = "{short}"\n')
    r = _stage(tmp_path, {}, "--config", str(conf))
    assert r.returncode == 1
    assert f"cluster secret from cluster_secret_file (--config {conf})" in r.stderr
