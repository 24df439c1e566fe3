"""Model configuration and named presets (docs/architecture.md#presets, paper section 3).

A config is a small frozen dataclass of plain values. Presets are data: a dict of field overrides.
Every field is validated on construction, and every error names the field that is wrong.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rdlm.checks import is_int

# Where a block normalizes (docs/model-families.md): "sandwich" (Huginn) x = n2(x + attn(n1 x)) and the same
# around the MLP; "prenorm" x = x + attn(n1 x); "postnorm" (OLMo-2) x = x + n2(attn(x)); "peri" (Ouro)
# x = x + n2(attn(n1 x)). Each branch has the norms the scheme names, in that order.
NORM_SCHEMES = ("sandwich", "prenorm", "postnorm", "peri")
# Where the model's final norm sits: "sandwich" before and after the coda (Huginn); "output" after the coda
# only (the retrofitted models); "loop" after every core iteration, fed back into the next, so the state
# the coda and the un-embedding read is already normalized (Ouro).
FINAL_NORMS = ("sandwich", "output", "loop")
# How RoPE pairs a head's dimensions: "adjacent" (2j, 2j+1) as Huginn; "halves" (j, j + d/2) as Llama.
ROPE_PAIRS = ("adjacent", "halves")
# The checkpoint layout a model is saved in: names and config keys of that family, read and written by its
# adapter (rdlm.model.families.ADAPTERS, in this order).
FAMILIES = ("huginn", "retrofit-llama", "retrofit-olmo", "ouro")
# How the reference code's test-time noise shrinks with the iteration (its `test_time_noise_type`).
NOISE_SCHEDULES = ("fixed", "geom", "sqrt", "line", "chi")
# How the core reads the prelude's output e: a linear adapter over [s, e] ("concat"), s + e ("add"), or
# not at all ("none": Ouro loops the layer stack on its own output, e enters only as s_0).
INJECTIONS = ("concat", "add", "none")
# s_0: random (truncated normal), zeros, or e itself ("embedding", Ouro).
STATE_INITS = ("random", "zero", "embedding")
# The longest context a config may ask for: the model holds RoPE tables for every position (length x head
# dim floats), and a KV cache or a training row of that length must fit too. 2**20 is 8x the longest
# context of the families rdlm runs (Llama 3.1's 131072); a typo like 1000000000 would need 32 GB of tables.
MAX_CONTEXT_LENGTH = 2**20


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the field."""


@dataclass(frozen=True)
class RDLMConfig:
    # Shape triplet (l_P, l_R, l_C): layers in prelude, core block, coda.
    prelude_layers: int = 2
    core_layers: int = 4
    coda_layers: int = 2
    hidden_size: int = 5280
    num_heads: int = 55
    intermediate_size: int = 17920
    vocab_size: int = 65536
    context_length: int = 4096
    rope_base: float = 50000.0
    norm_eps: float = 1e-6
    qk_bias: bool = True
    tie_embeddings: bool = True
    # Grouped-query attention: key/value heads (None: num_heads) and the width of a head (None:
    # hidden_size / num_heads).
    num_kv_heads: int | None = None
    head_size: int | None = None
    # RMSNorm of the whole query and key projections before RoPE (OLMo-2).
    qk_norm: bool = False
    rope_pairs: str = "adjacent"
    # transformers' `rope_scaling` (rope_type "llama3": factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings); None: plain RoPE.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    # The token embedding is multiplied by this (None: sqrt(hidden_size), Huginn's).
    embed_scale: float | None = None
    final_norm: str = "sandwich"
    adapter_bias: bool = False
    # A learned exit gate Linear(h, 1) read after every core iteration (Ouro): lambda_i = sigmoid(gate(s_i)),
    # and the threshold on the cumulative exit probability that `exit_criterion="gate"` uses by default.
    exit_gate: bool = False
    exit_threshold: float | None = None
    family: str = "huginn"
    # Training-time recurrence: r ~ sampler(mean_recurrence), gradients through the last backprop_depth.
    mean_recurrence: int = 32
    backprop_depth: int = 8
    recurrence_sampler: str = "lognormal-poisson"
    recurrence_sigma: float = 0.5
    # Ablation switches of the paper.
    norm_scheme: str = "sandwich"
    injection: str = "concat"
    state_init: str = "random"
    # Std of the random initial state s_0 before the embedding scale sqrt(h) (a Huginn config's
    # `init_values.std`); None is the paper's sqrt(2/(5h)). See `state_std`.
    state_init_std: float | None = None
    # Noise mixed into the state before every core iteration, as the reference code does when its config
    # sets `test_time_noise` (0 = off, the paper's model): s <- n4(s(1 - a) + a * N(0, 1)) with
    # a = test_time_noise * state_std * sqrt(h), shrunk over iterations by `test_time_noise_type`.
    test_time_noise: float = 0.0
    test_time_noise_type: str = "fixed"
    # Memory/speed switch: recompute each core iteration in backward instead of storing activations.
    activation_checkpointing: bool = False
    # Free-form provenance (e.g. the preset name); not used by the model.
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        positive = (
            "prelude_layers",
            "core_layers",
            "coda_layers",
            "hidden_size",
            "num_heads",
            "intermediate_size",
            "vocab_size",
            "context_length",
            "mean_recurrence",
            "backprop_depth",
        )
        for name in positive:
            value = getattr(self, name)
            if not is_int(value):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
        # Prelude and coda may be empty (an ablation); the core block and every size may not.
        for name in positive:
            minimum = 0 if name in ("prelude_layers", "coda_layers") else 1
            if getattr(self, name) < minimum:
                raise ConfigError(f"{name} must be >= {minimum}, got {getattr(self, name)}")
        for name in ("num_kv_heads", "head_size"):
            value = getattr(self, name)
            if value is not None and not is_int(value, 1):
                raise ConfigError(f"{name} must be an integer >= 1 or None, got {value!r}")
        if self.head_size is None and self.hidden_size % self.num_heads != 0:
            raise ConfigError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.context_length > MAX_CONTEXT_LENGTH:
            table = self.context_length * self.head_dim * 4  # cos and sin, head_dim / 2 floats each
            raise ConfigError(
                f"context_length must be at most {MAX_CONTEXT_LENGTH} positions (2**20), got "
                f"{self.context_length} (its RoPE tables alone would need {table / 1e9:.3g} GB)"
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(f"head dimension {self.head_dim} must be even for RoPE")
        if self.num_heads % self.kv_heads != 0:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.kv_heads})")
        if self.qk_bias and self.kv_heads != self.num_heads:
            raise ConfigError("qk_bias with grouped-query attention (num_kv_heads != num_heads) is not supported")
        for name, allowed in (("final_norm", FINAL_NORMS), ("rope_pairs", ROPE_PAIRS), ("family", FAMILIES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.embed_scale is not None and (
            isinstance(self.embed_scale, bool)
            or not isinstance(self.embed_scale, (int, float))
            or not math.isfinite(self.embed_scale)
            or self.embed_scale <= 0
        ):
            raise ConfigError(f"embed_scale must be a finite number > 0 or None, got {self.embed_scale!r}")
        if self.exit_threshold is not None and (
            isinstance(self.exit_threshold, bool)
            or not isinstance(self.exit_threshold, (int, float))
            or not 0 < self.exit_threshold <= 1
        ):
            raise ConfigError(f"exit_threshold must be a number in (0, 1] or None, got {self.exit_threshold!r}")
        from rdlm.model.rope import check_scaling  # local import: rope imports nothing from here

        try:
            check_scaling(self.rope_scaling)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        for name in ("rope_base", "norm_eps", "recurrence_sigma", "test_time_noise"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
        if self.rope_base <= 1:
            raise ConfigError(f"rope_base must be > 1, got {self.rope_base}")
        if self.norm_eps <= 0:
            raise ConfigError(f"norm_eps must be > 0, got {self.norm_eps}")
        if self.recurrence_sigma < 0:
            raise ConfigError(f"recurrence_sigma must be >= 0, got {self.recurrence_sigma}")
        if self.state_init_std is not None:
            std = self.state_init_std
            if isinstance(std, bool) or not isinstance(std, (int, float)) or not math.isfinite(std) or std < 0:
                raise ConfigError(f"state_init_std must be a finite number >= 0 or None, got {std!r}")
        if self.test_time_noise < 0:
            raise ConfigError(f"test_time_noise must be >= 0, got {self.test_time_noise}")
        if self.test_time_noise_type not in NOISE_SCHEDULES:
            raise ConfigError(
                f"test_time_noise_type must be one of {NOISE_SCHEDULES}, got {self.test_time_noise_type!r}"
            )
        if self.test_time_noise > 0 and self.norm_scheme != "sandwich":
            raise ConfigError(
                "test_time_noise renormalizes with the core's last sandwich norm; "
                f"norm_scheme {self.norm_scheme!r} has none"
            )
        for name in ("qk_bias", "tie_embeddings", "activation_checkpointing", "qk_norm", "adapter_bias", "exit_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name, allowed in (("norm_scheme", NORM_SCHEMES), ("injection", INJECTIONS), ("state_init", STATE_INITS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        from rdlm.model.recurrence import SAMPLERS  # local import: recurrence imports nothing from here

        if self.recurrence_sampler not in SAMPLERS:
            raise ConfigError(f"recurrence_sampler must be one of {sorted(SAMPLERS)}, got {self.recurrence_sampler!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads if self.head_size is None else self.head_size

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def embedding_scale(self) -> float:
        """What the token embedding is multiplied by: `embed_scale`, by default sqrt(h)."""
        return math.sqrt(self.hidden_size) if self.embed_scale is None else float(self.embed_scale)

    @property
    def state_std(self) -> float:
        """Std of s_0 before the embedding scale: `state_init_std`, by default sqrt(2/(5h))."""
        return math.sqrt(2 / (5 * self.hidden_size)) if self.state_init_std is None else self.state_init_std

    @property
    def takes_initial_state(self) -> bool:
        """Whether s_0 is an input that callers draw and pass (`state_init` "random" or "zero"); False where
        s_0 is the embedding e itself ("embedding": Ouro, a fixed-depth Llama), which the model makes and a
        given state would replace."""
        return self.state_init != "embedding"

    @property
    def effective_depth(self) -> int:
        """Expected effective depth L = l_P + r_mean * l_R + l_C (used by the Takase init)."""
        return self.prelude_layers + self.mean_recurrence * self.core_layers + self.coda_layers

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RDLMConfig:
        check_keys(values, cls)
        return cls(**values)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> RDLMConfig:
        if name not in PRESETS:
            raise ConfigError(
                f"unknown preset {name!r}{_suggest(name, PRESETS)}; available: {', '.join(sorted(PRESETS))}"
            )
        values = {**PRESETS[name], "name": name, **overrides}
        return cls.from_dict(values)

    def replace(self, **changes: Any) -> RDLMConfig:
        check_keys(changes, type(self))
        return dataclasses.replace(self, **changes)


def check_keys(values: Mapping[str, Any], cls: type = RDLMConfig) -> None:
    """Raise ConfigError naming the first key that is not a field of `cls`."""
    known = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            raise ConfigError(f"unknown config key {key!r}{_suggest(key, known)}")


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# Presets are plain field overrides on top of the dataclass defaults (which are Huginn-0125's).
PRESETS: dict[str, dict[str, Any]] = {
    # The released 3.5B model: (2, 4, 2), h=5280, 55 heads of 96, MLP 17920, vocab 65536, context 4096.
    "huginn-0125": {},
    # For tests: about 0.2M parameters, runs anything in milliseconds.
    "tiny": dict(
        prelude_layers=1,
        core_layers=2,
        coda_layers=1,
        hidden_size=64,
        num_heads=4,
        intermediate_size=160,
        vocab_size=512,
        context_length=256,
        mean_recurrence=8,
        backprop_depth=4,
    ),
    # Ouro's wiring at test size: the whole stack (2 layers) looped 4 times, s_0 = e, no injection, the final
    # norm after every loop, grouped-query attention, the learned exit gate (docs/model-families.md).
    "ouro-tiny": dict(
        prelude_layers=0,
        core_layers=2,
        coda_layers=0,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=160,
        vocab_size=512,
        context_length=256,
        mean_recurrence=4,
        backprop_depth=4,
        recurrence_sampler="fixed",
        qk_bias=False,
        tie_embeddings=False,
        rope_pairs="halves",
        rope_base=10000.0,
        norm_scheme="peri",
        injection="none",
        state_init="embedding",
        final_norm="loop",
        embed_scale=1.0,
        exit_gate=True,
        exit_threshold=0.5,
        family="ouro",
    ),
    # A CPU demo model: a few million parameters.
    "small": dict(
        prelude_layers=1,
        core_layers=2,
        coda_layers=1,
        hidden_size=256,
        num_heads=8,
        intermediate_size=704,
        vocab_size=8192,
        context_length=512,
        mean_recurrence=8,
        backprop_depth=4,
    ),
}
