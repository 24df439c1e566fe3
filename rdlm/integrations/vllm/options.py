"""How a served model recurs inside vLLM: the depth r, the cache mode, an exit criterion and s_0, read from
the model's config (config.json, or vLLM's `hf_overrides`), checked before any weight is loaded.

vLLM builds a model once per server, so these are per served model, not per request:

| key | meaning | default |
|---|---|---|
| `rdlm_num_steps` | core iterations r per token (the cap with an exit criterion) | the checkpoint's mean recurrence (`mean_recurrence`; Ouro's `total_ut_steps`), which `hf_overrides` may also set |
| `rdlm_cache` | `"per-iteration"`: a KV cache per core layer and iteration (exact); `"shared"`: `rdlm_cache_slots` k per core layer, iteration i reading and writing slot i mod k (rdlm's `cache_strategy="shared", cache_slots=k`; k = 1 is the authors' vLLM port) | `"per-iteration"` |
| `rdlm_cache_slots` | k, the shared cache's slots per core layer, 1..r (given alone it means `rdlm_cache: "shared"`) | 1 |
| `rdlm_exit_criterion` | a per-token exit criterion read inside the forward: `"latent-diff"` or `"cosine"` (no readout needed), `"gate"` (a learned exit gate, Ouro); none: fixed r | none |
| `rdlm_exit_threshold` | the criterion's threshold | the criterion's (latent-diff 0.03; gate: the checkpoint's) |
| `rdlm_min_steps` | fewest iterations before a token may exit | 2 (1 for a gate), as `rdlm generate` |
| `rdlm_exit_sync_every` | iterations between two looks at the exit flags (when every token of a step has exited, the loop stops at the next look: the eager loop's host looks, the compiled forward's `torch.cond`s); speed only, never the tokens, as `rdlm generate`'s `exit_sync_every` | the eager loop: 1 on the CPU, 4 on an accelerator; a compiled forward: 8 |
| `rdlm_exit_eager_tokens` | in a compiled engine with an exit criterion, decode steps of at most this many tokens run the eager loop instead of the compiled forward (both stop once every token has exited); speed only, never the tokens | 0: every step compiled |
| `rdlm_seed`, `rdlm_init_scale` | s_0 of the token at position p is row p of rdlm's table drawn from the seed (rdlm.inference.execution.noise) | 0 and 1, `rdlm generate`'s defaults |
"""  # noqa: E501 (a markdown table: its rows cannot wrap)

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rdlm.checks import is_int
from rdlm.inference.exits.criteria import CRITERIA, ExitCriterion, make_exit_criterion
from rdlm.inference.params import MAX_INIT_SCALE, MAX_SEED
from rdlm.model.config import RDLMConfig
from rdlm.model.huginn import config_from_huginn

CACHE_MODES = ("per-iteration", "shared")
PREFIX = "rdlm_"
KEYS = (
    "num_steps",
    "cache",
    "cache_slots",
    "exit_criterion",
    "exit_threshold",
    "min_steps",
    "exit_sync_every",
    "exit_eager_tokens",
    "seed",
    "init_scale",
)
# Criteria read from the state or a gate alone: reading logits would run the coda (and its attention, which
# writes the coda's cache) after every iteration, which costs more than the iterations an exit saves.
SERVED_CRITERIA = tuple(name for name, spec in CRITERIA.items() if not spec.uses_logits and not spec.exact)
MAX_SERVED_STEPS = 4096  # a KV cache per iteration: far more than any model is run at


class RecurrenceOptionError(ValueError):
    """A served model's recurrence option (rdlm_* key of its config or hf_overrides) is invalid."""


@dataclass(frozen=True)
class Recurrence:
    """What the plugin's forward does per token: `num_steps` iterations (fewer once `criterion` says a decoded
    token has converged, never before `min_steps`; the host looks every `sync_every` iterations, None: the
    device's default; in a compiled engine, decode steps of at most `eager_tokens` tokens run the eager loop),
    with `cache` mode (`cache_slots` when shared), from s_0 drawn by `seed` and `init_scale`."""

    num_steps: int
    cache: str = "per-iteration"
    criterion: ExitCriterion | None = None
    min_steps: int = 2
    seed: int = 0
    init_scale: float = 1.0
    cache_slots: int = 1
    sync_every: int | None = None
    eager_tokens: int = 0

    @property
    def core_caches(self) -> int:
        """KV caches per core layer: one per iteration, or the k slots the iterations share."""
        return self.num_steps if self.cache == "per-iteration" else self.cache_slots

    def slot(self, iteration: int) -> int:
        """The core cache that 0-based `iteration` reads and writes: its own, or slot iteration mod k."""
        return iteration % self.core_caches


def split_options(raw: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the config.json keys, the rdlm_* recurrence options) of a served model's config dict."""
    config = {k: v for k, v in raw.items() if not k.startswith(PREFIX)}
    options = {k[len(PREFIX) :]: v for k, v in raw.items() if k.startswith(PREFIX)}
    return config, options


def read(raw: Mapping[str, Any], source: str = "config") -> tuple[RDLMConfig, Recurrence]:
    """The model config and the recurrence of a served model's config dict (config.json with vLLM's
    hf_overrides applied). An unknown rdlm_* key or a bad value is a RecurrenceOptionError naming it."""
    keys, options = split_options(raw)
    config = config_from_huginn(keys, source)
    if config.test_time_noise > 0:
        raise RecurrenceOptionError(
            f"{source}: test_time_noise {config.test_time_noise:g} (noise mixed into the state "
            "before every iteration) is not served by vLLM; set it to 0 to serve the model"
        )
    unknown = sorted(set(options) - set(KEYS))
    if unknown:
        raise RecurrenceOptionError(
            f"{source}: unknown option(s) {', '.join(PREFIX + k for k in unknown)}; "
            f"known: {', '.join(PREFIX + k for k in KEYS)}"
        )
    steps = options.get("num_steps", config.mean_recurrence)
    if not is_int(steps, 1) or steps > MAX_SERVED_STEPS:
        raise RecurrenceOptionError(
            f"{source}: {PREFIX}num_steps must be an integer in 1..{MAX_SERVED_STEPS}, got {steps!r}"
        )
    slots = options.get("cache_slots")
    cache = options.get("cache", "per-iteration" if slots is None else "shared")
    if cache not in CACHE_MODES:
        raise RecurrenceOptionError(f"{source}: {PREFIX}cache must be one of {CACHE_MODES}, got {cache!r}")
    if slots is not None and cache != "shared":
        raise RecurrenceOptionError(f'{source}: {PREFIX}cache_slots goes with {PREFIX}cache "shared", not {cache!r}')
    slots = 1 if slots is None else slots
    if not is_int(slots, 1) or slots > steps:
        raise RecurrenceOptionError(
            f"{source}: {PREFIX}cache_slots must be an integer in 1..{PREFIX}num_steps ({steps}), got {slots!r}"
        )
    criterion = _criterion(config, options, source)
    gate = criterion is not None and criterion.uses_gate
    min_steps = options.get("min_steps", 1 if gate else 2)
    if not is_int(min_steps, 1) or min_steps > steps:
        raise RecurrenceOptionError(
            f"{source}: {PREFIX}min_steps must be an integer in 1..{PREFIX}num_steps ({steps}), got {min_steps!r}"
        )
    sync_every = options.get("exit_sync_every")
    if sync_every is not None and (criterion is None or not is_int(sync_every, 1) or sync_every > steps):
        raise RecurrenceOptionError(
            f"{source}: {PREFIX}exit_sync_every must be an integer in 1..{PREFIX}num_steps ({steps}) and goes with "
            f"{PREFIX}exit_criterion, got {sync_every!r}"
        )
    eager_tokens = options.get("exit_eager_tokens")
    if eager_tokens is not None and (criterion is None or not is_int(eager_tokens, 0)):
        raise RecurrenceOptionError(
            f"{source}: {PREFIX}exit_eager_tokens must be an integer >= 0 and goes with {PREFIX}exit_criterion, "
            f"got {eager_tokens!r}"
        )
    seed = options.get("seed", 0)
    if not is_int(seed, 0) or seed > MAX_SEED:  # rdlm generate's bounds (rdlm.inference.params)
        raise RecurrenceOptionError(f"{source}: {PREFIX}seed must be an integer in 0..2**63-1, got {seed!r}")
    scale = options.get("init_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 <= scale <= MAX_INIT_SCALE:
        raise RecurrenceOptionError(
            f"{source}: {PREFIX}init_scale must be a number in [0, {MAX_INIT_SCALE:g}], got {scale!r}"
        )
    return config, Recurrence(
        steps, cache, criterion, min_steps, seed, float(scale), slots, sync_every, eager_tokens or 0
    )


def _criterion(config: RDLMConfig, options: Mapping[str, Any], source: str) -> ExitCriterion | None:
    name, threshold = options.get("exit_criterion"), options.get("exit_threshold")
    if name is None:
        if threshold is not None:
            raise RecurrenceOptionError(f"{source}: {PREFIX}exit_threshold needs {PREFIX}exit_criterion")
        return None
    if name not in SERVED_CRITERIA:
        raise RecurrenceOptionError(
            f"{source}: {PREFIX}exit_criterion must be one of {SERVED_CRITERIA} inside "
            f"vLLM (criteria that read logits run the coda every iteration), got {name!r}"
        )
    if CRITERIA[name].uses_gate:
        if not config.exit_gate:
            raise RecurrenceOptionError(
                f"{source}: {PREFIX}exit_criterion {name!r} needs a model with a learned exit gate (Ouro)"
            )
        if threshold is None:
            threshold = config.exit_threshold
    try:
        return make_exit_criterion(name, threshold)
    except ValueError as err:
        raise RecurrenceOptionError(f"{source}: {err}") from None
