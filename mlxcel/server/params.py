"""From a validated request to :class:`SamplingParams`, refusing what this node cannot do.

Every parameter of the API is implemented, refused with a 400 naming it, or (``user``,
``metadata``, ``store``) accepted as a label with no effect on generation; docs/http-api.md
lists which is which. A parameter this serving mode cannot apply (a pipeline does not run
logits processors) is refused the same way: never silently ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mlxcel.base.errors import RequestError
from mlxcel.base.messages import SamplingParams
from mlxcel.server.schemas import MAX_INT, ChatCompletionRequest, CompletionRequest


def unsupported(param: str, why: str) -> RequestError:
    return RequestError(f"{param}: {why}", param=param, code="unsupported_parameter")


def refuse_unimplemented(req: ChatCompletionRequest | CompletionRequest) -> None:
    """The parameters the API defines that this server does not implement."""
    if req.n not in (None, 1):
        raise unsupported("n", "only n=1 is supported (one choice per request)")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise unsupported("echo", "echoing the prompt is not supported")
        if req.suffix:
            raise unsupported(
                "suffix", "insertion (a suffix after the completion) is not supported"
            )
        if req.best_of not in (None, 1):
            raise unsupported("best_of", "only best_of=1 is supported")
        return
    if req.functions is not None or req.function_call is not None:
        name = "functions" if req.functions is not None else "function_call"
        raise unsupported(name, "the deprecated functions API is not supported; send tools")
    for i, tool in enumerate(req.tools or []):
        if tool.function.strict:
            raise unsupported(
                f"tools.{i}.function.strict",
                "strict schemas (structured output) are not supported; the model's calls are "
                "returned as it writes them",
            )
    if req.parallel_tool_calls is False:
        raise unsupported(
            "parallel_tool_calls", "false is not supported: the model may call several tools"
        )
    choice = req.tool_choice
    if choice is not None and choice not in ("auto", "none"):
        raise unsupported(
            "tool_choice",
            f"{choice!r} is not supported: only 'auto' and 'none' (the model decides whether "
            "to call a tool; it cannot be forced)",
        )


def requested_max_tokens(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """The request's own token limit (None: it gave none, the server's default applies)."""
    if isinstance(req, ChatCompletionRequest):
        return req.max_completion_tokens or req.max_tokens
    return req.max_tokens


def fit_default(params: SamplingParams, prompt_len: int, limit: int | None) -> SamplingParams:
    """A request that named no max_tokens gets what is left of the context (``limit``:
    --max-model-len) when the default would not fit, as vLLM does; one that named it keeps
    it (and is refused if it does not fit)."""
    room = (limit or 0) - prompt_len
    if limit is None or room < 1 or room >= params.max_tokens:
        return params
    return dataclasses.replace(params, max_tokens=room)


def structured_grammar(req: ChatCompletionRequest | CompletionRequest) -> str:
    """The llguidance grammar of the request's response_format ("" for none or 'text');
    the schema itself is compiled against the tokenizer later (mlxcel.serving.grammar.check_grammar)."""
    fmt = getattr(req, "response_format", None)
    if fmt is None or fmt.type == "text":
        return ""
    if req.min_tokens or req.ignore_eos:
        name = "min_tokens" if req.min_tokens else "ignore_eos"
        raise unsupported(name, "does not combine with response_format: the grammar ends it")
    if req.stop:
        raise unsupported("stop", "does not combine with response_format: it would cut the JSON")
    from mlxcel.serving.grammar import grammar_for

    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    try:
        return grammar_for(fmt.type, schema)
    except ValueError as exc:
        raise RequestError(
            f"response_format: {exc}", param="response_format", code="invalid_value"
        ) from None


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    *,
    default_max: int,
    vocab: int,
    supported: frozenset[str],
    mode: str,
    defaults: dict[str, float] | None = None,
    grammar: str = "",
) -> SamplingParams:
    """The request's sampling, checked against the model's vocabulary and this node's mode;
    ``defaults`` (temperature, top_p, min_p) stand in for what the request leaves out;
    ``grammar``: :func:`structured_grammar`'s."""
    given = defaults or {}
    max_tokens = requested_max_tokens(req)
    if isinstance(req, ChatCompletionRequest):
        want_lp, top = req.logprobs, req.top_logprobs or 0
        if top and not want_lp:
            raise RequestError(
                "top_logprobs: needs logprobs set to true",
                param="top_logprobs",
                code="invalid_value",
            )
    else:
        want_lp, top = req.logprobs is not None, req.logprobs or 0
    bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
    bad = sorted(t for t in bias if t >= vocab)
    if bad:
        raise RequestError(
            f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab})",
            param="logit_bias",
            code="invalid_value",
        )
    params = SamplingParams(
        temperature=given.get("temperature", 1.0)
        if req.temperature is None
        else float(req.temperature),
        top_p=given.get("top_p", 1.0) if req.top_p is None else float(req.top_p),
        top_k=min(req.top_k or 0, MAX_INT),
        seed=req.seed,
        max_tokens=max_tokens or default_max,
        logprobs=want_lp,
        top_logprobs=top,
        min_p=given.get("min_p", 0.0) if req.min_p is None else float(req.min_p),
        logit_bias_ids=tuple(bias),
        logit_bias_values=tuple(bias.values()),
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        repetition_penalty=float(req.repetition_penalty or 1.0),
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        grammar=grammar,
    )
    if params.min_tokens > params.max_tokens:
        raise RequestError(
            f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens})",
            param="min_tokens",
            code="invalid_value",
        )
    for name in params.extended():
        if name not in supported:
            completions = isinstance(req, CompletionRequest)
            shown = "logprobs" if name == "top_logprobs" and completions else name
            raise unsupported(shown, f"not supported by this server's mode ({mode})")
    return params


def template_tools(
    req: ChatCompletionRequest, has_tool_calling: bool
) -> list[dict[str, Any]] | None:
    """The tools to render into the prompt (None: no tools, or tool_choice 'none')."""
    if not req.tools or req.tool_choice == "none":
        return None
    if not has_tool_calling:
        raise unsupported("tools", "this model's chat template does not support tool calling")
    return [t.model_dump(exclude_none=True) for t in req.tools]
