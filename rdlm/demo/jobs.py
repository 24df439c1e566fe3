"""Training and scoring the demo's models side by side.

Each model (recurrent, twin, depth-matched) is one job: train it through `rdlm.train`, then score it
(`rdlm.demo.scoring`; the recurrent model's adaptive exits too). With `workers` > 1 the jobs run in
spawned processes of one thread each, so the default demo keeps the cores of a small machine busy while
every number stays that of a one-thread run: a job's result depends on its seed, not on where or when it
ran (a test checks one worker against two). Each job reports its steps through a queue; the parent
prints them with an estimate of the time left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from rdlm.demo import tasks as T
from rdlm.demo.config import DemoConfig
from rdlm.demo.report import MODEL_LABELS
from rdlm.demo.scoring import accuracy_table, adaptive_exits
from rdlm.model.config import RDLMConfig
from rdlm.model.lm import RecurrentDepthLM
from rdlm.resources import ResidentPeak

REPORT_EVERY = 10  # training steps between two progress reports of a job
# The recurrent model's scoring (every r of the sweep on every split, the strict score, the exit sweep) as
# a share of its training time, measured on the default demo (seed 0: 54 s after 234 s).
SCORING_SHARE = 0.23


@dataclass
class Job:
    kind: str  # "recurrent", "twin", "depth_matched", or an experiment's model (rdlm.demo.experiments)
    config: RDLMConfig
    rs: tuple[int, ...]  # the r values it is scored at
    cost: float  # relative work, for the estimate of the time left (see `job_cost`)
    # An experiment's job may start from given weights, train on its own rows for its own number of steps
    # (0: score the start weights as they are) with further training settings (rdlm.train.TrainConfig
    # fields, over the demo's own), change the model before training (`prepare`, a module-level function
    # called as prepare(model): e.g. add LoRA adapters), and skip the adaptive exits or the strict score.
    # The defaults are the main demo's: a fresh model on the shared rows.
    start: dict[str, torch.Tensor] | None = None
    rows: Any = None
    steps: int | None = None
    train: dict[str, Any] = field(default_factory=dict)
    prepare: Callable[[RecurrentDepthLM], Any] | None = None
    exits: bool | None = None  # None: the recurrent model's
    strict: bool = True
    # More scoring after the accuracy table, in the job's process: a module-level function (it is pickled
    # by name) called as after(model, splits, tokenizer, cfg, table), whose result is JobResult.extra.
    after: Callable[..., Any] | None = None


@dataclass
class JobResult:
    kind: str
    state: dict[str, torch.Tensor]
    history: dict[str, Any]
    table: dict[str, Any]
    exits: dict[str, Any] | None = None
    exit_steps: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # "train" and "score"
    extra: Any = None

    def model(self, config: RDLMConfig) -> RecurrentDepthLM:
        model = RecurrentDepthLM(config)
        model.load_state_dict(self.state)
        return model.eval()


def job_cost(cfg: DemoConfig, config: RDLMConfig) -> float:
    """Layer passes per training token, forward and backward (backward ~ twice a forward), plus the
    scoring of the recurrent model (decoding at every r of the sweep, on every split)."""
    outer = config.prelude_layers + config.coda_layers
    if config.recurrence_sampler == "fixed":
        return cfg.steps * 3 * (outer + config.core_layers * config.mean_recurrence)
    mean_r = cfg.train_mean_r
    train = cfg.steps * (outer * 3 + config.core_layers * (mean_r + 2 * min(cfg.backprop_depth, mean_r)))
    return train * (1 + SCORING_SHARE)


# --------------------------------------------------------------------------------------------------


def train_model(
    cfg: DemoConfig,
    config: RDLMConfig,
    rows,
    label: str,
    on_step: Callable[[int], None] | None = None,
    progress: bool | None = None,
    start: dict[str, torch.Tensor] | None = None,
    prepare: Callable[[RecurrentDepthLM], Any] | None = None,
    **settings: Any,
) -> tuple[RecurrentDepthLM, dict]:
    """Train through rdlm.train (log-normal Poisson r, truncated backprop, Muon and AdamW or AdamW alone,
    clipping), on the rows in their order when they follow a curriculum: a fresh model, or one with the
    weights `start`, changed by `prepare(model)` before training (only the parameters that then require
    gradients train). `settings` are further TrainConfig fields (e.g. a curriculum on r), over the demo's.
    `on_step(step)` is called every `REPORT_EVERY` steps. The history records the trainable parameters, the
    training's CPU seconds and its peak resident memory above the start (`ResidentPeak`)."""
    from rdlm.train import TrainConfig, train

    progress = cfg.progress if progress is None else progress
    torch.manual_seed(cfg.seed)
    model = RecurrentDepthLM(config)
    if start is not None:
        model.load_state_dict(start)
    if prepare is not None:
        prepare(model)
    records: list[dict] = []

    def keep(record: dict) -> None:
        if record.get("kind") == "train":
            records.append(
                {
                    "step": record["step"],
                    "loss": record["loss"],
                    "num_steps": record["num_steps"],
                    "lr": record["lr"],
                    "flops": record["flops"],
                }
            )
            if on_step is not None and record["step"] % REPORT_EVERY == 0:
                on_step(record["step"])

    if progress:
        print(
            f"rdlm demo: training the {label} ({model.num_parameters() / 1e6:.2f}M parameters, "
            f"{cfg.steps} steps of {cfg.batch_size})",
            flush=True,
        )
    warmup, cooldown = min(cfg.warmup_steps, cfg.steps - 1), round(cfg.cooldown_fraction * cfg.steps)
    demo_settings: dict[str, Any] = dict(
        model=config.name,
        seed=cfg.seed,
        steps=cfg.steps,
        micro_batch_size=cfg.batch_size,
        shuffle=not cfg.ordered,
        lr=cfg.lr,
        optimizer=cfg.optimizer,
        muon_lr=cfg.muon_lr,
        warmup_steps=warmup,
        cooldown_steps=min(cooldown, cfg.steps - warmup),
        weight_decay=0.01,
        ema_decay=None,
        precision="fp32",
        device="cpu",
        threads=cfg.threads,
        progress=progress,
        tensorboard=False,
        out_dir=None,
    )
    tc = TrainConfig(**(demo_settings | settings))
    cpu_start = time.process_time()
    with ResidentPeak() as memory:
        result = train(tc, model=model, train_data=rows, step_hooks=[keep])
    if result.stopped_by is not None:
        # The trainer took SIGTERM/SIGINT as "save this step, then stop"; the demo saves no checkpoint, and a
        # model stopped early must not be scored and reported as if trained: the demo stops here.
        stop(result.stopped_by)
    return result.model.eval(), {
        "losses": [r["loss"] for r in records],
        "lr": [r["lr"] for r in records],
        "num_steps": [r["num_steps"] for r in records],
        "seconds": result.seconds,
        "flops": sum(r["flops"] for r in records),
        "flops_per_step": [r["flops"] for r in records],
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "cpu_seconds": round(time.process_time() - cpu_start, 1),
        "peak_memory_mib": memory.mib,
    }


def stop(number: int) -> NoReturn:
    """End the demo for the signal `number`, as the shell reports it: Ctrl-C is KeyboardInterrupt ("interrupted",
    130), SIGTERM an exit with 128 + 15."""
    if number == signal.SIGINT:
        raise KeyboardInterrupt
    if multiprocessing.parent_process() is None:  # the demo itself, not one of its workers
        print(
            f"rdlm demo: stopped by {signal.Signals(number).name}; the workers are stopped and no report is written",
            file=sys.stderr,
            flush=True,
        )
    raise SystemExit(128 + number)


@contextlib.contextmanager
def terminate_stops_the_demo() -> Iterator[None]:
    """SIGTERM (what a job scheduler, a service manager or `kill PID` sends) ends the demo as Ctrl-C does:
    the exception it raises here reaches `run_jobs`, which kills the workers rather than orphaning them.
    (Only the main thread can take a signal; elsewhere the workers still exit with their parent.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(number, frame):
        stop(number)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# In a worker process: the queue its jobs report into, and the data every job reads (given once, when the
# worker starts, so that a job's own message stays small).
_reports: Any = None
_data: tuple[Any, dict[str, list[T.Example]]] | None = None
PARENT_CHECK_SECONDS = 0.5  # how often a worker looks whether the demo that started it is still there


def _worker_init(reports, rows, splits, parent: int) -> None:
    global _reports, _data
    _reports, _data = reports, (rows, splits)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="exit-with-parent").start()


def _exit_with_parent(parent: int) -> None:
    """A worker never outlives the demo that started it, however that one ended (SIGKILL too): once its parent
    is gone (the worker is handed to another), it exits at once, mid-job."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_SECONDS)
    os._exit(1)


def _run_in_worker(cfg: DemoConfig, job: Job) -> JobResult:
    assert _data is not None  # set by the worker's initializer (_worker_init) before any job
    rows, splits = _data
    return run_job(cfg, job, rows, splits, progress=False)


def run_job(
    cfg: DemoConfig,
    job: Job,
    rows,
    splits: dict[str, list[T.Example]],
    progress: bool | None = None,
    on_step: Callable[[str, int], None] | None = None,
) -> JobResult:
    """Train one model and score it; with the recurrent model, also its adaptive exits."""
    torch.set_num_threads(cfg.threads)
    label = MODEL_LABELS.get(job.kind, job.kind)
    report = on_step or (lambda kind, step: _reports.put((kind, step)) if _reports is not None else None)
    start = time.perf_counter()
    if job.steps == 0:  # scored as it starts
        model, history = RecurrentDepthLM(job.config), dict[str, Any]()
        if job.start is not None:
            model.load_state_dict(job.start)
        if job.prepare is not None:
            job.prepare(model)
        model.eval()
    else:
        job_cfg = cfg if job.steps is None else dataclasses.replace(cfg, steps=job.steps)
        model, history = train_model(
            job_cfg,
            job.config,
            rows if job.rows is None else job.rows,
            label,
            lambda step: report(job.kind, step),
            progress,
            job.start,
            job.prepare,
            **job.train,
        )
    trained = time.perf_counter()
    report(job.kind, -1)  # scoring
    tokenizer = T.CharTokenizer()
    table = accuracy_table(model, splits, tokenizer, job.rs, cfg, label, progress=progress, strict=job.strict)
    result = JobResult(job.kind, model.state_dict(), history, table)
    if job.kind == "recurrent" if job.exits is None else job.exits:
        fixed = {name: table[name]["overall"][cfg.exit_max_steps] for name in ("validation", "test")}
        result.exits, result.exit_steps = adaptive_exits(model, splits, tokenizer, cfg, fixed)
    if job.after is not None:
        result.extra = job.after(model, splits, tokenizer, cfg, table)
    result.seconds = {"train": round(trained - start, 1), "score": round(time.perf_counter() - trained, 1)}
    return result


# --------------------------------------------------------------------------------------------------


class Progress:
    """Steps done per job and the time left, printed one line at a time (a line every `every` seconds,
    overwritten in place on a terminal); the estimate is `seconds_left`'s."""

    def __init__(self, cfg: DemoConfig, jobs: Sequence[Job], workers: int, every: float = 10.0) -> None:
        self.cfg, self.jobs, self.workers, self.every = cfg, {j.kind: j for j in jobs}, workers, every
        self.step = {j.kind: 0 for j in jobs}
        self.scoring: set[str] = set()
        self.done: set[str] = set()
        self.start = time.perf_counter()
        self.last = 0.0
        self.tty = cfg.progress and sys.stdout.isatty()

    def update(self, kind: str, step: int) -> None:
        if step < 0:
            self.scoring.add(kind)
        else:
            self.step[kind] = step

    def finish(self, kind: str) -> None:
        self.done.add(kind)

    def _steps(self, kind: str) -> int:
        return self.jobs[kind].steps or self.cfg.steps

    def _fraction(self, kind: str) -> float:
        """Of a job's work: training is the part before scoring (see `job_cost`)."""
        if kind in self.done:
            return 1.0
        train_part = 1 / (1 + SCORING_SHARE) if kind == "recurrent" else 1.0
        if kind in self.scoring:
            return train_part
        return train_part * self.step[kind] / self._steps(kind)

    def seconds_left(self) -> float | None:
        """The work left at the throughput so far (all processes together), and no sooner than the
        biggest job left can finish on one core. None until every running job has made some progress."""
        elapsed = time.perf_counter() - self.start
        started = sum(self._fraction(k) > 0 for k in self.jobs)
        if elapsed < 20 or started < min(self.workers, len(self.jobs)):
            return None
        throughput = sum(self._fraction(k) * j.cost for k, j in self.jobs.items()) / elapsed
        left = [(1 - self._fraction(k)) * j.cost for k, j in self.jobs.items()]
        running = max(1, min(self.workers, os.cpu_count() or 1, len(self.jobs) - len(self.done)))
        return max(sum(left), max(left) * running) / throughput

    def line(self) -> str:
        parts = []
        for kind in self.jobs:
            state = (
                "done"
                if kind in self.done
                else "scoring"
                if kind in self.scoring
                else f"{self.step[kind]}/{self._steps(kind)}"
            )
            parts.append(f"{kind.replace('_', '-')} {state}")
        left = self.seconds_left()
        eta = f", about {_duration(left)} left" if left is not None else ""
        return f"rdlm demo: {', '.join(parts)} ({_duration(time.perf_counter() - self.start)}{eta})"

    def show(self, force: bool = False) -> None:
        if not self.cfg.progress:
            return
        now = time.perf_counter()
        if not force and now - self.last < (1.0 if self.tty else self.every):
            return
        self.last = now
        print(("\r\033[K" if self.tty else "") + self.line(), end="" if self.tty else "\n", flush=True)

    def close(self) -> None:
        if self.cfg.progress:
            self.show(force=True)
            if self.tty:
                print(flush=True)


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


@contextlib.contextmanager
def _main_not_rerun():
    """A spawned worker re-runs the parent's `__main__` script (by its file or module name) before its
    job. A user's script that calls `run_demo` without an `if __name__ == "__main__":` guard would then
    start the demo again inside every worker, and fail. The jobs need nothing from `__main__`, so it is
    anonymous while the workers start."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved_spec, saved_file = getattr(main, "__spec__", None), main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__spec__ = saved_spec
        if saved_file is not None:
            main.__file__ = saved_file


def run_jobs(cfg: DemoConfig, jobs: Sequence[Job], rows, splits: dict[str, list[T.Example]]) -> dict[str, JobResult]:
    """Every job, in `cfg.processes` worker processes (in this process when 1), the longest first."""
    ordered = sorted(jobs, key=lambda j: -j.cost)
    workers = min(cfg.processes, len(ordered))
    progress = Progress(cfg, ordered, workers)
    results: dict[str, JobResult] = {}
    if workers <= 1:

        def on_step(kind: str, step: int) -> None:
            progress.update(kind, step)
            progress.show()

        for job in ordered:
            results[job.kind] = run_job(cfg, job, rows, splits, progress=False, on_step=on_step)
            progress.finish(job.kind)
        progress.close()
        return results
    context = multiprocessing.get_context("spawn")  # no fork of a process with OpenMP threads
    reports = context.Queue()
    with (
        terminate_stops_the_demo(),
        ProcessPoolExecutor(
            workers, mp_context=context, initializer=_worker_init, initargs=(reports, rows, splits, os.getpid())
        ) as pool,
    ):
        with _main_not_rerun():  # the workers start at the first submissions
            pending = {pool.submit(_run_in_worker, cfg, job): job.kind for job in ordered}
        try:
            while pending:
                finished, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                while True:
                    try:
                        progress.update(*reports.get_nowait())
                    except queue.Empty:
                        break
                for future in finished:
                    kind = pending.pop(future)
                    results[kind] = future.result()  # a worker's exception is raised here
                    progress.finish(kind)
                progress.show()
        except BaseException:
            # A failed job (or Ctrl-C, or SIGTERM) ends the demo now, not after the other models have trained
            # for minutes.
            for future in pending:
                future.cancel()
            for child in multiprocessing.active_children():
                child.kill()  # not SIGTERM: the trainer takes that as "save this step, then stop"
            raise
    progress.close()
    return results
