"""What "the same model" means between nodes of one cluster.

Two parts, compared separately so that a mismatch says which one differs:

- the *shape*: a SHA-256 over config.json's own SHA-256, the name and size of every
  ``*.safetensors`` file, and the layer count (cheap: no weight is read);
- the *weights*: a SHA-256 over the content digest of every ``*.safetensors`` file. Two
  copies of one architecture with other values (another fine-tune, another seed) have the
  same shape and different weights, and would serve wrong text without it.

Hashing reads every byte once (0.4 s per GB from the page cache on two cores, else the
disk's read speed; files are hashed in parallel), so each file's digest is cached under
``$MLXCEL_HOME/weight-digests.json``, keyed by its resolved path, size, modification time,
inode and change time: a restart rehashes nothing, and a file rewritten or replaced is hashed
again. An operator who knows every copy matches may skip the weights (``--trust-weights``);
the digest is then empty and not compared.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from loguru import logger

from mlxcel.base.errors import ModelLoadError
from mlxcel.bringup.protocol import ModelIdentity

CHUNK = 8 << 20  # bytes read per update: large enough that hashlib releases the GIL
CACHE_NAME = "weight-digests.json"
MAX_CACHED = 4096  # cache entries kept (the newest); a cache is never a growing log


def n_layers_of(config: dict[str, object]) -> int:
    text = config.get("text_config")
    source = text if isinstance(text, dict) and "num_hidden_layers" in text else config
    return int(source["num_hidden_layers"])  # type: ignore[call-overload]


def model_identity(path: Path, weights: bool = True, cache: Path | None = None) -> ModelIdentity:
    """``path``'s identity; with ``weights``, its weight digest too (reads every weight file
    not in the cache: run it off the reactor)."""
    try:
        raw = (path / "config.json").read_bytes()
        n_layers = n_layers_of(json.loads(raw))
        files = sorted(path.glob("*.safetensors"))
        sized = [(f.name, f.stat().st_size) for f in files]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{path}: cannot read the model identity: {exc}") from None
    h = hashlib.sha256()
    h.update(b"config.json\0" + hashlib.sha256(raw).digest())
    for name, size in sized:
        h.update(f"{name}\0{size}\0".encode())
    h.update(f"layers\0{n_layers}".encode())
    digest = weights_digest(files, cache) if weights and files else ""
    return ModelIdentity(h.hexdigest(), n_layers, digest)


def default_cache() -> Path:
    from mlxcel.process.home import home

    return home() / CACHE_NAME


def weights_digest(files: list[Path], cache: Path | None = None) -> str:
    """One SHA-256 over every file's content digest (by name, in name order)."""
    cache = cache or default_cache()
    keys = {f: _key(f) for f in files}
    known = _load(cache)
    todo = [f for f in files if _cached(known, *keys[f]) is None]
    digests = _hash_files(todo) if todo else {}
    if digests:
        with _locked(cache):  # merged under a lock: concurrent nodes keep each other's
            known = _load(cache)
            for f, d in digests.items():
                path, stat = keys[f]
                known.pop(path, None)  # re-inserted last: the newest entries survive trimming
                known[path] = {"stat": stat, "sha256": d}
            _store(cache, known)
    h = hashlib.sha256()
    for f in files:
        d = digests.get(f) or _cached(known, *keys[f])
        h.update(f"{f.name}\0{d}\n".encode())
    return h.hexdigest()


def _key(f: Path) -> tuple[str, list[int]]:
    """Where the file is and what would change if it were rewritten: its size and mtime, and
    its inode and ctime (which no copy tool can set back), so a same-size rewrite that kept
    the mtime is hashed again."""
    try:
        st = f.stat()
        return str(f.resolve()), [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns]
    except OSError as exc:
        raise ModelLoadError(f"{f}: cannot read the weights: {exc}") from None


def _cached(known: dict[str, object], path: str, stat: list[int]) -> str | None:
    entry = known.get(path)
    if not isinstance(entry, dict) or entry.get("stat") != stat:
        return None
    digest = entry.get("sha256")
    return digest if isinstance(digest, str) and len(digest) == 64 else None


def _hash_files(files: list[Path]) -> dict[Path, str]:
    total = sum(_key(f)[1][0] for f in files)
    report = _reporter(total, f"hashing {len(files)} weight file(s), {total / 1e9:.2f} GB")
    started = time.monotonic()

    def one(f: Path) -> str:
        h = hashlib.sha256()
        try:
            with f.open("rb") as fh:
                while chunk := fh.read(CHUNK):
                    h.update(chunk)
                    report(len(chunk))
        except OSError as exc:
            raise ModelLoadError(f"{f}: cannot read the weights: {exc}") from None
        return h.hexdigest()

    workers = max(1, min(len(files), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(workers, thread_name_prefix="weight-digest") as ex:
        out = dict(zip(files, ex.map(one, files), strict=True))
    report(0, done=True)
    took = time.monotonic() - started
    if took > 1.0:
        logger.info(
            "weights hashed in {:.1f} s ({:.2f} s per GB); cached until the files change",
            took,
            took / max(total / 1e9, 1e-9),
        )
    return out


def _reporter(total: int, desc: str) -> Callable[..., None]:
    """Progress for a hash that takes over a second: a bar at a terminal, else a log line
    every 10 s."""
    from mlxcel.process.progress import DELAY, bars_wanted

    if bars_wanted():
        from tqdm import tqdm

        bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, delay=DELAY, file=sys.stderr)

        def tick(n: int, done: bool = False) -> None:
            bar.update(n) if not done else bar.close()

        return tick
    state = {"seen": 0, "next": time.monotonic() + DELAY}

    def line(n: int, done: bool = False) -> None:
        state["seen"] += n
        now = time.monotonic()
        if not done and now >= state["next"]:
            state["next"] = now + 10.0
            logger.info("{}: {:.0%}", desc, state["seen"] / max(total, 1))

    return line


def _load(cache: Path) -> dict[str, object]:
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}  # absent or damaged: everything is hashed again
    return data if isinstance(data, dict) else {}


@contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """An exclusive lock beside the cache (best effort: without one, a lost entry is only
    hashed again)."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(cache.with_name(cache.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield
        return
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _store(cache: Path, known: dict[str, object]) -> None:
    items = list(known.items())[-MAX_CACHED:]
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{cache.name}.", dir=cache.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump(dict(items), fh)
        os.replace(tmp, cache)
    except OSError as exc:  # a read-only home: hash again next time, still correct
        logger.debug("weight digests not cached at {}: {}", cache, exc)
