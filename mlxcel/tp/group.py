"""Tensor-parallel groups on MLX's own distributed layer: NCCL between CUDA GPUs, else the
ring backend over TCP (``--tp-backend`` picks one).

Ranks are processes. Weights are sharded by mlx-lm's ``Model.shard(group)``; the collectives
inside the sharded layers are MLX's. Rank 0 drives: before each batch step it sends the
other ranks a :class:`~mlxcel.base.messages.TpStep` (CBOR) through the same group, so every rank
runs the identical batched forward pass.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlxcel.base.errors import ConfigError, TpGroupFailed
from mlxcel.base.messages import TpStep
from mlxcel.runtime.families import TP_FAMILIES, adapter_for, family_of
from mlxcel.tp.step_seal import StepSeal
from mlxcel.wire.codec import decode, encode

MODES = ("replicated", "sharded")


def check_modes(moe: str, embedding: str, lm_head: str) -> None:
    for flag, value in (
        ("--tp-moe-mode", moe),
        ("--tp-embedding-mode", embedding),
        ("--tp-lm-head-mode", lm_head),
    ):
        if value != "replicated":
            raise ConfigError(
                flag, f"mode {value!r} is not implemented yet; only 'replicated' is available"
            )


def check_shardable(config: dict[str, Any], n: int) -> None:
    """Refuse a model that mlx-lm cannot shard, or that does not split evenly over ``n``
    ranks, before any weights load: every size the family's ``shard()`` divides is checked."""
    family = family_of(config)
    adapter = adapter_for(config)
    if adapter is None or adapter.tp_sizes is None:
        raise ConfigError(
            "--tp-size",
            f"family {family!r} has no tensor-parallel path in mlx-lm (supported: "
            f"{', '.join(TP_FAMILIES)}); split it over stages with --pp-size instead",
        )
    bad = adapter.tp_problems(config, n)
    if bad:
        raise ConfigError(
            "--tp-size", f"the model does not shard evenly over {n} ranks: {'; '.join(bad)}"
        )


# A watchdog in a child process: MLX's ring ``init`` blocks while holding the GIL, so nothing
# in this process -- reactor, timer, signal handler -- can report progress or give up. The
# child prints what is being waited for every few seconds and, past the deadline, one error
# line and a SIGKILL for the stuck process. Closing its stdin (or dying) releases it.
_WATCHDOG = """
import json, os, select, signal, sys, time
timeout, pid, what, fmt, hint = float(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:6]
def say(level, msg):
    if fmt == "json":
        line = json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "level": level,
                           "message": msg, "logger": "mlxcel.tp.watchdog", "pid": os.getpid()})
    else:
        line = time.strftime("%H:%M:%S.000 ") + level.ljust(7) + " " + msg
    print(line, file=sys.stderr, flush=True)
start = time.monotonic()
while (left := start + timeout - time.monotonic()) > 0:
    if select.select([sys.stdin], [], [], min(2.0, left))[0]:
        sys.exit(0)
    say("INFO", "tensor parallel: waiting for %s (%.0fs of %gs)"
        % (what, time.monotonic() - start, timeout))
say("ERROR", "tensor parallel: gave up waiting for %s after %gs; %s (exit status 137: killed"
    " by the start-up watchdog)" % (what, timeout, hint))
os.kill(pid, signal.SIGKILL)
"""

# Why a group whose ranks all met rank 0 would not form (the watchdog's last line).
RING_HINT = (
    "every rank had met rank 0, so it should form at once: a rank stopped, or another "
    "process connected to a ring port first (on this host, or anyone on the ranks' "
    "network); start the group again"
)


def read_hostfile(path: Path) -> list[list[str]]:
    """The ring hostfile: a JSON list with one list of "HOST:PORT" strings per rank."""
    try:
        ranks = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError("--tp-hostfile", f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError("--tp-hostfile", f"{path} is not JSON: {exc}") from None
    ok = (
        isinstance(ranks, list)
        and len(ranks) >= 1
        and all(
            isinstance(r, list)
            and r
            and all(isinstance(a, str) and a.rpartition(":")[2].isdigit() for a in r)
            for r in ranks
        )
    )
    if not ok:
        raise ConfigError(
            "--tp-hostfile",
            f'{path} must be a JSON list with one list of "HOST:PORT" strings per rank, '
            'e.g. [["10.0.0.1:5000"], ["10.0.0.2:5000"]]',
        )
    return ranks


def ring_of(path: Path) -> list[str]:
    """Each rank's ring address from a hostfile: one IPv4 ``A.B.C.D:PORT`` per rank (what
    MLX's ring can parse; a rank proves its host by the address it connects from). MLX lets a
    rank list several addresses (one connection each); here a rank meets rank 0 and forms the
    ring at exactly one."""
    import ipaddress

    from mlxcel.net.network import check_address

    ranks = read_hostfile(path)
    several = [i for i, r in enumerate(ranks) if len(r) != 1]
    if several:
        raise ConfigError(
            "--tp-hostfile",
            f"rank {several[0]} lists {len(ranks[several[0]])} addresses; give each rank one "
            'HOST:PORT, e.g. [["10.0.0.1:5000"], ["10.0.0.2:5000"]]',
        )
    if len(ranks) < 2:
        raise ConfigError("--tp-hostfile", f"{path} lists {len(ranks)} rank; a group needs two")
    for i, (address,) in enumerate(ranks):
        try:
            check_address(address, "--tp-hostfile", port_zero=False)
            ipaddress.IPv4Address(address.rpartition(":")[0])
        except ValueError:
            raise ConfigError(
                "--tp-hostfile",
                f"rank {i}'s address {address!r} is not an IPv4 address and port: MLX's ring "
                "takes IPv4 addresses only (no host names, no IPv6)",
            ) from None
    return [r[0] for r in ranks]


def ring_digest(ring: Sequence[str]) -> str:
    """What ranks started by hand compare to know they were given one hostfile (its ranks,
    not its bytes: spacing does not matter)."""
    return hashlib.sha256(json.dumps(list(ring)).encode()).hexdigest()


def cleartext_hosts(ranks: list[list[str]], allowed: bool) -> str | None:
    """The WARNING every start of a group spanning hosts logs (None: all on this host's
    loopback). MLX's ring and NCCL have no encrypted or authenticated transport: refused
    unless the operator opted in (``--tp-allow-cleartext``)."""
    import ipaddress

    def loopback(host: str) -> bool:
        try:
            return ipaddress.ip_address(host.strip("[]")).is_loopback
        except ValueError:
            return host == "localhost"

    remote = sorted(
        {a.rpartition(":")[0] for r in ranks for a in r if not loopback(a.rpartition(":")[0])}
    )
    if not remote:
        return None
    what = (
        f"the tensor-parallel ranks span hosts ({', '.join(remote)}): MLX's ring and NCCL carry "
        "every all-reduce of activations and every step message (request ids, prompt token ids, "
        "sampling parameters) between them unencrypted, and the activations unauthenticated"
    )
    if not allowed:
        raise ConfigError(
            "--tp-hostfile",
            f"{what}; keep the ranks on one host, or pass --tp-allow-cleartext on every rank "
            "to run them on a network you trust",
        )
    return (
        f"{what}; anyone on that network can read them, and alter the activations "
        "(--tp-allow-cleartext)"
    )


BACKENDS = ("ring", "nccl")


def pick_backend(want: str = "auto") -> str:
    """NCCL where MLX runs on CUDA: its collectives go GPU to GPU, where the ring would copy
    every all-reduce through host memory and TCP. ``want`` (``--tp-backend``) overrides."""
    import mlx.core as mx

    want = want.strip().lower()
    if want != "auto" and want not in BACKENDS:
        raise ConfigError("--tp-backend", f"{want!r} is not one of auto, {', '.join(BACKENDS)}")
    if want == "nccl" and not mx.cuda.is_available():
        raise ConfigError("--tp-backend", "nccl needs MLX on CUDA GPUs")
    return want if want != "auto" else ("nccl" if mx.cuda.is_available() else "ring")


def init_group(rank: int, ring: Sequence[str], backend: str, timeout: float, key: bytes) -> Any:
    """Form MLX's group over ``ring`` (one HOST:PORT per rank, as rank 0 sent it) and check
    that every member holds this launch's ``key`` (:func:`prove_members`). Every rank calls
    this once every rank has met rank 0 (:mod:`.rendezvous`); it blocks until all are
    connected, or kills this process after ``timeout`` seconds with one line saying so.
    Under NCCL, rank 0's ring address is the rendezvous (``NCCL_HOST_IP:NCCL_PORT``)."""
    import shutil
    import subprocess
    import sys
    import tempfile

    import mlx.core as mx

    from mlxcel.process import logs

    folder = Path(tempfile.mkdtemp(prefix="mlxcel-ring-"))
    hostfile = folder / "ring.json"
    hostfile.write_text(json.dumps([[a] for a in ring]))
    os.environ["MLX_RANK"] = str(rank)
    os.environ["MLX_HOSTFILE"] = str(hostfile)
    if backend == "nccl":
        host, _, port = ring[0].rpartition(":")
        os.environ.update(
            NCCL_HOST_IP=host.strip("[]"), NCCL_PORT=port, MLX_WORLD_SIZE=str(len(ring))
        )
    peers = ", ".join(f"rank {i} at {a}" for i, a in enumerate(ring) if i != rank)
    what = f"MLX's {backend} group to form ({peers})"
    dog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(timeout), str(os.getpid()), what, logs.FORMAT]
        + [RING_HINT],
        stdin=subprocess.PIPE,
    )
    try:
        group = mx.distributed.init(backend=backend, strict=True)
        prove_members(group, rank, key)
        return group
    except RuntimeError as exc:  # MLX's own: a peer closed its ring connection
        raise TpGroupFailed(f"MLX's {backend} group did not form ({peers}): {exc}") from None
    finally:
        assert dog.stdin is not None
        dog.stdin.close()
        dog.wait()
        shutil.rmtree(folder, ignore_errors=True)


def member_tag(key: bytes, rank: int, size: int) -> bytes:
    return hmac.new(key, b"mlxcel-tp-member|%d|%d" % (rank, size), hashlib.sha256).digest()[:16]


def prove_members(group: Any, rank: int, key: bytes) -> None:
    """Every rank shows the others it holds this launch's key, over MLX's group itself: one
    all-sum of a tag per rank. MLX's connections authenticate nothing, so a process that won
    a ring port before a rank did would otherwise take its place -- and see every step, so
    every prompt, from then on. It cannot make that rank's tag: every rank then refuses the
    group before any step crosses it."""
    import mlx.core as mx
    import numpy as np

    n = group.size()
    mine = np.zeros((n, 16), dtype=np.int32)  # int32: the sum of one tag and zeros stays exact
    mine[rank] = np.frombuffer(member_tag(key, rank, n), dtype=np.uint8)
    got = np.array(mx.distributed.all_sum(mx.array(mine), group=group))
    bad = [
        r
        for r in range(n)
        if not np.array_equal(got[r], np.frombuffer(member_tag(key, r, n), dtype=np.uint8))
    ]
    if bad:
        raise TpGroupFailed(
            f"rank(s) {', '.join(map(str, bad))} of MLX's group do not hold this launch's key: "
            "another process took their place in the ring (its connections authenticate "
            "nothing); no step was sent. Start the group again, and keep the ranks' ports "
            "out of others' reach"
        )


def broadcast_step(group: Any, step: TpStep | None, seal: StepSeal) -> TpStep:
    """Rank 0 passes its step; the others pass None and receive it (two small all_sums).
    ``seal`` tags each step on rank 0 and checks each on the others (:mod:`.step_seal`).

    The batch generator leaves the next forward pass (with its own collectives) running
    asynchronously on its stream; issuing these all_sums on that same stream keeps every
    rank's collectives in one order.
    """
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generation_stream

    with mx.stream(generation_stream):
        return _broadcast(group, step, seal, mx, np)


def _broadcast(group: Any, step: TpStep | None, seal: StepSeal, mx: Any, np: Any) -> TpStep:
    payload = seal.seal(encode(step)) if step is not None else b""
    n = mx.distributed.all_sum(mx.array([len(payload)], dtype=mx.int32), group=group)
    size = int(n.item())
    buf = np.zeros(size, dtype=np.int32)
    if step is not None:
        buf[:] = np.frombuffer(payload, dtype=np.uint8)
    got = mx.distributed.all_sum(mx.array(buf), group=group)
    data = np.array(got).astype(np.uint8).tobytes()
    if step is not None:
        return step  # rank 0 knows what it sent
    msg = decode(seal.open(data))
    if not isinstance(msg, TpStep):  # pragma: no cover - only rank 0 writes here
        raise RuntimeError(f"expected a TpStep, got {type(msg).__name__}")
    return msg


def agree(group: Any, ok: list[bool]) -> list[bool]:
    """Whether every rank can do item ``i`` (each rank passes its own ``ok``): one small
    all_sum, on the generation stream like the steps' own collectives. Every rank must call it
    for the same items in the same order (rank 0 decides when, in the step it broadcasts)."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    with mx.stream(generation_stream):
        votes = mx.array([0 if x else 1 for x in ok], dtype=mx.int32)
        refused = mx.distributed.all_sum(votes, group=group).tolist()
    return [n == 0 for n in refused]


def load_sharded(path: Path, group: Any) -> Any:
    """Load a checkpoint lazily, shard it with mlx-lm, and materialise this rank's part."""
    import mlx.core as mx

    from mlxcel.runtime.model import load_model

    loaded = load_model(path, lazy=True)
    loaded.model.shard(group)
    mx.eval(loaded.model.parameters())
    return loaded
