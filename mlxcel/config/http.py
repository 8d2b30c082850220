"""``serve``'s HTTP API settings: where it listens, what a request gets by default, who may
call it and how much it may send (a part of :class:`mlxcel.config.settings.ServeSettings`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr

from mlxcel.base import defaults as d
from mlxcel.config.sources import _Base


class HttpApiSettings(_Base):
    host: str = Field("127.0.0.1", description="HTTP bind address")
    port: int = Field(8080, ge=0, le=65535, description="HTTP port (0 = pick a free one)")
    parallel: int = Field(d.PARALLEL, ge=1, le=4096, description="requests generating at once")
    queue_size: int = Field(
        d.QUEUE_SIZE, ge=0, le=100000, description="requests waiting for a slot before 503"
    )
    request_timeout: float = Field(
        d.REQUEST_TIMEOUT, gt=0, description="seconds before a request fails"
    )
    default_max_tokens: int = Field(
        256,
        ge=1,
        description="max_tokens when a request gives none",
        json_schema_extra={"aliases": ("--max-tokens",)},  # mlx-lm's server spelling
    )
    # What a request that gives none of these samples with (mlx_lm.server's --temp, --top-p and
    # --min-p). Unset: the OpenAI defaults (temperature 1, top_p 1, no min_p).
    temp: float | None = Field(
        None, ge=0.0, le=2.0, description="temperature when a request gives none (OpenAI: 1)"
    )
    top_p: float | None = Field(
        None, gt=0.0, le=1.0, description="top_p when a request gives none (OpenAI: 1)"
    )
    min_p: float | None = Field(
        None, ge=0.0, le=1.0, description="min_p when a request gives none (none: 0)"
    )
    served_model_name: str | None = Field(
        None, description="model id in the API (default: folder name)"
    )
    max_body_bytes: int = Field(4 << 20, ge=1024, description="largest accepted request body")
    http_header_timeout: float = Field(
        10.0, ge=0.1, le=600, description="seconds a client has to send a request's headers"
    )
    http_body_timeout: float = Field(
        30.0, ge=0.1, le=3600, description="seconds a client has to send a request's body"
    )
    max_http_connections: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="open HTTP connections at most, 1/32 of them from one IP (default: "
        "the file-descriptor limit less 256, at most 16384); more are closed at once",
    )
    drain_timeout: float = Field(
        30.0,
        ge=0,
        description="seconds SIGINT/SIGTERM waits for requests in flight; then they end with "
        "server_shutting_down (a second signal exits at once)",
    )
    api_key: SecretStr | None = Field(
        None,
        description="require Authorization: Bearer KEY on every request but /health/live; "
        "several keys separated by commas, each its own prompt-cache tenant (prefer the "
        "environment variable or --api-key-file: a flag shows in the process list)",
    )
    api_key_file: Path | None = Field(
        None,
        description="a file of API keys, one a line (# comments), added to --api-key's",
    )
    prompt_cache_scope: Literal["key", "shared"] = Field(
        "key",
        description="who shares prompt-cache entries: key (each API key only its own, and "
        "only with the same cache_salt) or shared (every key one cache; cache_salt still "
        "separates)",
    )
    allowed_origins: str | None = Field(
        None,
        description="CORS: browser origins allowed to call the API, comma-separated "
        "(https://app.example), or * for any; none by default",
    )
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="longest prompt + max_tokens a request may ask for (at most the model's "
        "context, which always applies); a request over it gets 400 context_length_exceeded",
    )
    chat_template: Path | None = Field(
        None, description="a Jinja chat template file, used instead of the tokenizer's"
    )
