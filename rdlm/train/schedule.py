"""Learning rate: linear warm-up, then constant, with an optional linear cooldown
(docs/architecture.md#optimizer)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    lr: float
    warmup_steps: int = 0
    total_steps: int = 0
    cooldown_steps: int = 0     # the last `cooldown_steps` of `total_steps` decay linearly
    min_lr_ratio: float = 0.0   # the cooldown ends at lr * min_lr_ratio

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
