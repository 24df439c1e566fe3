"""Cross-entropy of the tied un-embedding without materializing the logits.

With a 65k vocabulary the logits of a training micro-batch are the largest tensor of the step: 8 x 1024
tokens give a [8192, 65536] float32 matrix (2 GiB, and as much again for its gradient) whose only use
is one scalar. `linear_cross_entropy(hidden, weight, labels)` computes the same summed loss chunk by
chunk of tokens, and, because the loss is the end of the graph, the gradients with respect to `hidden`
and `weight` as well, in the same pass: each chunk's logits live for one chunk only, and backward
just scales the stored gradients. The FLOPs are those of the plain linear + cross-entropy.

Matmuls run in the autocast dtype when autocast is on (bf16 on GPUs); log-softmax in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = -100
# Float32 logits held at once: 2**26 elements (256 MiB), e.g. 1024 tokens of a 65536 vocabulary.
CHUNK_ELEMENTS = 2**26


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int) -> Tensor:
        # Grad mode is off in here; autocast (if any) is still on, so `@` runs in its dtype.
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start : start + chunk], labels[start : start + chunk]
            raw = h @ weight.t()
            logits = raw.float()
            valid = y != IGNORE_INDEX
            target = y.clamp_min(0).unsqueeze(1)
            lse = torch.logsumexp(logits, dim=-1)
            total += ((lse - logits.gather(1, target).squeeze(1)) * valid).sum()
            if want_hidden or want_weight:
                # d(sum CE)/d logits = softmax - one_hot(target), zero on ignored rows.
                grad = logits.sub_(lse.unsqueeze(1)).exp_()
                grad.scatter_add_(1, target, torch.full_like(lse, -1.0).unsqueeze(1))
                grad.mul_(valid.unsqueeze(1))
                grad = grad.to(raw.dtype)
                if grad_hidden is not None:  # (want_hidden)
                    grad_hidden[start : start + chunk] = grad @ weight
                if grad_weight is not None:  # (want_weight)
                    grad_weight += grad.t() @ h
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_output.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_output).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None


def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, reduction: str = "mean", chunk_tokens: int | None = None
) -> Tensor:
    """cross_entropy(hidden @ weight.T, labels) over labels != -100, never holding all the logits.

    hidden: [..., h]; weight: [vocab, h]; labels: [...]. reduction: "mean" (over counted targets) or
    "sum". chunk_tokens: tokens per chunk (default: CHUNK_ELEMENTS float32 logits at a time).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // weight.shape[0])
    total = _LinearCrossEntropy.apply(hidden, weight, labels, chunk)
    if reduction == "sum":
        return total
    return total / (labels != IGNORE_INDEX).sum().clamp_min(1)


def exit_distribution(lambdas: Tensor) -> Tensor:
    """p_i = lambda_i * prod_{j<i} (1 - lambda_j) over the last dimension (the iterations), the last
    iteration taking what is left, so each token's p sums to 1 (Ouro's exit distribution)."""
    survival = torch.cumprod(1 - lambdas, dim=-1)
    before = torch.cat((torch.ones_like(survival[..., :1]), survival[..., :-1]), dim=-1)
    exits = lambdas * before
    return torch.cat((exits[..., :-1], before[..., -1:]), dim=-1)


def expected_exit_loss(
    step_losses: Tensor, lambdas: Tensor, counted: Tensor, beta: float, reduction: str = "mean"
) -> Tensor:
    """Ouro's training objective: per token, sum_i p_i * loss_i - beta * H(p), with p the exit distribution
    of the gate's lambdas (`exit_distribution`) and loss_i the cross-entropy read out after iteration i.

    step_losses, lambdas: [..., T] (T iterations); counted: [...] bool, the tokens with a target.
    The entropy term keeps the gate from collapsing onto one iteration early in training."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    p = exit_distribution(lambdas.float())
    entropy = -(p * p.clamp_min(1e-12).log()).sum(dim=-1)
    per_token = (p * step_losses.float()).sum(dim=-1) - beta * entropy
    total = per_token.masked_fill(~counted, 0.0).sum()
    return total / counted.sum().clamp_min(1) if reduction == "mean" else total
