"""Request bodies of the OpenAI-compatible API, validated strictly.

Types are strict (a string is not a number, a number is not a bool). A top-level parameter
this server does not know is refused by name; one it knows but does not implement is refused
by :mod:`mlxcel.server.params`. Every validation failure becomes a 400 with an OpenAI-style
error body naming the offending parameter.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

MAX_STOP = 4
MAX_INT = (1 << 31) - 1  # bigger token counts and top_k mean "no limit" and must fit the wire
_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # a logit_bias key: ASCII digits only
MAX_LOGIT_BIAS = 1024  # entries; each is an index the processor adds a bias at
MAX_ARG_DEPTH = 32  # tool call arguments sent as a JSON string (the body's own limit is 64)
MAX_CACHE_SALT_BYTES = 256  # vLLM's cache_salt, as UTF-8
# Messages in one chat body: each costs a validated object and a pass of the chat template
# before a single token is counted, so a body of many tiny messages (94k in 3.85 MB took
# +717 MiB and held every other request for seconds) is refused by its count first.
MAX_MESSAGES = 4096


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return deepest


class _Strict(BaseModel):
    # allow_inf_nan=False: JSON's NaN/Infinity extensions get "should be a finite number".
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)


class _Request(_Strict):
    # A parameter this server does not know is refused by name, never silently ignored.
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far (prompt, completion and total tokens).
    continuous_usage_stats: bool = False


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        # Said before the union is tried, or the error would be about the str branch.
        for part in v if isinstance(v, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                shown = repr(kind).replace("{", "(").replace("}", ")")  # no template fields
                raise PydanticCustomError(
                    "unsupported_parameter",
                    f"content parts of type {shown} are not supported: this server's models "
                    "take text only (send parts of type 'text')",
                )
        return v

    @model_validator(mode="after")
    def _tool_result_names_its_call(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message of role 'tool' needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it (tool call arguments as objects)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                args = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args or "{}")
                    except (ValueError, RecursionError):
                        raise ValueError(
                            f"tool call {c.function.name!r}: arguments are not valid JSON"
                        ) from None
                    if _depth(args) > MAX_ARG_DEPTH:
                        raise ValueError(
                            f"tool call {c.function.name!r}: arguments are nested deeper than "
                            f"{MAX_ARG_DEPTH} levels"
                        )
                calls.append(
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": args},
                    }
                )
            out["tool_calls"] = calls
        return out


class ToolFunction(_Request):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: ToolFunction


class JsonSchemaFormat(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # "schema" would shadow pydantic's own attribute: the field is read under that key.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # llguidance always holds the output to the schema


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self


class _Sampling(_Request):
    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # Any k at or above the vocabulary keeps every token, so larger values are clamped (to a
    # number every node can carry: the cluster codec holds 64-bit integers).
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)  # more than 1 is refused by name (server.params)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    # vLLM's and llama.cpp's: hold back the end-of-sequence tokens (for the first min_tokens
    # tokens, or for all of them); show or drop special tokens' text (shown by default, as
    # mlx-lm's server does).
    min_tokens: int = Field(0, ge=0, le=MAX_INT)
    ignore_eos: bool = False
    skip_special_tokens: bool = False
    # Accepted and without effect on generation: they label the request for its sender.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # vLLM's: the prompt cache is shared only between requests of one tenant (API key) that
    # give the same salt (docs/security.md, "The prompt cache and its tenants").
    cache_salt: str | None = None

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, v: str | None) -> str | None:
        if v is not None and len(v.encode("utf-8", "surrogatepass")) > MAX_CACHE_SALT_BYTES:
            raise ValueError(f"at most {MAX_CACHE_SALT_BYTES} bytes (UTF-8)")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        seen: set[int] = set()
        for key, value in (v or {}).items():
            if not _TOKEN_ID.fullmatch(key):  # ASCII digits: str.isdigit() also takes "²"
                raise ValueError(f"keys are token ids as strings, got {key!r}")
            if int(key) in seen:
                raise ValueError(f"token {int(key)} is given twice")
            seen.add(int(key))
            if not -100 <= value <= 100:
                raise ValueError(f"bias for token {key} must be within [-100, 100]")
        return v

    @field_validator("stream_options")
    @classmethod
    def _options_need_a_stream(
        cls, v: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):  # stream is validated first
            raise ValueError("only allowed with stream set to true")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def messages_problem(messages: Any) -> str | None:
    """Why a body's ``messages`` is refused before anything is built from it (None: it may be
    validated): more than MAX_MESSAGES of them."""
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        return f"messages: at most {MAX_MESSAGES} messages, got {len(messages)}"
    return None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Extra variables for the chat template (vLLM's; Qwen3's enable_thinking, for one).
    chat_template_kwargs: dict[str, Any] | None = None
    # Structured output (mlxcel.serving.grammar).
    response_format: ResponseFormat | None = None
    # Known, not implemented: a request naming them gets a 400 (see params.refusals).
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in v or {}:
            if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
                raise ValueError(f"{key!r} cannot be set through the chat template's variables")
        if v is not None and _depth(v) > MAX_ARG_DEPTH:
            raise ValueError(f"nested deeper than {MAX_ARG_DEPTH} levels")
        return v


# What the server itself passes to the template: a request cannot set these through it.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "add_generation_prompt", "chat_template", "tokenize", "conversation"}
)


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
