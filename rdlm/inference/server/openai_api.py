"""The OpenAI API as rdlm's server speaks it (rdlm/inference/server/app.py): request bodies (OpenAI's fields and
rdlm's, anything else refused by name), their translation into a `GenerationConfig`, errors in OpenAI's
shape, a completion's text and logprobs. The HTTP side in front of it (API key, sizes, deadlines) is
rdlm/inference/server/http_guard.py."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, cast

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from rdlm.checks import Integer, InvalidValue, Number
from rdlm.data.tokenizer import IncrementalDecoder, Tokenizer
from rdlm.inference.events import BatchEvent
from rdlm.inference.params import (
    KV_CACHE_BUDGET,
    MAX_TOKENS,
    MAX_TOP_LOGPROBS,
    GenerationConfig,
    kv_cache_budget,
    params_for,
)

MAX_STOPS = 4  # stop sequences per request (OpenAI's limit)
MAX_STOP_CHARS = 256  # characters per stop sequence
MAX_N = 16  # completions per request
# The bounds of OpenAI's own numbers (GenerationConfig's parameters declare theirs with their fields; `bounds`
# lists both). presence_penalty and frequency_penalty take 0 only: repetition_penalty is rdlm's.
OPENAI_BOUNDS = {
    "max_tokens": Integer(1, MAX_TOKENS),
    "max_completion_tokens": Integer(1, MAX_TOKENS),
    "n": Integer(1, MAX_N),
    "logprobs": Integer(0, MAX_TOP_LOGPROBS),
    "top_logprobs": Integer(0, MAX_TOP_LOGPROBS),
}
UNSUPPORTED = ("presence_penalty", "frequency_penalty")
# A field of GenerationConfig that a request spells its own way: an error about it names the request's.
REQUEST_NAMES = {"cache_slots": "kv_cache_budget", "stop_strings": "stop", "max_new_tokens": "max_tokens"}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict:
        """OpenAI's error object (a response's body, or a stream's error event)."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# --------------------------------------------------------------------------------------------------
# Request bodies: OpenAI's fields and rdlm's; anything else is refused by name. Types are strict: no bool
# for a number (JSON's true is not 1), no string for a bool, no number for a string.

STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class OpenAIOptions(BaseModel):
    """Both endpoints' fields besides the generation parameters (`Options` adds those)."""

    model_config = STRICT

    model: str
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _few_short_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        # Every stop string is looked for after every token: bound them as OpenAI does (4), and their length.
        stops = [stop] if isinstance(stop, str) else stop or []
        if not all(stops):  # "" is in every text: every completion would end empty
            raise ValueError("a stop sequence may not be empty")
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters")
        return stop


# GenerationConfig's parameters a request sets by their names (OpenAI's temperature, top_p and seed, vLLM's
# top_k, min_p and repetition_penalty, rdlm's test-time compute), typed and described as declared (None: the
# server's default, `rdlm serve`'s flags); their values are checked by GenerationConfig (`generation_config`).
REQUEST_PARAMS = params_for("server")
if TYPE_CHECKING:  # a class built at run time: type checkers see its base (its own fields are read by name)

    class Options(OpenAIOptions):
        """A request body's options, both endpoints'."""

else:
    Options = create_model(
        "Options",
        __base__=OpenAIOptions,
        __doc__="A request body's options, both endpoints'.",
        **{p.name: (p.kind | None, Field(None, description=p.help)) for p in REQUEST_PARAMS},
    )


class CompletionRequest(Options):
    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(Options):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


# --------------------------------------------------------------------------------------------------
# From a request to generation configs and back to OpenAI's responses


def requested_logprobs(body: Options) -> int | None:
    """How many alternatives per token the request asks for (0: the chosen token's only), or None."""
    if isinstance(body, ChatRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    return getattr(body, "logprobs", None)


def check_bounds(body: Options) -> None:
    """Refuse, by name, an OpenAI number out of its bounds (`OPENAI_BOUNDS`; a request for no token would
    end without a response), an unsupported penalty, and options that need others."""
    for name, check in OPENAI_BOUNDS.items():
        value = getattr(body, name, None)
        if value is not None and not isinstance(value, bool):  # (chat's logprobs is a switch: strictly a bool)
            try:
                check(name, value)
            except InvalidValue as err:
                raise APIError(400, str(err), param=name) from None
    for name in UNSUPPORTED:
        if getattr(body, name) != 0:
            raise APIError(400, f"{name} is not supported; use repetition_penalty", param=name)
    if body.stream_options is not None and not body.stream:  # as OpenAI refuses it
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if body.n > 1 and body.stream:
        raise APIError(400, "n > 1 is not supported with stream", param="n")


def generation_config(
    body: Options, defaults: GenerationConfig, stop_tokens: tuple[int, ...], max_tokens: int | None
) -> GenerationConfig:
    """The request's GenerationConfig over the server's defaults; every value out of its declared bounds is
    refused (400) naming the request's field."""
    check_bounds(body)
    updates: dict[str, Any] = {
        "stop_tokens": tuple(defaults.stop_tokens) + stop_tokens,
        "logprobs": requested_logprobs(body),
    }
    if max_tokens is not None:
        updates["max_new_tokens"] = max_tokens
    try:
        for param in REQUEST_PARAMS:
            value = getattr(body, param.name)
            if param is KV_CACHE_BUDGET:
                if value is not None:
                    assert param.check is not None  # KV_CACHE_BUDGET declares its check
                    param.check(param.name, value)
                updates.update(kv_cache_budget(value))
            elif value is not None:
                updates[param.name] = value
        if body.stop is not None:
            updates["stop_strings"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
        return replace(defaults, **updates)
    except InvalidValue as err:
        raise APIError(400, str(err), param=REQUEST_NAMES.get(err.name, err.name)) from None
    except (ValueError, TypeError) as err:  # a rule between fields
        raise APIError(400, str(err)) from None


def numeric_checks() -> dict[str, Integer | Number]:
    """The check of every number a request may carry but the unsupported penalties (0 only), by field."""
    # (a number's check is an Integer or a Number: params.py declares them so)
    return {
        **OPENAI_BOUNDS,
        **{p.name: cast(Integer | Number, p.check) for p in REQUEST_PARAMS if p.kind in (int, float)},
    }


def bounds() -> dict[str, tuple[str, str]]:
    """Every number a request may carry: its type and the values it takes, as docs/production.md's table
    gives them (its test compares the two)."""
    rows = {
        name: ("integer" if isinstance(check, Integer) else "number", check.bounds)
        for name, check in numeric_checks().items()
    }
    rows.update({name: ("number", "0 only") for name in UNSUPPORTED})
    return rows


class Completion:
    """One ticket's completion. Its events are the one copy of its tokens (with their iterations and logprobs);
    its text is decoded as they arrive (`IncrementalDecoder`, linear in the completion's length) and cut before
    a stop string where the engine found one. `delta` gives what is safe to stream so far (nothing that may
    still turn out to be a stop string or half a character)."""

    def __init__(self, tokenizer: Tokenizer, config: GenerationConfig) -> None:
        self.tokenizer, self.config = tokenizer, config
        self.events: list[BatchEvent] = []
        self.decoder = IncrementalDecoder(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        self.iterations = 0
        self.finish_reason: str | None = None
        self.end: int | None = None  # once finished: the text's characters (before a stop string)
        self.sent = 0
        self.scored = self.scored_chars = 0  # events whose logprobs were sent (streaming), and their characters

    def add(self, event: BatchEvent) -> None:
        self.events.append(event)
        self.iterations += event.iterations
        settled = self.decoder.settled
        self.decoder.push(event.token)
        if event.finish_reason is not None:
            self.finish_reason = "stop" if event.finish_reason != "length" else "length"
            self.end = self._stop_at(settled) if event.finish_reason != "length" else self.decoder.length

    def _stop_at(self, settled: int) -> int:
        """Where the text ends once its last token is in: before the first stop string in it, else at its
        end. The engine checks the stop strings after every token (`GenerationConfig.finish_reason`), so one
        can only have been completed by the last token's text (it said "stop_string", or a stop token ended
        the completion first): the text before the last token's `settled` characters holds none, and only
        the tail from a stop string's length before them is searched."""
        stops = self.config.stop_strings
        if not stops:
            return self.decoder.length
        start = max(0, settled - max(map(len, stops)) + 1)
        tail = self.decoder.since(start)
        return start + min((tail.find(s) for s in stops if s in tail), default=len(tail))

    def logprobs(self, chat: bool, new_only: bool = False) -> dict | None:
        """OpenAI's logprobs object for the tokens so far (or, streaming, those not sent yet), each with
        `latent_iterations`; None when the request did not ask. A stop token that ended the completion is
        not part of it (as it is not part of the text)."""
        if self.config.logprobs is None:
            return None
        first, at = (self.scored, self.scored_chars) if new_only else (0, 0)
        events = [e for e in self.events[first:] if e.finish_reason != "stop_token"]
        text = self.tokenizer.token_text

        def top(e: BatchEvent) -> tuple[tuple[int, float], ...]:
            assert e.top is not None  # the request asked for logprobs: each of its tokens is scored
            return e.top

        out: dict[str, Any]
        if chat:

            def entry(token: int, lp: float | None) -> dict[str, Any]:
                return {"token": text(token), "logprob": lp, "bytes": list(self.tokenizer.token_bytes(token))}

            out = {
                "content": [
                    {
                        **entry(e.token, e.logprob),
                        "top_logprobs": [entry(t, lp) for t, lp in top(e)],
                        "latent_iterations": e.iterations,
                    }
                    for e in events
                ],
                "refusal": None,
            }
        else:
            tokens, offsets = [text(e.token) for e in events], []
            for token in tokens:
                offsets.append(at)
                at += len(token)
            out = {
                "tokens": tokens,
                "token_logprobs": [e.logprob for e in events],
                "top_logprobs": [{text(t): lp for t, lp in top(e)} for e in events] if self.config.logprobs else None,
                "text_offset": offsets,
                "latent_iterations": [e.iterations for e in events],
            }
        if new_only:
            self.scored, self.scored_chars = len(self.events), at
        return out

    @property
    def text(self) -> str:
        """The completion's text: the decode of its tokens (special tokens skipped), cut before a stop string."""
        text = self.decoder.text
        return text if self.end is None else text[: self.end]

    def delta(self) -> str:
        """The text not streamed yet that is safe to stream. While the completion goes on, the last characters
        that may begin a stop string (one fewer than the longest stop string's) are held back, and a U+FFFD
        just before them (with no stop strings: the last character, which may be half of one)."""
        length = self.decoder.length
        if self.end is not None:
            end = self.end
        else:
            hold = max((len(s) - 1 for s in self.config.stop_strings), default=0)
            safe = length - hold
            if safe >= 1 and self.decoder.since(safe - 1).startswith("\ufffd"):
                safe -= 1
            end = min(max(safe, self.sent), length)
        new = self.decoder.since(self.sent)[: end - self.sent] if end > self.sent else ""
        self.sent = end
        return new
