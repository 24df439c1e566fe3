"""Learning rate: linear warm-up, then constant, with an optional linear cooldown
(docs/architecture.md#optimizer)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    lr: float
    warmup_steps: int = 0
    total_steps: int = 0
    cooldown_steps: int = 0  # the last `cooldown_steps` of `total_steps` decay linearly
    min_lr_ratio: float = 0.0  # the cooldown ends at lr * min_lr_ratio

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0 or self.cooldown_steps < 0:
            raise ValueError("warmup_steps and cooldown_steps must be >= 0")
        if self.cooldown_steps > self.total_steps:
            raise ValueError(f"cooldown_steps ({self.cooldown_steps}) exceeds the run's steps ({self.total_steps})")

    def __call__(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        cooldown_start = self.total_steps - self.cooldown_steps
        if self.cooldown_steps and step >= cooldown_start:
            progress = (step - cooldown_start + 1) / self.cooldown_steps
            return self.lr * (1 - progress * (1 - self.min_lr_ratio))
        return self.lr


CURRICULA = ("linear", "1-sqrt")


@dataclass(frozen=True)
class RecurrenceCurriculum:
    """The mean of the training distribution of r, ramped over training (McLeish et al. 2025, retrofitted
    recurrence): from `start` at step 0 up to `target` over the first `fraction` of `total_steps`, then
    `target`. The ramp's shape is "linear" (progress x) or "1-sqrt" (1 - sqrt(1 - x): slow at first, the
    schedule the paper found best); the mean is rounded up to an integer, as the paper's code does. A
    function of the step alone, so a resumed run continues the same ramp."""

    target: int
    total_steps: int
    kind: str = "linear"
    start: int = 1
    fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in CURRICULA:
            raise ValueError(f"curriculum must be one of {CURRICULA}, got {self.kind!r}")
        if not 1 <= self.start <= self.target:
            raise ValueError(f"curriculum_start must be in [1, mean_recurrence = {self.target}], got {self.start}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"curriculum_fraction must be in (0, 1], got {self.fraction}")

    def __call__(self, step: int) -> int:
        """Mean r for optimizer step `step` (0-based)."""
        ramp = max(1, round(self.fraction * self.total_steps))
        x = min(step / ramp, 1.0)
        shape = x if self.kind == "linear" else 1 - (1 - x) ** 0.5
        return min(self.target, max(self.start, math.ceil(self.start + (self.target - self.start) * shape - 1e-9)))
