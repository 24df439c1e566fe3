"""The server's batch (rdlm.inference.server.app): `BatchLoop` is the only place that touches the model. It owns one
`ContinuousBatch` (rdlm.inference.batching) and runs in a thread of the server (`Worker`) or in a process of its
own (`EngineProcess`, `ServeConfig.engine_process`); the Worker hands each request's tokens to the event loop that
waits for them (`Ticket`). `ServeConfig` is the server's settings and `Metrics` its Prometheus metrics."""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.multiprocessing as mp
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
    engine_process: bool = False  # the batch in a process of its own (a CPU model's; Worker)


# --------------------------------------------------------------------------------------------------
# The worker thread: the only place that touches the model.


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


@dataclass(frozen=True)
class BatchInfo:
    """What the server says about its batch at start (`rdlm serve`'s banner), wherever the batch runs."""

    device: str
    cache_bytes: int  # the KV cache's size
    static: bool  # the batch's static core step
    compiled: bool  # ... compiled (the CPU's step)
    compile_seconds: float  # spent compiling it before the first request


class BatchLoop:
    """The batch's side of the server: owns one `ContinuousBatch` and runs it, in the worker thread or in the
    engine process. Commands come from `inbox` (`get(timeout=...)`, `get_nowait()`: a `queue.Queue` or a
    multiprocessing queue): ("add", key, prompt, config), ("cancel", key), ("abort", message), or None to stop.
    What happens to a request goes to `emit` as a message about its key (the parent's ticket):
    ("accepted", key, when), ("end", key, status, message) (refused, failed or ended by the server; nothing
    more comes for it), ("cancelled", key), ("events", [(key, BatchEvent), ...], step seconds, phase
    timings) and ("gauges", queued, running)."""

    def __init__(self, model: RecurrentDepthLM, decode, config: ServeConfig, inbox, emit) -> None:
        self.model, self.decode, self.config, self.inbox, self.emit = model, decode, config, inbox, emit
        self.batch = self._new_batch()
        self.keys: dict[int, int] = {}  # the batch's request id -> the parent's key
        self.ids: dict[int, int] = {}  # key -> request id

    def _new_batch(self) -> ContinuousBatch:
        c = self.config
        compile = c.compile
        if compile is None and next(self.model.parameters()).device.type == "cpu":
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
        self.compile_seconds = batch.warm_up()  # the CPU's compiled step: compiled before the first request
        if self.compile_seconds:
            log.info("compiled the decode step in %.1f s", self.compile_seconds)
        return batch

    def info(self) -> BatchInfo:
        b = self.batch
        return BatchInfo(str(b.device), b.cache_bytes, b.static, b.compiled, self.compile_seconds)

    def run(self) -> None:
        while True:
            try:
                if not self._take(block=not self.batch.busy):
                    break
                if self.batch.busy:
                    t0 = time.perf_counter()
                    events = self.batch.step()
                    seconds = time.perf_counter() - t0
                    ours = [(self.keys[e.request], e) for e in events if e.request in self.keys]
                    for key, event in ours:
                        if event.finish_reason is not None:
                            del self.ids[key], self.keys[event.request]
                    self.emit(("events", ours, seconds, self.batch.take_timings()))
                for request, err in self.batch.take_failures():  # failed alone: the others go on
                    log.error("request %d failed", request, exc_info=err)
                    self._end(self.keys.get(request), 500, f"generation failed: {err}")
            except Exception as err:  # any error (the step itself failed: nothing can tell whose fault it is;
                # a value of one request's fails that one alone, in the batch, and its values are bounded first)
                log.exception("the batch's step failed: its %d request(s) fail", len(self.ids))
                self._end_all(500, f"generation failed: {err}")
                self.batch = self._new_batch()
            self._gauges()  # after every step, a failed one included, and every admission or cancel
        self._end_all(503, "the server is shutting down")
        self._gauges()

    def _gauges(self) -> None:
        self.emit(("gauges", self.batch.queued, self.batch.running))

    def _end(self, key: int | None, status: int, message: str) -> None:
        """End one request in flight with an error."""
        request = self.ids.pop(key, None) if key is not None else None
        if request is not None:
            del self.keys[request]
            self.batch.cancel(request)
            self.emit(("end", key, status, message))

    def _end_all(self, status: int, message: str) -> None:
        for key in list(self.ids):
            self._end(key, status, message)

    def _take(self, block: bool) -> bool:
        """Take the commands waiting (waiting a little for one when `block`); False once told to stop."""
        while True:
            try:
                item = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
            except queue.Empty:
                return True
            block = False
            if item is None:
                return False
            command, key = item[0], item[1]
            if command == "abort":
                self._end_all(503, item[1])  # ("abort", message)
            elif command == "add":
                _, key, prompt, config = item
                try:
                    request = self.batch.add(prompt, config)
                except Exception as err:  # any error (what this one request asked for)
                    if not isinstance(err, ValueError):
                        log.error("a request could not join the batch", exc_info=err)
                    self.emit(("end", key, 400 if isinstance(err, ValueError) else 500, str(err)))
                    continue
                self.ids[key], self.keys[request] = request, key
                self.emit(("accepted", key, time.perf_counter()))
            elif command == "cancel" and key in self.ids:
                request = self.ids.pop(key)
                del self.keys[request]
                self.batch.cancel(request)
                self.emit(("cancelled", key))


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
        device = next(model.parameters()).device
        self.in_process = engine_process(config, device)
        if self.in_process:
            self.engine: EngineProcess | None = EngineProcess(model, tokenizer, config, self.handle)
            self.loop: BatchLoop | None = None
            self.info = self.engine.info
        else:
            self.engine = None
            self.inbox: queue.Queue = queue.Queue()
            decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
            self.loop = BatchLoop(model, decode, config, self.inbox, self.handle)
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


# --------------------------------------------------------------------------------------------------
# The engine process


def engine_process(config: ServeConfig, device: torch.device) -> bool:
    """Whether the batch runs in a process of its own (`config.engine_process`; off by default: measured on a
    2-core CPU it did not pay, docs/serving.md). Only a CPU model's batch does."""
    if config.engine_process and device.type != "cpu":
        raise ValueError(f"engine_process: only a CPU model's batch runs in a process of its own, not {device}'s")
    return config.engine_process


class EngineProcess:
    """The batch in a child process (multiprocessing's spawn; the model's weights passed in shared memory, not
    copied): commands go to it through one queue, its `BatchLoop`'s messages come back through another to a
    reader thread here, which hands them to `handle`. A child that dies ends the requests in flight (500)
    and is replaced by a new one."""

    def __init__(self, model: RecurrentDepthLM, tokenizer: Tokenizer, config: ServeConfig, handle) -> None:
        self.model, self.tokenizer, self.config, self.handle = model, tokenizer, config, handle
        self.context = mp.get_context("spawn")
        self.threads = torch.get_num_threads()
        self.stopping = False
        self.lock = threading.Lock()
        self.backlog: list | None = None  # commands given while a new child starts (None: none is starting)
        self.info = self._spawn()
        self.reader = threading.Thread(target=self._read, name="rdlm-engine-reader", daemon=True)

    def _spawn(self) -> BatchInfo:
        """A new child; returns once its batch is built (and its step compiled)."""
        self.inbox: Any = self.context.Queue()  # (a _Refuse once no child can start)
        self.outbox = self.context.Queue()
        self.process = self.context.Process(
            target=_engine_main,
            args=(self.model, self.tokenizer, self.config, self.threads, self.inbox, self.outbox),
            name="rdlm-engine",
            daemon=True,
        )
        self.process.start()
        while True:
            try:
                message = self.outbox.get(timeout=0.5)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(
                        f"the engine process died while starting (exit code {self.process.exitcode})"
                    ) from None
                continue
            if message[0] == "ready":
                return message[1]
            if message[0] == "failed":  # ("failed", the error's type is a ValueError, its message)
                self.process.join(timeout=30)
                raise (ValueError if message[1] else RuntimeError)(message[2])

    def start(self) -> None:
        self.reader.start()

    def put(self, item) -> None:
        with self.lock:
            if self.backlog is not None:
                self.backlog.append(item)
            else:
                self.inbox.put(item)

    def _read(self) -> None:
        while True:
            try:
                message = self.outbox.get(timeout=0.5)
            except queue.Empty:
                if self.process.is_alive():
                    continue
                if self.stopping:
                    return
                if not self._replace():
                    return
                continue
            except (EOFError, OSError):
                message = ("stopped",)
            if message[0] == "stopped":
                return
            self.handle(message)

    def _replace(self) -> bool:
        """The child died: its requests fail, a new child (with new queues: a dead process may leave one
        broken) takes the commands given since. False when none could start (every later request fails)."""
        log.error("the engine process died (exit code %s): starting a new one", self.process.exitcode)
        with self.lock:
            self.backlog = []
        self.handle(("died", self.process.exitcode))
        try:
            self.info = self._spawn()
        except (RuntimeError, ValueError):
            log.exception("the engine process could not be restarted")
            self.inbox, self.stopping = _Refuse(self.handle), True
            started = False
        else:
            started = True
        with self.lock:
            for item in self.backlog:  # (refused, where no child started)
                self.inbox.put(item)
            self.backlog = None
        return started

    def stop(self) -> None:
        self.stopping = True
        self.put(None)
        self.reader.join(timeout=30)
        self.process.join(timeout=30)
        if self.process.is_alive():  # (it ignores SIGTERM: the parent's to handle)
            self.process.kill()
            self.process.join(timeout=5)


class _Refuse:
    """The inbox once no engine process can run: each request added fails at once."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def put(self, item) -> None:
        if item is not None and item[0] == "add":
            self.handle(("end", item[1], 500, "the engine process could not be restarted"))


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is not None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)


def _engine_main(model, tokenizer, config, threads, inbox, outbox) -> None:
    """The engine process: its batch's loop, until told to stop."""
    # The server's signals are the parent's to handle (a terminal's Ctrl-C, or systemd's SIGTERM, reach the whole
    # group): the parent ends the requests in flight, then tells the child to stop. A parent that dies ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, name="rdlm-exit-with-parent", daemon=True).start()
    torch.set_num_threads(threads)
    if not logging.getLogger("rdlm").handlers:  # its errors on stderr, as the server's own
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("rdlm serve: %(levelname)s: %(message)s"))
        logging.getLogger("rdlm").addHandler(handler)
    try:
        loop = BatchLoop(model, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), config, inbox, outbox.put)
    except Exception as err:  # any error building the batch: the parent raises it
        log.exception("the engine process could not build its batch")
        bad_value = isinstance(err, ValueError)  # a setting the batch refuses: the parent's ValueError too
        outbox.put(("failed", bad_value, str(err) if bad_value else f"the engine process could not start: {err!r}"))
        return
    outbox.put(("ready", loop.info()))
    loop.run()
    outbox.put(("stopped",))
