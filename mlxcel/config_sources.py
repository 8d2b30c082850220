"""Where settings come from besides the command line: the environment (``MLXCEL_<NAME>``,
but not the settings whose loaders read the environment themselves) and a TOML file's
values. See :mod:`mlxcel.config` for the precedence."""

from __future__ import annotations

from typing import Any

from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource

ENV_PREFIX = "MLXCEL_"
# Read by mlxcel.net.secret's loader, which knows their precedence (not as a setting).
NOT_FROM_ENV = frozenset({"cluster_secret_file"})


class EnvSource(EnvSettingsSource):
    def __call__(self) -> dict[str, Any]:
        return {k: v for k, v in super().__call__().items() if k not in NOT_FROM_ENV}


class TomlData(PydanticBaseSettingsSource):
    """The settings a TOML file gives this command (see :mod:`mlxcel.config_cli`)."""

    def __init__(self, settings_cls: type[BaseSettings], data: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        self.data = data

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self.data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self.data)
