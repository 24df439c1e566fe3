"""What `rdlm demo` is given: `DemoConfig` (task, model, training and evaluation settings), checked before
anything is drawn or trained."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from rdlm.checks import check_int, is_int
from rdlm.demo import tasks as T
from rdlm.inference.exits.criteria import make_exit_criterion
from rdlm.model.config import RDLMConfig

EVAL_NUM_STEPS = (1, 2, 4, 8, 16, 32, 64)
# Exit thresholds tried on validation, loosest first; wide enough not to depend on a criterion's scale.
EXIT_THRESHOLDS = (1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5, 3e-6, 1e-6, 1e-7)
MODELS = ("recurrent", "twin", "depth_matched")
MARGIN_EPS = 1e-9  # floating-point slack when a claim's margin is exactly zero


@dataclass(frozen=True)
class DemoConfig:
    task: str = "permutations"  # a family of rdlm.demo.tasks, or "code"
    seed: int = 0
    out_dir: str = "demo-report"
    overwrite: bool = False  # replace a report already in out_dir (refused otherwise; docs/files.md)
    # Model: (l_P, l_R, l_C), width. Small enough to train in minutes on two CPU cores.
    # A one-layer core: each iteration advances the state by three to four moves, so r visibly buys depth.
    layers: tuple[int, int, int] = (1, 1, 1)
    hidden_size: int = 128
    num_heads: int = 4
    # The training mean r = 5: too few iterations for words longer than any trained on (the harder split),
    # which the model then answers by iterating longer than it usually trained.
    mean_recurrence: int = 4
    # The spread of the sampled r (the log-normal's sigma; the paper's recipe uses 0.5). At the same mean,
    # the wider 1.0 draws r >= 12 for one training step in twelve instead of one in thirty (r >= 16: 4%
    # instead of 0.7%), so the model learns to use deep r, which the longer words need (docs/demo.md).
    recurrence_sigma: float = 1.0
    backprop_depth: int = 4
    # Training budget (the same for the recurrent model and both baselines).
    steps: int = 1000
    batch_size: int = 64
    # The optimizer decides convergence here: with AdamW alone, training did not converge in 1000 steps on
    # seeds 5, 7 and 8 (test 67-86%); Muon for the blocks' weight matrices (AdamW for the embedding, norms
    # and the rest) converged on every design seed and on 12 others (docs/demo.md). `lr` is AdamW's,
    # `muon_lr` Muon's.
    # All three models of the comparison train with the same recipe.
    optimizer: str = "muon"
    lr: float = 1e-3
    muon_lr: float = 0.005
    warmup_steps: int = 30
    # A curriculum over difficulty (word length): training starts on the `curriculum_start` easiest
    # difficulties and takes in one more at even intervals until all of them are in, `curriculum_fraction`
    # of the way through training (0: every difficulty from the first step, in a shuffled order). Short
    # words make short batches, so the first half of training costs less.
    curriculum_fraction: float = 0.5
    curriculum_start: int = 3
    # The learning rate decays linearly to 0 over this last fraction of the steps (0: constant after the
    # warm-up).
    cooldown_fraction: float = 0.2
    # Evaluation: eval_examples per split (validation, test, harder).
    eval_examples: int = 300
    eval_num_steps: tuple[int, ...] = EVAL_NUM_STEPS
    exit_criterion: str = "kl"
    exit_thresholds: tuple[float, ...] = EXIT_THRESHOLDS  # the loosest within exit_tolerance is chosen
    exit_tolerance: float = 0.01  # validation accuracy an exit threshold may lose vs fixed r
    exit_max_steps: int = 32  # adaptive exits are compared with this fixed r
    eval_batch_size: int = 100
    train_twin: bool = True
    train_depth_matched: bool = True
    # One thread: the demo's models are tiny, the numbers are then the same whatever the machine's core
    # count, and no OpenMP worker is left busy-waiting on a shared CPU.
    threads: int = 1
    # Processes the models train and are scored in, side by side, one thread each (0: one per model, which
    # on two cores finishes sooner than two processes taking the models in turn). The numbers do not
    # depend on it.
    workers: int = 0
    progress: bool = True
    # Code task only.
    code_vocab_size: int = 1024
    code_chars: int = 1_000_000
    code_seq_len: int = 128

    def __post_init__(self) -> None:
        if self.task != "code":
            T.get_task(self.task)  # raises, naming the task
        for name in (
            "steps",
            "batch_size",
            "hidden_size",
            "num_heads",
            "mean_recurrence",
            "backprop_depth",
            "eval_examples",
            "exit_max_steps",
            "eval_batch_size",
            "threads",
            "code_vocab_size",
            "code_chars",
            "code_seq_len",
        ):
            if not is_int(getattr(self, name), 1):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not is_int(self.workers, 0):
            raise ValueError(f"workers must be 0 (one per model) or a positive integer, got {self.workers!r}")
        if len(self.layers) != 3 or not all(is_int(n, 1) for n in self.layers):
            raise ValueError(f"layers must be three positive integers (prelude, core, coda), got {self.layers!r}")
        if not self.eval_num_steps or not all(is_int(r, 1) for r in self.eval_num_steps):
            raise ValueError(f"eval_num_steps must be positive iteration counts, got {self.eval_num_steps}")
        for name in ("lr", "muon_lr"):
            if not getattr(self, name) > 0 or not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)!r}")
        if not self.exit_thresholds or any(not t > 0 for t in self.exit_thresholds):
            raise ValueError(f"exit_thresholds must be positive numbers, got {self.exit_thresholds!r}")
        sigma = self.recurrence_sigma
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not 0 <= sigma <= 3:
            raise ValueError(f"recurrence_sigma must be in [0, 3], got {self.recurrence_sigma!r}")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer must be adamw or muon, got {self.optimizer!r}")
        if not 0 <= self.curriculum_fraction <= 1:
            raise ValueError(f"curriculum_fraction must be in [0, 1], got {self.curriculum_fraction!r}")
        if self.task != "code":
            n = len(T.get_task(self.task).train_difficulties)
            if not is_int(self.curriculum_start, 1, n + 1):
                raise ValueError(
                    f"curriculum_start must be 1 to {n} (the {self.task} task's training "
                    f"difficulties), got {self.curriculum_start!r}"
                )
        check_int("warmup_steps", self.warmup_steps, 0)
        if not 0 <= self.cooldown_fraction <= 1:
            raise ValueError(f"cooldown_fraction must be in [0, 1], got {self.cooldown_fraction!r}")
        if not 0 <= self.exit_tolerance < 1:
            raise ValueError(f"exit_tolerance must be in [0, 1), got {self.exit_tolerance!r}")
        for threshold in self.exit_thresholds:
            make_exit_criterion(self.exit_criterion, threshold)  # raises, naming the criterion
        # The models themselves (e.g. hidden_size divisible by num_heads, an even head dimension):
        # checked now, not after minutes of data generation and training.
        for kind in MODELS:
            model_config(self, vocab_size=len(T.ALPHABET), context_length=64, kind=kind)

    @property
    def train_mean_r(self) -> int:
        """The mean r the recurrent model trains with: the log-normal Poisson draws Poisson(exp(tau)) + 1
        with E[exp(tau)] = mean_recurrence, so the mean is mean_recurrence + 1 (paper section 3.3)."""
        return self.mean_recurrence + 1

    @property
    def ordered(self) -> bool:
        """Whether training takes its rows in their order: a generated task's curriculum (the code corpus
        has none, and is shuffled)."""
        return self.curriculum_fraction > 0 and self.task != "code"

    @property
    def processes(self) -> int:
        """The worker processes: `workers`, or with 0 one per model."""
        return self.workers or len(self.models())

    def models(self) -> tuple[str, ...]:
        return (
            ("recurrent",)
            + (("twin",) if self.train_twin else ())
            + (("depth_matched",) if self.train_depth_matched else ())
        )


def model_config(cfg: DemoConfig, vocab_size: int, context_length: int, kind: str = "recurrent") -> RDLMConfig:
    """The demo model (`kind` "recurrent") or a non-recurrent baseline trained at r = 1 always:
    "twin" has the same layers and parameters (paper Table 4), "depth_matched" has the core unrolled
    to the training mean r (the depth the recurrent model runs on average, with its own weights)."""
    if kind not in MODELS:
        raise ValueError(f"unknown model kind {kind!r}; available: {', '.join(MODELS)}")
    lp, lr, lc = cfg.layers
    recurrence: dict[str, Any]
    if kind == "recurrent":
        recurrence = dict(
            mean_recurrence=cfg.mean_recurrence,
            backprop_depth=cfg.backprop_depth,
            recurrence_sampler="lognormal-poisson",
            recurrence_sigma=cfg.recurrence_sigma,
        )
    else:
        recurrence = dict(mean_recurrence=1, backprop_depth=1, recurrence_sampler="fixed")
        lr = lr * cfg.train_mean_r if kind == "depth_matched" else lr
    return RDLMConfig(
        prelude_layers=lp,
        core_layers=lr,
        coda_layers=lc,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        intermediate_size=2 * cfg.hidden_size,
        vocab_size=vocab_size,
        context_length=context_length,
        name={"recurrent": "demo"}.get(kind, f"demo-{kind}"),
        **recurrence,
    )


def settings_dict(settings: Any) -> dict[str, Any]:
    """A settings dataclass as results.json records it (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(settings).items()}
