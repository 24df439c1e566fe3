"""The training loop: randomized recurrence with truncated backpropagation (paper section 3.3,
docs/architecture.md#truncated-backprop).

    for step in steps:
        for each micro-batch m:
            (n, k) = draw_for_microbatch(seed, step * accumulation + m)   # same r on every worker
            loss   = CE(model(x, num_steps=(n, k)))                       # n steps no graph, k with
            backward                                                       # grads only through last k
        clip gradients at 1; AdamW step; EMA update; log; evaluate; checkpoint

Nothing in a step waits for the GPU: the loss, gradient norm and "was this step finite" stay on the
device (a non-finite step is skipped there, by the fused optimizer and the EMA) and are read back at
log, evaluation and checkpoint steps only. `--log-every 10` therefore lets the host run ahead.

Everything random is a pure function of (seed, step): r, the initial states s_0 (one generator per
row, keyed by its global position) and the data order. A resumed run, or the same global batch split
over several workers, therefore reproduces the same computation.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rdlm.data.shards import Batch, Batches, fixed_batches
from rdlm.fileio import new_dirs_removed_on_failure
from rdlm.model.config import ConfigError
from rdlm.model.flops import flops_per_token
from rdlm.model.lm import RecurrentDepthLM
from rdlm.model.lora import loaded_adapters
from rdlm.model.recurrence import draw_for_microbatch, microbatch_seed
from rdlm.resources import default_threads
from rdlm.train.build import (
    check_compatible,
    check_step_fits,
    data_sources,
    parallelize,
    prepare_lora,
    resolve_model,
    resolve_tokenizer,
    training_strategy,
)
from rdlm.train.config import EvalHook, StepHook, TrainConfig, TrainResult
from rdlm.train.distributed import (
    all_reduce_sum,
    barrier,
    init_single_process_group,
    setup,
    teardown_group,
)
from rdlm.train.monitor import Monitor, collapse_signatures, evaluate, peak_flops, warn_loudly
from rdlm.train.optim import EMA, clip_gradients
from rdlm.train.resume import RunCheckpoints, TrainingError
from rdlm.train.rundir import RunLock, check_run_dir, prepare_run_dir
from rdlm.train.schedule import RecurrenceCurriculum, Schedule

# --------------------------------------------------------------------------------------------------
# The trainer


class Trainer(RunCheckpoints):
    def __init__(
        self,
        config: TrainConfig,
        model: RecurrentDepthLM | None = None,
        train_data: Any = None,
        val_data: Any = None,
        tokenizer=None,
        eval_hooks: Sequence[EvalHook] = (),
        step_hooks: Sequence[StepHook] = (),
    ) -> None:
        self.config = config
        try:
            self.world, self.device = setup(config.device)
        except ValueError as err:
            raise ConfigError(f"--device: {err}") from err
        # One writer per run directory, for the whole run (released by `close`, or by the kernel).
        self.lock = None
        made: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if config.out_dir is not None and self.world.is_main:
            check_run_dir(config.out_dir, config.resume, config.overwrite)  # before the lock: nothing written
            made = new_dirs_removed_on_failure(config.out_dir)  # a refused run leaves no directory behind
        with made:
            if config.out_dir is not None and self.world.is_main:
                self.lock = RunLock(config.out_dir)
            try:
                self._build(config, model, train_data, val_data, tokenizer, eval_hooks, step_hooks)
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        """Release the run directory."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _build(self, config, model, train_data, val_data, tokenizer, eval_hooks, step_hooks) -> None:
        torch.manual_seed(config.seed)
        model_dir = None
        # What a lora run's adapter records as its base: the weights' own directory where there is one (a run
        # or checkpoint trains its raw weights, not the EMA that `--model RUN` would load), else the name.
        self.base_source = config.model
        if model is None:
            base_dtype = torch.bfloat16 if config.lora and config.lora_base_dtype == "bf16" else torch.float32
            model, model_dir = resolve_model(config.model, config.model_overrides, base_dtype, frozen=config.lora)
            self.base_source = str(getattr(model, "source", None) or config.model)
        elif config.model_overrides:
            raise ConfigError("model_overrides apply to TrainConfig.model; pass a model built as you want it")
        self.tokenizer = tokenizer if tokenizer is not None else resolve_tokenizer(config, model_dir)

        # Data, checked before anything is trained.
        self.train_source, self.val_source = data_sources(config, self.tokenizer, train_data, val_data)
        sources = {"training": self.train_source}
        if self.val_source is not None:
            sources["validation"] = self.val_source
        check_compatible(model, sources, self.tokenizer)

        self.strategy = training_strategy(config, self.world, config.lora or bool(loaded_adapters(model)))
        self.own_group = self.strategy == "fsdp" and init_single_process_group(self.device)
        # With CPU offload FSDP moves each shard to the host itself; the whole model never sits on the GPU.
        self.model = model.to("cpu" if config.cpu_offload else self.device).train()
        if config.lora:  # quantized on the device it trains on (rdlm.model.quantize's kernels are per device)
            self.model = prepare_lora(self.model, config)
        # A run trains adapters when its model has them (lora, or a model given with adapters added)
        self.lora = bool(loaded_adapters(self.model))
        self.names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        c = self.model.config
        self._set_recurrence(config)

        bf16 = config.precision == "bf16" or (
            config.precision == "auto" and self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        )
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16)
        self.precision = "bf16" if bf16 else "fp32"
        check_step_fits(
            c,
            config,
            self.device,
            self.train_source.row_length - 1,
            self.mean_recurrence,
            self.backprop_depth,
            2 if bf16 else 4,
        )
        self.optimizer, self.ddp = parallelize(self.model, config, self.strategy, self.device, self.world, bf16)
        self.ema = EMA(self.model, config.ema_decay) if config.ema_decay else None
        self.schedule = Schedule(
            config.lr, config.warmup_steps, config.steps, config.cooldown_steps, config.min_lr_ratio
        )
        self.batches = Batches(
            self.train_source,
            config.micro_batch_size,
            config.accumulation,
            self.world.size,
            seed=config.seed,
            shuffle=config.shuffle,
        )
        self.val_batches = (
            fixed_batches(self.val_source, config.eval_batch_size, config.eval_rows)
            if self.val_source is not None
            else []
        )
        self._check_rows(config, train_data is None and val_data is None and not eval_hooks)
        self.eval_hooks, self.step_hooks = list(eval_hooks), list(step_hooks)

        self.step = 0
        self.losses: list[float] = []
        self.drawn: list[list[int]] = []
        self.evals: list[dict[str, float]] = []
        self.bad_steps = 0
        self.consecutive_bad = 0
        self.last_checkpoint: Path | None = None
        self.last_finite_checkpoint: Path | None = None  # the newest one whose weights are all finite
        self.stop_signal: int | None = None  # set by SIGTERM/SIGINT during `fit`
        self.stopping = False  # some worker got one: every worker stops after this step
        if self.lock is not None:
            prepare_run_dir(config.out_dir, config.resume, config.overwrite)
        barrier(self.world)
        if config.resume:
            self._resume()
        self.peak = peak_flops(self.device, config.peak_flops)

    def _check_rows(self, config: TrainConfig, from_files: bool) -> None:
        """Refuse a micro-batch larger than the data (it would hold rows twice); say once when a global batch
        repeats rows, and when data read from files has no validation split (no evaluation, ever)."""
        rows, micro = len(self.train_source), config.micro_batch_size
        if micro > rows:
            raise ConfigError(
                f"--micro-batch-size {micro} exceeds the {rows} training rows: every micro-batch "
                f"would hold the same rows more than once; give at most {rows}, or more data"
            )
        if not self.world.is_main:
            return
        if self.batches.global_batch_size > rows:
            print(
                f"rdlm train: warning: a global batch of {self.batches.global_batch_size} rows (micro-batch x "
                f"accumulation x workers) exceeds the {rows} training rows: every step trains on some rows "
                "twice",
                file=sys.stderr,
            )
        if from_files and self.val_source is None:
            where = (
                f"{config.data} has no validation rows (prepare it with more documents or a larger --val-fraction)"
                if config.data
                else "prompt/response data has no validation split"
            )
            print(f"rdlm train: note: {where}; this run will not evaluate", file=sys.stderr)

    def _set_recurrence(self, config) -> None:
        """How r is drawn in training: the run's settings over the model config's, Ouro's exit loss at a
        fixed r, and the curriculum."""
        c = self.model.config
        self.mean_recurrence = c.mean_recurrence if config.mean_recurrence is None else config.mean_recurrence
        self.backprop_depth = c.backprop_depth if config.backprop_depth is None else config.backprop_depth
        self.sampler = c.recurrence_sampler if config.recurrence_sampler is None else config.recurrence_sampler
        self.sigma = c.recurrence_sigma if config.recurrence_sigma is None else config.recurrence_sigma
        if config.exit_loss_beta is not None:  # Ouro's objective: every iteration read out, all with gradient
            if not c.exit_gate:
                raise TrainingError(
                    "exit_loss_beta needs a model with a learned exit gate (model config "
                    "exit_gate: an Ouro checkpoint, or --set exit_gate=true)"
                )
            self.backprop_depth = max(self.backprop_depth, self.mean_recurrence)
            if self.sampler != "fixed":
                print(
                    f"rdlm train: exit_loss_beta trains at a fixed r = {self.mean_recurrence} (the sampler "
                    f"{self.sampler!r} is not used)",
                    file=sys.stderr,
                )
                self.sampler = "fixed"
        self.curriculum = (
            None
            if config.curriculum is None
            else RecurrenceCurriculum(
                self.mean_recurrence,
                config.steps,
                config.curriculum,
                config.curriculum_start,
                config.curriculum_fraction,
            )
        )
        if self.mean_recurrence < 1 or self.backprop_depth < 1:
            raise ConfigError("mean_recurrence and backprop_depth must be >= 1")

    # ---------------------------------------------------------------------------------------------

    def _to_device(self, tensor: Tensor) -> Tensor:
        """Host to GPU without waiting: through pinned memory, asynchronously."""
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)

    def _initial_state(self, batch: Batch, step: int, micro: int) -> Tensor | None:
        """s_0 row by row, each from a generator keyed by the row's global position in the run.

        This makes s_0 independent of how the global batch is split across workers and of resumes.
        The draws happen on the training device: on a GPU, drawing them on the host took longer than a
        short step's GPU work (and a GPU's draws differ from a CPU's; each device type is reproducible).
        """
        c = self.model.config
        if not c.takes_initial_state:
            return None  # s_0 = e, made by the model
        positions = self.batches.positions(step, micro, self.world.rank)
        rows = []
        template = torch.empty(1, batch.input_ids.shape[1], c.hidden_size, device=self.device)
        for pos in positions:
            g = torch.Generator(self.device).manual_seed(microbatch_seed(self.config.seed, int(pos), stream=1))
            rows.append(self.model.init_state(template, 1.0, g))
        return torch.cat(rows)

    def _evaluate(self, monitor: Monitor) -> dict[str, float]:
        record: dict[str, Any] = {"kind": "eval", "step": self.step}
        if self.val_batches:
            record.update(
                evaluate(
                    self.model,
                    self.val_batches,
                    self.config.eval_num_steps,
                    seed=self.config.seed,
                    autocast=self.autocast,
                    device=self.device,
                )
            )
        for hook in self.eval_hooks:
            record.update(hook(self.model, self.step))
        if self.world.is_main and self.val_batches:
            # "Ignores the state" is only meaningful once training has moved the model.
            steps = self.config.eval_num_steps if self.step > self.config.warmup_steps else ()
            for message in collapse_signatures(record, steps, self.config.collapse_correlation):
                warn_loudly(f"step {self.step}: {message}")
        self.evals.append(record)
        monitor.log(record)
        for hook in self.step_hooks:
            hook(record)
        return record

    # ---------------------------------------------------------------------------------------------

    def train_step(self) -> dict[str, Any]:
        """One optimizer step, launched without waiting for the device. The record's loss, grad_norm
        and finite are device tensors until `settle` reads them back."""
        cfg, step = self.config, self.step
        lr = self.schedule(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # (the Muon group keeps its own peak)
        micro_batches = [self.batches.get(step, m, self.world.rank) for m in range(cfg.accumulation)]
        # Normalize by the global number of targets so that any split of the batch gives the same gradient.
        # (Counted on the host: a CPU collective, the device is not waited for.)
        # The stop request rides along, so every worker stops after the same step.
        targets = torch.tensor([float(sum(b.num_targets for b in micro_batches)), float(self.stop_signal is not None)])
        targets = all_reduce_sum(targets, self.world)
        total_targets = targets[0].item()
        self.stopping = targets[1].item() > 0
        scale = self.world.size / max(total_targets, 1.0)  # DDP and FSDP average over workers: undo that

        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        drawn = []
        tokens = 0
        flops = 0.0
        network = self.ddp if self.ddp is not None else self.model
        mean = self.mean_recurrence if self.curriculum is None else self.curriculum(step)
        for m, batch in enumerate(micro_batches):
            index = step * cfg.accumulation + m
            no_grad, with_grad = draw_for_microbatch(
                cfg.seed, index, mean, self.backprop_depth, self.sampler, self.sigma
            )
            drawn.append(no_grad + with_grad)
            ids, labels = self._to_device(batch.input_ids), self._to_device(batch.labels)
            s0 = self._initial_state(batch, step, m)
            sync = self.ddp is None or m == cfg.accumulation - 1
            context = self.ddp.no_sync() if not sync else contextlib.nullcontext()
            with context:
                with self.autocast:
                    # The summed loss, without materializing the logits (rdlm.model.loss).
                    loss = network(
                        ids,
                        num_steps=(no_grad, with_grad),
                        initial_state=s0,
                        labels=labels,
                        return_logits=False,
                        loss_reduction="sum",
                        exit_loss_beta=cfg.exit_loss_beta,
                    ).loss
                (loss * scale).backward()
            loss_sum += loss.detach().double()
            tokens += ids.numel()
            flops += ids.numel() * flops_per_token(self.model, ids.shape[1], no_grad, with_grad)

        grad_norm = clip_gradients(self.model.parameters(), cfg.grad_clip)
        loss_sum = all_reduce_sum(loss_sum, self.world)
        finite = torch.isfinite(loss_sum) & torch.isfinite(grad_norm.to(loss_sum.device))
        # A non-finite step changes nothing; decided on the device (no host sync), counted at `settle`.
        self.optimizer.step(found_inf=~finite)  # type: ignore[call-overload]  # rdlm's optimizers take found_inf (ZeRO passes it on)
        if self.ema is not None:
            self.ema.update(finite)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.drawn.append(drawn)
        return {
            "kind": "train",
            "step": self.step,
            "loss": loss_sum,
            "lr": lr,
            "grad_norm": grad_norm,
            "finite": finite,
            "total_targets": total_targets,
            "num_steps": drawn[0] if len(drawn) == 1 else drawn,
            "mean_recurrence": mean,
            "tokens": tokens * self.world.size,
            "flops": flops * self.world.size,
        }

    def settle(self, pending: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Read launched steps' numbers back from the device (the host waits here), record them, and
        apply the non-finite-step policy. Returns the records with plain numbers."""
        done = []
        for record in pending:
            loss_sum, grad_norm = record.pop("loss").item(), record.pop("grad_norm").item()
            record.pop("finite")
            mean_loss = loss_sum / max(record.pop("total_targets"), 1.0)
            finite = math.isfinite(mean_loss) and math.isfinite(grad_norm)
            record.update(loss=mean_loss, grad_norm=grad_norm, skipped=not finite)
            self.losses.append(mean_loss if finite else float("nan"))
            if finite:
                self.consecutive_bad = 0
            else:
                self.bad_steps += 1
                self.consecutive_bad += 1
                print(
                    f"rdlm train: step {record['step']}: non-finite loss or gradient, step skipped "
                    f"({self.consecutive_bad} in a row, {self.bad_steps} in all)",
                    flush=True,
                )
                if self.consecutive_bad >= self.config.max_bad_steps:
                    good = self.last_finite_checkpoint
                    kept = f"; the last checkpoint with finite weights is {good}" if good else ""
                    raise TrainingError(
                        f"{self.consecutive_bad} non-finite losses in a row at step {record['step']}: stopping{kept}"
                    )
            done.append(record)
        return done

    def fit(self) -> TrainResult:
        cfg = self.config
        monitor = Monitor(cfg.out_dir, cfg.steps, self.step, cfg.tensorboard, cfg.progress, enabled=self.world.is_main)
        start = time.perf_counter()
        threads = torch.get_num_threads()
        if self.device.type == "cpu":
            torch.set_num_threads(
                cfg.threads if cfg.threads is not None else default_threads(self.model.num_parameters())
            )
        pending: list[dict[str, Any]] = []
        # A resumed run that had already finished: its last checkpoint and evaluation stand as they are.
        finished = self.step >= cfg.steps and self.last_checkpoint is not None
        if finished and self.world.is_main:
            print(
                f"rdlm train: the run in {cfg.out_dir} already finished at step {self.step}; nothing to do",
                file=sys.stderr,
                flush=True,
            )
        previous = self._catch_signals()
        try:
            interval_start = time.perf_counter()
            while self.step < cfg.steps:
                pending.append(self.train_step())
                monitor.advance()
                log = self.step % cfg.log_every == 0 or self.step == cfg.steps or self.stopping
                do_eval = cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps
                do_save = cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step < cfg.steps
                if self.stopping:  # SIGTERM/SIGINT: save this step and leave
                    do_eval, do_save = False, self.step < cfg.steps
                if not (log or do_eval or do_save):
                    continue
                records = self.settle(pending)
                pending = []
                seconds = time.perf_counter() - interval_start  # throughput over the whole interval
                interval_start = time.perf_counter()
                tokens, flops = sum(r["tokens"] for r in records), sum(r.pop("flops") for r in records)
                record = records[-1]
                record["flops"] = flops  # training FLOPs since the previous record (as the trainer counts them)
                record["tokens_per_s"] = tokens / seconds
                record["flops_per_s"] = flops / seconds
                if self.peak:
                    record["mfu"] = record["flops_per_s"] / (self.peak * self.world.size)
                if log:
                    monitor.log(record)
                    for hook in self.step_hooks:
                        hook(record)
                if do_eval:
                    self._evaluate(monitor)
                if do_save:
                    self._save()
                if do_eval or do_save:
                    interval_start = time.perf_counter()  # throughput counts training only
                if self.stopping:
                    break
            if not finished and not self.stopping:
                if self.val_batches or self.eval_hooks:
                    self._evaluate(monitor)
                self._save()
            if self.stopping and self.world.is_main:
                name = signal.Signals(self.stop_signal).name if self.stop_signal else "a signal on another worker"
                where = f"; checkpoint {self.last_checkpoint} (resume with --resume)" if self.last_checkpoint else ""
                print(f"rdlm train: stopped by {name} after step {self.step}{where}", file=sys.stderr, flush=True)
            if self.last_checkpoint is not None and self.last_finite_checkpoint != self.last_checkpoint:
                good = self.last_finite_checkpoint
                raise TrainingError(
                    f"the weights are not finite at step {self.step} (the run diverged); "
                    + (
                        f"the last checkpoint with finite weights is {good}"
                        if good
                        else "no checkpoint has finite weights"
                    )
                )
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
            monitor.close()
            torch.set_num_threads(threads)
        # (a lora run's EMA is its checkpoints' ema-adapter/; the model holds no second copy of the base)
        ema_model = self._ema_model() if self.ema and not self.lora else None
        return TrainResult(
            model=self.model,
            losses=self.losses,
            num_steps=self.drawn,
            evals=self.evals,
            bad_steps=self.bad_steps,
            checkpoint=self.last_checkpoint,
            ema_model=ema_model,
            steps_done=self.step,
            seconds=time.perf_counter() - start,
            stopped_by=self.stop_signal,
        )

    def _catch_signals(self) -> dict[int, Any]:
        """SIGTERM (what schedulers send before a kill) and SIGINT finish the current step, save a
        checkpoint and return; a second signal interrupts at once."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(number, frame):
            if self.stop_signal is not None:
                raise KeyboardInterrupt
            self.stop_signal = number
            if self.world.is_main:
                print(
                    f"\nrdlm train: {signal.Signals(number).name}: finishing step {self.step + 1}, then saving "
                    "a checkpoint (send it again to stop at once)",
                    file=sys.stderr,
                    flush=True,
                )

        return {number: signal.signal(number, handler) for number in (signal.SIGTERM, signal.SIGINT)}


def train(
    config: TrainConfig,
    model: RecurrentDepthLM | None = None,
    train_data: Any = None,
    val_data: Any = None,
    tokenizer=None,
    eval_hooks: Sequence[EvalHook] = (),
    step_hooks: Sequence[StepHook] = (),
) -> TrainResult:
    """Train a recurrent-depth model; see TrainConfig. Returns the model and the loss history.

    model: an existing RecurrentDepthLM (trained in place), else built/loaded from `config.model`.
    train_data / val_data: a RowSource (MemoryRows, TokenShards) or a [rows, length] tensor of ids;
        else read from `config.data` / `config.prompt_response`.
    eval_hooks: callables (model, step) -> {metric: value}, run at each evaluation.
    step_hooks: callables receiving every log record (training steps and evaluations).
    """
    trainer = Trainer(config, model, train_data, val_data, tokenizer, eval_hooks, step_hooks)
    try:
        return trainer.fit()
    finally:
        trainer.close()
        if os.environ.get("WORLD_SIZE", "1") != "1" or trainer.own_group:
            teardown_group()
