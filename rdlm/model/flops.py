"""Training and inference FLOPs of a recurrent-depth model, counted from its parameter groups: what the
trainer's monitor reports (throughput, MFU) and what the resource checks use to bound a run's time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rdlm.model.config import RDLMConfig


class Sizes(Protocol):
    """What `flops_per_token` reads: a model (RecurrentDepthLM) or its config's sizes (`ConfigSizes`)."""

    @property
    def config(self) -> RDLMConfig: ...

    def parameter_groups(self) -> dict[str, int]: ...


def flops_per_token(model: Sizes, seq_len: int, no_grad_steps: float, grad_steps: float) -> float:
    """Training FLOPs per token: forward over all r iterations, backward (2x) over the last k only.

    Matmul FLOPs are 2 per parameter per token; attention adds 4*seq*h per layer (QK^T and AV).
    """
    c = model.config
    groups = model.parameter_groups()
    head = c.vocab_size * c.hidden_size
    attention = 4 * seq_len * c.num_heads * c.head_dim  # per layer, causal halving ignored (as is common)
    edges = groups["prelude"] + groups["coda"] + head
    edge_attn = (c.prelude_layers + c.coda_layers) * attention
    r = no_grad_steps + grad_steps
    forward = 2 * (edges + r * groups["core"]) + edge_attn + r * c.core_layers * attention
    backward = 2 * (2 * (edges + grad_steps * groups["core"]) + edge_attn + grad_steps * c.core_layers * attention)
    return float(forward + backward)


class ConfigSizes:
    """What `flops_per_token` reads from a model, from its config alone (no weights needed: resource
    checks size a run before building it)."""

    def __init__(self, config) -> None:
        h, inter = config.hidden_size, config.intermediate_size
        q, kv = config.num_heads * config.head_dim, config.kv_heads * config.head_dim
        layer = h * (q + 2 * kv) + q * h + 3 * h * inter  # attention (q, k, v, out) and the gated MLP
        adapter = 2 * h * h if config.injection == "concat" else 0  # the adapter of [s, e]
        self.config = config
        self.groups = {
            "prelude": config.prelude_layers * layer,
            "coda": config.coda_layers * layer,
            "core": config.core_layers * layer + adapter,
        }

    def parameter_groups(self) -> dict[str, int]:
        return self.groups
