"""What a generation request asks for: `GenerationConfig`, its parameters in parts (sampling, depth,
exits, the cache, speculative decoding, the parallel sampler, the engine), each declared once with its
type, default, meaning and check; what it returns (`TokenEvent`, `GenerationResult`); and what an engine
that serves requests offers its driver (`Engine`, `BatchEvent`).

The front ends take the parameters from that declaration (`params_for`): the command line's flags
(rdlm/cli/generate.py), the server's request fields (rdlm/inference/server/openai_api.py) and transformers'
generation options (rdlm/integrations/hf/generation.py). Each builds a GenerationConfig, whose checks are
the one validator of them all.

A leaf of rdlm.inference: the engines, the samplers and every front end (the CLI, the server, the
transformers and lm-eval integrations) import it; it imports only the exit criteria and rdlm.checks.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rdlm.checks import Integer, InvalidValue, Number, OneOf, is_int
from rdlm.inference.exits.criteria import ExitCriterion, make_exit_criterion
from rdlm.model.lora import loaded_adapters

if TYPE_CHECKING:  # annotations only: the module stays a leaf
    from rdlm.model.lm import RecurrentDepthLM

Decode = Callable[[list[int]], str]
# Every number a request may carry is bounded where it is declared: a value that passes the checks reaches
# tensors (a long, a float32) and must fit them, and the engine's counts (iterations x tokens) must too.
MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's chat limit)
MAX_INIT_SCALE = 1000.0  # s_0's noise scale at most (the paper's is 1; 1e6 already overflows a float16 core)
MAX_ITERATIONS = 2**16  # core iterations per token (the paper's deepest is 64 x 2; a counter stays far below 2**63)
MAX_TOKENS = 2**20  # tokens of one response (beyond any model's context; a row cannot hold more)
MAX_TOP_K = 2**31 - 1  # tokens to sample among (an int32 index; more than any vocabulary: top_k is then off)
MAX_FACTOR = 1e6  # temperature and repetition_penalty (a float32 logit divided by it stays finite)
MAX_SEED = 2**63 - 1
THRESHOLD = " (a criterion's score, or argmax-stability's iterations)"
FRONT_ENDS = ("cli", "server", "transformers")  # where a parameter may be given by its own name


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """The text before the first stop string in it (what a response returns of a text that hit one)."""
    return text[: min((text.find(s) for s in stops if s in text), default=len(text))]


def kv_cache_budget(slots: int | None) -> dict:
    """The `GenerationConfig` fields of a KV-cache budget of k core slots per token (the front ends'
    `kv_cache_budget`: iteration i uses slot i mod k), or none for None (a slot per iteration)."""
    return {} if slots is None else {"cache_strategy": "shared", "cache_slots": slots}


# --------------------------------------------------------------------------------------------------
# A parameter's declaration, and the parts that group them


# An adapter's name: what a server's clients send as `model`, and a key of the model's LoRA layers (no dots).
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def adapter_name(name: str, value: Any) -> None:
    """A LoRA adapter's name: letters, digits, - and _, at most 64, beginning with a letter or digit."""
    if not isinstance(value, str) or not ADAPTER_NAME.fullmatch(value):
        raise InvalidValue(
            name, f"{name} must be a name of letters, digits, - and _ (at most 64, no dots), got {value!r}"
        )


def known_criterion(name: str, value: Any) -> None:
    """An ExitCriterion, or a name of rdlm.inference.exits.criteria.CRITERIA (an unknown one is told the nearest)."""
    if not isinstance(value, ExitCriterion):
        try:
            make_exit_criterion(value)
        except ValueError as err:
            raise InvalidValue(name, str(err)) from None


@dataclass(frozen=True)
class Param:
    """A generation parameter as declared: the part it belongs to, what it means (one line, which the
    command line's help shows too), its default, its check (None: any value) and the front ends that
    take it by its name. Its name, the type of a value given from outside Python (`kind`: int, float,
    str, bool, tuple) and whether None is a value (its check then skips None) come from its field."""

    part: str
    help: str
    default: Any
    check: Callable[[str, Any], None] | None = None
    front_ends: tuple[str, ...] = ()
    name: str = ""
    kind: type = object
    optional: bool = False


@dataclass(frozen=True)
class Part:
    """A group of GenerationConfig's fields by what they control; calling it declares one field."""

    name: str
    controls: str

    def __call__(
        self,
        default: Any,
        help: str,
        check: Callable[[str, Any], None] | None = None,
        *,
        front_ends: str = "cli",
        compare: bool = True,
    ) -> Any:
        unknown = set(front_ends.split()) - set(FRONT_ENDS)
        if unknown:
            raise TypeError(f"unknown front ends {sorted(unknown)}; they are {FRONT_ENDS}")
        param = Param(self.name, help, default, check, tuple(front_ends.split()))
        return dataclasses.field(default=default, compare=compare, metadata={"param": param})


SAMPLING = Part("sampling", "how each token is drawn from the logits, and when a response ends")
DEPTH = Part("depth", "the core iterations each token gets, and the state they start from")
EXITS = Part("exits", "per-token adaptive compute: when a token stops iterating (paper section 6)")
CACHE = Part("cache", "the KV cache of the core's iterations")
SPECULATIVE = Part("speculative", "self-speculative decoding: drafts at a lower depth, verified at num_steps")
PARALLEL = Part("parallel", "the parallel (diffusion-style) sampler of rdlm.inference.runner.parallel")
ADAPTER = Part("adapter", "which LoRA adapter loaded in the model a request runs with (rdlm.model.lora)")
ENGINE = Part("engine", "how the decode engine runs: set once per engine (rdlm.inference.batching.EngineArgs)")
EVERYWHERE = " ".join(FRONT_ENDS)  # the front ends of a parameter every one of them takes by its name


@dataclass(frozen=True)
class GenerationConfig:
    """What one generation request asks for. Each field is declared once, in its part, with its type,
    default, meaning and check (`PARAMS` lists them); `__post_init__` runs the checks, then the rules
    between the parts. Temperature 0 is greedy (the paper's evaluation convention), as is any below 1e-5."""

    # -- sampling
    max_new_tokens: int = SAMPLING(32, "most tokens to generate per prompt", Integer(0, MAX_TOKENS))
    temperature: float = SAMPLING(0.0, "0 = greedy", Number(0, MAX_FACTOR), front_ends="cli server")
    top_k: int | None = SAMPLING(
        None, "sample from the k most likely tokens only", Integer(1, MAX_TOP_K), front_ends="cli server"
    )
    top_p: float | None = SAMPLING(
        None,
        "sample from the smallest set of tokens with this much probability",
        Number(0, 1, open_low=True),
        front_ends="cli server",
    )
    min_p: float | None = SAMPLING(
        None,
        "drop tokens less likely than min_p x the most likely one",
        Number(0, 1, open_low=True),
        front_ends="cli server",
    )
    repetition_penalty: float = SAMPLING(
        1.0,
        "divide positive (multiply negative) logits of tokens already seen by this (1: off)",
        Number(0, MAX_FACTOR, open_low=True),
        front_ends="cli server",
    )
    seed: int = SAMPLING(0, "seed of s_0 and of sampling (per row)", Integer(0, MAX_SEED), front_ends=EVERYWHERE)
    # The raw logits' (before penalty, temperature and filtering): TokenEvent.logprob and .top.
    logprobs: int | None = SAMPLING(
        None,
        "each token's log-probability under the model and the k most likely tokens' (k = 0..20)",
        Integer(0, MAX_TOP_LOGPROBS),
        front_ends="",
    )
    stop_tokens: tuple[int, ...] = SAMPLING((), "token ids that end a response", front_ends="")
    stop_strings: tuple[str, ...] = SAMPLING(
        (), "strings that end a response (they need a decode function)", front_ends=""
    )

    # -- depth
    num_steps: int = DEPTH(
        32,
        "core iterations r per token (the maximum with an exit criterion)",
        Integer(1, MAX_ITERATIONS),
        front_ends=EVERYWHERE,
    )
    prefill_steps: int | None = DEPTH(
        None, "core iterations r for the prompt (default: num_steps)", Integer(1, MAX_ITERATIONS), front_ends=""
    )
    # A budget for the whole response, honoured by the continuous batch (rdlm serve): a token gets at least
    # one iteration, and the response ends ("length") when the budget cannot give the next one any (depth_cap).
    max_latent_iterations: int | None = DEPTH(
        None,
        "depth budget: most core iterations for all of a response's tokens (at least 1 each)",
        Integer(1, MAX_TOKENS * MAX_ITERATIONS),
        front_ends=EVERYWHERE,
    )
    target_mean_iterations: float | None = DEPTH(
        None,
        "depth budget: keep a response's running mean of iterations per token at most this",
        Number(1, MAX_ITERATIONS),
        front_ends=EVERYWHERE,
    )
    init_scale: float = DEPTH(
        1.0,
        "s_0 noise scale (0: all-zero state)",
        Number(0, MAX_INIT_SCALE, note=" (the scale of s_0's noise; larger overflows inside the core)"),
        front_ends=EVERYWHERE,
    )
    continuous_cot: bool = DEPTH(
        False, "warm-start each token's state from the previous token's final state", front_ends=EVERYWHERE
    )

    # -- exits
    exit_criterion: str | ExitCriterion | None = EXITS(  # noqa: RUF009 (declares the field: Part returns field())
        None,
        "per-token adaptive compute: a criterion of rdlm.inference.exits.criteria.CRITERIA",
        known_criterion,
        front_ends=EVERYWHERE,
    )
    exit_threshold: float | None = EXITS(
        None,
        "default: the criterion's (kl: 5e-4; a learned gate: the checkpoint's)",
        Number(0, MAX_ITERATIONS, note=THRESHOLD),
        front_ends=EVERYWHERE,
    )
    min_steps: int | None = EXITS(
        None,
        "fewest iterations per token before an exit (default 2; 1 for a learned gate)",
        Integer(1, MAX_ITERATIONS),
        front_ends=EVERYWHERE,
    )
    exit_every: int = EXITS(
        1,
        "evaluate the exit criterion every n iterations (1: after each, as in the paper)",
        Integer(1, MAX_ITERATIONS),
        front_ends="cli server",
    )
    # -- cache
    cache_strategy: str = CACHE(
        "full", "KV-cache strategy: full (a slot per iteration) or shared (k slots)", OneOf(("full", "shared"))
    )
    cache_slots: int | None = CACHE(
        None, "k for the shared cache (iteration i uses slot i mod k)", Integer(1, MAX_ITERATIONS)
    )

    # -- speculative
    draft_steps: int | None = SPECULATIVE(
        None,
        "self-speculative decoding: draft with N iterations",
        Integer(1, MAX_ITERATIONS),
        front_ends="cli transformers",
    )
    draft_length: int = SPECULATIVE(
        4, "tokens drafted per speculative round", Integer(1, MAX_TOKENS), front_ends="cli transformers"
    )

    # -- parallel
    sampler: str = PARALLEL(
        "sequential",
        "parallel: the diffusion-style wavefront sampler (a wave per prompt)",
        OneOf(("sequential", "parallel")),
        front_ends="cli server",
    )
    inner_recurrence: int = PARALLEL(4, "parallel: core iterations per wavefront step", Integer(1, MAX_ITERATIONS))
    headway: int = PARALLEL(1, "parallel: new positions per step", Integer(1, MAX_TOKENS))
    freeze_criterion: str | ExitCriterion = PARALLEL(  # noqa: RUF009 (declares the field: Part returns field())
        "latent-diff", "parallel: when a position's state has settled", known_criterion
    )
    freeze_threshold: float | None = PARALLEL(
        None, "parallel: default the criterion's (latent-diff: 0.03)", Number(0, MAX_ITERATIONS, note=THRESHOLD)
    )
    max_wavefront: int | None = PARALLEL(
        128, "parallel: most positions in flight", Integer(1, MAX_TOKENS)
    )  # None: no limit
    # m: s <- (1 - m/(1+i)) s + m/(1+i) noise before each step
    state_noise_mixing: float = PARALLEL(
        0.0, "parallel: noise mixed into each state per step, damped by 1/(1 + iterations)", Number(0, 1)
    )
    embedding_ema: float = PARALLEL(
        0.1, "parallel: EMA weight of a position's earlier input embeddings", Number(0, 1, open_high=True)
    )
    full_prefill: bool = PARALLEL(True, "parallel: prefill the prompt at r (off: the prompt is the first wave)")

    # -- adapter: the command line's --lora and the server's `model` field name it their own way
    adapter: str | None = ADAPTER(
        None,
        "a LoRA adapter loaded in the model, by name (default: the model as set, its active adapter or the base)",
        adapter_name,
        front_ends="",
    )

    # -- engine: deprecated here. How the engine runs is set once per engine, apart from a request's parameters
    # (`generate(..., engine=EngineArgs(...))`, rdlm.inference.batching); these two still reach the engine
    # `generate` builds, with a DeprecationWarning, and change no request's equality or sampling group.
    exit_sync_every: int | None = ENGINE(
        None, "deprecated: EngineArgs.exit_sync_every", Integer(1, MAX_ITERATIONS), front_ends="", compare=False
    )
    compile: bool | None = ENGINE(None, "deprecated: EngineArgs.compile", front_ends="", compare=False)

    def __post_init__(self) -> None:
        # Stops as tuples (a frozen, hashable config; one stop string given as a str is one string, not its letters).
        if isinstance(self.stop_strings, str):
            object.__setattr__(self, "stop_strings", (self.stop_strings,))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        object.__setattr__(self, "stop_tokens", tuple(self.stop_tokens))
        if self.min_steps is None:  # a learned gate may exit after the first iteration, as its reference does
            gate = self.exit_criterion in ("gate", "gate-exact") or getattr(self.exit_criterion, "uses_gate", False)
            object.__setattr__(self, "min_steps", 1 if gate else 2)
        for param in PARAMS:
            value = getattr(self, param.name)
            if param.check is not None and not (value is None and param.optional):
                param.check(param.name, value)
        for name in ("exit_sync_every", "compile"):
            if getattr(self, name) is not None:
                warnings.warn(
                    f"GenerationConfig.{name} is an engine setting: give generate(..., "
                    f"engine=EngineArgs({name}=...)) (rdlm.inference.batching)",
                    DeprecationWarning,
                    stacklevel=3,
                )
        self._check_parts_together()

    def _check_parts_together(self) -> None:
        """The rules between parts (each field's own check ran from its declaration)."""
        plain = self.draft_steps is None and self.sampler == "sequential"  # neither speculative nor parallel
        if self.logprobs is not None and not plain:
            raise ValueError("logprobs come with the sequential sampler without speculative decoding")
        if self.has_depth_budget and not plain:
            raise ValueError(
                "a depth budget (max_latent_iterations, target_mean_iterations) goes with the "
                "sequential sampler without speculative decoding"
            )
        if self.cache_strategy == "shared" and self.cache_slots is None:
            raise ValueError("cache_strategy 'shared' needs cache_slots (the budget k)")
        if self.draft_steps is not None:  # verification must reproduce plain decoding at num_steps
            if self.exit_criterion is not None:
                raise ValueError("speculative decoding runs a fixed number of steps; drop exit_criterion")
            if self.draft_steps >= self.num_steps:
                raise ValueError(
                    f"draft_steps ({self.draft_steps}) must be smaller than num_steps "
                    f"({self.num_steps}), the verification depth"
                )
            if self.temperature != 0:
                raise ValueError("speculative decoding is greedy: use temperature 0")
            if self.cache_strategy != "full" or self.continuous_cot or self.repetition_penalty != 1:
                raise ValueError(
                    "speculative decoding needs the full cache, no continuous_cot and no "
                    "repetition_penalty (so that verification reproduces plain decoding)"
                )
        self.criterion()  # a threshold the criterion cannot take (its name was checked with its field)
        if self.sampler == "parallel":
            if self.exit_criterion is not None or self.draft_steps is not None:
                raise ValueError(
                    "the parallel sampler freezes positions with freeze_criterion; drop exit_criterion and draft_steps"
                )
            if self.inner_recurrence > self.num_steps:
                raise ValueError(
                    f"inner_recurrence ({self.inner_recurrence}) must be at most num_steps "
                    f"({self.num_steps}), the iterations after which a position is final"
                )
            if self.repetition_penalty != 1:
                raise ValueError("the parallel sampler has no repetition_penalty")
            if self.freezer().uses_gate:
                raise ValueError(
                    "the parallel sampler's freeze criterion compares a position's iterations; "
                    "a learned exit gate is not one"
                )

    def criterion(self, model_config=None) -> ExitCriterion | None:
        """The exit criterion; a learned gate's default threshold is `model_config.exit_threshold`."""
        if self.exit_criterion is None or isinstance(self.exit_criterion, ExitCriterion):
            return self.exit_criterion
        threshold = self.exit_threshold
        if threshold is None and self.exit_criterion in ("gate", "gate-exact"):
            threshold = getattr(model_config, "exit_threshold", None)
        return make_exit_criterion(self.exit_criterion, threshold)

    def freezer(self) -> ExitCriterion:
        """The parallel sampler's criterion that freezes a position (a name of CRITERIA or an ExitCriterion)."""
        if isinstance(self.freeze_criterion, ExitCriterion):
            return self.freeze_criterion
        return make_exit_criterion(self.freeze_criterion, self.freeze_threshold)

    def depth_cap(self, produced: int, spent: int) -> int:
        """Core iterations the next new token may run, after `produced` tokens that ran `spent` in all:
        num_steps (prefill_steps for the first), bounded by the depth budget; 0 when the budget is spent."""
        cap = self.num_steps if produced else (self.prefill_steps or self.num_steps)
        if self.max_latent_iterations is not None:
            remaining = self.max_latent_iterations - spent
            if remaining < 1:
                return 0
            later = max(self.max_new_tokens - produced - 1, 0)  # keep one iteration for each later token
            cap = min(cap, max(1, remaining - later))
        if self.target_mean_iterations is not None:
            allowed = self.target_mean_iterations * (produced + 1) - spent  # inf for a target near float's max
            if allowed < cap:
                cap = max(1, math.floor(allowed + 1e-9))
        return cap

    @property
    def has_depth_budget(self) -> bool:
        return self.max_latent_iterations is not None or self.target_mean_iterations is not None

    @property
    def max_steps(self) -> int:
        return max(self.num_steps, self.prefill_steps or self.num_steps)

    @property
    def core_slots(self) -> int:
        """The core cache slots a request cycles through: `cache_slots` when shared, else one per iteration."""
        if self.cache_strategy == "shared":
            assert self.cache_slots is not None  # __post_init__: a shared cache needs cache_slots
            return self.cache_slots
        return self.max_steps

    def finish_reason(self, tokens: list[int], spent: int = 0, decode: Decode | None = None) -> str | None:
        """Why a response ends with its latest token (`tokens`: all its new tokens so far; `spent`: their
        core iterations): "stop_token", "stop_string" (in the text of its last tokens, through `decode`),
        "length" (max_new_tokens, or a depth budget with nothing left for another token); None while it
        goes on. The one stop check of generate and the continuous batch."""
        if tokens[-1] in self.stop_tokens:
            return "stop_token"
        if self.stop_strings:
            assert decode is not None  # check_request: stop strings need a decode function
            window = max(map(len, self.stop_strings)) + 8  # tokens decoded per check
            if any(s in decode(tokens[-window:]) for s in self.stop_strings):
                return "stop_string"
        return "length" if self.at_length(len(tokens), spent) else None

    def at_length(self, produced: int, spent: int) -> bool:
        """Whether `produced` new tokens that ran `spent` core iterations in all end the response by length:
        max_new_tokens, or a depth budget with nothing left for another token (`finish_reason`'s "length")."""
        return produced >= self.max_new_tokens or (self.has_depth_budget and self.depth_cap(produced, spent) == 0)


def _declared(config: type) -> tuple[Param, ...]:
    """The parameters of `config`'s fields, their name, kind and optionality taken from the field."""
    hints, found = typing.get_type_hints(config), []
    for f in dataclasses.fields(config):
        hint = hints[f.name]
        union = typing.get_origin(hint) in (types.UnionType, typing.Union)
        args = typing.get_args(hint) if union else (hint,)
        kind = next(a for a in args if a is not type(None))
        found.append(
            dataclasses.replace(
                f.metadata["param"], name=f.name, kind=typing.get_origin(kind) or kind, optional=type(None) in args
            )
        )
    return tuple(found)


PARAMS = _declared(GenerationConfig)  # its parameters, in the order declared
PARTS = (SAMPLING, DEPTH, EXITS, CACHE, SPECULATIVE, PARALLEL, ADAPTER, ENGINE)
# The shared cache as the server, transformers and lm-eval spell it: one number for two fields (kv_cache_budget).
KV_CACHE_BUDGET = Param(
    "cache",
    "KV-cache budget: k core cache slots per token (iteration i uses slot i mod k)",
    None,
    Integer(1, MAX_ITERATIONS),
    ("server", "transformers"),
    "kv_cache_budget",
    int,
    True,
)


def params_for(front_end: str) -> tuple[Param, ...]:
    """The parameters `front_end` ("cli", "server" or "transformers") takes by their own names, in the order
    declared (the others it spells its own way, or lacks)."""
    if front_end not in FRONT_ENDS:
        raise ValueError(f"front_end must be one of {FRONT_ENDS}, got {front_end!r}")
    return tuple(p for p in (*PARAMS, KV_CACHE_BUDGET) if front_end in p.front_ends)


def check_prompt(model: RecurrentDepthLM, prompt: list[int]) -> None:
    """Refuse a prompt no engine can run: an empty one, or one with an id outside the vocabulary."""
    vocab = model.config.vocab_size
    bad = [t for t in prompt if not is_int(t, 0, vocab)]
    if bad or not prompt:
        raise ValueError(
            f"token id {bad[0]} is outside the vocabulary (size {vocab})"
            if bad
            else "every prompt needs at least one token"
        )


def check_prompts(model: RecurrentDepthLM, prompts: list[list[int]]) -> None:
    """`check_prompt` for each of a batch of prompts; no prompt at all is refused as an empty one."""
    for prompt in prompts or [[]]:
        check_prompt(model, prompt)


def check_length(model: RecurrentDepthLM, prompt_length: int, new_tokens: int) -> None:
    """Refuse a prompt and new tokens that do not fit the model's context."""
    if prompt_length + new_tokens > model.config.context_length:
        raise ValueError(
            f"prompt ({prompt_length}) + new tokens ({new_tokens}) exceeds the context length "
            f"{model.config.context_length}"
        )


def check_request(
    model: RecurrentDepthLM, prompt: list[int], config: GenerationConfig, decode: Decode | None = None
) -> ExitCriterion | None:
    """Refuse a request no engine can run (`check_prompt`, stop strings without `decode` to read them, an
    exit gate or adapter the model lacks); returns its exit criterion."""
    check_prompt(model, prompt)
    if config.stop_strings and decode is None:
        raise ValueError("stop_strings need a decode function (a tokenizer)")
    check_adapter(model, config.adapter)
    return check_criterion(model, config)


def check_adapter(model: RecurrentDepthLM, adapter: str | None) -> None:
    """Refuse an adapter name the model has not loaded (rdlm.model.lora keeps their specs on the model)."""
    loaded = loaded_adapters(model)
    if adapter is not None and adapter not in loaded:
        have = f"it has {', '.join(map(repr, loaded))}" if loaded else "it has none"
        raise ValueError(f"the model has no LoRA adapter named {adapter!r} ({have})")


def check_criterion(model: RecurrentDepthLM, config: GenerationConfig) -> ExitCriterion | None:
    """The exit criterion of `config`, refused when it needs a learned exit gate the model lacks."""
    criterion = config.criterion(model.config)
    check_gate(model, criterion)
    return criterion


def check_gate(model: RecurrentDepthLM, criterion: ExitCriterion | None) -> None:
    """Refuse an exit criterion that reads a learned exit gate on a model without one."""
    if criterion is not None and criterion.uses_gate and model.exit_gate is None:
        raise ValueError(
            f"exit criterion {criterion.name!r} needs a model with a learned exit gate "
            "(an Ouro checkpoint); this one has none"
        )
