"""The OpenAI API as rdlm's server speaks it (rdlm/inference/serve.py): request bodies (OpenAI's fields and
rdlm's, anything else refused by name), their translation into a `GenerationConfig`, errors in OpenAI's
shape, a completion's text and logprobs. The HTTP side in front of it (API key, sizes, deadlines) is
rdlm/inference/serve_http.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from rdlm.data.tokenizer import Tokenizer
from rdlm.inference.batching import BatchEvent
from rdlm.inference.params import (KV_CACHE_BUDGET, MAX_TOP_LOGPROBS, GenerationConfig, cut_at_stop,
                                   kv_cache_budget, params_for)


MAX_STOPS = 4              # stop sequences per request (OpenAI's limit)
MAX_STOP_CHARS = 256       # characters per stop sequence


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


# --------------------------------------------------------------------------------------------------
# Request bodies: OpenAI's fields and rdlm's; anything else is refused by name.

class OpenAIOptions(BaseModel):
    """Both endpoints' fields besides the generation parameters (`Options` adds those)."""
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=16)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _few_short_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        # Every stop string is looked for after every token: bound them as OpenAI does (4), and their length.
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters")
        return stop


# GenerationConfig's parameters a request sets by their names (OpenAI's temperature, top_p and seed, vLLM's
# top_k, min_p and repetition_penalty, rdlm's test-time compute), typed and described as declared (None: the
# server's default, `rdlm serve`'s flags); their values are checked by GenerationConfig (`generation_config`).
REQUEST_PARAMS = params_for("server")
Options = create_model("Options", __base__=OpenAIOptions, __doc__="A request body's options, both endpoints'.",
                       **{p.name: (p.kind | None, Field(None, description=p.help)) for p in REQUEST_PARAMS})


class CompletionRequest(Options):
    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(Options):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


# --------------------------------------------------------------------------------------------------
# From a request to generation configs and back to OpenAI's responses

def requested_logprobs(body: Options) -> int | None:
    """How many alternatives per token the request asks for (0: the chosen token's only), or None."""
    if isinstance(body, ChatRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    return getattr(body, "logprobs", None)


def generation_config(body: Options, defaults: GenerationConfig, stop_tokens: tuple[int, ...],
                      max_tokens: int | None) -> GenerationConfig:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) != 0:
            raise APIError(400, f"{name} is not supported; use repetition_penalty", param=name)
    if body.n > 1 and body.stream:
        raise APIError(400, "n > 1 is not supported with stream", param="n")
    updates: dict[str, Any] = {"stop_tokens": tuple(defaults.stop_tokens) + stop_tokens,
                               "logprobs": requested_logprobs(body)}
    if max_tokens is not None:
        if max_tokens < 1:   # a request for no token would end without a response
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        updates["max_new_tokens"] = max_tokens
    for param in REQUEST_PARAMS:
        value = getattr(body, param.name)
        if param is KV_CACHE_BUDGET:
            updates.update(kv_cache_budget(value))
        elif value is not None:
            updates[param.name] = value
    if body.stop is not None:
        updates["stop_strings"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    try:
        return replace(defaults, **updates)
    except (ValueError, TypeError) as err:
        raise APIError(400, str(err)) from None


class Completion:
    """Collects one ticket's tokens into text; `delta` gives what is safe to stream so far (nothing
    that may still turn out to be a stop string or half a character)."""

    def __init__(self, tokenizer: Tokenizer, config: GenerationConfig) -> None:
        self.tokenizer, self.config = tokenizer, config
        self.tokens: list[int] = []
        self.events: list[BatchEvent] = []
        self.steps = 0
        self.finish_reason: str | None = None
        self.sent = 0
        self.scored = self.scored_chars = 0  # events whose logprobs were sent (streaming), and their characters

    def add(self, event: BatchEvent) -> None:
        self.tokens.append(event.token)
        self.events.append(event)
        self.steps += event.steps
        if event.finish_reason is not None:
            self.finish_reason = "stop" if event.finish_reason != "length" else "length"

    def logprobs(self, chat: bool, new_only: bool = False) -> dict | None:
        """OpenAI's logprobs object for the tokens so far (or, streaming, those not sent yet), each with
        `latent_iterations`; None when the request did not ask. A stop token that ended the completion is
        not part of it (as it is not part of the text)."""
        if self.config.logprobs is None:
            return None
        first, at = (self.scored, self.scored_chars) if new_only else (0, 0)
        events = [e for e in self.events[first:] if e.finish_reason != "stop_token"]
        text = self.tokenizer.token_text
        if chat:
            entry = lambda token, lp: {"token": text(token), "logprob": lp,  # noqa: E731
                                       "bytes": list(self.tokenizer.token_bytes(token))}
            out = {"content": [{**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top],
                                "latent_iterations": e.steps} for e in events], "refusal": None}
        else:
            tokens, offsets = [text(e.token) for e in events], []
            for token in tokens:
                offsets.append(at)
                at += len(token)
            out = {"tokens": tokens, "token_logprobs": [e.logprob for e in events],
                   "top_logprobs": [{text(t): lp for t, lp in e.top} for e in events] if self.config.logprobs
                   else None, "text_offset": offsets, "latent_iterations": [e.steps for e in events]}
        if new_only:
            self.scored, self.scored_chars = len(self.events), at
        return out

    @property
    def text(self) -> str:
        return cut_at_stop(self.tokenizer.decode(self.tokens, skip_special_tokens=True), self.config.stop_strings)

    def delta(self) -> str:
        text = self.text
        if self.finish_reason is None:
            hold = max((len(s) - 1 for s in self.config.stop_strings), default=0)
            safe = len(text) - hold
            if text[:safe].endswith("\ufffd"):
                safe -= 1
            text = text[:max(safe, self.sent)]
        new, self.sent = text[self.sent:], len(text)
        return new
