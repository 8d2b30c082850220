"""Request bodies of the OpenAI-compatible API, validated strictly.

Types are strict (a string is not a number, a number is not a bool); unknown fields that
OpenAI clients commonly send are ignored. Every validation failure becomes a 400 with an
OpenAI-style error body naming the offending parameter.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 4
MAX_INT = (1 << 31) - 1  # bigger token counts and top_k mean "no limit" and must fit the wire


class _Strict(BaseModel):
    # allow_inf_nan=False: JSON's NaN/Infinity extensions get "should be a finite number".
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # Any k at or above the vocabulary keeps every token, so larger values are clamped (to a
    # number every node can carry: the cluster codec holds 64-bit integers).
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=1)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool = False


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v
