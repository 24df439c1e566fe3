"""Continuous batching: a request in a busy batch gives the tokens of `generate` for its prompt alone."""

import random

import pytest
import torch

from rdlm import RDLMConfig, RecurrentDepthLM
from rdlm.inference.batching import ContinuousBatch
from rdlm.inference.generate import GenerationConfig, generate

CONFIGS = [
    GenerationConfig(num_steps=4, max_new_tokens=6, seed=3),
    GenerationConfig(num_steps=12, max_new_tokens=7, exit_criterion="kl", exit_threshold=3e-3),
    GenerationConfig(num_steps=12, max_new_tokens=5, exit_criterion="latent-diff", exit_threshold=0.1,
                     continuous_cot=True),
    GenerationConfig(num_steps=6, max_new_tokens=6, cache_strategy="shared", cache_slots=3),
    GenerationConfig(num_steps=5, max_new_tokens=6, temperature=0.9, top_p=0.9, seed=5),
    GenerationConfig(num_steps=3, prefill_steps=6, max_new_tokens=5),
    GenerationConfig(num_steps=12, max_new_tokens=6, exit_criterion="argmax-stability"),
    GenerationConfig(num_steps=8, max_new_tokens=6, repetition_penalty=1.5, init_scale=0.0),
]


@pytest.fixture(scope="module")
def model() -> RecurrentDepthLM:
    torch.manual_seed(0)
    return RecurrentDepthLM(RDLMConfig.from_preset("tiny")).eval()


def drain(batch: ContinuousBatch) -> dict[int, list]:
    events: dict[int, list] = {}
    while batch.busy:
        for event in batch.step():
            events.setdefault(event.request, []).append(event)
    return events


@pytest.mark.parametrize("sync_every", [1, 3, 4])
def test_a_busy_batch_gives_each_request_its_tokens_alone(model, sync_every):
    """Whenever the host looks at the exit flags (every step, or every 3 or 4 with rows frozen between)."""
    rng = random.Random(0)
    requests = [([rng.randrange(512) for _ in range(rng.randint(1, 9))], CONFIGS[k % len(CONFIGS)])
                for k in range(12)]
    batch = ContinuousBatch(model, max_batch=4, max_length=32, num_slots=12, sync_every=sync_every)
    ids = [batch.add(prompt, config) for prompt, config in requests]
    events = drain(batch)
    for rid, (prompt, config) in zip(ids, requests):
        alone = generate(model, prompt, config)
        assert [e.token for e in events[rid]] == alone.tokens[0]
        assert [e.steps for e in events[rid]] == alone.steps[0]
        assert [e.finish_reason for e in events[rid]][-1] == alone.finish_reasons[0]
        assert all(e.finish_reason is None for e in events[rid][:-1])


def test_rows_that_exit_early_go_on_to_their_next_token(model, monkeypatch):
    """Iteration granularity: a step runs one core iteration for rows at different tokens, and the core
    never runs more row-iterations than the tokens used (no idling behind the slowest row)."""
    rows_run = []
    step = model.step

    def counting_step(state, *args, **kwargs):
        rows_run.append(state.shape[0])
        return step(state, *args, **kwargs)

    config = GenerationConfig(num_steps=12, max_new_tokens=6, exit_criterion="kl", exit_threshold=3e-3)
    batch = ContinuousBatch(model, max_batch=3, max_length=32, num_slots=12)
    ids = [batch.add(p, config) for p in ([5, 17, 99], [250, 11], [1, 2, 3, 4])]
    monkeypatch.setattr(model, "step", counting_step)
    events = drain(batch)
    decoded = sum(e.steps for rid in ids for e in events[rid][1:])
    prefill = 12 * 3                                       # each prompt: one call of 12 iterations
    assert sum(rows_run) - prefill == decoded
    assert len(set(e.steps for rid in ids for e in events[rid][1:])) > 1   # tokens exited at different depths


def test_cancel_frees_the_row_and_others_are_undisturbed(model):
    config = GenerationConfig(num_steps=4, max_new_tokens=8)
    batch = ContinuousBatch(model, max_batch=2, max_length=32, num_slots=4)
    a, b, c = (batch.add(p, config) for p in ([1, 2], [3, 4, 5], [6]))
    first = batch.step()
    assert {e.request for e in first} == {a, b}              # c waits for a row
    batch.cancel(a)
    events = drain(batch)
    assert a not in events and len(events[b]) == 7 and len(events[c]) == 8
    assert [e.token for e in events[c]] == generate(model, [6], config).tokens[0]


def test_requests_that_cannot_be_served_are_refused_by_name(model):
    batch = ContinuousBatch(model, max_batch=2, max_length=16, num_slots=4)
    with pytest.raises(ValueError, match="exceeds the context of 16"):
        batch.add(list(range(10)), GenerationConfig(num_steps=2, max_new_tokens=8))
    with pytest.raises(ValueError, match="needs 8 core cache slots.*at most 4"):
        batch.add([1], GenerationConfig(num_steps=8, max_new_tokens=2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        batch.add([10_000], GenerationConfig(num_steps=2, max_new_tokens=2))
    with pytest.raises(ValueError, match="speculative"):
        batch.add([1], GenerationConfig(num_steps=4, draft_steps=2, max_new_tokens=2))
    with pytest.raises(ValueError, match="parallel sampler.*not available in a continuous batch"):
        batch.add([1], GenerationConfig(num_steps=4, max_new_tokens=2, sampler="parallel"))
    with pytest.raises(ValueError, match="max_batch"):
        ContinuousBatch(model, max_batch=0)
    # a shared cache of 4 slots serves any r
    rid = batch.add([1, 2], GenerationConfig(num_steps=9, max_new_tokens=3, cache_strategy="shared", cache_slots=4))
    assert len(drain(batch)[rid]) == 3


def test_non_finite_logits_fail_the_step_naming_the_weights():
    from rdlm.inference.engine import NonFiniteLogitsError

    torch.manual_seed(0)
    broken = RecurrentDepthLM(RDLMConfig.from_preset("tiny")).eval()
    with torch.no_grad():
        broken.coda[0].mlp.out.weight.fill_(float("nan"))
    broken.source = "runs/broken"
    batch = ContinuousBatch(broken, max_batch=2, max_length=16, num_slots=4)
    batch.add([1, 2, 3], GenerationConfig(num_steps=2, max_new_tokens=3))
    with pytest.raises(NonFiniteLogitsError, match="non-finite logits at new token 1; weights may be NaN: runs/broken"):
        drain(batch)
