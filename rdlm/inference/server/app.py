"""An OpenAI-compatible HTTP server whose batches think at different depths (`rdlm serve`).

    if __name__ == "__main__":  # (on the CPU the batch may run in a process of its own, which imports this module)
        app = create_app(model, tokenizer, ServeConfig(model_name="huginn"))     # a FastAPI app
        uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: `/v1/completions` and `/v1/chat/completions` (the model's chat template), both streamed as
server-sent events in OpenAI's chunk format (ending with `[DONE]`) or not; `/v1/models`; `/health`;
`/metrics` (Prometheus text format).

Requests take OpenAI's fields (`max_tokens`, `temperature`, `top_p`, `stop`, `seed`, `stream`, `n`, ...)
and rdlm's: `num_steps`, `exit_criterion`, `exit_threshold`, `min_steps`, `exit_every`,
`kv_cache_budget`, `continuous_cot`, `init_scale`, `max_latent_iterations`, `target_mean_iterations`.
`usage.latent_iterations` counts the core
iterations spent on the completion (`usage.mean_latent_iterations` per token). With `logprobs` (completions:
the number of alternatives, 0-20; chat: `logprobs: true` and `top_logprobs`) each token comes with its
log-probability under the model, the most likely alternatives and `latent_iterations`, the core iterations
that chose it.

LoRA adapters loaded in the model (rdlm.model.lora; `rdlm serve --lora NAME=DIR`) are served by name: a
request's `model` is the served model's name (the base alone) or an adapter's, `/v1/models` lists them all,
and requests for different adapters share the batch, each row's tokens through its own adapter.

The request bodies, their translation and the response objects are in rdlm/inference/server/openai_api.py, the
worker thread in rdlm/inference/server/worker.py.
One worker thread (or, with `ServeConfig.engine_process`, a process of its own) owns a `ContinuousBatch`
(rdlm/inference/batching.py): requests join and leave between core
iterations, each row at its own depth, so a request whose tokens exit early makes room for others
instead of waiting for them. A request's tokens are those of `rdlm.inference.generate` for its prompt alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rdlm.data.tokenizer import Tokenizer, TokenizerError
from rdlm.inference.params import GenerationConfig
from rdlm.inference.server.config import ServeConfig
from rdlm.inference.server.http_guard import Guard, install_error_handlers
from rdlm.inference.server.openai_api import (
    APIError,
    ChatRequest,
    Completion,
    CompletionRequest,
    Options,
    generation_config,
)
from rdlm.inference.server.worker import Metrics, Ticket, Worker
from rdlm.model.lm import RecurrentDepthLM
from rdlm.model.lora import loaded_adapters, set_adapter

log = logging.getLogger("rdlm.serve")
UNION_MEMBER = re.compile(r"str|int|float|bool|(list|dict)\[.*\]|function-.*")  # pydantic's names in a loc


# --------------------------------------------------------------------------------------------------
# The app


class OpenAIServer:
    """OpenAI's endpoints over the worker's batch: a request body becomes a prompt and a `GenerationConfig`
    (rdlm/inference/server/openai_api.py), its tickets go to the worker, and their tokens come back as
    completions, whole (JSON) or streamed (server-sent events)."""

    def __init__(
        self, worker: Worker, tokenizer: Tokenizer, config: ServeConfig, metrics: Metrics, adapters: list[str]
    ) -> None:
        self.worker, self.tokenizer, self.config, self.metrics = worker, tokenizer, config, metrics
        self.adapters = adapters  # the LoRA adapters served, by name (each a `model` a request may ask for)

    # ---- errors and the small endpoints

    async def api_error(self, request: Request, err: APIError) -> JSONResponse:
        self.metrics.count(request.url.path, err.status)
        return err.response()

    async def invalid(self, request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        # the field's path, without the member of a union the value was tried as ("prompt", not "prompt.str")
        where = ".".join(str(p) for p in first.get("loc", ())[1:] if not UNION_MEMBER.fullmatch(str(p))) or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message, where = f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})", None
        elif first.get("type") == "extra_forbidden":
            message = f"unknown field {where!r}"
        elif where:
            message = f"{where}: {message}"
        self.metrics.count(request.url.path, 400)
        return APIError(400, message, param=where).response()

    async def health(self) -> dict:
        return {"status": "ok", "model": self.config.model_name}

    async def prometheus(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> dict:
        base = self.config.model_name
        adapters = [
            {"id": name, "object": "model", "created": 0, "owned_by": "rdlm", "parent": base} for name in self.adapters
        ]
        return {
            "object": "list",
            "data": [{"id": base, "object": "model", "created": 0, "owned_by": "rdlm"}, *adapters],
        }

    def adapter_of(self, name: str) -> str | None:
        """The adapter a request's `model` names: None for the served model (the base alone), else the
        adapter of that name; any other name is refused (404), naming the ones there are."""
        if name == self.config.model_name:
            return None
        if name in self.adapters:
            return name
        served = ", ".join(repr(n) for n in (self.config.model_name, *self.adapters))
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server has {served}",
            param="model",
            code="model_not_found",
        )

    # ---- the completion endpoints

    async def completions(self, request: Request, body: CompletionRequest):
        adapter = self.adapter_of(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (send several requests)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await self.encode(self.tokenizer.encode, prompt, add_bos=True)
        else:
            ids = list(cast(list[int], prompt))  # (a list of strings was taken above)
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        gen = generation_config(body, self.config.defaults, (self.tokenizer.eos_id,), body.max_tokens)
        return await self.respond(request, body, ids, replace(gen, adapter=adapter), chat=False)

    async def chat_completions(self, request: Request, body: ChatRequest):
        adapter = self.adapter_of(body.model)
        tok = self.tokenizer
        if not tok.has_chat:
            raise APIError(
                400,
                "this model's tokenizer has no chat format (it was not made for chats): use /v1/completions",
                param="messages",
            )
        assert tok.end_turn_id is not None  # has_chat
        ids = await self.encode(tok.apply_chat_template, [m.model_dump() for m in body.messages])
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        gen = generation_config(body, self.config.defaults, (tok.end_turn_id, tok.eos_id), max_tokens)
        return await self.respond(request, body, ids, replace(gen, adapter=adapter), chat=True)

    async def encode(self, encode: Callable, *args, **kwargs) -> list[int]:
        """Text to ids in a thread (a long prompt takes a while: the event loop serves the others meanwhile);
        text the tokenizer cannot take (a lone surrogate, say) is the request's error (400)."""
        try:
            return await asyncio.to_thread(encode, *args, **kwargs)
        except TokenizerError as err:
            raise APIError(400, str(err), param="prompt") from None

    async def respond(self, request: Request, body: Options, prompt: list[int], gen: GenerationConfig, chat: bool):
        if gen.max_steps > self.config.max_num_steps:
            raise APIError(
                400,
                f"num_steps {gen.max_steps} is above this server's limit of "
                f"{self.config.max_num_steps} core iterations per token",
                param="num_steps",
            )
        started = await self.start(prompt, gen, body.n)
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        name = body.model  # the served model's name, or an adapter's

        def head(kind: str) -> dict:  # what every response object and chunk begins with
            return {"id": rid, "object": kind, "created": created, "model": name}

        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                self.stream(request.url.path, head, prompt, *started[0], chat, include_usage),
                media_type="text/event-stream",
            )
        await self.collect(request, started)
        completions = [c for _, c in started]
        if chat:
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": c.logprobs(chat),
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(completions)
            ]
        else:
            choices = [
                {"index": i, "text": c.text, "logprobs": c.logprobs(chat), "finish_reason": c.finish_reason}
                for i, c in enumerate(completions)
            ]
        self.metrics.count(request.url.path, 200)
        return JSONResponse(
            {
                **head("chat.completion" if chat else "text_completion"),
                "choices": choices,
                "usage": usage(prompt, completions),
            }
        )

    async def stream(
        self,
        endpoint: str,
        head: Callable[[str], dict],
        prompt: list[int],
        ticket: Ticket,
        completion: Completion,
        chat: bool,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """One completion as server-sent events: a chunk per token (chat: a first one with the role), the usage
        when asked for, then [DONE]; an error mid-stream as an error event."""
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, role: bool = False) -> str:
            logprobs = None if role else completion.logprobs(chat, new_only=True)
            if chat:
                content = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
                choice = {"index": 0, "delta": content, "logprobs": logprobs, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}
            return f"data: {json.dumps({**head(kind), 'choices': [choice]})}\n\n"

        try:
            if chat:
                yield chunk(None, None, role=True)
            while completion.finish_reason is None:
                # a chunk per token, its text possibly empty (held back: half a character, or what may begin a
                # stop string), as vLLM and OpenAI stream: a client sees each token arrive, its first one included
                self.take(ticket, completion, await ticket.events.get())
                yield chunk(completion.delta(), completion.finish_reason)
            if include_usage:
                data = {**head(kind), "choices": [], "usage": usage(prompt, [completion])}
                yield f"data: {json.dumps(data)}\n\n"
            yield "data: [DONE]\n\n"
            self.metrics.count(endpoint, 200)
        except APIError as err:
            self.metrics.count(endpoint, err.status)
            yield f"data: {json.dumps(err.body())}\n\n"
        except Exception as err:  # any error (the response has begun: an error event is all that can be sent)
            log.error("a stream failed", exc_info=err)
            self.metrics.count(endpoint, 500)
            failed = APIError(500, "the server failed", kind="server_error", code="internal_error")
            yield f"data: {json.dumps(failed.body())}\n\n"
        finally:
            if completion.finish_reason is None:  # the client went away, or an error: free the row
                self.worker.cancel(ticket)

    # ---- tickets

    async def start(self, prompt: list[int], gen: GenerationConfig, n: int) -> list[tuple[Ticket, Completion]]:
        """Submit the request's n completions (sampled ones with seeds seed, seed + 1, ...); wait until the
        batch has taken or refused each."""
        loop = asyncio.get_running_loop()
        configs = [gen if gen.temperature == 0 else replace(gen, seed=(gen.seed + i) % 2**63) for i in range(n)]
        started = [(Ticket(prompt, c, loop), Completion(self.tokenizer, c)) for c in configs]
        self.worker.submit([ticket for ticket, _ in started])
        for ticket, _ in started:
            first = await ticket.events.get()
            if first[0] == "error":
                for other, _ in started:
                    self.worker.cancel(other)
                raise error(first)
        return started

    async def collect(self, request: Request, started: list[tuple[Ticket, Completion]]) -> None:
        """Wait for every ticket to finish; a client that goes away cancels them at once."""
        gone = asyncio.ensure_future(disconnected(request))
        try:
            for ticket, completion in started:
                while completion.finish_reason is None:
                    item = asyncio.ensure_future(ticket.events.get())
                    await asyncio.wait((item, gone), return_when=asyncio.FIRST_COMPLETED)
                    if not item.done():
                        item.cancel()
                        for other, _ in started:
                            self.worker.cancel(other)
                        raise APIError(499, "the client disconnected")
                    self.take(ticket, completion, item.result())
        finally:
            gone.cancel()

    def take(self, ticket: Ticket, completion: Completion, item) -> None:
        if isinstance(item, tuple) and item[0] == "error":
            raise error(item)
        if not completion.events:
            self.metrics.ttft.observe(time.perf_counter() - ticket.submitted)
        completion.add(item)


def error(item: tuple) -> APIError:
    """The APIError of a ticket's ("error", status, message)."""
    _, status, message = item
    return APIError(
        status,
        message,
        kind="invalid_request_error" if status == 400 else "server_error",
        code="shutting_down" if status == 503 else None,
    )


async def disconnected(request: Request) -> None:
    """Returns when the client goes away (the ASGI server's disconnect message, which comes at once)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def usage(prompt: list[int], completions: list[Completion]) -> dict:
    out = sum(len(c.events) for c in completions)
    spent = sum(c.iterations for c in completions)
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": out,
        "total_tokens": len(prompt) + out,
        "latent_iterations": spent,
        "mean_latent_iterations": spent / out if out else 0.0,
    }


def create_app(model: RecurrentDepthLM, tokenizer: Tokenizer, config: ServeConfig | None = None) -> FastAPI:
    """The server's app over `model`; every LoRA adapter loaded in it is served under its name, and the
    model's own name is the base alone (no adapter is left active)."""
    config = config or ServeConfig()
    adapters = loaded_adapters(model)
    if config.model_name in adapters:
        raise ValueError(f"the adapter {config.model_name!r} has the served model's name: give either another name")
    if adapters:
        set_adapter(model, None)  # a request for the model's own name runs the base
    metrics = Metrics()
    worker = Worker(model, tokenizer, config, metrics)
    server = OpenAIServer(worker, tokenizer, config, metrics, adapters)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="rdlm", lifespan=lifespan)
    app.state.worker, app.state.metrics = worker, metrics
    app.add_middleware(
        Guard,
        api_key=config.api_key,
        max_bytes=config.max_request_bytes,
        body_timeout=config.body_timeout,
        count=metrics.count,
    )
    # Starlette types a handler as taking any Exception; it calls one with the class it was registered for
    app.add_exception_handler(APIError, server.api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, server.invalid)  # type: ignore[arg-type]
    install_error_handlers(app, metrics.count)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["HEAD"], include_in_schema=False)  # balancers' probe
    app.add_api_route("/metrics", server.prometheus, methods=["GET"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    # (Starlette types the routes as BaseRoute, which declares no path; every route of this app has one)
    metrics.routes = frozenset(route.path for route in app.routes)  # type: ignore[attr-defined]
    return app
