"""What a training run is given: `TrainConfig`, its validation, and its JSON form (`rdlm train --config`); what
it gives back (`TrainResult`) and the hooks it calls."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rdlm.checks import check_int
from rdlm.model.config import ConfigError, check_keys
from rdlm.model.lm import RecurrentDepthLM
from rdlm.model.lora import DEFAULT_PARTS, PARTS
from rdlm.model.recurrence import SAMPLERS
from rdlm.train.distributed import STRATEGIES
from rdlm.train.schedule import CURRICULA


def option(default: Any = dataclasses.MISSING, help: str = "", *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A config field with its one-line help, which the command line shows (rdlm/cli/train.py)."""
    if not help:
        raise TypeError("every TrainConfig field needs a help text")
    return field(default=default, default_factory=default_factory, metadata={"help": help})


# What a resumed run may set anew: how long it runs, how it reports and saves, and the hardware it runs on
# (a global batch split otherwise is checked against the checkpoint's). Everything else (the model, the
# data, the optimizer and its schedule, the recurrence, the seed) is the run's own, recorded in its
# checkpoints' trainer.json (rdlm.train.resume.recorded_config).
MAY_CHANGE_ON_RESUME = (
    "steps",
    "micro_batch_size",
    "accumulation",
    "precision",
    "compile",
    "device",
    "threads",
    "strategy",
    "cpu_offload",
    "sharded_optimizer",
    "log_every",
    "eval_every",
    "eval_num_steps",
    "eval_rows",
    "eval_batch_size",
    "collapse_correlation",
    "progress",
    "tensorboard",
    "peak_flops",
    "checkpoint_every",
    "keep_checkpoints",
    "resume",
    "max_bad_steps",
)


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run is given. Each field's help (its metadata) is the command line's
    `rdlm train --<field>` help; `rdlm train --help` lists them."""

    # What to train and on what
    model: str = option(
        "tiny",
        "what to train: a preset (tiny, small, ...), a Huginn-layout directory, a "
        "training checkpoint (its raw weights) or a run directory",
    )
    model_overrides: dict[str, Any] = option(  # noqa: RUF009 (option() returns a dataclasses.field)
        help="model config fields to change (the command line's --set KEY=VALUE)", default_factory=dict
    )
    data: str | None = option(None, "token shards from `rdlm data prepare` (a directory)")
    prompt_response: str | None = option(
        None, "a prompt/response JSONL file for fine-tuning (loss on the responses only)"
    )
    tokenizer: str | None = option(None, "tokenizer.json or its directory (default: the data's, else the model's)")
    out_dir: str | None = option(
        None, "run directory: checkpoints, log.jsonl, TensorBoard events (None: nothing is saved)"
    )
    seed: int = option(0, "seed of everything random: r per micro-batch, s_0, data order, initialisation")
    shuffle: bool = option(
        True,
        "draw the rows in a new random order every epoch (--no-shuffle: in the data's "
        "own order, e.g. a curriculum written easiest first)",
    )
    # Batch geometry: global batch = micro_batch_size * accumulation * number of workers.
    steps: int = option(100, "optimizer steps")
    micro_batch_size: int = option(8, "rows per micro-batch on each worker")
    accumulation: int = option(
        1, "micro-batches per optimizer step (global batch = micro-batch size x accumulation x workers)"
    )
    # Recurrence (None: the model config's values).
    mean_recurrence: int | None = option(None, "mean of the training distribution of r (default: the model's)")
    backprop_depth: int | None = option(
        None, "k: backpropagate through the last k iterations of each draw (default: the model's)"
    )
    recurrence_sampler: str | None = option(None, f"distribution of r: {', '.join(SAMPLERS)} (default: the model's)")
    recurrence_sigma: float | None = option(None, "spread of the log-normal Poisson sampler (default: the model's)")
    curriculum: str | None = option(
        None,
        "ramp the mean of r over training, linear or 1-sqrt (retrofitted "
        "recurrence, McLeish et al. 2025; None: a constant mean)",
    )
    curriculum_start: int = option(1, "mean r at the start of the curriculum")
    curriculum_fraction: float = option(0.5, "fraction of the steps over which the mean ramps to mean_recurrence")
    exit_loss_beta: float | None = option(
        None,
        "train a model with a learned exit gate (Ouro) on its expected "
        "loss over exit iterations minus beta x the exit distribution's "
        "entropy; every iteration with gradient (None: rdlm's loss at r)",
    )
    # LoRA and QLoRA (rdlm.model.lora, docs/fine-tuning.md): adapters on a frozen base.
    lora: bool = option(
        False,
        "train LoRA adapters on a frozen base instead of every weight (only the adapters get gradients and "
        "optimizer state; checkpoints hold the adapter in PEFT's format)",
    )
    lora_rank: int = option(16, "LoRA rank")
    lora_alpha: float = option(32.0, "LoRA alpha: the update is scaled by alpha / rank")
    lora_dropout: float = option(0.0, "dropout on each adapter's input in training")
    lora_parts: str = option(
        "default",
        f"the parts whose linear layers get adapters, comma-separated: some of {', '.join(PARTS)}; all; or "
        f"default: those of {','.join(DEFAULT_PARTS)} the model has (every block projection, head excluded)",
    )
    lora_base_dtype: str = option("fp32", "the frozen base's weights: fp32 or bf16 (the adapters stay float32)")
    quantize: str | None = option(
        None,
        "QLoRA: quantize the frozen base (int8, int4, w8a8, or per part: core=int4,prelude=int8; "
        "docs/quantization.md); needs lora",
    )
    quantize_group_size: int = option(128, "int4 group size of --quantize")
    # Optimization (docs/architecture.md#optimizer).
    lr: float = option(1e-3, "peak learning rate")
    optimizer: str = option(
        "adamw",
        "adamw, or muon: Muon (torch.optim.Muon) for the blocks' weight matrices "
        "and AdamW for the rest (McLeish et al. 2025); not with FSDP",
    )
    muon_lr: float = option(0.005, "peak learning rate of the Muon matrices (follows the lr schedule's shape)")
    muon_weight_decay: float = option(1e-4, "weight decay of the Muon matrices")
    warmup_steps: int = option(10, "linear warm-up steps")
    cooldown_steps: int = option(0, "steps of the final linear decay to min_lr_ratio x lr (0: constant after warm-up)")
    min_lr_ratio: float = option(0.0, "learning rate at the end of the cool-down, as a fraction of lr")
    betas: tuple[float, float] = option((0.9, 0.95), "AdamW betas (two numbers)")
    eps: float = option(1e-8, "AdamW epsilon")
    weight_decay: float = option(5e-4, "decoupled weight decay, on matrices only (not norms or q/k biases)")
    atan2: bool = option(False, "the epsilon-free Adam-atan2 update (Everett et al. 2024)")
    update_clip: float | None = option(
        None, "clip the per-tensor RMS of each Adam update at this value (None: no clip)"
    )
    grad_clip: float = option(1.0, "clip the global gradient norm at this value")
    ema_decay: float | None = option(0.999, "decay of the EMA of the weights, saved beside them (None: no EMA)")
    # Hardware and parallelism.
    precision: str = option("auto", "auto (bf16 where the GPU has it), bf16 or fp32")
    compile: bool = option(
        False, "torch.compile each block's forward (regional: r changes every step without recompiling)"
    )
    device: str = option("auto", "auto (the GPU if there is one, else the CPU), cpu, cuda or cuda:N")
    threads: int | None = option(
        None,
        "CPU threads for this run (default: 1 for models under 20M parameters on "
        "the CPU, where threads cost more than they save; else the cores the load "
        "average leaves free)",
    )
    strategy: str = option(
        "auto",
        "with several processes (torchrun): fsdp (FSDP2, sharded) or ddp "
        "(replicated); single: one process; auto: fsdp under torchrun, else single",
    )
    cpu_offload: bool = option(False, "FSDP: keep sharded weights, gradients and optimizer state in host memory")
    sharded_optimizer: bool = option(True, "ddp: shard the optimizer state (ZeroRedundancyOptimizer)")
    # Monitoring.
    log_every: int = option(1, "write a log record every n steps (the host reads the device only then)")
    eval_every: int = option(0, "evaluate every n steps (0: only at the end, when there is validation data)")
    eval_num_steps: tuple[int, ...] = option((1, 4, 8, 16, 32, 64), "r values of the validation sweep")
    eval_rows: int = option(64, "validation rows per evaluation")
    eval_batch_size: int = option(8, "rows per validation forward")
    collapse_correlation: float = option(
        0.95, "warn of hidden-state collapse when the token-to-token state correlation exceeds this"
    )
    progress: bool = option(True, "show a progress bar")
    tensorboard: bool = option(True, "write TensorBoard events (skipped, with a note, without tensorboard)")
    peak_flops: float | None = option(
        None, "peak FLOP/s of one device, for MFU (default: from the GPU's name; none on the CPU)"
    )
    # Checkpoints and failures.
    checkpoint_every: int = option(0, "save a checkpoint every n steps (0: only at the end)")
    keep_checkpoints: int = option(3, "checkpoints kept in the run directory (older ones are removed)")
    resume: bool = option(False, "continue the run in out_dir from its latest intact checkpoint")
    overwrite: bool = option(False, "remove another run already in out_dir (refused otherwise)")
    max_bad_steps: int = option(5, "a non-finite loss skips the step; this many in a row stop the run")

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "micro_batch_size",
            "accumulation",
            "log_every",
            "eval_rows",
            "eval_batch_size",
            "max_bad_steps",
            "curriculum_start",
        ):
            check_int(name, getattr(self, name), error=ConfigError)
        for name in ("warmup_steps", "cooldown_steps", "eval_every", "checkpoint_every", "keep_checkpoints"):
            check_int(name, getattr(self, name), 0, error=ConfigError)
        # None means "the model's own value"; a given value must be usable (0 is not "the default").
        for name in ("mean_recurrence", "backprop_depth", "threads"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), error=ConfigError, note=" (or None for the default)")
        finite = {
            "lr": (0, None),
            "eps": (0, None),
            "weight_decay": (0, None),
            "min_lr_ratio": (0, 1),
            "grad_clip": (0, None),
            "collapse_correlation": (None, None),
            "recurrence_sigma": (0, None),
            "update_clip": (0, None),
            "peak_flops": (0, None),
            "ema_decay": (0, 1),
        }
        for name, (low, high) in finite.items():
            value = getattr(self, name)
            if value is None and name in ("recurrence_sigma", "update_clip", "peak_flops", "ema_decay"):
                continue
            _check_number(name, value, low, high)
        if len(self.betas) != 2:
            raise ConfigError(f"betas must be two numbers, got {self.betas!r}")
        for beta in self.betas:
            _check_number("betas", beta, 0, 1)
        if self.resume and self.overwrite:
            raise ConfigError("resume and overwrite contradict each other: give one")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ConfigError(f"precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.recurrence_sampler is not None and self.recurrence_sampler not in SAMPLERS:
            raise ConfigError(f"recurrence_sampler must be one of {sorted(SAMPLERS)}, got {self.recurrence_sampler!r}")
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            raise ConfigError(f"ema_decay must be in (0, 1) or None, got {self.ema_decay}")
        if self.data and self.prompt_response:
            raise ConfigError("give either data (token shards) or prompt_response (JSONL), not both")
        if self.cooldown_steps > self.steps:
            raise ConfigError(f"cooldown_steps ({self.cooldown_steps}) exceeds steps ({self.steps})")
        if not self.eval_num_steps or any(int(r) < 1 for r in self.eval_num_steps):
            raise ConfigError(f"eval_num_steps must be positive iteration counts, got {self.eval_num_steps}")
        if self.grad_clip <= 0:
            raise ConfigError(f"grad_clip must be > 0, got {self.grad_clip}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.cpu_offload and self.strategy not in ("auto", "fsdp"):
            raise ConfigError(f"cpu_offload needs strategy fsdp, got {self.strategy!r}")
        check_keys(self.model_overrides)
        if self.exit_loss_beta is not None:
            _check_number("exit_loss_beta", self.exit_loss_beta, 0.0, None)
        if self.optimizer not in ("adamw", "muon"):
            raise ConfigError(f"optimizer must be adamw or muon, got {self.optimizer!r}")
        _check_number("muon_lr", self.muon_lr, 0.0, None)
        _check_number("muon_weight_decay", self.muon_weight_decay, 0.0, None)
        if self.lora:
            self.lora_spec()  # refuses a bad rank, alpha, dropout or part by name
        if self.lora_base_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"lora_base_dtype must be fp32 or bf16, got {self.lora_base_dtype!r}")
        if self.quantize is not None:
            if not self.lora:
                raise ConfigError(
                    f"quantize={self.quantize!r}: a quantized base trains only through adapters; add lora "
                    "(QLoRA), or train unquantized and quantize afterwards"
                )
            from rdlm.model.quantize import QuantizationError, QuantSpec

            try:
                QuantSpec.parse(self.quantize, self.quantize_group_size)
            except QuantizationError as err:
                raise ConfigError(f"quantize: {err}") from None
        if self.lora and self.cpu_offload:
            raise ConfigError("cpu_offload offloads FSDP's shards; lora runs with ddp (and its base is frozen)")
        if self.lora and self.strategy == "fsdp":
            raise ConfigError(
                "lora runs data-parallel with ddp, not fsdp: the frozen base is replicated (a quantized base's "
                "integer weights are buffers, which FSDP does not shard) and only the small adapter gradients "
                "are all-reduced; give --strategy ddp (or auto)"
            )
        if self.curriculum is not None and self.curriculum not in CURRICULA:
            raise ConfigError(f"curriculum must be one of {CURRICULA}, got {self.curriculum!r}")
        _check_number("curriculum_fraction", self.curriculum_fraction, 0.0, 1.0)
        if self.curriculum_fraction <= 0:
            raise ConfigError(f"curriculum_fraction must be in (0, 1], got {self.curriculum_fraction}")

    def lora_spec(self):
        """The adapters' LoraSpec (rdlm.model.lora) of a lora run."""
        from rdlm.model.lora import LoraError, LoraSpec

        try:
            return LoraSpec(self.lora_rank, self.lora_alpha, self.lora_dropout, LoraSpec.parse_parts(self.lora_parts))
        except LoraError as err:
            raise ConfigError(str(err)) from None

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        check_keys(values, cls)
        values = dict(values)
        for key in ("betas", "eval_num_steps"):
            if key in values:
                values[key] = tuple(values[key])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_number(name: str, value: Any, low: float | None, high: float | None) -> None:
    """A finite number within [low, high] (NaN and infinity are refused at the boundary)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"{name} must be {bounds}, got {value!r}")


@dataclass
class TrainResult:
    model: RecurrentDepthLM  # under FSDP the sharded model (ema_model is whole)
    losses: list[float]  # mean training loss per optimizer step (NaN for skipped steps)
    num_steps: list[list[int]]  # the r drawn for each micro-batch of each step
    evals: list[dict[str, float]]
    bad_steps: int
    checkpoint: Path | None
    ema_model: RecurrentDepthLM | None = None
    steps_done: int = 0
    seconds: float = 0.0
    stopped_by: int | None = None  # the signal (SIGTERM, SIGINT) that stopped the run early


# An evaluation hook: called with (model, step) at each evaluation; its numbers join the eval record.
EvalHook = Callable[[RecurrentDepthLM, int], dict[str, float]]
# A step hook: called with each log record (train and eval) as it is written.
StepHook = Callable[[dict[str, Any]], None]
