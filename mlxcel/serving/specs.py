"""What to run, in plain values: one spec type per serving mode, and the generation limits
every generating mode shares. Pure (no MLX, no sockets): the CLI, an embedding service or a
test writes one, and :func:`mlxcel.serving.assembly.assemble` builds it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.base import defaults as d
from mlxcel.base.errors import ConfigError


def _never() -> bool:
    return False


def _need(ok: bool, field: str, problem: str) -> None:
    """A spec is refused when it is written, naming the field, as a bad flag is."""
    if not ok:
        raise ConfigError(field, problem)


def _positive(owner: object, *names: str) -> None:
    for name in names:
        value, field = getattr(owner, name), f"{type(owner).__name__}.{name}"
        number = isinstance(value, int | float) and not isinstance(value, bool)
        _need(number, field, f"must be a number, not {value!r}")
        _need(value > 0, field, f"must be above 0, not {value!r}")


@dataclass(frozen=True)
class Generation:
    """What every generating stack shares: admission and batching limits."""

    parallel: int = d.PARALLEL
    queue_size: int = d.QUEUE_SIZE
    request_timeout: float = d.REQUEST_TIMEOUT
    max_batch_size: int = d.MAX_BATCH_SIZE
    prefill_step_size: int = d.PREFILL_STEP_SIZE
    prompt_cache_bytes: int = 0  # per node, one process or a pipeline: 0 keeps none
    # Decode steps per hand-off from the engine (one process and disaggregated nodes).
    stream_interval: int = d.STREAM_INTERVAL

    def __post_init__(self) -> None:
        _positive(self, "parallel", "request_timeout", "max_batch_size")
        for name, low, high in (
            ("queue_size", 0, None),
            ("prefill_step_size", 16, 65536),
            ("prompt_cache_bytes", 0, None),
            ("stream_interval", 1, 256),
        ):
            value, field = getattr(self, name), f"Generation.{name}"
            integer = isinstance(value, int) and not isinstance(value, bool)
            _need(integer, field, f"must be an integer, not {value!r}")
            _need(value >= low, field, f"{value} is below {low}")
            _need(high is None or value <= high, field, f"{value} is above {high}")


@dataclass(frozen=True)
class LocalSpec:
    """One process: the whole model, one engine."""

    model: Path
    adapter: Path | None = None  # a LoRA adapter folder mlx-lm applies on load
    max_kv_size: int | None = None  # mlx-lm's rotating KV cache of this many tokens
    mode = "local"


@dataclass(frozen=True)
class TensorParallelSpec:
    """Rank 0 of a tensor-parallel group (it starts the other ranks unless ``hostfile``)."""

    model: Path
    size: int
    hostfile: Path | None = None
    startup_timeout: float = d.STARTUP_TIMEOUT
    backend: str = "auto"  # --tp-backend
    allow_cleartext: bool = False  # --tp-allow-cleartext: a hostfile may span hosts
    # The cluster secret (a ClusterSecret): with a hostfile, the ranks' step key comes from it.
    secret: Any = None
    mode = "tensor-parallel"

    def __post_init__(self) -> None:
        _positive(self, "size", "startup_timeout")
        backends = ("auto", "ring", "nccl")
        field = "TensorParallelSpec.backend"
        _need(self.backend in backends, field, f"{self.backend!r} is not one of {backends}")


@dataclass(frozen=True)
class PipelineSpec:
    """Every stage and the coordinator in this process, on an in-memory fabric."""

    model: Path
    size: int
    layers: str | None = None
    return_logits: bool = False
    micro_batch_size: int | None = None
    # A compute thread per stage (micro-batches overlap on the host as across processes);
    # by default the stages share one, as one device is fed in order.
    stage_threads: bool = False
    mode = "pipeline"

    def __post_init__(self) -> None:
        _positive(self, "size")
        if self.micro_batch_size is not None:
            _positive(self, "micro_batch_size")


@dataclass(frozen=True)
class _ClusterNodeSpec:
    """A node of a multi-process pipeline (``cfg``: its cluster TOML; ``me``: its entry)."""

    cfg: Any
    me: Any
    model: Path
    secret: Any
    return_logits: bool = False
    interface: str | None = None
    trust_weights: bool = False  # skip the weight digest (see mlxcel.bringup.identity)

    def __post_init__(self) -> None:
        name = type(self).__name__
        _need(self.cfg is not None and self.me is not None, name, "needs its cluster and entry")
        _need(self.secret is not None, f"{name}.secret", "every cluster node needs the secret")


@dataclass(frozen=True)
class CoordinatorSpec(_ClusterNodeSpec):
    """The coordinator of a multi-process pipeline: it serves the HTTP API."""

    startup_timeout: float = d.STARTUP_TIMEOUT
    micro_batch_size: int | None = None
    # Stage addresses in /health, read per request (the CLI: MLXCEL_ROUTER_STATS_VERBOSE).
    verbose_stats: Callable[[], bool] = _never
    mode = "coordinator"


@dataclass(frozen=True)
class StageSpec(_ClusterNodeSpec):
    """One stage process of a multi-process pipeline."""

    # Serve throwaway sequences first (kernels compiled for a full prompt chunk and decode
    # batches); False (--no-warmup): serve at once, the first requests pay for it.
    warm_up: bool = True
    mode = "stage"


@dataclass(frozen=True)
class DisaggSpec:
    """A node of disaggregated serving: ``role`` (router, prefill or decode) is its mode."""

    role: str
    model: Path
    secret: Any
    bind: str
    prefill_peers: tuple[str, ...] = ()
    decode_peers: tuple[str, ...] = ()
    interface: str | None = None
    startup_timeout: float = d.STARTUP_TIMEOUT
    peer_timeout: float = d.PEER_TIMEOUT  # a peer unheard this long is down
    prefill_timeout: float = d.PREFILL_TIMEOUT  # router: dispatch to first token
    decode_allowlist: str | None = None  # prefill: decode targets a request may name (None: any)
    # prefill/decode: the routers that use it (None: any router that polls it; see DecodeCore)
    router_peers: tuple[str, ...] | None = None
    handoff_lease: float = d.HANDOFF_LEASE  # prefill: a handoff's lease past its last progress
    handoff_lease_max: float = d.HANDOFF_LEASE_MAX  # prefill: and its whole life at most
    # router: node addresses in /router/stats, read per request (MLXCEL_ROUTER_STATS_VERBOSE).
    verbose_stats: Callable[[], bool] = _never

    def __post_init__(self) -> None:
        roles = ("router", "prefill", "decode")
        _need(self.role in roles, "DisaggSpec.role", f"{self.role!r} is not one of {roles}")
        _need(self.secret is not None, "DisaggSpec.secret", "every role needs the secret")
        _need(bool(self.bind), "DisaggSpec.bind", "the node's cluster address is required")
        _positive(
            self, "startup_timeout", "peer_timeout", "prefill_timeout", "handoff_lease",
            "handoff_lease_max",
        )  # fmt: skip

    @property
    def mode(self) -> str:
        return self.role


StackSpec = LocalSpec | TensorParallelSpec | PipelineSpec | CoordinatorSpec | StageSpec | DisaggSpec
