"""The batch's side of `rdlm serve` (rdlm.inference.server.worker): `BatchLoop` runs one `ContinuousBatch`
(rdlm.inference.batching), the only place that touches the model, in the server's worker thread or in a process
of its own (`EngineProcess`, `ServeConfig.engine_process`), and reports what happens to each request as
messages."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

from rdlm.data.tokenizer import Tokenizer
from rdlm.inference.batching import ContinuousBatch
from rdlm.inference.execution.cpu_compile import cpu_compiled, one_thread_step, server_compiles
from rdlm.inference.server.config import ServeConfig
from rdlm.model.lm import RecurrentDepthLM
from rdlm.model.lora import loaded_adapters
from rdlm.resources import available_cpus

log = logging.getLogger("rdlm.serve")


@dataclass(frozen=True)
class BatchInfo:
    """What the server says about its batch at start (`rdlm serve`'s banner), wherever the batch runs."""

    device: str
    cache_bytes: int  # the KV cache's size
    static: bool  # the batch's static core step
    compiled: bool  # ... compiled (the CPU's step)
    compile_seconds: float  # spent compiling it before the first request
    cpu: int | None = None  # the one CPU the engine process runs on (None: no pin)
    prompt_threads: tuple[int, int] | None = None  # ContinuousBatch.prompt_threads
    prompt_cpus: frozenset[int] | None = None  # where those calls run (None: the process's own CPUs)


class BatchLoop:
    """The batch's side of the server: owns one `ContinuousBatch` and runs it, in the worker thread or in the
    engine process. Commands come from `inbox` (`get(timeout=...)`, `get_nowait()`: a `queue.Queue` or a
    multiprocessing queue): ("add", key, prompt, config), ("cancel", key), ("abort", message), or None to stop.
    What happens to a request goes to `emit` as a message about its key (the parent's ticket):
    ("accepted", key, when), ("end", key, status, message) (refused, failed or ended by the server; nothing
    more comes for it), ("cancelled", key), ("events", [(key, BatchEvent), ...], step seconds, phase
    timings) and ("gauges", queued, running)."""

    def __init__(self, model: RecurrentDepthLM, tokenizer: Tokenizer, config: ServeConfig, inbox, emit) -> None:
        self.model, self.config, self.inbox, self.emit = model, config, inbox, emit
        self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # (stop strings)
        self.prompt_cpus: set[int] | None = None  # ContinuousBatch.prompt_cpus, set where the process is pinned
        self.batch = self._new_batch()
        self.cpu: int | None = None  # the CPU the engine process is pinned to (pin_to_one_cpu)
        self.keys: dict[int, int] = {}  # the batch's request id -> the parent's key
        self.ids: dict[int, int] = {}  # key -> request id

    def _new_batch(self) -> ContinuousBatch:
        c = self.config
        compile = batch_compiles(c, self.model)
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
        batch.prompt_cpus = self.prompt_cpus
        self.compile_seconds = batch.warm_up()  # the CPU's compiled step: compiled before the first request
        if self.compile_seconds:
            log.info("compiled the decode step in %.1f s", self.compile_seconds)
        return batch

    def info(self) -> BatchInfo:
        b = self.batch
        cpus = None if b.prompt_cpus is None else frozenset(b.prompt_cpus)
        return BatchInfo(
            str(b.device), b.cache_bytes, b.static, b.compiled, self.compile_seconds, self.cpu, b.prompt_threads, cpus
        )

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


# --------------------------------------------------------------------------------------------------
# The engine process


def batch_compiles(config: ServeConfig, model: RecurrentDepthLM) -> bool | None:
    """The server's `compile` for its batch: `config.compile`, by default on the CPU where it pays
    (rdlm.inference.execution.cpu_compile.server_compiles; None: the batch's own default, on with CUDA)."""
    if config.compile is None and next(model.parameters()).device.type == "cpu":
        return server_compiles(config.max_batch, adapters=bool(loaded_adapters(model)))
    return config.compile


def one_thread_steps(config: ServeConfig, model: RecurrentDepthLM) -> bool:
    """Whether the batch's steps will run on one thread (`one_thread_step`: compiled, few enough rows)."""
    device = next(model.parameters()).device
    return one_thread_step(config.max_batch, cpu_compiled(bool(batch_compiles(config, model)), device, model))


def engine_process(config: ServeConfig, model: RecurrentDepthLM) -> bool:
    """Whether the batch runs in a process of its own: `config.engine_process`, by default (None) where that was
    measured to pay: a CPU model whose steps run on one thread (`one_thread_steps`), on a machine with a CPU to
    spare for the HTTP server; the child then runs on one CPU of its own (docs/serving.md). Only a CPU model's batch
    may."""
    device = next(model.parameters()).device
    if config.engine_process is None:
        return device.type == "cpu" and one_thread_steps(config, model) and len(available_cpus()) > 1
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
                        f"the engine process died while starting (exit code {self.process.exitcode}; a script that "
                        "calls create_app needs `if __name__ == '__main__':` around it, since the process imports "
                        "the script's module; or ServeConfig(engine_process=False))"
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


def pin_to_one_cpu() -> int | None:
    """Run this process (the batch, whose steps run on one thread) on one CPU of its own, the last it may use, as
    vLLM binds its engine's thread: the HTTP server and the clients then keep to the others rather than
    interrupting it (docs/serving.md, measured on two cores); the prompts' calls that measured faster on more
    threads widen to the others for their time (`ContinuousBatch.prompt_cpus`). None where it has only one CPU."""
    cpus = available_cpus()
    if len(cpus) < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    os.sched_setaffinity(0, {cpus[-1]})
    torch.set_num_threads(1)
    return cpus[-1]


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
        loop = BatchLoop(model, tokenizer, config, inbox, outbox.put)
        if one_thread_step(config.max_batch, loop.batch.compiled):
            cpus = set(available_cpus())
            loop.cpu = pin_to_one_cpu()
            if loop.cpu is not None:  # the prompts' calls that run on more threads run on every CPU it had
                loop.prompt_cpus = loop.batch.prompt_cpus = cpus
    except Exception as err:  # any error building the batch: the parent raises it
        log.exception("the engine process could not build its batch")
        bad_value = isinstance(err, ValueError)  # a setting the batch refuses: the parent's ValueError too
        outbox.put(("failed", bad_value, str(err) if bad_value else f"the engine process could not start: {err!r}"))
        return
    outbox.put(("ready", loop.info()))
    loop.run()
    outbox.put(("stopped",))
