"""What ``serve`` checks of its HTTP options before it loads a model: a mistake here costs a
line at start, not a model load (minutes, for a large one) and then a failure.

- the chat template file reads and compiles (Jinja);
- the allowed origins are origins;
- ``--max-model-len`` is within the model's context (config.json);
- the HTTP port is free.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path

from mlxcel.base.errors import ConfigError, ListenError
from mlxcel.config.settings import ServeSettings
from mlxcel.server.access import parse_api_keys, parse_origins


@dataclass(frozen=True)
class ApiOptions:
    api_keys: tuple[str, ...] = ()  # each its own prompt-cache tenant
    origins: tuple[str, ...] = ()
    max_model_len: int | None = None
    chat_template: str | None = None
    shared_prompt_cache: bool = False  # --prompt-cache-scope shared


def api_options(s: ServeSettings) -> ApiOptions:
    text = s.api_key.get_secret_value() if s.api_key is not None else None
    file_text = None
    if s.api_key_file is not None:
        try:
            file_text = s.api_key_file.expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("--api-key-file", f"cannot read {s.api_key_file}: {exc}") from None
        if not parse_api_keys(None, file_text):
            raise ConfigError("--api-key-file", f"{s.api_key_file} holds no key")
    return ApiOptions(
        parse_api_keys(text, file_text),
        parse_origins(s.allowed_origins),
        s.max_model_len,
        read_chat_template(s.chat_template) if s.chat_template is not None else None,
        s.prompt_cache_scope == "shared",
    )


def read_chat_template(path: Path) -> str:
    import jinja2

    try:
        text = path.expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("--chat-template", f"cannot read {path}: {exc}") from None
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(
            "--chat-template", f"{path}, line {exc.lineno}: not a valid Jinja template: {exc}"
        ) from None
    return text


def model_context(model: Path) -> int | None:
    """The model's context length from its config.json (None: it does not say)."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config")
    source = text if isinstance(text, dict) and "max_position_embeddings" in text else config
    value = source.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def check_context(options: ApiOptions, model: Path) -> None:
    limit = model_context(model)
    if options.max_model_len is not None and limit is not None and options.max_model_len > limit:
        raise ConfigError(
            "--max-model-len",
            f"{options.max_model_len} exceeds the model's context of {limit} tokens "
            f"(max_position_embeddings in {model / 'config.json'})",
        )


def check_port(host: str, port: int, what: str = "serve HTTP") -> None:
    """Fail now, in one line, if a port this node will listen on is taken (it binds later,
    after loading the model)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            why = (exc.strerror or str(exc)).lower()  # as the event loop words it later
            raise ListenError(f"cannot {what} on {host}:{port}: {why}") from None
