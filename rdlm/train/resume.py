"""A run's checkpoints, from the trainer's side: what a checkpoint holds of the run (weights, EMA, optimizer,
the trainer's counters and history), saving it, and resuming from the newest intact one. The file
formats are rdlm.train.checkpoint's."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rdlm.model.config import ConfigError
from rdlm.model.lm import RecurrentDepthLM
from rdlm.train import checkpoint as ckpt
from rdlm.train.distributed import all_reduce_sum, barrier, full, local

if TYPE_CHECKING:
    from rdlm.data.shards import Batches
    from rdlm.train.config import TrainConfig
    from rdlm.train.distributed import World
    from rdlm.train.optim import EMA
    from rdlm.train.schedule import Schedule


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. too many non-finite losses in a row)."""


def recorded_config(out_dir: str | Path) -> tuple[dict[str, Any], Path] | None:
    """The TrainConfig fields the run in `out_dir` was trained with, and the checkpoint that records them
    (its newest whose trainer.json reads); None when it has no checkpoint yet."""
    import json

    for path in ckpt.list_checkpoints(out_dir)[::-1]:
        try:
            recorded = json.loads((path / ckpt.TRAINER_FILE).read_text()).get("train_config")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(recorded, dict):
            return recorded, path
    return None


class RunCheckpoints:
    """The checkpoint half of `Trainer` (rdlm.train.trainer), which sets every attribute used here."""

    # What this half reads and writes of the trainer's state (declared for the type checker; Trainer sets them).
    config: TrainConfig
    world: World
    strategy: str
    model: RecurrentDepthLM
    lora: bool  # the model trains LoRA adapters (rdlm.model.lora): checkpoints hold the adapter
    base_source: str  # the base a lora run's adapter records
    names: list[str]
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    ema: EMA | None
    schedule: Schedule
    batches: Batches
    step: int
    losses: list[float]
    drawn: list[list[int]]
    evals: list[dict[str, float]]
    bad_steps: int
    consecutive_bad: int
    last_checkpoint: Path | None
    last_finite_checkpoint: Path | None
    mean_recurrence: int
    backprop_depth: int
    sampler: str
    sigma: float

    def _resume(self) -> None:
        if self.config.out_dir is None:
            raise ConfigError("resume needs out_dir (where the checkpoints are)")
        candidates = ckpt.list_checkpoints(self.config.out_dir)[::-1]
        if not candidates:
            return  # nothing to resume: start from scratch (a first launch with --resume is fine)
        damaged = []
        for path in candidates:  # newest first; a damaged one gives way to the one before it
            try:
                point = self._load(path)
            except Exception as err:  # noqa: BLE001 - any failure to read it means "damaged"
                damaged.append(f"{path}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
                print(
                    f"rdlm train: checkpoint {path} cannot be resumed from ({damaged[-1]}); trying the previous one",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            if damaged:
                print(f"rdlm train: resuming from {path}, the newest intact checkpoint", file=sys.stderr, flush=True)
            break
        else:
            raise TrainingError(
                f"no checkpoint in {ckpt.checkpoint_dir(self.config.out_dir)} can be resumed from: {'; '.join(damaged)}"
            )
        state = point.trainer
        if state.get("global_batch_size") != self.batches.global_batch_size:
            raise ConfigError(
                f"checkpoint {path} was trained with a global batch of "
                f"{state.get('global_batch_size')} rows, this run has "
                f"{self.batches.global_batch_size}: the data position would not match"
                + self._batch_hint(state.get("global_batch_size"))
            )
        self.step = point.step
        if self.world.rank == 0:
            print(
                f"rdlm train: resumed from {path} at step {point.step} of {self.config.steps}",
                file=sys.stderr,
                flush=True,
            )
        self.losses = list(state.get("losses", []))
        self.drawn = [list(x) for x in state.get("num_steps", [])]
        self.evals = list(state.get("evals", []))
        self.bad_steps = int(state.get("bad_steps", 0))
        self.consecutive_bad = int(state.get("consecutive_bad", 0))
        self.last_checkpoint = path
        self.last_finite_checkpoint = ckpt.last_finite_checkpoint(self.config.out_dir, upto=path)

    def _load(self, path: Path) -> ckpt.Checkpoint:
        """Load checkpoint `path` into the model, EMA and optimizer."""
        if self.strategy == "fsdp":
            return ckpt.load_sharded_checkpoint(
                path, self.model, self.optimizer, self.ema.shadow if self.ema else None, self.names
            )
        if self.lora:
            point, optimizer_state, ema = ckpt.load_adapter_checkpoint(path, self.model, self.names)
            if self.ema is not None and ema is not None:
                self.ema.load([ema[name].float() for name in self.names])
            if optimizer_state is not None:
                self.optimizer.load_state_dict(optimizer_state)
            return point
        ema_model = self._ema_model() if self.ema else None
        point, optimizer_state = ckpt.load_checkpoint(path, self.model, ema_model, self.names)
        if self.ema is not None and ema_model is not None:
            self.ema.load([p.detach().float() for p in ema_model.parameters()])
        if optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state)
        return point

    def _ema_model(self) -> RecurrentDepthLM:
        """The EMA weights as a new model on the CPU (under FSDP a collective: every worker calls it)."""
        ema_model = RecurrentDepthLM(self.model.config)
        if self.ema is None:
            return ema_model
        with torch.no_grad():  # EMA.shadow follows the parameters that train (self.names)
            trained = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
            for (name, param), shadow in zip(trained, self.ema.shadow, strict=True):
                ema_model.get_parameter(name).copy_(full(ckpt.shaped_like(shadow, param)).cpu())
        return ema_model

    def _ema_adapter(self) -> dict[str, torch.Tensor] | None:
        """A lora run's EMA as adapter tensors, named as saved (rdlm.model.lora.adapter_state)."""
        if self.ema is None:
            return None
        from rdlm.model.lora_files import adapter_state, parameter_of

        shadow = dict(zip(self.names, self.ema.shadow, strict=True))
        return {key: shadow[parameter_of(key)].cpu() for key in adapter_state(self.model)}

    def _batch_hint(self, saved: Any) -> str:
        """How to keep a checkpoint's global batch of `saved` rows with this run's workers."""
        per_step = self.config.micro_batch_size * self.world.size
        if isinstance(saved, int) and saved > 0 and saved % per_step == 0:
            return (
                f"; with {self.world.size} worker(s) of micro-batch {self.config.micro_batch_size}, "
                f"--accumulation {saved // per_step} keeps it"
            )
        if isinstance(saved, int) and saved > 0:
            return (
                f"; {saved} rows is not a multiple of {self.world.size} worker(s) x micro-batch "
                f"{self.config.micro_batch_size}: choose --micro-batch-size and --accumulation with "
                f"micro-batch x accumulation x workers = {saved}"
            )
        return ""

    def _save(self) -> Path | None:
        if self.config.out_dir is None:
            return None
        optimizer = self.optimizer
        if hasattr(optimizer, "consolidate_state_dict"):  # ZeRO: gather the shards on rank 0
            optimizer.consolidate_state_dict(to=0)
        path = None
        finite = self._weights_finite()
        trainer_state = {
            "finite_weights": finite,
            "format": "rdlm-training-checkpoint",
            "consumed_rows": self.step * self.batches.global_batch_size,
            "global_batch_size": self.batches.global_batch_size,
            "world_size": self.world.size,
            "strategy": self.strategy,
            "epoch": self.batches.epoch_of(self.step),
            "lr": self.schedule(max(self.step - 1, 0)),
            "schedule": dataclasses.asdict(self.schedule),
            "bad_steps": self.bad_steps,
            "consecutive_bad": self.consecutive_bad,
            "losses": self.losses,
            "num_steps": self.drawn,
            "evals": self.evals,
            "train_config": self.config.to_dict(),
            "recurrence": {
                "mean": self.mean_recurrence,
                "backprop_depth": self.backprop_depth,
                "sampler": self.sampler,
                "sigma": self.sigma,
            },
        }
        if self.strategy == "fsdp":  # every worker writes its shards
            path = ckpt.save_sharded_checkpoint(
                self.config.out_dir,
                self.step,
                self.model,
                optimizer,
                self.ema.shadow if self.ema else None,
                self.names,
                trainer_state,
                self.tokenizer,
                self.config.keep_checkpoints,
            )
        elif self.world.is_main:
            path = ckpt.save_checkpoint(
                self.config.out_dir,
                self.step,
                self.model,
                self._ema_model() if self.ema and not self.lora else None,
                optimizer.state_dict(),
                self.names,
                trainer_state,
                self.tokenizer,
                self.config.keep_checkpoints,
                ema_adapter=self._ema_adapter() if self.lora else None,
                base_source=self.base_source,
            )
        barrier(self.world)
        self.last_checkpoint = ckpt.checkpoint_dir(self.config.out_dir) / f"step-{self.step:06d}"
        if finite:
            self.last_finite_checkpoint = self.last_checkpoint
        return path

    def _weights_finite(self) -> bool:
        """Whether every weight is finite (one device sync; under FSDP over every worker's shards)."""
        with torch.no_grad():
            bad = torch.as_tensor(sum((~torch.isfinite(local(p))).sum() for p in self.model.parameters())).float().cpu()
        return all_reduce_sum(bad.reshape(1), self.world).item() == 0
