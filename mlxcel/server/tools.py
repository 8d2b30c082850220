"""Tool calls in generated text, found with mlx-lm's tool parsers and shaped as OpenAI's.

mlx-lm picks a parser from the model's chat template and knows the markers around a call
(``<tool_call>`` … ``</tool_call>`` for Qwen-style templates). :class:`ToolCallText` splits a
stream of text into content and calls: text inside markers is held back until the call is
complete, then parsed. A call that does not parse, or is cut off by ``max_tokens``, goes back
into the content as it was generated, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from loguru import logger


def _held_prefix(buf: str, marker: str) -> int:
    """How many trailing characters of ``buf`` could be the start of ``marker``."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class ToolCallText:
    def __init__(
        self,
        start: str,
        end: str,
        parser: Callable[[str, Any], Any],
        tools: list[dict[str, Any]] | None,
    ) -> None:
        self.start, self.end, self.parser, self.tools = start, end, parser, tools
        self._buf = ""
        self._call: str | None = None  # text of the call being read, None outside one
        self.made = 0  # calls returned so far (the next one's stream index)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Content safe to show now, and the calls completed by this text."""
        self._buf += text
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while self._buf:
            if self._call is None:
                i = self._buf.find(self.start)
                if i < 0:
                    keep = _held_prefix(self._buf, self.start)
                    content.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                content.append(self._buf[:i])
                self._buf, self._call = self._buf[i + len(self.start) :], ""
            else:
                j = self._buf.find(self.end)
                if j < 0:
                    keep = _held_prefix(self._buf, self.end)
                    self._call += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                raw, self._call = self._call + self._buf[:j], None
                self._buf = self._buf[j + len(self.end) :]
                parsed = self._parse(raw)
                if parsed is None:
                    content.append(self.start + raw + self.end)
                calls.extend(parsed or [])
        return "".join(content), calls

    def finish(self) -> str:
        """What is still held back, as content (an unfinished call is returned verbatim)."""
        rest = self._buf if self._call is None else self.start + self._call + self._buf
        self._buf, self._call = "", None
        return rest

    def _parse(self, raw: str) -> list[dict[str, Any]] | None:
        try:
            parsed = self.parser(raw, self.tools)
        except Exception as exc:  # every parser raises its own kinds on bad model output
            logger.warning("a tool call did not parse ({}); returned as content", exc)
            return None
        out = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                logger.warning("a tool call has no function name; returned as content")
                return None
            args = call.get("arguments", {})
            out.append(
                {
                    "index": self.made + len(out),
                    "id": str(call.get("id") or f"call_{uuid.uuid4().hex[:24]}"),
                    "type": "function",
                    "function": {
                        "name": call["name"],
                        "arguments": args
                        if isinstance(args, str)
                        else json.dumps(args, ensure_ascii=False),
                    },
                }
            )
        if not out:  # "[]" calls nothing: what the model wrote stays content
            return None
        self.made += len(out)
        return out


def tool_text_for(tokenizer: Any, tools: list[dict[str, Any]] | None) -> ToolCallText | None:
    """A splitter when the request offered tools and the tokenizer knows its markers."""
    if not tools or not getattr(tokenizer, "has_tool_calling", False):
        return None
    return ToolCallText(
        tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser, tools
    )
