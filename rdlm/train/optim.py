"""AdamW as the paper trains with it (docs/architecture.md#optimizer), plus the weight EMA.

Options beyond torch's AdamW:
- `atan2`: the epsilon-free update of Everett et al. (2024), `a * atan2(m_hat, sqrt(v_hat))` with
  a = 4/pi, so the update is 1 where m_hat = sqrt(v_hat) (as Adam's is) and bounded by 2 everywhere.
- `update_clip`: clip the per-tensor RMS of the Adam update to this value (Wortsman et al. 2023), which
  tames the rare huge step when v_hat lags a sudden gradient spike.
Weight decay is decoupled (scaled by the learning rate) and applied to weight matrices only.

Without those two options the update is exactly torch's AdamW, and `step` hands it to torch's fused
kernel (one launch for all parameters, no host synchronization). `step(found_inf=t)` skips the update
where the 0-d tensor `t` is nonzero, decided on the device (the trainer's non-finite-loss skip).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import cast

import torch
from torch import Tensor, nn
from torch.optim.adamw import adamw as fused_adamw  # the functional form: fused=True below

from rdlm.train.distributed import full


class AdamW(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 5e-4,
        atan2: bool = False,
        update_clip: float | None = None,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if update_clip is not None and update_clip <= 0:
            raise ValueError(f"update_clip must be > 0, got {update_clip}")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, atan2=atan2, update_clip=update_clip
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None, found_inf: Tensor | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group.get("muon"):
                self._step_muon(group, params, found_inf)
                continue
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                elif state["step"].device != p.device:  # loaded from a checkpoint (kept on the CPU)
                    state["step"] = state["step"].to(p.device)
            if group["atan2"] or group["update_clip"] is not None or not all(_fusable(p) for p in params):
                if found_inf is not None and found_inf.item():
                    continue
                self._step_per_tensor(group, params)
            else:
                self._step_fused(group, params, found_inf)
        return loss

    def _step_fused(self, group: dict, params: list[Tensor], found_inf: Tensor | None) -> None:
        beta1, beta2 = group["betas"]
        # Decay on matrices (linear and embedding weights), not on norms or qk_bias: two calls.
        for decay in (True, False):
            chosen = [p for p in params if (p.ndim == 2) == decay]
            if not chosen:
                continue
            states = [self.state[p] for p in chosen]
            inf = None if found_inf is None else found_inf.to(chosen[0].device, torch.float32)
            fused_adamw(
                chosen,
                [cast(Tensor, p.grad) for p in chosen],  # (step passes only parameters with a gradient)
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [],
                [s["step"] for s in states],
                fused=True,
                found_inf=inf,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"] if decay else 0.0,
                eps=group["eps"],
                maximize=False,
            )

    def _step_per_tensor(self, group: dict, params: list[Tensor]) -> None:
        beta1, beta2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        for p in params:
            grad = cast(Tensor, p.grad).float()  # (as in _step_fused)
            state = self.state[p]
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

    def _step_muon(self, group: dict, params: list[Tensor], found_inf: Tensor | None) -> None:
        raise ValueError("a Muon parameter group needs MuonAdamW")


class MuonAdamW(AdamW):
    """Muon for the weight matrices of the blocks and the adapter, AdamW for the rest (embedding, head, norms,
    biases, the exit gate): the split McLeish et al. 2025 found stable for retrofitted recurrence. The Muon
    update is torch's (`torch.optim.Muon`: momentum, Nesterov, Newton-Schulz orthogonalization); its group has
    its own learning rate (`lr_scale` x the schedule's) and weight decay. Orthogonalization needs whole
    matrices, so the parameters must not be sharded (one process, or DDP without a sharded optimizer)."""

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        muon_lr: float = 0.005,
        muon_weight_decay: float = 1e-4,
        momentum: float = 0.95,
        **adamw,
    ) -> None:
        try:
            from torch.optim._muon import muon  # noqa: F401  (the functional form of torch.optim.Muon)
        except ImportError as err:
            raise ValueError(
                f"the muon optimizer needs torch.optim.Muon (torch >= 2.9); this torch is {torch.__version__}"
            ) from err
        body, rest = muon_parameters(model)
        groups = [
            {
                "params": body,
                "muon": True,
                "lr_scale": muon_lr / lr,
                "lr": muon_lr,
                "weight_decay": muon_weight_decay,
                "momentum": momentum,
            },
            {"params": rest},
        ]
        super().__init__(groups, lr=lr, **adamw)

    def _step_muon(self, group: dict, params: list[Tensor], found_inf: Tensor | None) -> None:
        from torch.optim._muon import muon

        if not params or (found_inf is not None and found_inf.item()):
            return
        buffers = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
            buffers.append(state["momentum_buffer"])
        muon(
            params,
            [cast(Tensor, p.grad).float() for p in params],  # (as in _step_fused)
            buffers,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            nesterov=True,
            ns_coefficients=(3.4445, -4.775, 2.0315),
            eps=1e-7,
            ns_steps=5,
            adjust_lr_fn=None,
            has_complex=False,
        )


def muon_parameters(model: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    """(the blocks' and the adapter's weight matrices, everything else)."""
    body: list[Tensor] = []
    rest: list[Tensor] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        matrix = (
            p.ndim == 2 and name.endswith(".weight") and name.split(".")[0] in ("prelude", "core", "coda", "adapter")
        )
        (body if matrix else rest).append(p)
    return body, rest


def _fusable(p: Tensor) -> bool:
    """torch's fused AdamW takes float parameters on CUDA or the CPU, with float32 state."""
    return p.dtype in (torch.float32, torch.bfloat16, torch.float16) and p.device.type in ("cuda", "cpu")


def parameter_groups(model: nn.Module) -> list[dict]:
    """Parameters in model order; weight decay applies to matrices only (not norms or q/k biases)."""
    return [{"params": [p for p in model.parameters() if p.requires_grad]}]


class EMA:
    """Exponential moving average of the trained weights: the paper's cheap stand-in for a cooldown.

    Kept in float32 next to each worker's own shard when the model is sharded (FSDP): `shadow[i]` is
    the local part of the i-th parameter that trains (requires_grad: every one in a full run, the
    adapters' in a LoRA run, whose frozen base has no average to keep).
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"ema decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shadow = [_local(p).detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self, finite: Tensor | None = None) -> None:
        """Move toward the current weights; with `finite` (a 0-d bool tensor), only where it is true."""
        current = [_local(p).detach().float() for p in self.params]
        if finite is None:
            torch._foreach_lerp_(self.shadow, current, 1 - self.decay)
            return
        weights: dict[torch.device, Tensor] = {}  # decided on the device: no host sync
        for shadow, value in zip(self.shadow, current, strict=True):
            if shadow.device not in weights:
                weights[shadow.device] = finite.to(shadow.device, torch.float32) * (1 - self.decay)
            shadow.lerp_(value, weights[shadow.device])

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        targets = [p for p in model.parameters() if p.requires_grad]
        for target, value in zip(targets, self.shadow, strict=True):
            target.copy_(value.to(target.dtype))

    @torch.no_grad()
    def load(self, tensors: list[Tensor]) -> None:
        for shadow, value in zip(self.shadow, tensors, strict=True):
            shadow.copy_(value)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def clip_gradients(parameters, max_norm: float) -> Tensor:
    """Clip the global gradient norm to `max_norm`; return the norm before clipping (a device tensor,
    the whole model's even when FSDP shards the gradients)."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    norm = full(norm)  # FSDP: the shards' norms combined (an all-reduce, no host sync)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm
