"""Settings for every command, with one precedence rule: CLI > environment > TOML file > default.

Each command has a pydantic-settings model. The CLI parser is generated from its fields (so
``--help`` lists every setting with its default); each field is also read from
``MLXCEL_<NAME>`` and a TOML file (``--config FILE`` or ``MLXCEL_CONFIG``; flat keys named like
the fields). An invalid value raises :class:`ConfigError` naming the flag (and the variable or
file it came from); the entry point prints one line on stderr and exits with status 2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import (
    ByteSize,
    Field,
    field_validator,
    model_validator,
)

from mlxcel.base import defaults as d
from mlxcel.config.http import HttpApiSettings
from mlxcel.config.mlx_lm import MlxLmSettings
from mlxcel.config.sources import _Base, _short, check_model
from mlxcel.net.network import check_address


class ModelSettings(_Base):
    model: str | None = Field(
        None,
        description="model folder (Hugging Face layout) or Hub id org/name (default: the "
        "embedded tiny model)",
        json_schema_extra=_short("-m"),
    )
    prefill_step_size: int = Field(
        d.PREFILL_STEP_SIZE, ge=16, le=65536, description="prompt tokens per prefill chunk"
    )
    tp_size: int = Field(
        1,
        ge=1,
        le=64,
        description="tensor-parallel ranks (processes on mx.distributed)",
        json_schema_extra={"aliases": ("--tensor-parallel-size",)},  # vLLM's spelling
    )
    tp_hostfile: Path | None = Field(
        None, description="ring hostfile to join ranks on several hosts (with --tp-rank)"
    )
    tp_rank: int | None = Field(
        None, ge=0, description="this process's rank with --tp-hostfile (default $MLX_RANK)"
    )
    tp_allow_cleartext: bool = Field(
        False,
        description="let a --tp-hostfile span hosts: MLX's ring and NCCL send activations and "
        "step messages between them unencrypted, and the activations unauthenticated",
    )
    tp_backend: Literal["auto", "ring", "nccl"] = Field(
        "auto",
        description="collectives: auto (NCCL on CUDA, else the TCP ring), ring, nccl; rank 0 "
        "picks for the whole group",
    )
    tp_moe_mode: Literal["replicated", "sharded"] = Field(
        "replicated", description="expert layers under TP (sharded: not implemented yet)"
    )
    tp_embedding_mode: Literal["replicated", "sharded"] = Field(
        "replicated", description="embedding under TP (sharded: not implemented yet)"
    )
    tp_lm_head_mode: Literal["replicated", "sharded"] = Field(
        "replicated", description="LM head under TP (sharded: not implemented yet)"
    )
    pp_size: int = Field(
        1,
        ge=1,
        description="pipeline stages in this process (see --distributed-config for hosts)",
        json_schema_extra={"aliases": ("--pipeline-parallel-size",)},  # vLLM's spelling
    )
    startup_timeout: float = Field(
        d.STARTUP_TIMEOUT,
        gt=0,
        description="seconds to wait for pipeline stages or tensor-parallel ranks at start-up",
    )

    @field_validator("model")
    @classmethod
    def _model_exists(cls, v: str | None) -> str | None:
        return check_model(v)


class SamplingSettings(_Base):
    max_tokens: int = Field(
        100, ge=1, le=1 << 20, description="tokens to generate", json_schema_extra=_short("-n")
    )
    temp: float = Field(0.0, ge=0.0, le=10.0, description="sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    top_k: int = Field(
        0, ge=0, le=(1 << 31) - 1, description="sample from the k most likely tokens (0 = all)"
    )
    seed: int | None = Field(None, ge=0, lt=2**63, description="random seed for sampling")
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, description="drop tokens below this fraction of the top one's prob"
    )


class PipelineSettings(_Base):
    pp_layers: str | None = Field(None, description="explicit stage layer ranges, e.g. 0-15,16-31")

    @field_validator("pp_layers")
    @classmethod
    def _ranges_given(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("is empty: give the stages' ranges, e.g. 0-15,16-31")
        return v

    @model_validator(mode="after")
    def _one_stage_count(self) -> PipelineSettings:
        """--pp-size and --pp-layers both say how many stages: they must agree."""
        size = getattr(self, "pp_size", 1)
        if self.pp_layers is not None and size > 1:
            ranges = len(self.pp_layers.split(","))
            if ranges != size:
                raise ValueError(
                    f"--pp-size {size} but --pp-layers lists {ranges} ranges: give one of them"
                )
        return self

    pp_return_logits: bool = Field(
        False, description="final stage returns logits; the coordinator samples"
    )
    dry_run: bool = Field(False, description="print the pipeline plan and exit")
    pp_micro_batch_size: int | None = Field(
        None,
        ge=1,
        le=4096,
        description=(
            "pipeline: sequences per micro-batch -- decode steps that travel and run as one "
            "batch on every stage, while other micro-batches occupy the other stages "
            "(default: --parallel / stages for a multi-process pipeline, --parallel for "
            "--pp-size, whose stages share one compute thread; at most --max-batch-size)"
        ),
    )


class GenerateSettings(ModelSettings, SamplingSettings, PipelineSettings, MlxLmSettings):
    prompt: str = Field(
        "Hello", description="prompt text ('-' reads it from stdin)", json_schema_extra=_short("-p")
    )
    raw: bool = Field(
        False, description="feed the prompt as is (default: wrapped in the model's chat template)"
    )
    system_prompt: str | None = Field(None, description="a system message before the prompt")

    @model_validator(mode="after")
    def _system_needs_template(self) -> GenerateSettings:
        if self.raw and self.system_prompt is not None:
            raise ValueError("--system-prompt needs the chat template: drop --raw")
        for flag, given in (
            ("--pp-return-logits", self.pp_return_logits),
            ("--pp-micro-batch-size", self.pp_micro_batch_size is not None),
        ):
            if given and self.pp_size == 1 and self.pp_layers is None:
                raise ValueError(f"{flag} is for a pipeline (--pp-size or --pp-layers)")
        return self


class ServeSettings(ModelSettings, PipelineSettings, HttpApiSettings, MlxLmSettings):
    serves_batches: ClassVar[bool] = True  # (mlx-lm's one-stream-only options are refused)

    max_batch_size: int = Field(
        d.MAX_BATCH_SIZE, ge=1, le=1024, description="sequences per batched forward pass"
    )
    warmup: bool = Field(
        True,
        description="a pipeline stage serves throwaway sequences before serving (kernels "
        "compiled for a full prompt chunk and decode batches); --no-warmup serves at once and "
        "the first requests pay for it",
    )
    stream_interval: int = Field(
        d.STREAM_INTERVAL,
        ge=1,
        le=256,
        description="decode steps the engine runs per hand-off, shared by the batch's rows (a "
        "run also ends after about 25 ms): a stream's tokens reach it in bursts of up to this "
        "many; 1 sends each token as soon as it is sampled, at some cost in throughput "
        "(vLLM's --stream-interval)",
    )
    prompt_cache_bytes: ByteSize = Field(
        "1GiB",  # type: ignore[assignment]  # validated into a ByteSize
        description="memory for KV caches of finished requests, reused by later prompts of "
        "the same tenant that share their prefix (multi-turn chat), per node: one process, "
        "each pipeline stage for its own layers (the coordinator plans by its own value), or "
        "each tensor-parallel rank for its shard (rank 0's value); "
        "0 turns it off; bytes or a size such as 512MiB",
    )

    @field_validator("prompt_cache_bytes")
    @classmethod
    def _cache_size(cls, v: ByteSize) -> ByteSize:
        # A few bytes hold no model's KV for one token: a forgotten unit, not a choice.
        if 0 < v < 1 << 20:
            raise ValueError(
                f"{int(v)} bytes cannot hold a cached prompt; give at least 1MiB (a size "
                "such as 512MiB), or 0 to turn the cache off"
            )
        return v

    distributed_config: Path | None = Field(
        None, description="cluster TOML (pipeline across processes/hosts)"
    )
    node_id: str | None = Field(None, description="this process's node id in the cluster TOML")
    cluster_secret_file: Path | None = Field(
        None, description="cluster secret file (see docs/security.md)"
    )
    cluster_interface: str | None = Field(
        None, description="bind and connect cluster traffic through this interface"
    )
    trust_weights: bool = Field(
        False,
        description="skip hashing the weight files: this host's copy is vouched to match the "
        "other nodes' (their shapes are still compared)",
    )
    # --- zero-config bring-up (docs/bringup.md) ---
    pp_auto: int | None = Field(
        None, ge=1, le=256, description="coordinator: find N --pp-peer processes and assign stages"
    )
    pp_peer: bool = Field(False, description="wait for a stage assignment, then serve the stage")
    usable_memory: ByteSize = Field(
        0,  # type: ignore[assignment]  # validated into a ByteSize
        description="--pp-peer: the most memory this peer offers for its stage, which the "
        "coordinator splits the model by (bytes or a size such as 24GiB; default: MLX's "
        "memory limit on this device)",
    )
    cluster_peers: str | None = Field(
        None, description="static discovery: the peers' IP:PORT, comma-separated"
    )
    cluster_control_addr: str | None = Field(
        None,
        description="IP:PORT this node's control listener uses (coordinator default: the "
        "--host IP on port 19000; peer default with mdns: 0.0.0.0, any port)",
    )
    cluster_discovery: Literal["static", "mdns"] = Field(
        "static", description="how a --pp-auto coordinator finds its peers"
    )
    cluster_discovery_target: str = Field(
        "255.255.255.255", description="where a peer sends its beacons (broadcast or unicast IP)"
    )
    cluster_discovery_port: int = Field(49555, ge=1, le=65535, description="beacon UDP port")
    cluster_name: str = Field(
        "mlxcel-cluster", min_length=1, max_length=255, description="bring-up cluster name"
    )
    cluster_config_out: Path | None = Field(
        None,
        description="where bring-up writes the cluster TOML (default .mlxcel/cluster.toml on "
        "the coordinator, .mlxcel/cluster-<node-id>.toml on a peer)",
    )

    peer_timeout: float | None = Field(
        None,
        ge=0.3,
        le=600,
        description="seconds a cluster peer may go unheard before it counts as down "
        "(default: the cluster TOML's, else 3)",
    )
    prefill_timeout: float = Field(
        d.PREFILL_TIMEOUT,
        gt=0,
        description="router: seconds from dispatch to a prompt's first token",
    )

    # --- disaggregated serving (docs/disaggregated.md) ---
    node_role: Literal["hybrid", "prefill", "decode", "router"] = Field(
        "hybrid",
        description="disaggregated serving: hybrid does prefill and decode in one node",
    )
    serving_bind: str | None = Field(
        None, description="prefill/decode/router: IP:PORT of this node's cluster listener"
    )
    prefill_peers: str | None = Field(
        None, description="router: the prefill nodes' --serving-bind IP:PORT, comma-separated"
    )
    decode_peers: str | None = Field(
        None,
        description="router: the decode nodes; prefill: its fallback decode target (first entry)",
    )
    router_peers: str | None = Field(
        None,
        description="prefill/decode: the routers that use this node, IP:PORT, comma-separated: "
        "their dials never wait behind strangers', and only they may receive its tokens "
        "(unset: any router that polls it)",
    )
    decode_allowlist: str | None = Field(
        None,
        description="prefill: the decode targets a request may name, numeric IP:PORT, "
        "comma-separated (unset: any member; also MLXCEL_DECODE_ALLOWLIST)",
    )
    handoff_lease: float = Field(
        d.HANDOFF_LEASE,
        ge=0.5,
        le=3600,
        description="prefill: seconds a KV handoff may go without writing a part to its "
        "decode node (renewed by every part; after the last, the wait for the ack); decode: "
        "the wait for a handoff's next part and its verdict is this plus 5 s",
    )
    handoff_lease_max: float = Field(
        d.HANDOFF_LEASE_MAX,
        ge=1,
        le=86400,
        description="prefill: seconds a KV handoff may take in all, however it progresses",
    )

    def peer_list(self, field: str) -> list[str]:
        return [p.strip() for p in (getattr(self, field) or "").split(",") if p.strip()]

    @model_validator(mode="after")
    def _disagg_rules(self) -> ServeSettings:
        role = self.node_role
        if role == "hybrid":
            for flag, value in (
                ("--serving-bind", self.serving_bind),
                ("--prefill-peers", self.prefill_peers),
                ("--decode-peers", self.decode_peers),
                ("--router-peers", self.router_peers),
            ):
                if value:
                    raise ValueError(f"{flag} needs --node-role prefill, decode or router")
            return self
        if self.serving_bind is None:
            raise ValueError(f"--node-role {role} needs --serving-bind IP:PORT")
        check_address(self.serving_bind, "--serving-bind", port_zero=False)
        if self.serving_bind.rpartition(":")[0].strip("[]") in ("0.0.0.0", "::"):
            port = self.serving_bind.rpartition(":")[2]
            raise ValueError(
                f"--serving-bind {self.serving_bind}: this address is the node's identity in "
                "every cluster handshake, and the other side checks it against the "
                "connection's source IP, so it must be the IP the other nodes see this node "
                f"connect from (for example --serving-bind 10.0.0.2:{port}; --cluster-interface "
                "NAME takes it from a network interface). An unspecified address would "
                "fail every handshake from a multi-homed host, so it is refused here"
            )
        if self.distributed_config is not None or self.pp_auto is not None or self.pp_peer:
            raise ValueError(f"--node-role {role} does not combine with a pipeline")
        if self.tp_size > 1 or self.pp_size > 1:
            raise ValueError(f"--node-role {role} does not combine with --tp-size or --pp-size")
        for field, flag in (
            ("prefill_peers", "--prefill-peers"),
            ("decode_peers", "--decode-peers"),
            ("router_peers", "--router-peers"),
        ):
            peers = self.peer_list(field)
            for p in peers:
                check_address(p, flag, port_zero=False)
            if len(set(peers)) != len(peers):
                raise ValueError(f"{flag} lists an address twice")
        if role == "router" and not (
            self.peer_list("prefill_peers") and self.peer_list("decode_peers")
        ):
            raise ValueError("--node-role router needs --prefill-peers and --decode-peers")
        both = set(self.peer_list("prefill_peers")) & set(self.peer_list("decode_peers"))
        if both:
            raise ValueError(
                f"{', '.join(sorted(both))} is listed in both --prefill-peers and --decode-peers"
            )
        if role != "router" and self.prefill_peers:
            raise ValueError("--prefill-peers is for --node-role router")
        if role == "decode" and self.decode_peers:
            raise ValueError("--decode-peers is for --node-role router or prefill")
        if role == "router" and self.router_peers:
            raise ValueError("--router-peers is for --node-role prefill or decode")
        if self.handoff_lease > self.handoff_lease_max:
            raise ValueError(
                f"--handoff-lease ({self.handoff_lease:g}) exceeds --handoff-lease-max "
                f"({self.handoff_lease_max:g})"
            )
        return self

    @model_validator(mode="after")
    def _flags_need_their_mode(self) -> ServeSettings:
        """A flag of a mode this node does not run would be ignored: refuse it instead."""
        pipelined = (
            self.pp_size > 1
            or self.pp_layers is not None
            or self.distributed_config is not None
            or self.pp_auto is not None
            or self.pp_peer
        )
        for flag, given in (
            ("--pp-micro-batch-size", self.pp_micro_batch_size is not None),
            ("--pp-return-logits", self.pp_return_logits),
        ):
            if given and not pipelined:
                raise ValueError(
                    f"{flag} is for a pipeline (--pp-size, --pp-layers, --distributed-config, "
                    "--pp-auto or --pp-peer)"
                )
        if self.node_id is not None and self.distributed_config is None:
            raise ValueError("--node-id names this node in a --distributed-config file")
        if (
            "prompt_cache_bytes" in self.model_fields_set
            and self.prompt_cache_bytes
            and self.node_role == "router"
        ):
            raise ValueError(
                "--prompt-cache-bytes is for a node that runs the model: a router keeps no "
                "cache (its prefill and decode nodes each take their own)"
            )
        return self

    @model_validator(mode="after")
    def _bringup_rules(self) -> ServeSettings:
        if self.pp_auto is not None and self.pp_peer:
            raise ValueError("--pp-auto and --pp-peer are two ends of one bring-up: give one")
        if self.pp_auto is not None and self.distributed_config is not None:
            raise ValueError("--pp-auto and --distributed-config are mutually exclusive")
        if self.pp_peer and self.dry_run and self.distributed_config is None:
            raise ValueError("--dry-run is for the --pp-auto coordinator; a --pp-peer has no plan")
        if "usable_memory" in self.model_fields_set and not self.pp_peer:
            raise ValueError(
                "--usable-memory is what a --pp-peer offers the coordinator; give it to the peers"
            )
        if "usable_memory" in self.model_fields_set and self.usable_memory <= 0:
            raise ValueError(
                "--usable-memory 0 holds no stage; give a size such as 48GiB (or leave it out "
                "to offer what MLX may allocate on this device)"
            )
        if (self.pp_auto is not None or self.pp_peer) and (self.tp_size > 1 or self.tp_hostfile):
            raise ValueError(
                "--tp-size with --pp-auto or --pp-peer: tensor and pipeline parallelism cannot "
                "be combined yet"
            )
        stages_set_elsewhere = self.distributed_config is not None or self.pp_auto or self.pp_peer
        if stages_set_elsewhere and (self.pp_size > 1 or self.pp_layers is not None):
            raise ValueError(
                "--pp-size and --pp-layers are for a pipeline in this process; with "
                "--distributed-config, --pp-auto or --pp-peer the stages come from the cluster"
            )
        peers = [p.strip() for p in (self.cluster_peers or "").split(",") if p.strip()]
        for p in peers:
            check_address(p, "--cluster-peers", port_zero=False)
        if len(set(peers)) != len(peers):
            raise ValueError(f"--cluster-peers lists an address twice: {self.cluster_peers}")
        if self.cluster_control_addr is not None:
            check_address(
                self.cluster_control_addr, "--cluster-control-addr", port_zero=self.pp_peer
            )
        if self.pp_auto is not None and self.cluster_discovery == "static":
            if len(peers) != self.pp_auto:
                raise ValueError(
                    f"--pp-auto {self.pp_auto} with static discovery needs --cluster-peers "
                    f"listing exactly {self.pp_auto} peer addresses (got {len(peers)}); or use "
                    "--cluster-discovery=mdns"
                )
        if (
            self.pp_peer
            and self.distributed_config is None
            and self.cluster_discovery == "static"
            and self.cluster_control_addr is None
        ):
            raise ValueError(
                "a --pp-peer found by static discovery needs --cluster-control-addr IP:PORT "
                "(the address the coordinator's --cluster-peers lists)"
            )
        return self


def router_stats_verbose() -> bool:
    """MLXCEL_ROUTER_STATS_VERBOSE: addresses in /router/stats and /health. Read on each
    request (an operator may flip it without a restart), here, where the environment is read."""
    return os.environ.get("MLXCEL_ROUTER_STATS_VERBOSE", "").strip().lower() in TRUE_WORDS


TRUE_WORDS = ("1", "true", "yes", "on")
