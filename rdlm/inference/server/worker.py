"""The server's worker (rdlm.inference.server.app): `Worker` runs the batch (rdlm.inference.server.engine's
`BatchLoop`, the only place that touches the model) in a thread of the server or in a process of its own, and hands
each request's tokens to the event loop that waits for them (`Ticket`). `Metrics` are the server's Prometheus
metrics; its settings are `ServeConfig` (rdlm.inference.server.config)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from rdlm.data.tokenizer import Tokenizer
from rdlm.inference.batching import ContinuousBatch
from rdlm.inference.events import BatchEvent
from rdlm.inference.params import GenerationConfig
from rdlm.inference.server.config import ServeConfig
from rdlm.inference.server.engine import BatchLoop, EngineProcess, engine_process
from rdlm.inference.server.openai_api import APIError
from rdlm.model.lm import RecurrentDepthLM

log = logging.getLogger("rdlm.serve")


# --------------------------------------------------------------------------------------------------
# The worker: requests to the batch, tokens and metrics back.


@dataclass
class Ticket:
    """One row's worth of a request: where its tokens go."""

    prompt: list[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    key: int = -1  # the worker's name for it (Worker.submit)
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
    """Runs the server's batch (a `BatchLoop`) in a thread of this process, or in a process of its own
    (`engine_process`: then the batch's Python never waits for the HTTP server's, which holds the same
    interpreter lock in a thread). Requests come in through `submit`; each ticket receives ("accepted",),
    then BatchEvents, or ("error", status, message): the batch refused the request (400), the request failed
    (500: alone, the others go on; logged with its traceback), the server is shutting down (503), or the
    engine process died (500; a new one takes the next requests)."""

    def __init__(self, model: RecurrentDepthLM, tokenizer: Tokenizer, config: ServeConfig, metrics: Metrics) -> None:
        self.config, self.metrics = config, metrics
        self.tickets: dict[int, Ticket] = {}
        self.keys = itertools.count()
        self.pending = 0  # submitted and not finished (inbox, waiting, running)
        self.lock = threading.Lock()
        self.closing = False  # shutting down: new requests are refused
        if engine_process(config, model):
            self.engine: EngineProcess | None = EngineProcess(model, tokenizer, config, self.handle)
            self.loop: BatchLoop | None = None
            self.info = self.engine.info
        else:
            self.engine = None
            self.inbox: queue.Queue = queue.Queue()
            self.loop = BatchLoop(model, tokenizer, config, self.inbox, self.handle)
            self.info = self.loop.info()
            self.thread = threading.Thread(target=self.loop.run, name="rdlm-batch", daemon=True)

    @property
    def batch(self) -> ContinuousBatch:
        """The batch, when it runs in this process (tests look inside it)."""
        if self.loop is None:
            raise AttributeError("the batch runs in the engine process (ServeConfig.engine_process)")
        return self.loop.batch

    def start(self) -> None:
        if self.engine is not None:
            self.engine.start()
        else:
            self.thread.start()

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        else:
            self.inbox.put(None)
            self.thread.join(timeout=30)

    def _put(self, item) -> None:
        if self.engine is not None:
            self.engine.put(item)
        else:
            self.inbox.put(item)

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
                ticket.key = next(self.keys)
                self.tickets[ticket.key] = ticket
        for ticket in tickets:
            self._put(("add", ticket.key, ticket.prompt, ticket.config))

    def cancel(self, ticket: Ticket) -> None:
        self._put(("cancel", ticket.key))

    def abort(self, message: str) -> None:
        """End every request in flight with a 503 `message` (the shutdown's deadline)."""
        self._put(("abort", message))

    def _finish(self, key: int) -> Ticket | None:
        with self.lock:
            ticket = self.tickets.pop(key, None)
            if ticket is not None:
                self.pending -= 1
        return ticket

    def _send(self, ticket: Ticket, item) -> None:
        ticket.loop.call_soon_threadsafe(ticket.events.put_nowait, item)

    def handle(self, message: tuple) -> None:
        """One message of the batch's (BatchLoop): the tickets' events and the metrics."""
        kind, m = message[0], self.metrics
        if kind == "events":
            self._deliver(message[1])
            m.step_seconds.inc(message[2])
            for phase, seconds in message[3].items():
                m.phase_seconds.labels(phase).inc(seconds)
        elif kind == "gauges":
            m.queue.set(message[1])
            m.batch.set(message[2])
        elif kind == "accepted":
            _, key, taken = message
            ticket = self.tickets.get(key)
            if ticket is not None:
                ticket.taken = taken
                m.step_wait.observe(taken - ticket.submitted)
                m.prompt_tokens.inc(len(ticket.prompt))
                self._send(ticket, ("accepted",))
        elif kind == "end":
            _, key, status, text = message
            ticket = self._finish(key)
            if ticket is not None:
                self._send(ticket, ("error", status, text))
        elif kind == "cancelled":
            self._finish(message[1])
        elif kind == "died":
            self.engine_died(message[1])

    def engine_died(self, exitcode: int | None) -> None:
        """The engine process ended by itself: every request in flight fails (500)."""
        with self.lock:
            keys = list(self.tickets)
        for key in keys:
            self.handle(("end", key, 500, f"the engine process died (exit code {exitcode}); retry the request"))
        self.handle(("gauges", 0, 0))

    def _deliver(self, events: list[tuple[int, BatchEvent]]) -> None:
        """A step's tokens to their tickets: one wake-up of each event loop per step, not per token."""
        m = self.metrics
        now = time.perf_counter()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Ticket, BatchEvent]]] = {}
        for key, event in events:
            ticket = self.tickets.get(key)
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
                self._finish(key)
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[Ticket, BatchEvent]]) -> None:
    for ticket, event in items:
        ticket.events.put_nowait(event)
