"""Settings of the tool commands (checkpoint, benchmarks, sim, keygen, cluster-check, demo).

Same rules as :mod:`mlxcel.config.settings` (CLI > environment > TOML file > default); kept apart so
the serving settings stay readable.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from mlxcel.base.defaults import PREFILL_STEP_SIZE
from mlxcel.config.sources import LogLevel, _Base, _short, check_model

Shape = Literal["tiny", "small", "qwen3-0.6b", "qwen3-8b", "qwen3-14b", "qwen3-30b-a3b"]
# The families mlxcel writes checkpoints of (mlxcel.runtime.checkpoint.FAMILIES, checked by a
# test), each with its real structure.
Family = Literal[
    "qwen3", "qwen2", "llama", "mistral", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gemma3_text",
    "deepseek_v3",
    "kimi_k2", "kimi_k3", "glm4_moe", "gpt_oss", "mixtral", "phi3",
]  # fmt: skip


def json_lines_field() -> Any:
    """``--json``: the figures as one JSON object per line instead of a table."""
    return Field(
        False, description="print one JSON object per line", json_schema_extra={"flag": "--json"}
    )


def quiet_log_level_field() -> Any:
    """A tool that prints figures logs only warnings unless told otherwise."""
    return Field(
        "WARNING",
        description="log level on stderr (any case)",
        json_schema_extra={"group": "logging and configuration"},
    )


def model_field(default: str) -> Any:
    """``-m``: the model a tool runs, or (None) an embedded checkpoint it writes itself."""
    return Field(
        None,
        description=f"model folder or Hub id org/name (default: {default})",
        json_schema_extra=_short("-m"),
    )


class _HasModel(_Base):
    """A command with a ``model`` field: a local folder or a Hub id, checked up front."""

    @field_validator("model", check_fields=False)
    @classmethod
    def _model_exists(cls, v: str | None) -> str | None:
        return check_model(v)


class CheckpointSettings(_Base):
    shape: Shape = Field("tiny", description="model shape")
    family: Family = Field("qwen3", description="architecture family (its real structure, shrunk)")
    out: Path = Field(..., description="output folder")
    seed: int = Field(
        0, ge=0, lt=2**32, description="weight seed", json_schema_extra={"group": "options"}
    )
    quantize: Literal[4, 8] | None = Field(None, description="quantize weights to 4 or 8 bits")
    force: bool = Field(False, description="write into a folder that is not empty")

    @field_validator("quantize", mode="before")
    @classmethod
    def _bits_from_text(cls, v: Any) -> Any:
        # The CLI and the environment deliver text; the choices are numbers.
        if isinstance(v, str) and v.strip().isdigit():
            return int(v)
        return v


class BenchBatchingSettings(_HasModel):
    model: str | None = model_field("the embedded small checkpoint")
    prefill_step_size: int = Field(
        PREFILL_STEP_SIZE, ge=16, le=65536, description="prompt tokens per prefill chunk"
    )
    streams: str = Field("1,4,8", description="comma-separated concurrent stream counts")
    tokens: int = Field(64, ge=1, description="tokens generated per stream")
    json_lines: bool = json_lines_field()

    @field_validator("streams")
    @classmethod
    def _streams(cls, v: str) -> str:
        try:
            counts = [int(x) for x in v.split(",") if x.strip()]
        except ValueError:
            raise ValueError("must be comma-separated integers, e.g. 1,4,8") from None
        if not counts or min(counts) < 1:
            raise ValueError("needs at least one count, each >= 1")
        return v


class BenchFramesSettings(_Base):
    json_lines: bool = json_lines_field()
    sizes: str = Field(
        "8K,64K,1M,2M,16M", description="payload sizes (8K, 64K, 256K, 1M, 2M, 4M, 16M or bytes)"
    )
    scale: float = Field(1.0, gt=0, le=100, description="multiply every iteration count by this")
    modes: str = Field(
        "reference,unprotected,hmac-sha256,aes-256-gcm,chacha20-poly1305",
        description="modes to measure (reference: a bare length-prefixed uvloop stream)",
    )
    netns: bool = Field(
        False,
        description="the peer on a second host: two network namespaces over veth links and a "
        "bridge (Linux, root); an activation's transfer between two hosts",
    )
    netns_rate: str | None = Field(
        None,
        description="with --netns (implied): shape both hosts' links to this rate (tc tbf: "
        "1gbit, 100mbit ...)",
    )

    @field_validator("netns_rate")
    @classmethod
    def _rate(cls, v: str | None) -> str | None:
        return BenchPipelineRunSettings._rate(v)

    log_level: LogLevel = quiet_log_level_field()

    @field_validator("sizes")
    @classmethod
    def _sizes(cls, v: str) -> str:
        for part in v.split(","):
            p = part.strip().upper()
            if p not in ("8K", "64K", "256K", "1M", "2M", "4M", "16M") and not (
                p.isdigit() and 0 < int(p) <= 1 << 28
            ):
                raise ValueError(f"bad size {part!r}")
        return v

    @field_validator("modes")
    @classmethod
    def _modes(cls, v: str) -> str:
        known = {"reference", "unprotected", "hmac-sha256", "aes-256-gcm", "chacha20-poly1305"}
        bad = [m for m in v.split(",") if m.strip() not in known]
        if bad:
            raise ValueError(f"unknown mode(s) {bad}; choose from {sorted(known)}")
        return v


class KeygenSettings(_Base):
    out: Path = Field(..., description="file to write the secret to (mode 0600)")
    force: bool = Field(False, description="overwrite an existing file")


class StatusSettings(_Base):
    url: str = Field(
        "http://127.0.0.1:8080",
        description="the serving node (a router, a pipeline coordinator, any server); also "
        "the first argument: status URL",
    )
    watch: bool = Field(False, description="redraw every --interval seconds until Ctrl-C")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        """``HOST:PORT`` as typed means http://HOST:PORT; another scheme is refused."""
        scheme, sep, rest = v.partition("://")
        if not sep:
            return f"http://{v}"
        if scheme.lower() not in ("http", "https") or not rest:
            raise ValueError(f"{v!r}: give http://HOST:PORT, https://HOST:PORT or HOST:PORT")
        return v

    interval: float = Field(2.0, ge=0.2, le=3600, description="seconds between redraws")
    api_key: SecretStr | None = Field(None, description="the server's --api-key, if it has one")


class SimSettings(_HasModel):
    seeds: int = Field(20, ge=1, le=1_000_000, description="how many seeded scenarios to run")
    first_seed: int = Field(0, ge=0, description="the first seed of the run")
    scenario: Literal["all", "mixed", "bringup", "disagg", "scale", "tiny", "engine"] = Field(
        "all",
        description="all: mixed, bringup and disagg for every seed; mixed: 2-8 stages serving, "
        "every fault kind; bringup: zero-config bring-up of 2-16 peers; disagg: a router with "
        "1-8 prefill and 1-8 decode nodes; scale: 32 stages; tiny: 2-4 stages computing with "
        "the real checkpoint (--model); engine: the one-process engine and frontend on it",
    )
    model: str | None = Field(
        None,
        description="checkpoint or Hub id for --scenario tiny or engine (default: the embedded "
        "tiny model)",
    )
    seed: int | None = Field(
        None,
        ge=0,
        description="replay this one seed (ignores --seeds)",
        json_schema_extra={"group": "options"},
    )
    stages: int | None = Field(None, ge=2, le=512, description="force the number of stages")
    inject: str | None = Field(
        None,
        description="deliberate bugs, comma-separated (skip-owner-check, accept-stale-nonce, "
        "shared-prefix-index; "
        "bringup: activate-early; disagg: read-uncommitted, prefill-drops-namespace; any "
        "scenario, in the effect "
        "runner: runner-drop-delivery)",
    )
    json_lines: bool = json_lines_field()

    @field_validator("inject")
    @classmethod
    def _known_bugs(cls, v: str | None) -> str | None:
        known = (
            "skip-owner-check",
            "accept-stale-nonce",
            "shared-prefix-index",
            "activate-early",
            "read-uncommitted",
            "prefill-drops-namespace",
            "runner-drop-delivery",
        )
        for bug in (v or "").split(","):
            if bug.strip() and bug.strip() not in known:
                raise ValueError(f"unknown bug {bug.strip()!r} (known: {', '.join(known)})")
        return v


class ClusterCheckSettings(_Base):
    listen: str | None = Field(None, description="run an authenticated ping endpoint on HOST:PORT")
    connect: str | None = Field(
        None, description="dial HOST:PORT with the cluster handshake and ping it"
    )
    advertise: str | None = Field(
        None, description="listener identity HOST:PORT this node claims (connect mode)"
    )
    node_id: str = Field(
        "check",
        description="node id announced in the handshake",
        json_schema_extra={"group": "options"},
    )
    cluster_secret_file: Path | None = Field(
        None, description="cluster secret file (see docs/security.md)"
    )
    cluster_interface: str | None = Field(
        None, description="bind and connect through this network interface"
    )
    pings: int = Field(5, ge=0, le=10000, description="pings to send after connecting")
    attempts: int = Field(
        5, ge=1, le=1000, description="connect attempts (refusals and at-capacity are retried)"
    )
    base_delay: float = Field(
        0.2, gt=0, le=60, description="first reconnect delay in seconds (doubles)"
    )
    duration: float = Field(0.0, ge=0, description="listen mode: seconds to run (0 = until Ctrl-C)")

    @model_validator(mode="after")
    def _one_mode(self) -> ClusterCheckSettings:
        if (self.listen is None) == (self.connect is None):
            raise ValueError("give exactly one of --listen or --connect")
        return self


class BenchPipelineSettings(_HasModel):
    """A model-level benchmark: which model (default small), how many tokens, JSON or table."""

    model: str | None = model_field("the embedded small checkpoint")
    shape: Shape = Field(
        "small",
        description="without -m: the embedded random-weight checkpoint of this shape (written "
        "into the cache on first use)",
    )
    family: Family = Field(
        "qwen3",
        description="without -m: the embedded checkpoint's family (e.g. qwen3_moe with "
        "--shape qwen3-30b-a3b: Qwen3-30B-A3B's shapes)",
    )
    tokens: int = Field(64, ge=2, le=4096, description="greedy tokens per measured run")
    json_lines: bool = json_lines_field()
    log_level: LogLevel = quiet_log_level_field()


class BenchDisaggSettings(_HasModel):
    """TTFT and inter-token latency under a mixed workload, hybrid vs 1 prefill + 1 decode."""

    model: str | None = model_field("the embedded small checkpoint")
    shape: Shape = Field(
        "small", description="without -m: the embedded random-weight checkpoint of this shape"
    )
    streams: int = Field(4, ge=1, le=64, description="short streams decoding throughout")
    tokens: int = Field(64, ge=2, le=4096, description="tokens each short stream decodes")
    long_prompts: int = Field(3, ge=0, le=64, description="long prompts arriving meanwhile")
    long_len: int = Field(1536, ge=16, le=65536, description="tokens in each long prompt")
    json_lines: bool = json_lines_field()
    log_level: LogLevel = quiet_log_level_field()


class DemoSettings(_HasModel):
    prompt: str = Field(
        "Explain pipeline parallelism in one sentence.", description="the chat message to send"
    )
    max_tokens: int = Field(32, ge=1, le=4096, description="tokens to stream")
    model: str | None = model_field("the embedded tiny model")
    log_level: LogLevel = quiet_log_level_field()


class BenchEngineSettings(BenchPipelineSettings):
    """mlxcel's engine beside mlx-lm's own generate path, on identical random prompts."""

    streams: str = Field("1,8,32", description="comma-separated concurrent stream counts")
    prompt_tokens: int = Field(64, ge=1, le=65536, description="tokens in each random prompt")
    tokens: int = Field(128, ge=2, le=4096, description="greedy tokens per stream (at most)")
    repeats: int = Field(
        3,
        ge=1,
        le=50,
        description="rounds per stream count (the median is reported, and the spread)",
    )

    @field_validator("streams")
    @classmethod
    def _streams(cls, v: str) -> str:
        return BenchBatchingSettings._streams(v)


class BenchStagesSettings(BenchPipelineSettings):
    """The pipeline and tensor-parallel benchmarks: one stream, then ``streams`` at once."""

    streams: int = Field(8, ge=1, le=256, description="concurrent streams of the aggregate run")


class BenchPipelineRunSettings(BenchPipelineSettings):
    """``bench pipeline``: every mode at each stream count, beside plain mlx-lm's split."""

    streams: str = Field("1,8,32", description="comma-separated concurrent stream counts")
    pp_micro_batch_size: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="sequences per micro-batch in both pipelines (default: as serve picks)",
    )
    reference: bool = Field(
        True, description="time plain mlx-lm's loop and two-halves split (the reference rows)"
    )
    pin: bool = Field(
        False,
        description="one device against two on a CPU host: the one-process rows pinned to one "
        "core, each stage process of remote-2 to a core of its own with BLAS at one thread (Linux)",
    )
    netns_rate: str | None = Field(
        None,
        description="run remote-2's stages on two network-namespace hosts whose links are shaped "
        "to this rate (tc tbf: 1gbit, 100mbit ...), the coordinator on the last stage's host "
        "(Linux, root)",
    )
    protection_cost: bool = Field(
        True,
        description="also run remote-2 with frame protection off (framing alone, bench "
        "processes only) at the smallest and largest stream count: what AES-256-GCM costs",
    )

    @field_validator("netns_rate")
    @classmethod
    def _rate(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit)", v):
            raise ValueError(f"{v!r} is not a tc rate such as 1gbit, 100mbit or 512kbit")
        return v

    @field_validator("streams")
    @classmethod
    def _streams(cls, v: str) -> str:
        return BenchBatchingSettings._streams(v)


class BenchTpSettings(BenchStagesSettings):
    """Same knobs as the pipeline benchmark: model (default small), tokens, streams, --json."""


class BenchBringupSettings(_HasModel):
    model: str | None = model_field("the embedded tiny model")
    json_lines: bool = json_lines_field()
    log_level: LogLevel = quiet_log_level_field()


class BenchFaultsSettings(BenchBringupSettings):
    """Silent and stopped peers on network namespaces (root): detection, 503s, recovery."""


class BenchFloodsSettings(BenchBringupSettings):
    """Outsiders without the secret on network namespaces (root): discovery under a beacon
    flood, a pipeline's first requests under a pending-handshake flood."""


class BenchHostileSettings(BenchBringupSettings):
    """A heavy client, a few addresses, a slow link and a faulty member against serving nodes
    on network namespaces (root)."""


class BenchPromptCacheSettings(BenchPipelineSettings):
    """Time to first token of a chat's second turn, with the history cached and without, in
    each mode, beside mlx-lm's own chat loop."""

    history: str = Field(
        "2048,8000",
        description="tokens of history in turn 1, one run each (comma-separated); each with "
        "turn 2 and its replies must fit the model's context (8192 for the embedded models)",
    )
    modes: str = Field(
        "local,pipeline,stages,tp,disagg",
        description="where mlxcel runs: local (one process), pipeline (2 stages in-process), "
        "stages (2 stage processes on 127.0.0.2/127.0.0.3), tp (2 tensor-parallel ranks), "
        "disagg (a router, a prefill and a decode node on 127.0.0.4-6: the decode node keeps "
        "the conversation), disagg-prefill (the same, only the prefill node keeps a cache), "
        "comma-separated",
    )
    turn_tokens: int = Field(32, ge=1, le=4096, description="new user tokens in turn 2")
    tokens: int = Field(32, ge=2, le=4096, description="greedy tokens each turn generates")

    @field_validator("history")
    @classmethod
    def _history(cls, v: str) -> str:
        sizes = [x.strip() for x in v.split(",") if x.strip()]
        if not sizes or not all(x.isdigit() and 16 <= int(x) <= 65536 for x in sizes):
            raise ValueError(f"{v!r}: give token counts from 16 to 65536, comma-separated")
        return v

    @field_validator("modes")
    @classmethod
    def _modes(cls, v: str) -> str:
        modes = [x.strip() for x in v.split(",") if x.strip()]
        unknown = [m for m in modes if m not in PROMPT_CACHE_MODES]
        if not modes or unknown:
            raise ValueError(f"{v!r}: modes are {', '.join(PROMPT_CACHE_MODES)}")
        return v


PROMPT_CACHE_MODES = ("local", "pipeline", "stages", "tp", "disagg", "disagg-prefill")
