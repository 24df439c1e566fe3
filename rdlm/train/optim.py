"""AdamW as the paper trains with it (SPEC section 3), plus the weight EMA.

Options beyond torch's AdamW:
- `atan2`: the epsilon-free update of Everett et al. (2024), `a * atan2(m_hat, sqrt(v_hat))` with
  a = 4/pi, so the update is 1 where m_hat = sqrt(v_hat) (as Adam's is) and bounded by 2 everywhere.
- `update_clip`: clip the per-tensor RMS of the Adam update to this value (Wortsman et al. 2023), which
  tames the rare huge step when v_hat lags a sudden gradient spike.
Weight decay is decoupled (scaled by the learning rate) and applied to weight matrices only.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor, nn


class AdamW(torch.optim.Optimizer):
    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 5e-4, atan2: bool = False,
                 update_clip: float | None = None) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if update_clip is not None and update_clip <= 0:
            raise ValueError(f"update_clip must be > 0, got {update_clip}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, atan2=atan2,
                        update_clip=update_clip)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.float()
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                step = state["step"].item()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                m_hat = m / (1 - beta1**step)
                v_hat_sqrt = (v / (1 - beta2**step)).sqrt_()
                if group["atan2"]:
                    update = torch.atan2(m_hat, v_hat_sqrt).mul_(4 / math.pi)
                else:
                    update = m_hat.div_(v_hat_sqrt.add_(group["eps"]))
                if group["update_clip"] is not None:
                    rms = update.square().mean().sqrt().item()
                    if rms > group["update_clip"]:
                        update.mul_(group["update_clip"] / rms)
                if wd and p.ndim == 2:  # linear and embedding matrices; not norms, not qk_bias
                    p.mul_(1 - lr * wd)
                p.add_(update.to(p.dtype), alpha=-lr)
        return loss


def parameter_groups(model: nn.Module) -> list[dict]:
    """Parameters in model order; weight decay applies to matrices only (not norms or q/k biases)."""
    return [{"params": [p for p in model.parameters() if p.requires_grad]}]


class EMA:
    """Exponential moving average of the weights: the paper's cheap stand-in for a cooldown."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"ema decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.params = [p for p in model.parameters()]
        self.shadow = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_lerp_(self.shadow, [p.detach().float() for p in self.params], 1 - self.decay)

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        for target, value in zip(model.parameters(), self.shadow):
            target.copy_(value.to(target.dtype))

    @torch.no_grad()
    def load(self, tensors: list[Tensor]) -> None:
        for shadow, value in zip(self.shadow, tensors):
            shadow.copy_(value)
