"""The server's worker thread (rdlm.inference.server.app): the only place that touches the model. It owns one
`ContinuousBatch` (rdlm.inference.batching) and hands each request's tokens to the event loop that waits for
them (`Ticket`); `ServeConfig` is the server's settings and `Metrics` its Prometheus metrics."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from rdlm.data.tokenizer import Tokenizer
from rdlm.inference.batching import ContinuousBatch
from rdlm.inference.events import BatchEvent
from rdlm.inference.execution.cpu_compile import server_compiles
from rdlm.inference.params import GenerationConfig
from rdlm.inference.server.openai_api import APIError
from rdlm.model.lm import RecurrentDepthLM
from rdlm.model.lora import loaded_adapters

log = logging.getLogger("rdlm.serve")


@dataclass(frozen=True)
class ServeConfig:
    model_name: str = "rdlm"
    max_batch: int = 8  # rows decoded together
    max_queue: int = 64  # requests waiting for a row before the server answers 503
    max_length: int | None = None  # tokens per row (prompt + completion); default: the model's context
    num_slots: int = 32  # core cache slots per token: the largest r without a cache budget
    prefill_chunk: int = 256  # prompt token-iterations per step (and the longest chunk of a prompt)
    coda_every: int = 8  # core iterations a done row may wait for others to run the coda with
    exit_sync_every: int = 4  # core iterations between the batch's looks at the exit flags (rows found done
    # then leave its calls: rdlm.inference.batching)
    defaults: GenerationConfig = field(default_factory=lambda: GenerationConfig(max_new_tokens=256))
    retry_after: int = 1  # seconds, in the Retry-After of a 503
    api_key: str | None = None  # when set, /v1/ requests need "Authorization: Bearer <api_key>"
    max_request_bytes: int = 1 << 20  # larger request bodies are answered 413 before they are parsed
    max_num_steps: int = 256  # the most core iterations per token a request may ask for
    header_timeout: float = 10.0  # seconds a connection may take to send a request's headers
    body_timeout: float = 30.0  # seconds a request may take to send its body after its headers
    profile: bool = False  # time each phase of the batch's steps (/metrics: rdlm_batch_phase_seconds)
    compile: bool | None = None  # the batch's static core step (None: on with CUDA; rdlm.inference.batching)


# --------------------------------------------------------------------------------------------------
# The worker thread: the only place that touches the model.


@dataclass
class Ticket:
    """One row's worth of a request: where its tokens go."""

    prompt: list[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: int | None = None
    submitted: float = field(default_factory=time.perf_counter)
    taken: float | None = None  # when the worker took it into the batch; None again once its first token came


class Metrics:
    """The server's Prometheus metrics. Requests are counted by endpoint, the route's path or "unmatched" for a
    path no route takes (a series per random path would grow without end), and status."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.routes: frozenset[str] = frozenset()  # the app's paths (create_app sets them)
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_open_fds, ... (Linux)
        self.requests = Counter(
            "rdlm_requests",
            "HTTP requests by endpoint (a route's path, or unmatched) and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter("rdlm_prompt_tokens", "prompt tokens admitted", registry=r)
        self.tokens = Counter("rdlm_generated_tokens", "tokens generated", registry=r)
        self.exits = Counter(
            "rdlm_early_exits", "tokens that stopped iterating before their cap (an exit criterion fired)", registry=r
        )
        self.budget_cuts = Counter(
            "rdlm_budget_capped_tokens", "tokens whose cap a depth budget set below r (num_steps)", registry=r
        )
        self.queue = Gauge("rdlm_queue_length", "requests waiting for a row", registry=r)
        self.batch = Gauge("rdlm_batch_size", "rows being decoded", registry=r)
        self.iterations = Histogram(
            "rdlm_iterations_per_token",
            "core iterations per generated token",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.step_seconds = Counter(
            "rdlm_batch_step_seconds",
            "seconds the batch spent in its steps (the rest of the server's time: idle, or HTTP)",
            registry=r,
        )
        self.phase_seconds = Counter(
            "rdlm_batch_phase_seconds",
            "seconds per phase of the batch's steps (rdlm serve --profile)",
            ["phase"],
            registry=r,
        )
        latency = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.ttft = Histogram(
            "rdlm_time_to_first_token_seconds", "from submission to the first token", buckets=latency, registry=r
        )
        # the first token's time in two parts (their sum is the TTFT less its hand-over to the HTTP stream)
        self.step_wait = Histogram(
            "rdlm_step_wait_seconds",
            "from submission until the worker takes the request into the batch (it does so between steps)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.prefill = Histogram(
            "rdlm_prefill_seconds",
            "from joining the batch to the first token: waiting for a row, then the prompt's iterations",
            buckets=latency,
            registry=r,
        )

    def count(self, path: str, status: int | str) -> None:
        """One answered request: its endpoint (the route's path, or "unmatched") and status."""
        self.requests.labels(path if path in self.routes else "unmatched", str(status)).inc()


class Worker:
    """Runs a ContinuousBatch in a thread. Requests come in through `submit`; each ticket receives
    ("accepted",), then BatchEvents, or ("error", status, message): the batch refused the request (400),
    the request failed (500: alone, the others go on; logged with its traceback), or the server is shutting
    down (503)."""

    def __init__(self, model: RecurrentDepthLM, tokenizer: Tokenizer, config: ServeConfig, metrics: Metrics) -> None:
        self.config, self.metrics = config, metrics
        self.model, self.decode = model, lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        self.model_device = next(model.parameters()).device
        self.batch = self._new_batch()
        self.inbox: queue.Queue = queue.Queue()
        self.tickets: dict[int, Ticket] = {}
        self.pending = 0  # submitted and not finished (inbox, waiting, running)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.closing = False  # shutting down: new requests are refused
        self.thread = threading.Thread(target=self.run, name="rdlm-batch", daemon=True)

    def _new_batch(self) -> ContinuousBatch:
        c = self.config
        compile = c.compile
        if compile is None and self.model_device.type == "cpu":
            compile = server_compiles(c.max_batch, adapters=bool(loaded_adapters(self.model)))
        batch = ContinuousBatch(
            self.model,
            c.max_batch,
            c.max_length,
            c.num_slots,
            decode=self.decode,
            exit_sync_every=c.exit_sync_every,
            prefill_chunk=c.prefill_chunk,
            coda_every=c.coda_every,
            profile=c.profile,
            compile=compile,
        )
        seconds = batch.warm_up()  # the CPU's compiled step: compiled before the first request, not during it
        if seconds:
            log.info("compiled the decode step in %.1f s", seconds)
        return batch

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.inbox.put(None)
        self.thread.join(timeout=30)

    def submit(self, tickets: list[Ticket]) -> None:
        """Hand a request's tickets (its n completions) to the batch: all of them, or none (503)."""
        retry = {"Retry-After": str(self.config.retry_after)}
        with self.lock:
            if self.closing:
                raise APIError(
                    503, "the server is shutting down", code="shutting_down", kind="server_error", headers=retry
                )
            if self.pending + len(tickets) > self.config.max_batch + self.config.max_queue:
                raise APIError(
                    503,
                    f"the server is at capacity ({self.pending} requests in flight); retry later",
                    code="overloaded",
                    kind="server_error",
                    headers=retry,
                )
            self.pending += len(tickets)
        for ticket in tickets:
            self.inbox.put(("add", ticket))

    def cancel(self, ticket: Ticket) -> None:
        self.inbox.put(("cancel", ticket))

    def abort(self, message: str) -> None:
        """End every request in flight with a 503 `message` (the shutdown's deadline)."""
        self.inbox.put(("abort", message))

    def _done(self) -> None:
        with self.lock:
            self.pending -= 1

    def _send(self, ticket: Ticket, item) -> None:
        ticket.loop.call_soon_threadsafe(ticket.events.put_nowait, item)

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self._take(block=not self.batch.busy)
                if self.batch.busy:
                    t0 = time.perf_counter()
                    events = self.batch.step()
                    self.metrics.step_seconds.inc(time.perf_counter() - t0)
                    self._deliver(events)
                    for phase, seconds in self.batch.take_timings().items():
                        self.metrics.phase_seconds.labels(phase).inc(seconds)
                for request, err in self.batch.take_failures():  # failed alone: the others go on
                    log.error("request %d failed", request, exc_info=err)
                    self._end(request, 500, f"generation failed: {err}")
            except Exception as err:  # any error (the step itself failed: nothing can tell whose fault it is;
                # a value of one request's fails that one alone, in the batch, and its values are bounded first)
                log.exception("the batch's step failed: its %d request(s) fail", len(self.tickets))
                self._end_all(500, f"generation failed: {err}")
                self.batch = self._new_batch()
            self._gauges()  # after every step, a failed one included, and every admission or cancel
        self._end_all(503, "the server is shutting down")
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.queue.set(self.batch.queued)
        self.metrics.batch.set(self.batch.running)

    def _end(self, request: int, status: int, message: str) -> None:
        """End one request in flight with an error."""
        ticket = self.tickets.pop(request, None)
        if ticket is not None:
            self.batch.cancel(request)
            self._send(ticket, ("error", status, message))
            self._done()

    def _end_all(self, status: int, message: str) -> None:
        for request in list(self.tickets):
            self._end(request, status, message)

    def _take(self, block: bool) -> None:
        while True:
            try:
                item = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            command, ticket = item
            if command == "abort":
                self._end_all(503, item[1])  # ("abort", message)
            elif command == "add":
                try:
                    ticket.request_id = self.batch.add(ticket.prompt, ticket.config)
                except Exception as err:  # any error (what this one request asked for)
                    if not isinstance(err, ValueError):
                        log.error("a request could not join the batch", exc_info=err)
                    self._send(ticket, ("error", 400 if isinstance(err, ValueError) else 500, str(err)))
                    self._done()
                    continue
                self.tickets[ticket.request_id] = ticket
                ticket.taken = time.perf_counter()
                self.metrics.step_wait.observe(ticket.taken - ticket.submitted)
                self.metrics.prompt_tokens.inc(len(ticket.prompt))
                self._send(ticket, ("accepted",))
            elif command == "cancel" and ticket.request_id in self.tickets:
                self.batch.cancel(ticket.request_id)
                del self.tickets[ticket.request_id]
                self._done()

    def _deliver(self, events: list[BatchEvent]) -> None:
        """A step's tokens to their tickets: one wake-up of each event loop per step, not per token."""
        m = self.metrics
        now = time.perf_counter()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Ticket, BatchEvent]]] = {}
        for event in events:
            ticket = self.tickets.get(event.request)
            if ticket is None:
                continue
            if ticket.taken is not None:  # its first token
                m.prefill.observe(now - ticket.taken)
                ticket.taken = None
            m.tokens.inc()
            m.iterations.observe(event.iterations)
            if event.exited:
                m.exits.inc()
            if event.cap is not None and event.cap < ticket.config.num_steps:
                m.budget_cuts.inc()
            by_loop.setdefault(ticket.loop, []).append((ticket, event))
            if event.finish_reason is not None:
                del self.tickets[event.request]
                self._done()
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[Ticket, BatchEvent]]) -> None:
    for ticket, event in items:
        ticket.events.put_nowait(event)
