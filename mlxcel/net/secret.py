"""The cluster secret: where it comes from, how it is checked, and how it is kept out of logs.

Sources, highest first: ``--cluster-secret-file PATH``; ``MLXCEL_CLUSTER_SECRET_FILE``;
``MLXCEL_CLUSTER_SECRET`` (the value itself; setting both variables is an error);
``secret_file`` under ``[cluster]`` in the cluster TOML (relative to the TOML's folder). The
value must be at least 16 bytes after trimming one trailing newline.
"""

from __future__ import annotations

import os
import secrets
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from mlxcel.base.errors import SecretError

MIN_SECRET_BYTES = 16
SOURCES = (
    "--cluster-secret-file",
    "MLXCEL_CLUSTER_SECRET_FILE",
    "MLXCEL_CLUSTER_SECRET",
    "secret_file under [cluster] in the cluster TOML",
)


@dataclass(frozen=True)
class ClusterSecret:
    """Holds the secret bytes; its repr and str never show them."""

    value: bytes = field(repr=False)
    source: str

    def __repr__(self) -> str:
        return f"ClusterSecret(<redacted, {len(self.value)} bytes>, source={self.source!r})"

    __str__ = __repr__


def _check(raw: bytes, source: str) -> ClusterSecret:
    if raw.endswith(b"\n"):
        raw = raw[:-1]
    if len(raw) < MIN_SECRET_BYTES:
        raise SecretError(
            f"cluster secret from {source} is {len(raw)} bytes; at least {MIN_SECRET_BYTES} are "
            "required (generate one with `python -m mlxcel keygen --out PATH`)"
        )
    return ClusterSecret(raw, source)


def _read_file(path: Path, source: str) -> ClusterSecret:
    try:
        st = path.stat()
        raw = path.read_bytes()
    except OSError as exc:
        raise SecretError(
            f"cannot read the cluster secret file {path} ({source}): {exc.strerror}"
        ) from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning(
            "cluster secret file {} is readable by group or others (mode {:o}); chmod 600 it",
            path,
            stat.S_IMODE(st.st_mode),
        )
    return _check(raw, f"{source} ({path})")


def load_cluster_secret(
    cli_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    cluster_toml: str | Path | None = None,
    *,
    required: bool = True,
    cli_label: str = "--cluster-secret-file",
) -> ClusterSecret | None:
    """Resolve the secret from its sources in precedence order. ``cli_label`` names where
    ``cli_file`` came from (the flag, or ``cluster_secret_file`` in a ``--config`` file);
    ``environ``: the process environment, which only the command line passes (None: none)."""
    env = environ or {}
    if cli_file:
        return _read_file(Path(cli_file), cli_label)
    env_file = env.get("MLXCEL_CLUSTER_SECRET_FILE")
    env_value = env.get("MLXCEL_CLUSTER_SECRET")
    if env_file and env_value:
        raise SecretError(
            "both MLXCEL_CLUSTER_SECRET_FILE and MLXCEL_CLUSTER_SECRET are set; keep one"
        )
    if env_file:
        return _read_file(Path(env_file), "MLXCEL_CLUSTER_SECRET_FILE")
    if env_value:
        return _check(env_value.encode(), "MLXCEL_CLUSTER_SECRET")
    if cluster_toml:
        toml_path = Path(cluster_toml)
        try:
            data = tomllib.loads(toml_path.read_text())
        except (OSError, ValueError) as exc:
            raise SecretError(f"cannot read the cluster TOML {toml_path}: {exc}") from None
        rel = (data.get("cluster") or {}).get("secret_file")
        if rel is not None:
            if not isinstance(rel, str):
                raise SecretError(f"{toml_path}: [cluster] secret_file must be a string")
            path = Path(rel)
            if not path.is_absolute():
                path = toml_path.parent / path
            return _read_file(path, f"[cluster] secret_file in {toml_path}")
    if required:
        raise SecretError(
            "this role needs the cluster secret and none was given; set one of: "
            + "; ".join(SOURCES)
        )
    return None


def keygen(out: Path, force: bool = False) -> Path:
    """Write 32 random bytes as hex (plus newline) with mode 0600; refuse to overwrite."""
    if out.is_symlink():  # dangling ones too: writing through a link lands somewhere else
        raise SecretError(f"{out} is a symbolic link; refusing to write a secret through it")
    if out.exists() and not force:
        raise SecretError(f"{out} exists; pass --force to overwrite it")
    if not out.parent.is_dir():
        raise SecretError(f"cannot write {out}: the folder {out.parent} does not exist")
    data = (secrets.token_bytes(32).hex() + "\n").encode()
    # O_NOFOLLOW: a link planted between the check above and this open is refused too.
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(out, flags, 0o600)
    except OSError as exc:
        raise SecretError(f"cannot write {out}: {exc.strerror}") from None
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)
    return out
