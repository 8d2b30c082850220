"""Settings for every command, with one precedence rule: CLI > environment > TOML file > default.

Each command has a pydantic-settings model. The CLI parser is generated from the model's fields
(so ``--help`` always lists every setting with its default), every field is also read from
``MLXCEL_<NAME>`` and from a TOML file (``--config FILE`` or ``MLXCEL_CONFIG``; flat keys named
like the fields, e.g. ``max_batch_size = 8``). An invalid value raises :class:`ConfigError`
naming the flag (and the variable or file it came from); the entry point turns that into one
line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from mlxcel.errors import ConfigError

ENV_PREFIX = "MLXCEL_"
# Read by their own loaders, which know the precedence among them (mlxcel.net.secret): mapped
# onto a setting, MLXCEL_CLUSTER_SECRET_FILE would pose as --cluster-secret-file.
NOT_FROM_ENV = frozenset({"cluster_secret_file"})


class _EnvSource(EnvSettingsSource):
    def __call__(self) -> dict[str, Any]:
        return {k: v for k, v in super().__call__().items() if k not in NOT_FROM_ENV}


class _Base(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    # Set by :func:`load_settings` just before construction; read by the source hook.
    _toml_file: ClassVar[Path | None] = None
    # Set by :func:`load_settings`: setting name -> where its value came from, as a message
    # names it (the flag, the variable, or "name (--config FILE)").
    _origin: dict[str, str] = PrivateAttr(default_factory=dict)

    def origin(self, name: str) -> str:
        return self._origin.get(name) or flag_of(name, type(self))

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, _EnvSource(settings_cls)]
        if cls._toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=cls._toml_file))
        return tuple(sources)


def _short(flag: str) -> dict[str, Any]:
    return {"short": flag}


class ModelSettings(_Base):
    model: str | None = Field(
        None,
        description="model folder (Hugging Face layout); default: the embedded tiny model",
        json_schema_extra=_short("-m"),
    )
    max_batch_size: int = Field(8, ge=1, le=1024, description="sequences per batched forward pass")
    prefill_step_size: int = Field(
        512, ge=16, le=65536, description="prompt tokens per prefill chunk"
    )
    tp_size: int = Field(
        1, ge=1, le=64, description="tensor-parallel ranks (processes on mx.distributed)"
    )
    tp_hostfile: Path | None = Field(
        None, description="ring hostfile to join ranks on several hosts (with --tp-rank)"
    )
    tp_rank: int | None = Field(
        None, ge=0, description="this process's rank with --tp-hostfile (default $MLX_RANK)"
    )
    tp_moe_mode: Literal["replicated", "sharded"] = Field(
        "replicated", description="expert layers under TP"
    )
    tp_embedding_mode: Literal["replicated", "sharded"] = Field(
        "replicated", description="embedding under TP"
    )
    tp_lm_head_mode: Literal["replicated", "sharded"] = Field(
        "replicated", description="LM head under TP"
    )
    pp_size: int = Field(
        1, ge=1, description="pipeline stages in this process (see --distributed-config for hosts)"
    )
    startup_timeout: float = Field(
        60.0,
        gt=0,
        description="seconds to wait for pipeline stages or tensor-parallel ranks at start-up",
    )
    log_level: Literal["TRACE", "DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="log level on stderr"
    )

    @field_validator("model")
    @classmethod
    def _model_exists(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).expanduser().is_dir():
            raise ValueError(f"no such model folder: {v}")
        return v


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


class PipelineSettings(_Base):
    pp_layers: str | None = Field(None, description="explicit stage layer ranges, e.g. 0-15,16-31")
    pp_return_logits: bool = Field(
        False, description="final stage returns logits; the coordinator samples"
    )
    dry_run: bool = Field(False, description="print the pipeline plan and exit")


class GenerateSettings(ModelSettings, SamplingSettings, PipelineSettings):
    prompt: str = Field("Hello", description="prompt text", json_schema_extra=_short("-p"))
    chat: bool = Field(False, description="wrap the prompt in the model's chat template")


class ServeSettings(ModelSettings, PipelineSettings):
    pp_micro_batch_size: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="pipeline: sequences in the stages at once; more wait (default: --parallel)",
    )
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
    host: str = Field("127.0.0.1", description="HTTP bind address")
    port: int = Field(8080, ge=0, le=65535, description="HTTP port (0 = pick a free one)")
    parallel: int = Field(8, ge=1, le=4096, description="requests generating at once")
    queue_size: int = Field(
        64, ge=0, le=100000, description="requests waiting for a slot before 503"
    )
    request_timeout: float = Field(600.0, gt=0, description="seconds before a request fails")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none")
    served_model_name: str | None = Field(
        None, description="model id in the API (default: folder name)"
    )
    max_body_bytes: int = Field(4 << 20, ge=1024, description="largest accepted request body")
    drain_timeout: float = Field(
        30.0, ge=0, description="seconds SIGTERM waits for requests in flight"
    )


class CheckpointSettings(_Base):
    shape: Literal["tiny", "small", "qwen3-0.6b"] = Field("tiny", description="model shape")
    family: Literal["qwen3", "qwen2", "llama"] = Field("qwen3", description="architecture family")
    out: Path = Field(..., description="output folder")
    seed: int = Field(0, ge=0, lt=2**32, description="weight seed")
    quantize: Literal[4, 8] | None = Field(None, description="quantize weights to 4 or 8 bits")

    @field_validator("quantize", mode="before")
    @classmethod
    def _bits_from_text(cls, v: Any) -> Any:
        # The CLI and the environment deliver text; the choices are numbers.
        if isinstance(v, str) and v.strip().isdigit():
            return int(v)
        return v


class BenchBatchingSettings(ModelSettings):
    streams: str = Field("1,4,8", description="comma-separated concurrent stream counts")
    tokens: int = Field(64, ge=1, description="tokens generated per stream")
    json_lines: bool = Field(
        False, description="print one JSON object per line", json_schema_extra={"flag": "--json"}
    )

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


# --- CLI generation --------------------------------------------------------------------------


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(self.prog, message)


def flag_of(name: str, cls: type[BaseSettings]) -> str:
    extra = cls.model_fields[name].json_schema_extra or {}
    return str(extra.get("flag", "--" + name.replace("_", "-")))  # type: ignore[union-attr]


def add_arguments(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    parser.add_argument(
        "--config",
        dest="_config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="TOML file of settings (default: $MLXCEL_CONFIG, else none)",
    )
    for name, f in cls.model_fields.items():
        extra = f.json_schema_extra or {}
        flags = [flag_of(name, cls)]
        if isinstance(extra, dict) and "short" in extra:
            flags.insert(0, str(extra["short"]))
        default = "required" if f.is_required() else repr(f.default)
        help_text = f"{f.description} (default: {default}; env {ENV_PREFIX}{name.upper()})"
        if name in NOT_FROM_ENV:
            help_text = f"{f.description} (default: {default})"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if f.annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = name.upper()
        parser.add_argument(*flags, **kwargs)


def _source(name: str, cli: dict[str, Any], toml_path: Path | None) -> str | None:
    """Where a given setting came from: None for the command line (or nowhere), else the
    environment variable or the TOML file."""
    if name in cli:
        return None
    env = ENV_PREFIX + name.upper()
    if env in os.environ and name not in NOT_FROM_ENV:
        return env
    return str(toml_path) if toml_path is not None else None


def load_settings(cls: type[_Base], args: argparse.Namespace) -> Any:
    """Build settings from parsed CLI args plus environment and TOML; raise ConfigError."""
    cli = {k: v for k, v in vars(args).items() if k in cls.model_fields}
    config_file = getattr(args, "_config", None) or os.environ.get(ENV_PREFIX + "CONFIG")
    toml_path = None
    if config_file:
        toml_path = Path(config_file)
        if not toml_path.is_file():
            raise ConfigError("--config", f"no such file: {config_file}")
        import tomllib

        try:
            data = tomllib.loads(toml_path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError("--config", f"{config_file}: {exc}") from None
        unknown = sorted(set(data) - set(cls.model_fields))
        if unknown:
            raise ConfigError("--config", f"{config_file}: unknown setting(s) {', '.join(unknown)}")
    cls._toml_file = toml_path
    try:
        settings = cls(**cli)
        # Where each explicitly given setting came from, for messages that must name it.
        for name in settings.model_fields_set:
            src = _source(name, cli, toml_path)
            settings._origin[name] = (
                flag_of(name, cls)
                if src is None
                else src
                if src.startswith(ENV_PREFIX)
                else f"{name} (--config {src})"
            )
        return settings
    except ValidationError as exc:
        err = exc.errors()[0]
        if not err["loc"]:  # a rule across several settings
            raise ConfigError(
                cls.__name__.removesuffix("Settings").lower(),
                err["msg"].removeprefix("Value error, "),
            ) from None
        name = str(err["loc"][0])
        flag = flag_of(name, cls) if name in cls.model_fields else name
        src = _source(name, cli, toml_path)
        where = f" (from {src})" if src else ""
        raw = err.get("input")
        shown = f" (got {raw!r})" if raw is not None and not isinstance(raw, dict) else ""
        raise ConfigError(flag + where, f"{err['msg']}{shown}") from None
    finally:
        cls._toml_file = None


def make_parser(prog: str, cls: type[BaseSettings], description: str) -> argparse.ArgumentParser:
    p = _OneLineParser(prog=prog, description=description)
    add_arguments(p, cls)
    return p


def die(err: ConfigError) -> None:
    print(f"error: {err}", file=sys.stderr)
    raise SystemExit(2)


class BenchFramesSettings(_Base):
    json_lines: bool = Field(
        False, description="print one JSON object per line", json_schema_extra={"flag": "--json"}
    )
    sizes: str = Field(
        "8K,64K,1M,2M,16M", description="payload sizes (8K, 64K, 1M, 2M, 16M or bytes)"
    )
    scale: float = Field(1.0, gt=0, le=100, description="multiply every iteration count by this")
    modes: str = Field(
        "reference,unprotected,hmac-sha256,aes-256-gcm,chacha20-poly1305",
        description="modes to measure (reference: a bare length-prefixed uvloop stream)",
    )
    log_level: Literal["TRACE", "DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "WARNING", description="log level on stderr"
    )

    @field_validator("sizes")
    @classmethod
    def _sizes(cls, v: str) -> str:
        for part in v.split(","):
            p = part.strip().upper()
            if p not in ("8K", "64K", "1M", "2M", "16M") and not (
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


class SimSettings(_Base):
    seeds: int = Field(20, ge=1, le=1_000_000, description="how many seeded scenarios to run")
    first_seed: int = Field(0, ge=0, description="the first seed of the run")
    scenario: Literal["all", "mixed", "bringup", "scale", "tiny"] = Field(
        "all",
        description="all: mixed and bringup for every seed; mixed: 2-8 stages serving, every "
        "fault kind; bringup: zero-config bring-up of 2-16 peers; scale: 32 stages; "
        "tiny: 2-4 stages computing with the real checkpoint (--model)",
    )
    model: str | None = Field(
        None, description="checkpoint for --scenario tiny (default: the embedded tiny model)"
    )
    seed: int | None = Field(None, ge=0, description="replay this one seed (ignores --seeds)")
    stages: int | None = Field(None, ge=2, le=512, description="force the number of stages")
    inject: str | None = Field(
        None,
        description="deliberate bugs, comma-separated (skip-owner-check, accept-stale-nonce)",
    )
    json_lines: bool = Field(
        False, description="print one JSON object per line", json_schema_extra={"flag": "--json"}
    )

    @field_validator("inject")
    @classmethod
    def _known_bugs(cls, v: str | None) -> str | None:
        known = ("skip-owner-check", "accept-stale-nonce")
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
    node_id: str = Field("check", description="node id announced in the handshake")
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
    log_level: Literal["TRACE", "DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="log level on stderr"
    )

    @model_validator(mode="after")
    def _one_mode(self) -> ClusterCheckSettings:
        if (self.listen is None) == (self.connect is None):
            raise ValueError("give exactly one of --listen or --connect")
        return self


class BenchPipelineSettings(_Base):
    """A model-level benchmark: which model (default small), how many tokens, JSON or table."""

    model: str | None = Field(
        None,
        description="model folder (default: the embedded small checkpoint)",
        json_schema_extra=_short("-m"),
    )
    tokens: int = Field(64, ge=2, le=4096, description="greedy tokens per measured run")
    json_lines: bool = Field(
        False, description="print one JSON object per line", json_schema_extra={"flag": "--json"}
    )
    log_level: Literal["TRACE", "DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "WARNING", description="log level on stderr"
    )


class DemoSettings(_Base):
    prompt: str = Field(
        "Explain pipeline parallelism in one sentence.", description="the chat message to send"
    )
    max_tokens: int = Field(32, ge=1, le=4096, description="tokens to stream")
    model: str | None = Field(
        None,
        description="model folder (default: the embedded tiny model)",
        json_schema_extra=_short("-m"),
    )
    log_level: Literal["TRACE", "DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "WARNING", description="log level on stderr"
    )


class BenchTpSettings(BenchPipelineSettings):
    """Same knobs as the pipeline benchmark: model (default small), tokens, --json."""
