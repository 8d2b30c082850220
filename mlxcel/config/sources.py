"""The base of every command's settings: where values come from besides the command line
-- the environment (``MLXCEL_<NAME>``, but not the settings whose loaders read the
environment themselves) and a TOML file's values -- and how a setting is named in messages.
See :mod:`mlxcel.config.settings` for the precedence."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

ENV_PREFIX = "MLXCEL_"
# Read by mlxcel.net.secret's loader, which knows their precedence (not as a setting).
NOT_FROM_ENV = frozenset({"cluster_secret_file"})


class EnvSource(EnvSettingsSource):
    def __call__(self) -> dict[str, Any]:
        return {k: v for k, v in super().__call__().items() if k not in NOT_FROM_ENV}


class TomlData(PydanticBaseSettingsSource):
    """The settings a TOML file gives this command (see :mod:`mlxcel.config.cli`)."""

    def __init__(self, settings_cls: type[BaseSettings], data: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        self.data = data

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self.data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self.data)


LogLevel = Literal["TRACE", "DEBUG", "INFO", "WARNING", "ERROR"]


class _Base(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    # Every command logs through loguru with these two.
    log_level: LogLevel = Field(
        "INFO",
        description="log level on stderr (any case)",
        json_schema_extra={"group": "logging and configuration"},
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="text lines, or one JSON object per line for log shippers",
        json_schema_extra={"group": "logging and configuration"},
    )

    # Set by :func:`mlxcel.config.cli.load_settings` just before construction: this
    # command's settings from the TOML file, read by the source hook.
    _toml_data: ClassVar[dict[str, Any] | None] = None
    # Set by load_settings: setting name -> where its value came from, as a message names it
    # (the flag, the variable, or "name (--config FILE)").
    _origin: dict[str, str] = PrivateAttr(default_factory=dict)
    # Set by load_settings: notes about the TOML file, logged once logging is up.
    _notes: list[str] = PrivateAttr(default_factory=list)

    def origin(self, name: str) -> str:
        return self._origin.get(name) or flag_of(name, type(self))

    @property
    def notes(self) -> list[str]:
        """Notes about the TOML file these settings came from, to log once logging is up."""
        return list(self._notes)

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _any_case(cls, v: Any, info: ValidationInfo) -> Any:
        if not isinstance(v, str):
            return v
        return v.upper() if info.field_name == "log_level" else v.lower()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, EnvSource(settings_cls)]
        if cls._toml_data is not None:
            sources.append(TomlData(settings_cls, cls._toml_data))
        return tuple(sources)


def _short(flag: str) -> dict[str, Any]:
    return {"short": flag}


def flag_of(name: str, cls: type[BaseSettings]) -> str:
    extra = cls.model_fields[name].json_schema_extra or {}
    return str(extra.get("flag", "--" + name.replace("_", "-")))  # type: ignore[union-attr]


def check_model(v: str | None) -> str | None:
    """A local model folder, or a Hugging Face ``org/name`` id (resolved when used)."""
    from mlxcel.runtime.hub import is_hub_id

    if v is not None and (not v.strip() or not Path(v).expanduser().is_dir()) and not is_hub_id(v):
        hint = ""
        if v.strip().isdigit():  # mlx_lm generate's -m is --max-tokens: here it is the model
            hint = " (-m is the model here; the token count is -n/--max-tokens, as in mlx-lm)"
        raise ValueError(f"no such model folder (nor a Hugging Face org/name id): {v}{hint}")
    return v
