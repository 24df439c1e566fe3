"""Continuous batching at the granularity of iterations: the decode engine of `rdlm serve` and of
`rdlm.inference.generate`.

A fixed number of rows share one `RecurrentKVCache`; each request occupies one row from its prompt to
its last token. Every `ContinuousBatch.step()`:

1. admits waiting requests into free rows; their prompts start prefilling (rdlm.inference.runner.prefill:
   a chunk of each prompt runs its iterations inside the following steps, so the rows already decoding
   go on; a prompt's first new token is chosen when its last chunk is done). A step gives the prompts
   `prefill_chunk` token-iterations: a chunk of that many tokens runs one iteration per step, in the
   decoding rows' call; chunks of fewer tokens run proportionally more (the extra ones in calls of
   their own), so a short prompt is prefilled within a few steps and a long one never stalls the batch;
2. starts the next token on every row whose previous token is done (prelude, s_0);
3. runs **one** core iteration for every iterating row and every prompt chunk, in one model call,
   although the rows are at different tokens and iterations, with different r, exit criteria, cache
   budgets and sampling;
4. evaluates each row's exit criterion on the device (rdlm.inference.runner.row_exits): a row whose token is
   done (exit, or r iterations) is frozen there (state kept, no more core cache writes; eagerly on the CPU
   it leaves the core's calls at the next step). Every `exit_sync_every` iterations the host looks at the flags
   (at once when a row reaches its cap); the rows found done run the coda together once one of them has
   waited `coda_every` - 1 iterations, or half the rows wait, or no other row can be done before then, and
   choose their next token, which starts at the next step. A row that exits early goes on to its next
   token instead of idling behind the others: adaptive depth (paper section 6.1) turned into throughput.

How often to look and to run the coda is a trade: the coda and the head cost about as much for one row
as for many (on a CPU their weights are read once per call) and on a GPU a look is a host sync; every
few steps pays them once for many rows, and keeps rows that finish together in step (so their next
tokens can run in lockstep), at the cost of a done row waiting a few steps (`benchmarks/bench_serve.py`
measures it; `rdlm serve` looks every 4 iterations and lets a row wait up to 8). Neither changes a token.
With the static step, several iterations run in one call where nothing but the step itself decides between
them: rows at a fixed r, and rows whose exit criterion compares the latent states alone (latent-diff, cosine),
which the step reads itself (rdlm.inference.runner.row_exits), up to the next look.

When every request in a row starts its token at the same step with the same depth settings and nothing
waits to join (`generate`'s batch, or a server's rows that happen to go together), the token runs in
lockstep: all its core iterations in this step, then the coda (rdlm.inference.runner.lockstep).

With `compile=True` (the default on CUDA) step 3 is the static step: one fixed-shape call over every row
(per-row index, slot and writers on the device) that CUDA captures once as a graph (`StaticStep.run`,
rdlm.inference.runner.static_step; docs/inference.md); the prompt chunks in flight then run their iteration in a call
of their own.

A request in a busy batch gets the tokens of its prompt alone with the same `GenerationConfig`, however
its tokens are scheduled: the same s_0 table (seed, position), cache slots, exit decisions and sampler.

The work is split as vLLM v1 splits its engine (`ContinuousBatch.step`):

    plan = scheduler.schedule()            # rdlm.inference.scheduling.scheduler: who does what, as host data
    out = step_runner.execute(plan)        # rdlm.inference.runner.step_runner: every tensor and model call
    events = scheduler.update(plan, out)   # the chosen tokens and what the look found, into the requests
    done = scheduler.coda_due()            # the rows found done whose coda runs now (or None) ...
    events += scheduler.coda_ran(step_runner.coda(done))   # ... and the tokens it chose

The `Scheduler` holds the requests, their rows and the prompt chunks in flight as host numbers, and makes
every decision: admission, lockstep, which rows compute, when to look, when a coda is due, fused
iterations, the prompts' share, where a prompt ends, a request's cap, cancellations. The `StepRunner`
keeps what it needs to run each request in its rows (its prompt, parameters, generator and s_0 table) and
carries the plans out; the seam between them is rdlm.inference.scheduling.plan, plain data both ways.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from rdlm.checks import check_int
from rdlm.inference.events import BatchEvent, Engine
from rdlm.inference.execution.cpu_compile import cpu_compiled, one_thread_step, step_threads
from rdlm.inference.execution.graphs import PhaseTimes, resolve_compile, resolve_sync_every, sync
from rdlm.inference.params import Decode, GenerationConfig, check_request
from rdlm.inference.runner.parallel import check_parallel
from rdlm.inference.runner.step_runner import StepRunner
from rdlm.inference.scheduling.plan import EngineSettings
from rdlm.inference.scheduling.request import Request
from rdlm.inference.scheduling.scheduler import Scheduler
from rdlm.model.lm import RecurrentDepthLM


@dataclass(frozen=True)
class EngineArgs:
    """How the decode engine runs, set once per engine and apart from each request's parameters
    (`GenerationConfig`), as vLLM keeps its EngineArgs apart from SamplingParams. Neither changes a token in
    float32 (docs/generation.md says where bf16 near-ties can flip); both change speed.

    `compile`: the static decode step, captured as a CUDA graph (None: on with CUDA) or compiled by inductor
    on the CPU (None: where it pays, rdlm.inference.execution.cpu_compile); `exit_sync_every`: core iterations
    between the host's looks at the exit flags, the batch's steps and a lockstep token's iterations alike
    (None: 1 on the CPU, where a look waits for nothing, 4 on a GPU, where it drains the queued work)."""

    compile: bool | None = None
    exit_sync_every: int | None = None

    def __post_init__(self) -> None:
        if self.exit_sync_every is not None:
            check_int("exit_sync_every", self.exit_sync_every)
        if not (self.compile is None or isinstance(self.compile, bool)):
            raise ValueError(f"compile must be True, False or None, got {self.compile!r}")


class ContinuousBatch(Engine):
    """Requests in, tokens out, one core iteration at a time. Not thread-safe: one thread calls
    `add`, `cancel` and `step` (a server runs it in a worker thread and hands requests over).

        batch = ContinuousBatch(model, max_batch=8, max_length=512, num_slots=32)
        rid = batch.add([1, 2, 3], GenerationConfig(num_steps=16, max_new_tokens=8))
        while batch.busy:
            for event in batch.step(): ...
    """

    def __init__(
        self,
        model: RecurrentDepthLM,
        max_batch: int = 8,
        max_length: int | None = None,
        num_slots: int = 32,
        decode: Decode | None = None,
        exit_sync_every: int | None = None,
        prefill_chunk: int = 256,
        coda_every: int = 1,
        profile: bool = False,
        compile: bool | None = None,
    ) -> None:
        max_length = model.config.context_length if max_length is None else max_length
        self.model, self.decode = model.eval(), decode
        self.device = next(model.parameters()).device
        exit_sync_every = resolve_sync_every(exit_sync_every, self.device)  # (EngineArgs.exit_sync_every)
        for name, value in (
            ("max_batch", max_batch),
            ("max_length", max_length),
            ("num_slots", num_slots),
            ("exit_sync_every", exit_sync_every),
            ("prefill_chunk", prefill_chunk),
            ("coda_every", coda_every),
        ):
            check_int(name, value)
        # `compile` None: the static step on with CUDA, off on the CPU
        static = resolve_compile(compile, self.device)
        self.settings = EngineSettings(
            max_batch,
            max_length,
            num_slots,
            exit_sync_every,
            coda_every,
            prefill_chunk,
            static,
            rides_along=self.device.type != "cpu" or static,
            lockstep=not cpu_compiled(static, self.device, model),  # the compiled step runs every token
        )
        self.scheduler = Scheduler(self.settings, decode)  # who does what, when: no tensor
        self.phases = PhaseTimes(self.device, profile)  # with `profile`: seconds per phase of the steps
        self.step_runner = StepRunner(model, self.settings, self.phases)  # the rows' tensors and the model calls
        self.calls, self.cache = self.step_runner.calls, self.step_runner.cache
        self._compiled = self.step_runner.static_step.compiled is not None  # the CPU's compiled step
        self.cache_bytes = self.cache.nbytes
        self.ids = itertools.count()
        self.first_step: float | None = None  # time.perf_counter() at the first step
        self._captured = 0.0  # capture_seconds at the first step

    # ---- requests

    def add(self, prompt: list[int], config: GenerationConfig) -> int:
        """Queue a request; returns its id. Raises ValueError for what this batch cannot serve."""
        criterion = check_request(self.model, prompt, config, self.decode)
        if len(prompt) + config.max_new_tokens > self.settings.max_length:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({config.max_new_tokens}) "
                f"exceeds the context of {self.settings.max_length} tokens"
            )
        if config.sampler == "parallel":
            check_parallel(self.model, config, len(prompt))
        budget = config.core_slots
        if budget > self.settings.num_slots:
            raise ValueError(
                f"num_steps {config.max_steps} needs {budget} core cache slots and this batch "
                f"has {self.settings.num_slots}: use the shared cache (a KV-cache budget) of at most "
                f"{self.settings.num_slots} slots"
            )
        request = Request(next(self.ids), list(prompt), config, criterion, budget)
        self.scheduler.add(request)
        return request.id

    def cancel(self, request: int) -> None:
        """Drop a request (waiting or running); its row is freed at the next step."""
        self.scheduler.cancel(request)

    @property
    def active(self) -> list[Request]:
        return self.scheduler.active

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    @property
    def queued(self) -> int:
        return self.scheduler.queued

    @property
    def running(self) -> int:
        return self.scheduler.running

    @property
    def capture_seconds(self) -> float:
        return self.step_runner.capture_seconds

    @property
    def prompt_cpus(self) -> set[int] | None:
        """The CPUs the prompts' iteration runs its calls on more threads on (`CompiledPrompts.cpus`): a process
        pinned to one CPU for its one-thread steps widens to them for those calls; None: its own."""
        compiled = self.calls.compiled_prompts
        return None if compiled is None else compiled.cpus

    @prompt_cpus.setter
    def prompt_cpus(self, cpus: set[int] | None) -> None:
        if self.calls.compiled_prompts is not None:
            self.calls.compiled_prompts.cpus = cpus

    @property
    def prompt_threads(self) -> tuple[int, int] | None:
        """(threads, tokens): the prompts' calls of at least that many tokens run on that many threads, as
        `warm_up` measured (`CompiledPrompts.measure_threads`); None: on the step's own."""
        compiled = self.calls.compiled_prompts
        if compiled is None or compiled.wide_from is None:
            return None
        return compiled.threads, compiled.wide_from

    @property
    def static(self) -> bool:
        """Whether the rows' iterations run as the static step (EngineArgs.compile)."""
        return self.step_runner.static

    @property
    def compiled(self) -> bool:
        """Whether the static step is the CPU's compiled one (rdlm.inference.execution.cpu_compile)."""
        return self._compiled

    @property
    def drafted(self) -> int:
        return self.scheduler.drafted

    @property
    def accepted(self) -> int:
        return self.scheduler.accepted

    @property
    def core_passes(self) -> int:
        return self.step_runner.rounds.core_passes

    @property
    def wave_steps(self) -> int:
        return self.step_runner.rounds.wave_steps

    # ---- one step

    def step(self) -> list[BatchEvent]:
        """Run the next step (the module doc): the scheduler's plan, carried out by the step runner, its outcome
        taken by the scheduler; the tokens it chose. The first step that chooses tokens (or that leaves the
        batch idle) ends the prefill of `generate`'s batch (`prefill_seconds`, `decode_start`)."""
        if self.first_step is None:
            self.first_step, self._captured = time.perf_counter(), self.capture_seconds
        with torch.inference_mode(), step_threads(self.settings.max_batch, self._compiled):
            plan = self.scheduler.schedule()
            out = self.step_runner.execute(plan)
            events = self.scheduler.update(plan, out)
            done = self.scheduler.coda_due()
            if done:
                events += self.scheduler.coda_ran(self.step_runner.coda(done))
        if (events or not self.busy) and self.decode_start is None:  # (a prefill alone chooses no token)
            sync(self.device)
            self.decode_start, self.decode_capture = time.perf_counter(), self.capture_seconds
            self.prefill_seconds = self.decode_start - self.first_step - (self.decode_capture - self._captured)
        return events

    def warm_up(self) -> float:
        """Compile the decode step now rather than at the first request (the CPU's compiled step; a no-op
        elsewhere), and, while no request holds a row, the prompts' iteration, measuring which of its calls run on
        every thread where the step runs on one (`CompiledPrompts.measure_threads`; on `prompt_cpus`, where set);
        measure which GEMM the eager linear layers run (rdlm.inference.execution.cpu_linear); the seconds it
        took."""
        threads = torch.get_num_threads() if one_thread_step(self.settings.max_batch, self._compiled) else 1
        with torch.inference_mode(), step_threads(self.settings.max_batch, self._compiled):
            start = time.perf_counter()
            self.calls.linears.measure_all()
            seconds = time.perf_counter() - start + self.step_runner.static_step.warm_up()
            if not self.busy:
                seconds += self.step_runner.warm_up_prompts(threads)
            return seconds

    def take_failures(self) -> list[tuple[int, Exception]]:
        """The requests that failed since the last call, each with its error (their rows are free)."""
        failures, self.scheduler.failures = self.scheduler.failures, []
        return failures

    def take_timings(self) -> dict[str, float]:
        """The seconds per phase accumulated since the last call (empty without `profile`)."""
        return self.phases.take()
