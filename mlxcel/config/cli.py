"""Command lines and TOML files for the settings models of :mod:`mlxcel.config.settings`.

The parser is generated from a command's model: one flag per field, in groups per concern
(the common flags first), choices listed for fixed sets, required flags marked, each help
line ending in its default (when it says something) and its environment variable.

One TOML file serves every command. Top-level keys apply to each command that has that
setting, and a table named after a command (``[serve]``, ``[generate]``, ``[bench.batching]``)
applies to that command only, over the top level. A key that no command knows is an error; a
key that only other commands know is skipped with a note.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from mlxcel.base.errors import ConfigError
from mlxcel.config.sources import ENV_PREFIX, NOT_FROM_ENV, _Base, flag_of

# Help groups, in the order they are shown; a field with no group lands in "options".
GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("required", ()),
    (
        "model and prompt",
        (
            "model",
            "prompt",
            "raw",
            "system_prompt",
            "max_tokens",
            "served_model_name",
            "out",
        ),
    ),
    (
        "sampling",
        (
            "temp",
            "top_p",
            "top_k",
            "seed",
        ),
    ),
    ("options", ()),
    (
        "HTTP server",
        (
            "host",
            "port",
            "parallel",
            "queue_size",
            "request_timeout",
            "default_max_tokens",
            "max_body_bytes",
            "max_http_connections",
            "http_header_timeout",
            "http_body_timeout",
            "drain_timeout",
            "api_key",
            "allowed_origins",
            "max_model_len",
            "chat_template",
        ),
    ),
    (
        "batching",
        (
            "max_batch_size",
            "prefill_step_size",
        ),
    ),
    (
        "pipeline parallelism",
        (
            "pp_size",
            "pp_layers",
            "pp_return_logits",
            "pp_micro_batch_size",
            "dry_run",
            "distributed_config",
            "node_id",
            "startup_timeout",
        ),
    ),
    (
        "tensor parallelism",
        (
            "tp_size",
            "tp_hostfile",
            "tp_rank",
            "tp_allow_cleartext",
            "tp_backend",
            "tp_moe_mode",
            "tp_embedding_mode",
            "tp_lm_head_mode",
        ),
    ),
    (
        "cluster transport",
        (
            "cluster_secret_file",
            "cluster_interface",
            "peer_timeout",
        ),
    ),
    (
        "zero-config bring-up",
        (
            "pp_auto",
            "pp_peer",
            "cluster_peers",
            "cluster_control_addr",
            "cluster_discovery",
            "cluster_discovery_target",
            "cluster_discovery_port",
            "cluster_name",
            "cluster_config_out",
        ),
    ),
    (
        "disaggregated serving",
        (
            "node_role",
            "serving_bind",
            "prefill_peers",
            "decode_peers",
            "prefill_timeout",
        ),
    ),
    (
        "logging and configuration",
        (
            "log_level",
            "log_format",
        ),
    ),
]


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(self.prog, message)


def unknown_arguments(
    parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str]
) -> str:
    """What argparse says of ``unknown`` arguments, with the closest flag the command has for
    each unknown one ("did you mean") and where its flags are listed."""
    import difflib

    words = [getattr(args, "command", None), getattr(args, "bench", None)]
    words = [w for w in words if w]
    for word in words:  # the (sub)command's own parser: its flags
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    known = [o for o in parser._option_string_actions if o.startswith("--")]
    hints = []
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        if flag.startswith("-"):
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            if close:
                hints.append(f"{flag}: did you mean {close[0]}?")
    command = " ".join(["mlxcel", *words])
    return "; ".join(
        [f"unrecognized arguments: {' '.join(unknown)}", *hints, f"see `{command} --help`"]
    )


def _group_of(name: str, required: bool, extra: dict[str, Any] | None = None) -> str:
    if required:
        return "required"
    if extra and "group" in extra:
        return str(extra["group"])
    for title, names in GROUPS:
        if name in names:
            return title
    return "options"


def _choices(annotation: Any) -> list[Any] | None:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    if len(args) == 1:
        return _choices(args[0])
    return None


def _help(description: str, default: Any, name: str, required: bool) -> str:
    parts = []
    if required:
        parts.append("required")
    elif (
        not (default is None or default is False or default == "") and "default" not in description
    ):
        parts.append(f"default: {default}")
    if name not in NOT_FROM_ENV:
        parts.append(f"env {ENV_PREFIX}{name.upper()}")
    return f"{description} [{'; '.join(parts)}]" if parts else description


def add_arguments(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    parser._optionals.title = "help"  # argparse's own group, shown first: -h alone
    groups = {title: parser.add_argument_group(title) for title, _ in GROUPS}
    order = {title: i for i, (title, _) in enumerate(GROUPS)}
    rank = {name: i for _, names in GROUPS for i, name in enumerate(names)}

    def position(item: tuple[int, tuple[str, Any]]) -> tuple[int, int, int]:
        index, (name, f) = item
        return (order[_group_of(name, f.is_required(), _extra(f))], rank.get(name, 999), index)

    fields = [kv for _, kv in sorted(enumerate(cls.model_fields.items()), key=position)]
    for name, f in fields:
        extra = _extra(f)
        flags = [flag_of(name, cls), *map(str, extra.get("aliases", ()))]
        if "short" in extra:
            flags.insert(0, str(extra["short"]))
        required = f.is_required()
        kwargs: dict[str, Any] = {
            "dest": name,
            "default": argparse.SUPPRESS,
            "help": _help(f.description or "", f.default, name, required),
        }
        choices = _choices(f.annotation)
        if f.annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif choices:
            if all(isinstance(c, int) for c in choices):
                kwargs["type"] = int
            elif name == "log_level":
                kwargs["type"] = str.upper
            elif name == "log_format":
                kwargs["type"] = str.lower
            kwargs["choices"] = choices
            kwargs["metavar"] = "{" + ",".join(map(str, choices)) + "}"
        else:
            kwargs["metavar"] = name.upper()
        groups[_group_of(name, required, extra)].add_argument(*flags, **kwargs)
    groups["logging and configuration"].add_argument(
        "--config",
        dest="_config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"TOML file of settings for any command [env {ENV_PREFIX}CONFIG]",
    )
    for group in groups.values():  # argparse shows empty groups as bare titles
        if not group._group_actions:
            parser._action_groups.remove(group)


def _extra(f: Any) -> dict[str, Any]:
    return f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}


def _source(name: str, cli: dict[str, Any], toml_path: Path | None) -> str | None:
    """Where a given setting came from: None for the command line (or nowhere), else the
    environment variable or the TOML file."""
    if name in cli:
        return None
    env = ENV_PREFIX + name.upper()
    if env in os.environ and name not in NOT_FROM_ENV:
        return env
    return str(toml_path) if toml_path is not None else None


def _tables(data: dict[str, Any], sections: dict[str, type[_Base]], path: Path) -> dict[str, Any]:
    """Every command table in the file, by section name, each checked against its command."""
    found: dict[str, Any] = {}
    for key, value in data.items():
        if key == "bench":
            if not isinstance(value, dict):
                raise ConfigError("--config", f"{path}: [bench] must hold [bench.NAME] tables")
            for name, table in value.items():
                found[f"bench.{name}"] = table
        elif key in sections:
            found[key] = value
    for name, table in found.items():
        if name not in sections:
            known = ", ".join(s for s in sections if s.startswith("bench."))
            raise ConfigError("--config", f"{path}: no command [{name}] (benchmarks: {known})")
        if not isinstance(table, dict):
            raise ConfigError("--config", f"{path}: [{name}] must be a table")
        lacking = sorted(set(table) - set(sections[name].model_fields))
        if lacking:
            raise ConfigError(
                "--config", f"{path}: [{name}] has setting(s) {name} lacks: {', '.join(lacking)}"
            )
    return found


def toml_settings(
    path: Path, cls: type[_Base], section: str, sections: dict[str, type[_Base]]
) -> tuple[dict[str, Any], list[str]]:
    """This command's settings from the file, and notes on what it skipped. The whole file
    is checked, whichever command reads it: a typo fails every command alike."""
    import tomllib

    try:
        data = tomllib.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("--config", f"{path}: {exc}") from None
    tables = _tables(data, {**sections, section: cls}, path)
    top = {k: v for k, v in data.items() if k != "bench" and k not in sections}
    known = {name for c in [cls, *sections.values()] for name in c.model_fields}
    unknown = sorted(set(top) - known)
    if unknown:
        raise ConfigError("--config", f"{path}: unknown setting(s) {', '.join(unknown)}")
    fields = set(cls.model_fields)
    notes = []
    skipped = sorted(set(top) - fields)
    if skipped:
        notes.append(f"{path}: {section} ignores other commands' setting(s) {', '.join(skipped)}")
    merged = {k: v for k, v in top.items() if k in fields}
    merged.update(tables.get(section, {}))
    return merged, notes


def load_settings(
    cls: type[_Base],
    args: argparse.Namespace,
    *,
    section: str = "",
    sections: dict[str, type[_Base]] | None = None,
) -> Any:
    """Build settings from parsed CLI args plus environment and TOML; raise ConfigError.

    ``section``: the command's table name; ``sections``: every command's table name and
    settings class (``bench.NAME`` for benchmarks), to check the whole file."""
    cli = {k: v for k, v in vars(args).items() if k in cls.model_fields}
    config_file = getattr(args, "_config", None) or os.environ.get(ENV_PREFIX + "CONFIG")
    toml_path = None
    notes: list[str] = []
    data: dict[str, Any] | None = None
    if config_file:
        toml_path = Path(config_file)
        if not toml_path.is_file():
            raise ConfigError("--config", f"no such file: {config_file}")
        data, notes = toml_settings(toml_path, cls, section or "this command", sections or {})
    cls._toml_data = data
    try:
        settings = cls(**cli)
        settings._notes = notes
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
                section or cls.__name__.removesuffix("Settings").lower(),
                err["msg"].removeprefix("Value error, "),
            ) from None
        name = str(err["loc"][0])
        flag = flag_of(name, cls) if name in cls.model_fields else name
        src = _source(name, cli, toml_path)
        where = f" (from {src})" if src else ""
        raw = err.get("input")
        msg = str(err["msg"]).removeprefix("Value error, ")
        quiet = raw is None or isinstance(raw, dict) or str(raw) in msg  # said once is enough
        shown = "" if quiet else f" (got {raw!r})"
        raise ConfigError(flag + where, f"{msg}{shown}") from None
    finally:
        cls._toml_data = None


def make_parser(prog: str, cls: type[BaseSettings], description: str) -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description=description)
    add_arguments(p, cls)
    return p


def _json_asked(argv: list[str]) -> bool:
    """Whether the command line or environment asks for JSON logs (read before parsing
    succeeded, for the one line that says why it did not)."""
    for i, a in enumerate(argv):
        if a.lower() == "--log-format=json" or (
            a == "--log-format" and i + 1 < len(argv) and argv[i + 1].lower() == "json"
        ):
            return True
    return os.environ.get(ENV_PREFIX + "LOG_FORMAT", "").lower() == "json"


def die(err: Exception, argv: list[str] | None = None) -> None:
    """A bad command line: one line on stderr, exit status 2 (before logging is set up)."""
    if _json_asked(sys.argv[1:] if argv is None else argv):
        import json
        import time

        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        line = {"time": stamp, "level": "ERROR", "message": str(err), "pid": os.getpid()}
        print(json.dumps(line), file=sys.stderr)
    else:
        print(f"error: {err}", file=sys.stderr)
    raise SystemExit(2)
