"""The cluster TOML: who is in the cluster, where, and which layers each stage runs.

```toml
name = "demo"                      # cluster name
pipeline_parallel_size = 2

[cluster]
secret_file = "cluster.secret"     # relative to this file's folder
max_connections = 512

[[nodes]]
id = "coordinator"
role = "coordinator"
address = "127.0.0.1:19000"        # the listener stages reply to

[[nodes]]
id = "stage-0"
role = "stage"
address = "127.0.0.2:19001"
layers = "0-1"                     # inclusive; omit on every stage for an automatic split
memory_gb = 8                      # optional: weight the automatic split, refuse what cannot fit
```

Stages run in the order they are listed. Validation is by pydantic; an invalid file is a
:class:`~mlxcel.base.errors.ConfigError` naming the field.
"""

from __future__ import annotations

import ipaddress
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from mlxcel.base.errors import ConfigError
from mlxcel.net.connection import (
    DEFAULT_FRAME_TIMEOUT,
    DEFAULT_MEMORY_BUDGET,
    DEFAULT_PEER_TIMEOUT,
)
from mlxcel.net.listener import DEFAULT_IDLE_TIMEOUT
from mlxcel.wire.frames import DEFAULT_MAX_MESSAGE
from mlxcel.wire.handshake import MAX_CLOCK_SKEW


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NodeSpec(_Strict):
    id: str = Field(min_length=1, max_length=255)
    role: Literal["coordinator", "stage"]
    address: str
    layers: str | None = None
    memory_gb: float | None = Field(None, gt=0, allow_inf_nan=False)

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"expected IP:PORT, got {v!r}")
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            raise ValueError(
                f"host of {v!r} must be an IP address (identities are bound to source IPs)"
            ) from None
        return v

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])


class ClusterSection(_Strict):
    secret_file: str | None = None
    max_connections: int = Field(512, ge=1)
    max_pending_handshakes: int = Field(64, ge=1)
    max_pending_handshakes_per_ip: int = Field(8, ge=1)
    handshake_timeout: float = Field(5.0, gt=0)
    # One message's cap; frames themselves are 256 KiB records. `max_frame_bytes` (its old
    # name) is still accepted.
    max_message_bytes: int = Field(
        DEFAULT_MAX_MESSAGE,
        ge=1024,
        validation_alias=AliasChoices("max_message_bytes", "max_frame_bytes"),
    )
    memory_budget_bytes: int = Field(DEFAULT_MEMORY_BUDGET, ge=1 << 20)
    idle_timeout: float = Field(DEFAULT_IDLE_TIMEOUT, gt=0)
    frame_timeout: float = Field(DEFAULT_FRAME_TIMEOUT, gt=0)
    # A peer not heard from for this long is dead: its connections close, it is marked down.
    peer_timeout: float = Field(DEFAULT_PEER_TIMEOUT, ge=0.3, le=600)
    max_clock_skew: float = Field(MAX_CLOCK_SKEW, gt=0)
    sequence_lease: float = Field(300.0, gt=0)
    max_sequences_per_stage: int = Field(256, ge=1)
    forward_timeout: float = Field(120.0, gt=0)
    # Operators of the original engine write max_reconnect_attempts: both are accepted.
    reconnect_attempts: int = Field(
        5, ge=1, validation_alias=AliasChoices("reconnect_attempts", "max_reconnect_attempts")
    )
    reconnect_base_delay: float = Field(0.2, gt=0)
    step_timeout: float = Field(30.0, gt=0)


class ClusterConfig(_Strict):
    name: str = "mlxcel-cluster"
    pipeline_parallel_size: int = Field(ge=1)
    model: str | None = None
    cluster: ClusterSection = ClusterSection()
    nodes: list[NodeSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _shape(self) -> ClusterConfig:
        coords = [n for n in self.nodes if n.role == "coordinator"]
        if len(coords) != 1:
            raise ValueError(
                f"exactly one node must have role = 'coordinator' (found {len(coords)})"
            )
        stages = self.stages
        if len(stages) != self.pipeline_parallel_size:
            raise ValueError(
                f"pipeline_parallel_size is {self.pipeline_parallel_size} but {len(stages)} stage nodes are listed"
            )
        ids = [n.id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ValueError("node ids must be unique")
        addrs = [n.address for n in self.nodes]
        if len(set(addrs)) != len(addrs):
            raise ValueError("node addresses must be unique")
        with_layers = [s for s in stages if s.layers]
        if with_layers and len(with_layers) != len(stages):
            raise ValueError("give layers on every stage or on none (automatic split)")
        with_memory = [s for s in stages if s.memory_gb is not None]
        if with_memory and len(with_memory) != len(stages):
            raise ValueError(
                "give memory_gb on every stage or on none (the split weighs each stage's "
                "memory against the others')"
            )
        return self

    @property
    def coordinator(self) -> NodeSpec:
        return next(n for n in self.nodes if n.role == "coordinator")

    @property
    def stages(self) -> list[NodeSpec]:
        return [n for n in self.nodes if n.role == "stage"]

    def node(self, node_id: str) -> NodeSpec:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise ConfigError(
            "--node-id",
            f"no node {node_id!r} in the cluster config (have: {', '.join(n.id for n in self.nodes)})",
        )

    @property
    def pp_layers(self) -> str | None:
        if self.stages and all(s.layers for s in self.stages):
            return ",".join(str(s.layers) for s in self.stages)
        return None

    @property
    def memory(self) -> list[float] | None:
        if all(s.memory_gb for s in self.stages):
            return [float(s.memory_gb) * 2**30 for s in self.stages]  # type: ignore[arg-type]
        return None


def load_cluster_config(path: str | Path) -> ClusterConfig:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as exc:
        raise ConfigError("--distributed-config", f"cannot read {p}: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError("--distributed-config", f"{p}: not valid TOML: {exc}") from None
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "cluster"
        raise ConfigError(
            "--distributed-config", f"{p}: {loc}: {err['msg'].removeprefix('Value error, ')}"
        ) from None


def parse_cluster_toml(text: str) -> ClusterConfig:
    """A cluster TOML received over the network (a bring-up offer), validated; raises
    ValueError with the first line of what is wrong."""
    try:
        return ClusterConfig.model_validate(tomllib.loads(text))
    except ValueError as exc:  # TOMLDecodeError and ValidationError both are
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(first) from None
