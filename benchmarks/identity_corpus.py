"""A corpus of generation cases whose outputs must stay bit for bit the same across a restructure of the
inference engine: record them before, record them after, compare.

    python benchmarks/identity_corpus.py record before.jsonl            # every case, one JSON line each
    python benchmarks/identity_corpus.py record after.jsonl
    python benchmarks/identity_corpus.py compare before.jsonl after.jsonl   # exit status 1 on any difference
    python benchmarks/identity_corpus.py --list [--only SUBSTRING]       # the case names
    python benchmarks/identity_corpus.py record part.jsonl --only served/ --only error/

A case is a name, a kind, a model and its settings; what it records is what the engine produced: new
tokens, iterations per token, finish reasons, text (where a decode function exists), log-probabilities
and their alternatives (as float.hex, so exact), the `on_token` events of
`rdlm.inference.generate.generate` in order, the events of a `ContinuousBatch` driven step by step (with
the step each came at), the server's JSON and its streamed chunks (ids and timestamps dropped), the
logits of teacher-forced forwards (sha256 of the tensor's bytes, shape, dtype), and for a case that fails,
the exception's type and message.

Kinds: `generate` (five models: `tiny`, random and seeded; the huginn-tiny fixture in float32 and
bfloat16; the retrofitted Llama and Ouro family fixtures; plus `tiny-tok`, the tiny preset over a trained
tokenizer, for text and real stop strings), `batch` (a `ContinuousBatch` with requests joining at given
steps, cancelled, or failing), `served` (the FastAPI app of rdlm.inference.server.app in this process: its
lifespan run by hand, requests through httpx's ASGI transport, nothing on a socket), `hf` (transformers'
`generate` and a hand-written greedy loop over `RecurrentCache`, through rdlm.integrations.hf), `logits`
(forwards, the learned gate's exit logits, scores), `analysis` (exit steps of the teacher-forced
analysis) and `error` (what must be refused, with the same type and message).

Exact equality is a claim about one machine: the same kernels, one thread (set here). Record both sides
on the same machine with the same torch; across machines compare within round-off instead. A row's
logits also depend in their last bits on the rows that share its steps (the CPU's matmul rounds
differently for another number of rows), so the served requests that share the batch at once are
recorded without logprobs: which steps they share is the worker thread's timing.

Every case starts from the same global seeds and builds what it needs (models are loaded once and never
modified; a case that breaks weights builds its own model), so `--only` records the same lines as a full
run. The batch is built in `new_batch` and the server in `Served`: if the restructure renames their
options, change them there only.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    from rdlm import RecurrentDepthLM
# rdlm itself is imported where a case runs: `compare` and `--list` work while the package is mid-edit.

FIXTURES = ROOT / "tests" / "fixtures"
MODEL_DIRS = {
    "huginn-tiny": FIXTURES / "huginn-tiny",
    "huginn-tiny-bf16": FIXTURES / "huginn-tiny-bf16",
    "retrofit-llama-tiny": FIXTURES / "families" / "retrofit-llama-tiny",
    "ouro-tiny": FIXTURES / "families" / "ouro-tiny",
}
FAMILY_MODELS = ("tiny", *MODEL_DIRS)  # every generate feature runs on each of these
TOKENIZER_TEXT = "the cat sat on the mat. the dog sat on the log. 1 2 3 4 5 6 7 8 9. " * 10

# Prompts below every model's vocabulary (the family fixtures have 128 ids): lengths 6, 2 and 11.
P1 = [5, 17, 99, 3, 42, 7]
P2 = [120, 11]
P3 = [1, 2, 3, 4, 9, 8, 7, 6, 5, 4, 3]
BATCH = [P1, P2, P3]
LETTERS = "abcdefgh "


def toy_decode(ids: list[int]) -> str:
    """A decode function for models without a tokenizer: one letter per id (stop strings need one)."""
    return "".join(LETTERS[t % len(LETTERS)] for t in ids)


# --------------------------------------------------------------------------------------------------
# Models: loaded once per run, in eval mode, never modified by a case

class Models:
    def __init__(self) -> None:
        self.loaded: dict[str, RecurrentDepthLM] = {}
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from rdlm.data.tokenizer import train_tokenizer

            self._tokenizer = train_tokenizer([TOKENIZER_TEXT], vocab_size=300)
        return self._tokenizer

    def __getitem__(self, name: str) -> RecurrentDepthLM:
        from rdlm import RDLMConfig, RecurrentDepthLM, load_pretrained

        if name not in self.loaded:
            if name == "tiny":  # the test suite's tiny model
                torch.manual_seed(0)
                model = RecurrentDepthLM(RDLMConfig.from_preset("tiny"))
            elif name == "tiny-tok":  # the tiny preset over the trained tokenizer's vocabulary (the served model)
                vocab = self.tokenizer.vocab_size
                torch.manual_seed(0)
                model = RecurrentDepthLM(RDLMConfig.from_preset("tiny", vocab_size=vocab))
            else:
                model = load_pretrained(MODEL_DIRS[name])
            self.loaded[name] = model.eval()
        return self.loaded[name]

    def decode(self, model: str) -> Callable[[list[int]], str]:
        if model == "tiny-tok":
            tok = self.tokenizer
            return lambda ids: tok.decode(ids, skip_special_tokens=True)
        return toy_decode


# --------------------------------------------------------------------------------------------------
# Cases

@dataclass(frozen=True)
class Case:
    name: str
    kind: str                     # generate, batch, served, hf, logits, analysis, error
    model: str | None
    settings: dict
    run: Callable[[Models], dict]
    fails: bool = False           # the case must raise (its record is the error)


def hexf(x: float | None) -> str | None:
    return None if x is None else float(x).hex()


def top_hex(top) -> list | None:
    return None if top is None else [[int(t), hexf(lp)] for t, lp in top]


def tensor_digest(t: torch.Tensor) -> dict:
    """sha256 of a tensor's bytes (row-major), with its shape and dtype."""
    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"sha256": hashlib.sha256(raw).hexdigest(), "shape": list(t.shape), "dtype": str(t.dtype)}


def error_record(err: BaseException) -> dict:
    return {"type": type(err).__name__, "message": str(err)}


def jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return str(value)
    return value


# ---- generate

def run_generate(models: Models, model: str, prompts, config: dict, decode: bool = False,
                 stop_from: str | None = None) -> dict:
    """`generate` with `on_token` collecting the events. `stop_from` ("token" or "string"): first run the
    config without stops and stop at its third token (as a stop token, or as the text of that token)."""
    from rdlm.inference.generate import EngineArgs, GenerationConfig, generate

    m = models[model]
    dec = models.decode(model) if decode or stop_from == "string" else None
    out: dict[str, Any] = {}
    config = dict(config)  # the engine's settings apart (the cases name both together)
    engine = EngineArgs(**{name: config.pop(name) for name in ("compile", "exit_sync_every") if name in config})
    if stop_from is not None:
        plain = generate(m, prompts, GenerationConfig(**config), decode=dec, engine=engine)
        third = plain.tokens[0][min(2, len(plain.tokens[0]) - 1)]
        if stop_from == "token":
            config = {**config, "stop_tokens": (third,)}
            out["stop_tokens"] = [third]
        else:
            text = dec([third]) or LETTERS[0]
            config = {**config, "stop_strings": (text,)}
            out["stop_strings"] = [text]
    events: list = []
    out["events"] = events
    try:
        result = generate(m, prompts, GenerationConfig(**config), decode=dec, engine=engine,
                          on_token=lambda e: events.append([e.row, e.token, e.iterations, hexf(e.logprob), top_hex(e.top)]))
    except Exception as err:  # the record of a case that fails keeps the events before the failure
        out["error"] = error_record(err)
        return out
    out.update(tokens=result.tokens, steps=result.iterations, finish_reasons=result.finish_reasons, texts=result.texts,
               logprobs=None if result.logprobs is None else [[hexf(x) for x in row] for row in result.logprobs],
               counters={"drafted": result.drafted, "accepted": result.accepted, "core_passes": result.core_passes,
                         "wave_steps": result.wave_steps, "prompt_tokens": result.prompt_tokens})
    return out


def gen_case(model: str, feature: str, prompts, decode: bool = False, stop_from: str | None = None,
             fails: bool = False, kind: str = "generate", **config) -> Case:
    settings = {"prompts": prompts, "config": config}
    if decode:
        settings["decode"] = "tokenizer" if model == "tiny-tok" else "toy"
    if stop_from is not None:
        settings["stop_from"] = f"the third token of the run without stops, as a stop {stop_from}"
    return Case(f"{kind}/{model}/{feature}", kind, model, settings,
                lambda models: run_generate(models, model, prompts, config, decode, stop_from), fails)


# Thresholds at which each model's tokens exit at a spread of depths (some below r, not all at once); the
# family fixtures' iterations move more than the Huginn-style models'.
EXIT_THRESHOLDS = {"kl": 3e-3, "entropy-diff": 1e-2, "latent-diff": 0.1, "minp-kl": 1e-3, "argmax-stability": 3,
                   "cosine": 5e-3}
FAMILY_THRESHOLDS = {
    "retrofit-llama-tiny": {"kl": 0.3, "entropy-diff": 3e-2, "latent-diff": 1.0, "minp-kl": 0.2,
                            "argmax-stability": 1, "cosine": 0.6},
    "ouro-tiny": {"kl": 0.3, "entropy-diff": 3e-2, "latent-diff": 0.5, "minp-kl": 0.1, "argmax-stability": 2,
                  "cosine": 0.1},
}


def thresholds(model: str) -> dict[str, float]:
    return FAMILY_THRESHOLDS.get(model, EXIT_THRESHOLDS)


def generate_cases(model: str) -> list[Case]:
    """Every feature of `GenerationConfig` on one model: a fixed r, sampling, log-probabilities, the cache
    strategies, continuous chain of thought, prefill depth, each exit criterion, depth budgets, speculative
    decoding, the parallel sampler, stops, the static step and a prefill alone."""
    base = dict(num_steps=4, max_new_tokens=6)
    exit_base = dict(num_steps=10, max_new_tokens=5)
    t = thresholds(model)
    # Ouro's s_0 is its embedding: the parallel sampler has no noise state to refine (refused).
    parallel = dict(kind="error", fails=True) if model == "ouro-tiny" else {}
    cases = [
        gen_case(model, "greedy", P1, **base),
        gen_case(model, "greedy-zero-init", P1, **base, init_scale=0.0),
        gen_case(model, "greedy-r1", P2, num_steps=1, max_new_tokens=6),
        gen_case(model, "batch3", BATCH, **base),
        gen_case(model, "batch3-logprobs2", BATCH, **base, logprobs=2),
        gen_case(model, "sample-topk", P1, **base, temperature=0.8, top_k=20, seed=1),
        gen_case(model, "sample-topp-minp-batch", BATCH, **base, temperature=1.1, top_p=0.9, min_p=0.05, seed=2),
        gen_case(model, "repetition-penalty", P1, num_steps=3, max_new_tokens=8, repetition_penalty=1.3),
        gen_case(model, "logprobs5", P1, **base, logprobs=5),
        gen_case(model, "logprobs0", P2, **base, logprobs=0),
        gen_case(model, "shared-k1", P1, num_steps=5, max_new_tokens=6, cache_strategy="shared", cache_slots=1),
        gen_case(model, "shared-k2-batch", BATCH, num_steps=5, max_new_tokens=6, cache_strategy="shared",
                 cache_slots=2),
        gen_case(model, "continuous-cot", P1, num_steps=5, max_new_tokens=6, continuous_cot=True),
        gen_case(model, "prefill-steps", P1, num_steps=3, prefill_steps=8, max_new_tokens=6),
        *[gen_case(model, f"exit-{name}", BATCH, **exit_base, exit_criterion=name, exit_threshold=threshold)
          for name, threshold in t.items()],
        gen_case(model, "exit-kl-every2-min3", P1, **exit_base, exit_criterion="kl", exit_threshold=t["kl"],
                 exit_every=2, min_steps=3),
        gen_case(model, "exit-latent-sync3", BATCH, **exit_base, exit_criterion="latent-diff",
                 exit_threshold=t["latent-diff"], exit_sync_every=3),
        gen_case(model, "depth-max-latent", P1, num_steps=6, max_new_tokens=6, max_latent_iterations=20),
        gen_case(model, "depth-target-mean-exit", BATCH, num_steps=8, max_new_tokens=6, target_mean_iterations=3.5,
                 exit_criterion="kl", exit_threshold=t["kl"]),
        gen_case(model, "speculative", P1, num_steps=6, max_new_tokens=8, draft_steps=2, draft_length=3),
        gen_case(model, "speculative-zero-init", P1, num_steps=6, max_new_tokens=8, draft_steps=3, draft_length=4,
                 init_scale=0.0),
        gen_case(model, "parallel", P1, num_steps=6, max_new_tokens=6, sampler="parallel", inner_recurrence=2,
                 seed=3, **parallel),
        gen_case(model, "parallel-headway2", P1, num_steps=4, max_new_tokens=6, sampler="parallel",
                 inner_recurrence=2, headway=2, seed=4, **parallel),
        gen_case(model, "stop-token", P1, stop_from="token", **base),
        gen_case(model, "stop-string", BATCH, stop_from="string", **base),
        gen_case(model, "static-step", BATCH, **base, compile=True),
        gen_case(model, "static-step-exit", BATCH, **exit_base, exit_criterion="kl", exit_threshold=t["kl"],
                 compile=True),
        gen_case(model, "prefill-only", BATCH, num_steps=4, max_new_tokens=0),
    ]
    if model == "ouro-tiny":  # the learned exit gate
        cases += [
            gen_case(model, "exit-gate", BATCH, num_steps=6, max_new_tokens=5, exit_criterion="gate"),
            gen_case(model, "exit-gate-t0.9-logprobs", BATCH, num_steps=6, max_new_tokens=5, exit_criterion="gate",
                     exit_threshold=0.9, logprobs=3),
            gen_case(model, "exit-gate-min2", P1, num_steps=6, max_new_tokens=5, exit_criterion="gate", min_steps=2),
            gen_case(model, "exit-gate-exact", BATCH, num_steps=6, max_new_tokens=5, exit_criterion="gate-exact"),
            gen_case(model, "exit-gate-exact-t0.3-cot", P1, num_steps=6, max_new_tokens=5,
                     exit_criterion="gate-exact", exit_threshold=0.3, continuous_cot=True),
            gen_case(model, "exit-gate-static", BATCH, num_steps=6, max_new_tokens=5, exit_criterion="gate",
                     compile=True),
            gen_case(model, "exit-gate-exact-static", BATCH, num_steps=6, max_new_tokens=5,
                     exit_criterion="gate-exact", compile=True),
            gen_case(model, "exit-gate-shared-k2", P1, num_steps=6, max_new_tokens=5, exit_criterion="gate",
                     cache_strategy="shared", cache_slots=2),
            gen_case(model, "exit-gate-depth-budget", BATCH, num_steps=6, max_new_tokens=5, exit_criterion="gate",
                     target_mean_iterations=2.5),
        ]
    return cases


def tiny_combination_cases() -> list[Case]:
    """Features together, on the tiny model (and text on the tokenizer's tiny model)."""
    m = "tiny"
    P_LONG = [(7 * i + 3) % 512 for i in range(60)]
    five = [P1, P2, P3, [400], [9, 8, 7, 6, 5, 500, 3, 2, 1]]
    return [
        gen_case(m, "batch5-varied-lengths", five, num_steps=3, max_new_tokens=5, seed=4),
        gen_case(m, "long-prompt-prefill12", P_LONG, num_steps=4, prefill_steps=12, max_new_tokens=5),
        gen_case(m, "logprobs20", P1, num_steps=3, max_new_tokens=4, logprobs=20),
        gen_case(m, "init-scale-half-seed7", BATCH, num_steps=4, max_new_tokens=5, init_scale=0.5, seed=7),
        gen_case(m, "exit-kl-shared4-cot-batch", BATCH, num_steps=6, max_new_tokens=5, exit_criterion="kl",
                 exit_threshold=3e-3, cache_strategy="shared", cache_slots=4, continuous_cot=True),
        gen_case(m, "exit-latent-sampled", BATCH, num_steps=12, max_new_tokens=6, exit_criterion="latent-diff",
                 exit_threshold=0.1, temperature=0.9, top_k=40, top_p=0.95, seed=3),
        gen_case(m, "exit-argmax-default", P1, num_steps=12, max_new_tokens=5, exit_criterion="argmax-stability"),
        gen_case(m, "exit-kl-default-threshold", P1, num_steps=12, max_new_tokens=5, exit_criterion="kl"),
        gen_case(m, "exit-kl-every3-min4-logprobs", BATCH, num_steps=12, max_new_tokens=5, exit_criterion="kl",
                 exit_threshold=3e-3, exit_every=3, min_steps=4, logprobs=2),
        gen_case(m, "exit-entropy-penalty", P1, num_steps=12, max_new_tokens=6, exit_criterion="entropy-diff",
                 exit_threshold=1e-2, repetition_penalty=1.5, init_scale=0.0),
        gen_case(m, "depth-both-budgets-exit", BATCH, num_steps=8, max_new_tokens=6, max_latent_iterations=24,
                 target_mean_iterations=4.0, exit_criterion="latent-diff", exit_threshold=0.1),
        gen_case(m, "depth-budget-ends-early", P1, num_steps=6, max_new_tokens=8, max_latent_iterations=9),
        gen_case(m, "static-step-shared-cot", BATCH, num_steps=5, max_new_tokens=5, cache_strategy="shared",
                 cache_slots=2, continuous_cot=True, compile=True),
        gen_case(m, "static-step-sampled", BATCH, num_steps=4, max_new_tokens=5, temperature=0.7, top_p=0.8,
                 seed=11, compile=True),
        gen_case(m, "static-step-depth-budget", BATCH, num_steps=6, max_new_tokens=5, target_mean_iterations=3.0,
                 compile=True),
        gen_case(m, "speculative-draft1", P1, num_steps=5, max_new_tokens=8, draft_steps=1, draft_length=1),
        gen_case(m, "speculative-draft6-stop", P1, num_steps=6, max_new_tokens=10, draft_steps=4, draft_length=6,
                 stop_from="token"),
        gen_case(m, "speculative-logprobs", P1, num_steps=6, max_new_tokens=6, draft_steps=2, logprobs=2,
                 kind="error", fails=True),
        gen_case(m, "parallel-noise-mixing", P1, num_steps=6, max_new_tokens=6, sampler="parallel",
                 inner_recurrence=3, state_noise_mixing=0.5, seed=5),
        gen_case(m, "parallel-freeze-wavefront3", P1, num_steps=8, max_new_tokens=8, sampler="parallel",
                 inner_recurrence=2, freeze_threshold=0.1, max_wavefront=3),
        gen_case(m, "parallel-no-full-prefill", P3, num_steps=4, max_new_tokens=6, sampler="parallel",
                 inner_recurrence=2, full_prefill=False),
        gen_case(m, "parallel-sampled-ema", P1, num_steps=4, max_new_tokens=6, sampler="parallel",
                 inner_recurrence=2, temperature=0.7, seed=5, embedding_ema=0.5),
        gen_case(m, "parallel-shared-k2", P1, num_steps=5, max_new_tokens=6, sampler="parallel",
                 inner_recurrence=5, max_wavefront=1, cache_strategy="shared", cache_slots=2, seed=3),
        gen_case(m, "parallel-cot-cosine", P1, num_steps=6, max_new_tokens=6, sampler="parallel",
                 inner_recurrence=2, continuous_cot=True, freeze_criterion="cosine", freeze_threshold=1e-2),
        gen_case(m, "parallel-logprobs", P1, num_steps=4, max_new_tokens=6, sampler="parallel",
                 inner_recurrence=2, logprobs=1, kind="error", fails=True),
        gen_case(m, "parallel-stop", P1, num_steps=4, max_new_tokens=6, sampler="parallel", inner_recurrence=2,
                 stop_from="token"),
        gen_case("tiny-tok", "text", [282, 258, 278], decode=True, num_steps=4, max_new_tokens=8),
        gen_case("tiny-tok", "text-batch-sampled", [[282, 258, 278], [40, 41]], decode=True, num_steps=4,
                 max_new_tokens=8, temperature=0.9, seed=2),
        gen_case("tiny-tok", "stop-string", [282, 258, 278], stop_from="string", num_steps=4, max_new_tokens=8),
        gen_case("tiny-tok", "stop-strings-exit", [[282, 258, 278], [40, 41, 42]], decode=True, num_steps=10,
                 max_new_tokens=8, exit_criterion="kl", exit_threshold=3e-3, stop_strings=("3", "og")),
    ]


# ---- a ContinuousBatch driven step by step

def new_batch(model: RecurrentDepthLM, decode=None, **options):
    from rdlm.inference.batching import ContinuousBatch

    if "sync_every" in options:   # the cases' name for it before the batch called it exit_sync_every
        options = {("exit_sync_every" if k == "sync_every" else k): v for k, v in options.items()}
    return ContinuousBatch(model, decode=decode, **options)


BATCH_CONFIGS = [
    dict(num_steps=4, max_new_tokens=6, seed=3),
    dict(num_steps=12, max_new_tokens=7, exit_criterion="kl", exit_threshold=3e-3),
    dict(num_steps=12, max_new_tokens=5, exit_criterion="latent-diff", exit_threshold=0.1, continuous_cot=True),
    dict(num_steps=6, max_new_tokens=6, cache_strategy="shared", cache_slots=3),
    dict(num_steps=5, max_new_tokens=6, temperature=0.9, top_p=0.9, seed=5, logprobs=2),
    dict(num_steps=3, prefill_steps=6, max_new_tokens=5),
    dict(num_steps=12, max_new_tokens=6, exit_criterion="argmax-stability"),
    dict(num_steps=8, max_new_tokens=6, repetition_penalty=1.5, init_scale=0.0),
    dict(num_steps=6, max_new_tokens=6, max_latent_iterations=14, exit_criterion="cosine", exit_threshold=5e-3),
    dict(num_steps=10, max_new_tokens=5, target_mean_iterations=4.0, exit_criterion="entropy-diff",
         exit_threshold=1e-2, exit_every=2),
]


def busy_requests(vocab: int, n: int, seed: int = 0) -> list[tuple[list[int], dict, int]]:
    """n requests (prompt, config, the step before which it joins) with every kind of config."""
    rng = random.Random(seed)
    joins = [0, 0, 0, 1, 2, 4, 7, 9, 12, 15]
    return [([rng.randrange(vocab) for _ in range(rng.randint(1, 9))], BATCH_CONFIGS[k % len(BATCH_CONFIGS)],
             joins[k % len(joins)]) for k in range(n)]


def drive_batch(models: Models, model: str, options: dict, requests: list, cancels: dict | None = None,
                decode: bool = False, broken: Callable[[], RecurrentDepthLM] | None = None) -> dict:
    """Add each request before its step, cancel ({request index: step}) before a step, step until idle;
    returns each request's events and the timeline (step, request, token, iterations, finish reason)."""
    from rdlm.inference.generate import GenerationConfig

    m = broken() if broken is not None else models[model]
    batch = new_batch(m, models.decode(model) if decode else None, **options)
    ids: dict[int, int] = {}
    events: dict[int, list] = {k: [] for k in range(len(requests))}
    timeline, failures, refused = [], [], {}
    pending = sorted(range(len(requests)), key=lambda k: requests[k][2])
    cancels = cancels or {}
    step = 0
    while pending or batch.busy:
        while pending and requests[pending[0]][2] <= step:
            k = pending.pop(0)
            prompt, config, _ = requests[k]
            try:
                ids[batch.add(prompt, GenerationConfig(**config))] = k
            except ValueError as err:
                refused[k] = error_record(err)
        for k, at in cancels.items():
            if at == step:
                batch.cancel(next(rid for rid, j in ids.items() if j == k))
        if batch.busy:
            for e in batch.step():
                k = ids[e.request]
                events[k].append([e.token, e.iterations, e.finish_reason, hexf(e.logprob), top_hex(e.top)])
                timeline.append([step, k, e.token, e.iterations, e.finish_reason])
            failures += [[ids[rid], *error_record(err).values()] for rid, err in batch.take_failures()]
        step += 1
        if step > 5000:
            raise RuntimeError("the batch did not finish in 5000 steps")
    return {"events": [events[k] for k in range(len(requests))], "timeline": timeline, "failures": failures,
            "refused": {str(k): v for k, v in refused.items()}, "steps_run": step}


def batch_case(model: str, feature: str, options: dict, requests: list, cancels: dict | None = None,
               decode: bool = False, broken: Callable[[], RecurrentDepthLM] | None = None,
               broken_how: str | None = None) -> Case:
    settings = {"batch": options, "requests": [{"prompt": p, "config": c, "joins_before_step": j}
                                                for p, c, j in requests]}
    if cancels:
        settings["cancel_before_step"] = {str(k): v for k, v in cancels.items()}
    if broken_how:
        settings["weights"] = broken_how
    return Case(f"batch/{model}/{feature}", "batch", model, settings,
                lambda models: drive_batch(models, model, options, requests, cancels, decode, broken))


def broken_embedding() -> RecurrentDepthLM:
    """Token 7 embeds as infinity (head untied): a request whose prompt holds it fails alone."""
    from rdlm import RDLMConfig, RecurrentDepthLM

    torch.manual_seed(0)
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny", tie_embeddings=False)).eval()
    with torch.no_grad():
        model.embedding.weight[7] = float("inf")
    return model


def broken_coda() -> RecurrentDepthLM:
    """NaN in the coda: every request's logits are non-finite."""
    from rdlm import RDLMConfig, RecurrentDepthLM

    torch.manual_seed(0)
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny")).eval()
    with torch.no_grad():
        model.coda[0].mlp.out.weight.fill_(float("nan"))
    model.source = "runs/broken"
    return model


def batch_cases() -> list[Case]:
    cases = []
    small = dict(max_batch=4, max_length=32, num_slots=12)
    # (sync_every, prefill_chunk, coda_every): the host looks every step or every few; prompts whole or in chunks;
    # done rows run their coda at once or wait for others.
    for sync, chunk, coda in [(1, 256, 1), (3, 2, 1), (1, 5, 4), (4, 3, 6), (2, 12, 2)]:
        for compile in (False, True):
            options = dict(small, sync_every=sync, prefill_chunk=chunk, coda_every=coda, compile=compile)
            name = f"busy-sync{sync}-chunk{chunk}-coda{coda}-{'static' if compile else 'eager'}"
            cases.append(batch_case("tiny", name, options, busy_requests(512, 10)))
    together = [(p, BATCH_CONFIGS[1], 0) for p in BATCH]
    two = dict(num_steps=2, max_new_tokens=12)
    chunked = [([7, 8], two, 0), (list(range(3, 33)), two, 1)]   # a 30-token prompt joins a decoding row
    four, six = dict(num_steps=4, max_new_tokens=8), dict(num_steps=6, max_new_tokens=5)
    refusals = [([1, 2], dict(num_steps=2, max_new_tokens=3), 0),
                (list(range(10)), dict(num_steps=2, max_new_tokens=8), 0),      # past the batch's 16 tokens
                ([1], dict(num_steps=8, max_new_tokens=2), 0),                   # more slots than the batch has
                ([1], dict(num_steps=4, draft_steps=2, max_new_tokens=2), 1),
                ([1], dict(num_steps=4, max_new_tokens=2, sampler="parallel"), 1),
                ([1, 2], dict(num_steps=9, max_new_tokens=3, cache_strategy="shared", cache_slots=4), 2)]
    poisoned = dict(num_steps=4, max_new_tokens=6)
    cases += [
        batch_case("tiny", "lockstep-kl", dict(small, sync_every=2), together),
        batch_case("tiny", "lockstep-kl-static", dict(small, sync_every=2, compile=True), together),
        batch_case("tiny", "lockstep-fixed-static", dict(small, compile=True),
                   [(p, BATCH_CONFIGS[0], 0) for p in BATCH]),
        batch_case("tiny", "long-prompt-in-chunks", dict(max_batch=2, max_length=48, num_slots=4, prefill_chunk=8),
                   chunked),
        batch_case("tiny", "long-prompt-in-chunks-static",
                   dict(max_batch=2, max_length=48, num_slots=4, prefill_chunk=8, compile=True), chunked),
        batch_case("tiny", "cancel-running", dict(max_batch=2, max_length=32, num_slots=4),
                   [([1, 2], four, 0), ([3, 4, 5], four, 0), ([6], four, 0)], cancels={0: 1}),
        batch_case("tiny", "cancel-while-prefilling", dict(max_batch=3, max_length=32, num_slots=6, prefill_chunk=10),
                   [([12, 13], dict(six, max_new_tokens=12), 0), ([9, 8, 7, 6, 5], six, 1), ([4, 3], six, 1),
                    ([2, 1, 11], six, 1)], cancels={1: 3}),
        batch_case("tiny", "refusals-beside-work", dict(max_batch=2, max_length=16, num_slots=4), refusals),
        batch_case("tiny", "nan-row-fails-alone", dict(max_batch=2, max_length=32, num_slots=4),
                   [([1, 2, 3], poisoned, 0), ([1, 2, 3, 7, 7, 7, 7, 7, 7], poisoned, 0),
                    ([1, 2, 3, 4, 5, 6, 8, 9, 10, 11], poisoned, 9), ([1, 2, 3], poisoned, 9)],
                   broken=broken_embedding, broken_how="tiny, head untied, token 7 embeds as inf"),
        batch_case("tiny", "nan-weights", dict(max_batch=2, max_length=16, num_slots=4),
                   [([1, 2, 3], dict(num_steps=2, max_new_tokens=3), 0)],
                   broken=broken_coda, broken_how="tiny, NaN in the coda's MLP"),
        batch_case("tiny", "stop-strings-toy", dict(small, sync_every=2),
                   [(P1, dict(num_steps=4, max_new_tokens=8, stop_strings=("c", "ab")), 0),
                    (P2, dict(num_steps=6, max_new_tokens=8, stop_strings=("e",)), 1),
                    (P3, dict(num_steps=5, max_new_tokens=8, stop_tokens=(3, 5)), 2)], decode=True),
        batch_case("tiny-tok", "stop-strings-tokenizer", dict(small, sync_every=2),
                   [([282, 258, 278], dict(num_steps=4, max_new_tokens=8, stop_strings=("the",)), 0),
                    ([40, 41], dict(num_steps=6, max_new_tokens=8, stop_strings=(" ", "at")), 1)], decode=True),
        batch_case("huginn-tiny-bf16", "busy-sync2-chunk3", dict(small, sync_every=2, prefill_chunk=3, coda_every=2),
                   busy_requests(512, 8, seed=1)),
        batch_case("huginn-tiny", "busy-sync1-static", dict(small, compile=True), busy_requests(512, 8, seed=2)),
        batch_case("retrofit-llama-tiny", "busy-sync3-chunk4", dict(small, sync_every=3, prefill_chunk=4),
                   busy_requests(128, 8, seed=3)),
    ]
    gate = [dict(num_steps=6, max_new_tokens=5, exit_criterion="gate"),
            dict(num_steps=6, max_new_tokens=5, exit_criterion="gate-exact", logprobs=1),
            dict(num_steps=4, max_new_tokens=6),
            dict(num_steps=8, max_new_tokens=5, exit_criterion="gate", exit_threshold=0.8, target_mean_iterations=3.0)]
    rng = random.Random(4)
    gate_requests = [([rng.randrange(128) for _ in range(rng.randint(1, 7))], gate[k % 4], [0, 0, 1, 3, 5, 8][k])
                     for k in range(6)]
    for compile in (False, True):
        cases.append(batch_case("ouro-tiny", f"gate-mixed-{'static' if compile else 'eager'}",
                                dict(small, sync_every=2, prefill_chunk=4, coda_every=2, compile=compile),
                                gate_requests))
    return cases


# ---- served: the FastAPI app in this process

SERVE_DEFAULTS = dict(num_steps=4, max_new_tokens=8)


class Served:
    """The server's app for one case: its lifespan (the worker thread) run by hand, requests through the ASGI
    transport (no socket), every wait bounded."""

    def __init__(self, models: Models, **config) -> None:
        from rdlm.inference.params import GenerationConfig
        from rdlm.inference.server.app import ServeConfig, create_app

        self.config = ServeConfig(model_name="tiny", defaults=GenerationConfig(**SERVE_DEFAULTS), max_length=96,
                                  num_slots=16, **config)
        self.app = create_app(models["tiny-tok"], models.tokenizer, self.config)

    async def __aenter__(self) -> "Served":
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.outbox: asyncio.Queue = asyncio.Queue()
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self.lifespan = asyncio.ensure_future(self.app(scope, self.inbox.get, self.outbox.put))
        await self.inbox.put({"type": "lifespan.startup"})
        message = await asyncio.wait_for(self.outbox.get(), 30)
        assert message["type"] == "lifespan.startup.complete", message
        try:  # the HTTP client the openai package uses: httpx2 in openai >= 3, httpx before
            import httpx2 as httpx
        except ImportError:  # pragma: no cover
            import httpx
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://corpus")
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()
        await self.inbox.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(self.outbox.get(), 60)
        await asyncio.wait_for(self.lifespan, 60)

    async def post(self, path: str, body: dict | str) -> dict:
        """Status and body, ids and timestamps dropped; a streamed body as its list of chunks."""
        kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) \
            else {"json": body}
        response = await asyncio.wait_for(self.client.post(path, **kwargs), 60)
        text = response.text
        out: dict[str, Any] = {"status": response.status_code}
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            out["chunks"] = [chunk if chunk == "[DONE]" else anonymous(json.loads(chunk))
                             for chunk in (part.removeprefix("data: ") for part in text.split("\n\n") if part)]
        else:
            out["body"] = anonymous(json.loads(text))
        return out


def anonymous(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if k not in ("id", "created")}


def run_served(models: Models, requests: list[tuple[str, dict | str]], concurrent: bool, config: dict) -> dict:
    async def main() -> list[dict]:
        async with Served(models, **config) as served:
            if concurrent:
                return list(await asyncio.gather(*(served.post(path, body) for path, body in requests)))
            return [await served.post(path, body) for path, body in requests]

    return {"responses": asyncio.run(main())}


def served_case(feature: str, requests: list[tuple[str, dict | str]], concurrent: bool = False,
                **config) -> Case:
    settings = {"server": {**SERVE_DEFAULTS, **config}, "requests": [[p, b] for p, b in requests],
                "concurrent": concurrent}
    return Case(f"served/tiny-tok/{feature}", "served", "tiny-tok", settings,
                lambda models: run_served(models, requests, concurrent, config))


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def completion(prompt: str | list[int] = "the cat", **fields) -> tuple[str, dict]:
    return COMPLETIONS, {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, **fields}


def chat(content: str = "the dog", system: str | None = None, **fields) -> tuple[str, dict]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return CHAT, {"model": "tiny", "messages": messages, "max_tokens": 7, **fields}


def served_cases() -> list[Case]:
    return [
        served_case("completion", [completion()]),
        served_case("completion-stream", [completion(stream=True)]),
        served_case("completion-logprobs3", [completion(logprobs=3)]),
        served_case("completion-logprobs2-stream", [completion(logprobs=2, stream=True)]),
        served_case("completion-logprobs0-usage-stream", [completion(logprobs=0, stream=True,
                                                                     stream_options={"include_usage": True})]),
        served_case("completion-token-ids", [completion([282, 258, 278, 40], max_tokens=5)]),
        served_case("chat", [chat(num_steps=6)]),
        served_case("chat-stream", [chat(num_steps=6, stream=True)]),
        served_case("chat-logprobs", [chat(logprobs=True, top_logprobs=2)]),
        served_case("chat-logprobs-stream-usage", [chat(logprobs=True, top_logprobs=1, stream=True,
                                                        stream_options={"include_usage": True})]),
        served_case("chat-system", [chat("1 2 3", system="count", max_completion_tokens=6)]),
        served_case("exit-kl", [completion("the dog sat", num_steps=12, exit_criterion="kl", exit_threshold=3e-3,
                                           logprobs=1)]),
        served_case("exit-latent-cot-stream", [completion("on the", num_steps=10, exit_criterion="latent-diff",
                                                          exit_threshold=0.1, continuous_cot=True, stream=True)]),
        served_case("exit-every2-min3", [completion("log", num_steps=12, exit_criterion="entropy-diff",
                                                    exit_threshold=1e-2, exit_every=2, min_steps=3)]),
        served_case("kv-cache-budget", [completion("1 2 3", num_steps=8, kv_cache_budget=2, logprobs=1)]),
        served_case("sampled", [completion("log", temperature=0.8, top_p=0.9, top_k=30, min_p=0.02, seed=9)]),
        # Requests that share the batch at once (n = 2, concurrent clients) without logprobs: a row's logits
        # depend in their last bits on which rows share its steps (the CPU's matmul rounds differently for
        # another number of rows), and that depends on when the worker thread takes each request.
        served_case("sampled-n2", [completion("the mat", temperature=0.9, seed=4, n=2)]),
        served_case("repetition-penalty-init0", [completion("the the", repetition_penalty=1.4, init_scale=0.0)]),
        served_case("stop-string", [completion("the cat", stop=["at", "on"], max_tokens=8)]),
        served_case("stop-string-stream", [completion("the cat", stop="at", max_tokens=8, stream=True)]),
        served_case("depth-budget", [completion("the dog", num_steps=6, max_latent_iterations=14,
                                                target_mean_iterations=2.5)]),
        served_case("sequential-requests", [completion("the cat"), chat("the cat"), completion("the cat")]),
        served_case("concurrent-mixed", [
            completion("the cat", num_steps=3), completion("the dog sat", num_steps=12, exit_criterion="kl",
                                                           exit_threshold=3e-3),
            completion("1 2 3", num_steps=8, kv_cache_budget=2), completion("on the", num_steps=5, seed=4),
            chat("the mat", num_steps=10, exit_criterion="latent-diff", exit_threshold=0.1, stream=True),
            completion("log", num_steps=4, temperature=0.8, top_p=0.9, seed=9)], concurrent=True),
        served_case("concurrent-static", [
            completion("the cat", num_steps=3), completion("the dog", num_steps=6, exit_criterion="kl",
                                                           exit_threshold=3e-3, stream=True),
            completion("1 2", num_steps=5, kv_cache_budget=3)], concurrent=True, compile=True),
        # refused requests: status and OpenAI's error object
        served_case("error-num-steps-0", [completion(num_steps=0)]),
        served_case("error-num-steps-over-limit", [completion(num_steps=1000)]),
        served_case("error-unknown-exit", [completion(exit_criterion="kl-divergence")]),
        served_case("error-gate-without-gate", [completion(exit_criterion="gate")]),
        served_case("error-prompt-too-long", [completion("the cat sat on the mat " * 20, max_tokens=8)]),
        served_case("error-model-name", [(COMPLETIONS, {"model": "huginn", "prompt": "the"})]),
        served_case("error-presence-penalty", [completion(presence_penalty=0.5)]),
        served_case("error-n-stream", [completion(n=2, stream=True)]),
        served_case("error-top-logprobs-alone", [chat(top_logprobs=2)]),
        served_case("parallel-sampler", [completion(sampler="parallel")]),       # refused before #45's plan kinds
        served_case("parallel-sampler-stream", [completion(sampler="parallel", stream=True)]),
        served_case("error-max-tokens-0", [completion(max_tokens=0)]),
        served_case("error-unknown-field", [completion(beam_width=4)]),
        served_case("error-bad-json", [(COMPLETIONS, "{not json")]),
        served_case("error-temperature-negative", [completion(temperature=-1)]),
    ]


# ---- logits and analysis

def logits_case(model: str, feature: str, fn: Callable[[RecurrentDepthLM], dict], **settings) -> Case:
    return Case(f"logits/{model}/{feature}", "logits", model, settings, lambda models: fn(models[model]))


def forward(num_steps: int, init_scale: float, seed: int | None, ids: list[int]):
    def run(model: RecurrentDepthLM) -> dict:
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        with torch.inference_mode():
            logits = model(torch.tensor([ids]), num_steps=num_steps, init_scale=init_scale, generator=generator).logits
        return {"logits": tensor_digest(logits)}
    return run


def gate_exit(num_steps: int, threshold: float | None, ids: list[int]):
    def run(model: RecurrentDepthLM) -> dict:
        from rdlm.inference.evaluate import gate_exit_logits

        logits, steps = gate_exit_logits(model, torch.tensor([ids]), num_steps, threshold)
        return {"logits": tensor_digest(logits), "exit_steps": steps.tolist()}
    return run


def nll_sweep(ids: list[list[int]], steps: list[int]):
    def run(model: RecurrentDepthLM) -> dict:
        from rdlm.inference.evaluate import nll_vs_steps

        x = torch.tensor(ids)
        labels = torch.cat([x[:, 1:], torch.full((x.shape[0], 1), -100)], dim=1)
        with torch.inference_mode():
            scores = nll_vs_steps(model, [(x, labels)], steps, seed=1)
        return {str(r): {"nll": [hexf(v) for v in s.nll.tolist()], "greedy": s.greedy.tolist()}
                for r, s in scores.items()}
    return run


def analysis_case(model: str, name: str, threshold: float | None, max_steps: int, ids: list[int],
                  init_scale: float = 0.0) -> Case:
    def run(models: Models) -> dict:
        from rdlm.analysis.exit_steps import exit_steps
        from rdlm.inference.exits.criteria import make_exit_criterion

        crit = make_exit_criterion(name, threshold)
        return {"exit_steps": exit_steps(models[model], ids, crit, max_steps, seed=2, init_scale=init_scale).tolist()}

    settings = {"criterion": name, "threshold": threshold, "max_steps": max_steps, "ids": ids,
                "init_scale": init_scale, "seed": 2}
    return Case(f"analysis/{model}/exit-steps-{name}", "analysis", model, settings, run)


def logits_cases() -> list[Case]:
    ids = P3 + P1
    cases = []
    for model in FAMILY_MODELS:
        cases += [logits_case(model, "forward-r4-zero-init", forward(4, 0.0, None, ids), num_steps=4, init_scale=0.0,
                              ids=ids),
                  logits_case(model, "forward-r2-seeded", forward(2, 1.0, 1, ids), num_steps=2, init_scale=1.0, seed=1,
                              ids=ids)]
    cases += [logits_case("ouro-tiny", "gate-exit-default", gate_exit(6, None, ids), num_steps=6, ids=ids),
              logits_case("ouro-tiny", "gate-exit-t0.9", gate_exit(8, 0.9, ids), num_steps=8, threshold=0.9, ids=ids),
              logits_case("tiny", "nll-vs-steps", nll_sweep([P3[:6], P1], [1, 3, 6]), ids=[P3[:6], P1],
                          steps=[1, 3, 6], seed=1),
              logits_case("huginn-tiny-bf16", "nll-vs-steps", nll_sweep([P3[:6], P1], [2, 4]), ids=[P3[:6], P1],
                          steps=[2, 4], seed=1)]
    for name, threshold in EXIT_THRESHOLDS.items():
        cases.append(analysis_case("huginn-tiny", name, threshold, 12, ids))
    cases += [analysis_case("tiny", "latent-diff", 0.02, 16, [3, 1, 4, 1, 5, 9, 2, 6]),
              analysis_case("retrofit-llama-tiny", "kl", thresholds("retrofit-llama-tiny")["kl"], 10, ids,
                            init_scale=1.0),
              analysis_case("ouro-tiny", "gate", None, 8, ids)]
    return cases


# ---- transformers: `generate` and the recurrent cache through the integration

def hf_model(models: Models, name: str):
    """The fixture through transformers' Auto classes (registered by rdlm.integrations.hf), loaded once."""
    key = f"hf:{name}"
    if key not in models.loaded:
        importlib.import_module("rdlm.integrations.hf")
        from transformers import AutoModelForCausalLM

        models.loaded[key] = AutoModelForCausalLM.from_pretrained(MODEL_DIRS[name]).eval()
    return models.loaded[key]


def hf_generate(name: str, ids: list[list[int]], mask: list[list[int]] | None, options: dict):
    def run(models: Models) -> dict:
        model = hf_model(models, name)
        extra = {} if mask is None else {"attention_mask": torch.tensor(mask)}
        out = model.generate(torch.tensor(ids), **extra, **options)
        sequences = out.sequences if options.get("return_dict_in_generate") else out
        return {"sequences": sequences.tolist(), "dtype": str(next(model.parameters()).dtype)}
    return run


def hf_cached_greedy(name: str, ids: list[int], new_tokens: int, cache: dict, forward: dict):
    """Greedy decoding by hand over forward(past_key_values=RecurrentCache(...)); the last logits too."""
    def run(models: Models) -> dict:
        from rdlm.integrations.hf import RecurrentCache

        model = hf_model(models, name)
        tokens = []
        with torch.no_grad():
            out = model(torch.tensor([ids]), past_key_values=RecurrentCache(**cache), **forward)
            first = tensor_digest(out.logits)
            for _ in range(new_tokens):
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(int(nxt[0]))
                out = model(nxt, past_key_values=out.past_key_values, **forward)
        return {"tokens": tokens, "prompt_logits": first, "final_logits": tensor_digest(out.logits)}
    return run


def hf_case(model: str, feature: str, run: Callable[[Models], dict], fails: bool = False, **settings) -> Case:
    return Case(f"hf/{model}/{feature}", "error" if fails else "hf", model, settings, run, fails)


def hf_cases() -> list[Case]:
    prompt = [[3, 1, 4, 1, 5]]
    padded, mask = [[0, 0, 3, 1, 4], [9, 2, 6, 5, 3]], [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    greedy = dict(max_new_tokens=6, num_steps=4, init_scale=0.0, do_sample=False)
    exits = dict(max_new_tokens=6, num_steps=16, exit_criterion="kl", exit_threshold=1e-3, kv_cache_budget=4,
                 init_scale=0.0, eos_token_id=None)
    cases = []
    for model in ("huginn-tiny", "huginn-tiny-bf16"):
        cases += [hf_case(model, "generate-greedy", hf_generate(model, prompt, None, greedy), ids=prompt,
                          options=greedy),
                  hf_case(model, "generate-exit-kl-budget4", hf_generate(model, prompt, None, exits), ids=prompt,
                          options=exits)]
    options = [
        ("generate-depth-budget", prompt, None, dict(max_new_tokens=6, num_steps=8, max_latent_iterations=14,
                                                     init_scale=0.0, eos_token_id=None)),
        ("generate-reference-spelling", prompt, None, dict(max_new_tokens=6, num_steps=16, criterion="argmax-stability",
                                                           exit_threshold=3, continuous_compute=True,
                                                           eos_token_id=None)),
        ("generate-sampled", prompt, None, dict(max_new_tokens=6, num_steps=4, do_sample=True, temperature=0.8,
                                                top_k=20, seed=3, eos_token_id=None)),
        ("generate-left-padded", padded, mask, dict(greedy, pad_token_id=0, eos_token_id=None)),
        ("generate-speculative", prompt, None, dict(max_new_tokens=8, num_steps=6, draft_steps=2, do_sample=False,
                                                    eos_token_id=None)),
        ("generate-return-dict", prompt, None, dict(greedy, return_dict_in_generate=True)),
        ("error-criteria-disagree", prompt, None, dict(greedy, criterion="kl", exit_criterion="cosine")),
        ("error-threshold-alone", prompt, None, dict(greedy, exit_threshold=1e-3)),
    ]
    for feature, ids, m, opts in options:
        cases.append(hf_case("huginn-tiny", feature, hf_generate("huginn-tiny", ids, m, opts),
                             fails=feature.startswith("error"), ids=ids, attention_mask=m, options=opts))
    forward = dict(num_steps=4, init_scale=0.0)
    cases += [
        hf_case("huginn-tiny", "cached-greedy-full", hf_cached_greedy("huginn-tiny", [5, 9, 14, 3], 6, {}, forward),
                ids=[5, 9, 14, 3], cache={}, forward=forward),
        hf_case("huginn-tiny", "cached-greedy-shared2",
                hf_cached_greedy("huginn-tiny", [5, 9, 14, 3], 6, dict(strategy="shared", num_slots=2),
                                 dict(num_steps=5)),
                ids=[5, 9, 14, 3], cache=dict(strategy="shared", num_slots=2), forward=dict(num_steps=5)),
        hf_case("huginn-tiny-bf16", "cached-greedy-seeded",
                hf_cached_greedy("huginn-tiny-bf16", [5, 9, 14, 3], 5, dict(seed=3), dict(num_steps=3)),
                ids=[5, 9, 14, 3], cache=dict(seed=3), forward=dict(num_steps=3)),
    ]
    return cases


# ---- errors: what must be refused, with the same type and message

def config_error(feature: str, **config) -> Case:
    def run(models: Models) -> dict:
        from rdlm.inference.generate import GenerationConfig

        GenerationConfig(**config)
        return {}

    return Case(f"error/config/{feature}", "error", None, {"config": config}, run, fails=True)


def error_cases() -> list[Case]:
    configs = [
        config_error("num-steps-0", num_steps=0),
        config_error("num-steps-bool", num_steps=True),
        config_error("max-new-tokens-negative", max_new_tokens=-1),
        config_error("min-steps-0", min_steps=0),
        config_error("exit-unknown", exit_criterion="klx"),
        config_error("exit-typo-suggests", exit_criterion="latent_diff"),
        config_error("exit-threshold-nan", exit_criterion="kl", exit_threshold=float("nan")),
        config_error("argmax-threshold-fraction", exit_criterion="argmax-stability", exit_threshold=2.5),
        config_error("gate-threshold-above-1", exit_criterion="gate", exit_threshold=1.5),
        config_error("shared-without-slots", cache_strategy="shared"),
        config_error("cache-strategy-unknown", cache_strategy="half"),
        config_error("cache-slots-0", cache_strategy="shared", cache_slots=0),
        config_error("draft-not-below-r", num_steps=4, draft_steps=4),
        config_error("draft-sampled", num_steps=4, draft_steps=2, temperature=0.7),
        config_error("draft-with-exit", num_steps=4, draft_steps=2, exit_criterion="kl"),
        config_error("draft-with-cot", num_steps=4, draft_steps=2, continuous_cot=True),
        config_error("budget-with-draft", num_steps=4, draft_steps=2, max_latent_iterations=10),
        config_error("target-mean-below-1", target_mean_iterations=0.5),
        config_error("sampler-unknown", sampler="diffusion"),
        config_error("parallel-with-exit", sampler="parallel", exit_criterion="kl"),
        config_error("parallel-inner-above-r", sampler="parallel", num_steps=4, inner_recurrence=8),
        config_error("parallel-penalty", sampler="parallel", num_steps=4, repetition_penalty=1.2),
        config_error("parallel-gate-freeze", sampler="parallel", num_steps=4, freeze_criterion="gate"),
        config_error("temperature-nan", temperature=float("nan")),
        config_error("temperature-negative", temperature=-0.5),
        config_error("top-p-0", top_p=0.0),
        config_error("min-p-above-1", min_p=1.5),
        config_error("seed-negative", seed=-1),
        config_error("init-scale-huge", init_scale=2000.0),
        config_error("repetition-penalty-0", repetition_penalty=0.0),
        config_error("logprobs-21", logprobs=21),
        config_error("embedding-ema-1", embedding_ema=1.0),
    ]
    base = dict(num_steps=2, max_new_tokens=4)
    runs = [
        gen_case("tiny", "prompt-longer-than-context", [1] * 250, kind="error", fails=True, num_steps=2,
                 max_new_tokens=10),
        gen_case("huginn-tiny-bf16", "prompt-longer-than-context", [[1] * 255, [2]], kind="error", fails=True,
                 num_steps=2, max_new_tokens=2),
        gen_case("tiny", "empty-prompt", [[1, 2], []], kind="error", fails=True, **base),
        gen_case("tiny", "no-prompts", [], kind="error", fails=True, **base),
        gen_case("ouro-tiny", "id-outside-vocab", [5, 128], kind="error", fails=True, **base),
        gen_case("tiny", "stop-strings-without-decode", P1, kind="error", fails=True, stop_strings=("a",), **base),
        gen_case("huginn-tiny", "gate-without-gate", P1, kind="error", fails=True, exit_criterion="gate", **base),
        gen_case("tiny", "speculative-batch", BATCH, num_steps=4, draft_steps=2),   # refused before #45's plan kinds
        gen_case("tiny", "parallel-batch", BATCH, num_steps=4, sampler="parallel"),   # refused before #45's plan kinds
        gen_case("tiny", "parallel-no-prefill-too-long", list(range(1, 10)), kind="error", fails=True,
                 num_steps=4, sampler="parallel", full_prefill=False, max_new_tokens=250),
    ]

    def nan_generate(models: Models) -> dict:
        from rdlm.inference.generate import GenerationConfig, generate

        out: dict[str, Any] = {"events": []}
        try:
            generate(broken_coda(), [[1, 2, 3]], GenerationConfig(**base),
                     on_token=lambda e: out["events"].append([e.row, e.token, e.iterations]))
        except Exception as err:
            out["error"] = error_record(err)
        return out

    def inf_generate(models: Models) -> dict:
        from rdlm.inference.generate import GenerationConfig, generate

        out: dict[str, Any] = {"events": []}
        try:
            generate(broken_embedding(), [[1, 2, 3], [1, 7, 7]], GenerationConfig(**base),
                     on_token=lambda e: out["events"].append([e.row, e.token, e.iterations]))
        except Exception as err:
            out["error"] = error_record(err)
        return out

    def batch_error(**options) -> Callable[[Models], dict]:
        def run(models: Models) -> dict:
            new_batch(models["tiny"], **options)
            return {}
        return run

    def batch_add_error(prompt, config, **options) -> Callable[[Models], dict]:
        def run(models: Models) -> dict:
            from rdlm.inference.generate import GenerationConfig

            new_batch(models["tiny"], **options).add(prompt, GenerationConfig(**config))
            return {}
        return run

    small = dict(max_batch=2, max_length=16, num_slots=4)
    runs += [
        Case("error/tiny/nan-weights", "error", "tiny", {"weights": "NaN in the coda's MLP", "config": base},
             nan_generate, fails=True),
        Case("error/tiny/inf-embedding-in-batch", "error", "tiny",
             {"weights": "token 7 embeds as inf, head untied", "config": base}, inf_generate, fails=True),
        Case("error/batch/max-batch-0", "error", "tiny", {"batch": {"max_batch": 0}}, batch_error(max_batch=0),
             fails=True),
        Case("error/batch/sync-every-0", "error", "tiny", {"batch": {"sync_every": 0}}, batch_error(sync_every=0),
             fails=True),
        Case("error/batch/add-too-long", "error", "tiny", {"batch": small, "prompt_length": 10},
             batch_add_error(list(range(10)), dict(num_steps=2, max_new_tokens=8), **small), fails=True),
        Case("error/batch/add-too-few-slots", "error", "tiny", {"batch": small, "num_steps": 8},
             batch_add_error([1], dict(num_steps=8, max_new_tokens=2), **small), fails=True),
        Case("error/batch/add-wave-wider-than-max-wavefront", "error", "tiny", {"batch": small, "sampler": "parallel"},
             batch_add_error([1, 2, 3], dict(num_steps=4, max_new_tokens=2, sampler="parallel", full_prefill=False,
                                             max_wavefront=2), **small), fails=True),
        Case("error/batch/add-gate-without-gate", "error", "tiny", {"batch": small, "exit_criterion": "gate"},
             batch_add_error([1], dict(num_steps=4, max_new_tokens=2, exit_criterion="gate"), **small), fails=True),
    ]
    return configs + runs


def all_cases() -> list[Case]:
    cases = [c for model in FAMILY_MODELS for c in generate_cases(model)]
    cases += tiny_combination_cases() + batch_cases() + served_cases() + hf_cases() + logits_cases()
    cases += error_cases()
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "case names must be unique"
    return cases


# --------------------------------------------------------------------------------------------------
# record and compare

def run_case(case: Case, models: Models) -> dict:
    # Its model loaded first, then the global generators seeded: whatever the case draws from them, it draws
    # the same whether or not an earlier case loaded the model.
    if case.model in ("tiny", "tiny-tok", *MODEL_DIRS):
        models[case.model]
        if case.name.startswith("hf/"):
            hf_model(models, case.model)
    torch.manual_seed(0)
    random.seed(0)
    try:
        result = case.run(models)
    except Exception as err:
        result = {"error": error_record(err)}
    return {"name": case.name, "kind": case.kind, "model": case.model, "settings": jsonable(case.settings),
            "result": jsonable(result)}


def select(cases: list[Case], only: list[str] | None) -> list[Case]:
    return cases if not only else [c for c in cases if any(s in c.name for s in only)]


def record(path: Path, only: list[str] | None) -> int:
    cases = select(all_cases(), only)
    models = Models()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # one thread: the same reductions every run, and fastest for these sizes
    t0 = time.perf_counter()
    try:
        with open(path, "w") as f:
            for case in cases:
                line = run_case(case, models)
                failed = "error" in line["result"]
                if failed != case.fails:   # a note for whoever edits the corpus; the line is recorded as it is
                    what = f"raised {line['result']['error']}" if failed else "did not raise"
                    print(f"note: {case.name} {what}", file=sys.stderr)
                f.write(json.dumps(line, sort_keys=True) + "\n")
    finally:
        torch.set_num_threads(threads)
    print(f"recorded {len(cases)} cases in {time.perf_counter() - t0:.1f} s to {path}", file=sys.stderr)
    return 0


def first_difference(a: Any, b: Any, where: str) -> str | None:
    """Where two JSON values first differ, and how; None if equal."""
    if type(a) is not type(b):
        return f"{where}: {short(a)} != {short(b)}"
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{where}.{key}: {'missing' if key not in a else short(a[key])} != " \
                       f"{'missing' if key not in b else short(b[key])}"
            found = first_difference(a[key], b[key], f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{where}[{i}]")
            if found:
                return found
        if len(a) != len(b):
            return f"{where}: length {len(a)} != {len(b)}"
        return None
    return None if a == b else f"{where}: {short(a)} != {short(b)}"


def short(value: Any, limit: int = 100) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[:limit] + "..."


def load(path: Path) -> dict[str, dict]:
    records = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            records[rec["name"]] = rec
    return records


def compare(a_path: Path, b_path: Path) -> int:
    a, b = load(a_path), load(b_path)
    names = list(a) + [n for n in b if n not in a]
    identical = 0
    for name in names:
        if name not in a or name not in b:
            print(f"{name}: missing in {a_path if name not in a else b_path}")
            continue
        diff = None
        for part in ("kind", "model", "settings", "result"):
            diff = first_difference(a[name].get(part), b[name].get(part), part)
            if diff:
                break
        if diff:
            print(f"{name}: {diff}")
        else:
            identical += 1
    print(f"{len(names)} cases, {identical} identical")
    return 0 if identical == len(names) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", choices=("record", "compare"))
    parser.add_argument("paths", nargs="*", type=Path, help="record: OUT.jsonl; compare: A.jsonl B.jsonl")
    parser.add_argument("--only", action="append", metavar="SUBSTRING",
                        help="only the cases whose name holds this (repeat for several)")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    args = parser.parse_args(argv)
    if args.list:
        for case in select(all_cases(), args.only):
            print(case.name)
        return 0
    if args.command == "record" and len(args.paths) == 1:
        return record(args.paths[0], args.only)
    if args.command == "compare" and len(args.paths) == 2:
        return compare(*args.paths)
    parser.error("give record OUT.jsonl, compare A.jsonl B.jsonl, or --list")
    return 2


if __name__ == "__main__":
    sys.exit(main())
