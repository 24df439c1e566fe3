"""The parallel (diffusion-style) sampler, rdlm/inference/runner/parallel.py."""

import json

import pytest
import torch

from rdlm import RDLMConfig, RecurrentDepthLM, load_pretrained
from rdlm.inference.generate import GenerationConfig, generate, stream
from rdlm.inference.runner.parallel import ParallelSampler

from conftest import FIXTURES, HUGINN_TINY


REFERENCE = json.loads((FIXTURES / "parallel_reference.json").read_text())
# The reference's keyword arguments -> GenerationConfig fields.
FIELDS = dict(inner_recurrence="inner_recurrence", ema_embeds="embedding_ema", max_wavefront="max_wavefront",
              exit_t="freeze_threshold", headway="headway", continuous_compute="continuous_cot",
              full_prefill="full_prefill")


@pytest.fixture(scope="module")
def model() -> RecurrentDepthLM:
    torch.manual_seed(0)
    return RecurrentDepthLM(RDLMConfig.from_preset("tiny")).eval()


@pytest.fixture(scope="module")
def fixture_model() -> RecurrentDepthLM:
    return load_pretrained(HUGINN_TINY).eval()


@pytest.mark.parametrize("r, cache", [(4, {}), (6, {}), (5, dict(cache_strategy="shared", cache_slots=2))])
def test_a_wavefront_of_one_position_at_full_depth_is_sequential_greedy(model, r, cache):
    # s_0 from the (seed, position) noise table, embedding EMA at its default: still token for token
    prompt = [5, 17, 99, 3, 42, 7]
    sequential = generate(model, prompt, GenerationConfig(num_steps=r, max_new_tokens=10, seed=3, **cache))
    parallel = generate(model, prompt, GenerationConfig(num_steps=r, max_new_tokens=10, seed=3, sampler="parallel",
                                                        inner_recurrence=r, max_wavefront=1, **cache))
    assert parallel.tokens == sequential.tokens
    assert parallel.iterations == sequential.iterations
    assert parallel.core_passes == 9 * r and parallel.wave_steps == 9  # one step per token after the prefill


def reference_config(case: dict, **extra) -> GenerationConfig:
    kwargs = {FIELDS[k]: v for k, v in case["reference_kwargs"].items()}
    # num_steps caps the iterations of a position; the reference has no cap, so put it above any count
    # the reference reached (the iterations in the fixture)
    return GenerationConfig(sampler="parallel", num_steps=128, prefill_steps=REFERENCE["prefill_steps"],
                            max_new_tokens=REFERENCE["max_new_tokens"], init_scale=0.0,
                            state_noise_mixing=0.0, **kwargs, **extra)


def with_reference_bookkeeping(next_wave):
    """`ParallelSampler._next_wave` with the reference's freeze comparison: after a step that froze c
    positions, position q is compared with the previous state of position q + c (see rdlm.inference.runner.parallel);
    the last c positions have nothing to be compared with (zeros: a latent difference of 1, never below the
    threshold)."""
    def shifted_next_wave(self, state, keep, init):
        next_wave(self, state, keep, init)
        shifted = self.state[:, keep:]
        self.previous = torch.cat((shifted, torch.zeros_like(self.state[:, shifted.shape[1]:])), dim=1)

    return shifted_next_wave


@pytest.mark.numerics  # the reference sampler's tokens, run elsewhere (CI reruns them with other CPU kernels)
@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: f"{c['name']}-{len(c['prompt'])}")
def test_with_the_references_bookkeeping_it_reproduces_the_reference_exactly(fixture_model, case, monkeypatch):
    monkeypatch.setattr(ParallelSampler, "_next_wave", with_reference_bookkeeping(ParallelSampler._next_wave))
    result = generate(fixture_model, case["prompt"], reference_config(case))
    assert result.tokens[0] == case["tokens"]
    assert result.wave_steps == case["wave_steps"]
    assert result.core_passes == case["core_passes"]
    # the iterations run at the position that chose each token (the prompt's last ran in the prefill, if any)
    assert result.iterations[0] == case["iterations"]


# Where comparing each position with its own previous state (rdlm) instead of the shifted one (the
# reference) changes tokens: a loose threshold freezes a different draft.
ALIGNED_DIFFERS = {("inner2_threshold0.3", 5)}


@pytest.mark.numerics  # the reference sampler's tokens, run elsewhere (CI reruns them with other CPU kernels)
@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: f"{c['name']}-{len(c['prompt'])}")
def test_reference_tokens(fixture_model, case):
    result = generate(fixture_model, case["prompt"], reference_config(case))
    if (case["name"], len(case["prompt"])) in ALIGNED_DIFFERS:
        assert result.tokens[0] != case["tokens"]
    else:
        assert result.tokens[0] == case["tokens"]


def test_fewer_core_passes_than_sequential_and_streams_what_it_returns(fixture_model):
    config = GenerationConfig(sampler="parallel", num_steps=32, inner_recurrence=4, max_new_tokens=12, seed=1)
    events = []
    gen = stream(fixture_model, [1, 2, 3, 4, 5], config)
    while True:
        try:
            events.append(next(gen))
        except StopIteration as stop:
            result = stop.value
            break
    assert [e.token for e in events] == result.tokens[0] and len(result.tokens[0]) == 12
    assert result.core_passes < 11 * 32
    assert all(1 <= s <= 32 for s in result.iterations[0])


def test_stop_tokens_and_zero_new_tokens(model):
    prompt = [5, 17, 99]
    base = dict(sampler="parallel", num_steps=8, max_new_tokens=8, init_scale=0.0)
    full = generate(model, prompt, GenerationConfig(**base)).tokens[0]
    stop = full[3]
    cut = generate(model, prompt, GenerationConfig(**base, stop_tokens=(stop,)))
    assert cut.tokens[0] == full[:full.index(stop) + 1] and cut.finish_reasons == ["stop_token"]
    assert generate(model, prompt, GenerationConfig(**{**base, "max_new_tokens": 0})).tokens == [[]]


@pytest.mark.parametrize("knobs", [
    dict(state_noise_mixing=0.5, temperature=0.8, top_k=20),
    dict(headway=3, max_wavefront=6, continuous_cot=True),
    dict(freeze_criterion="kl", freeze_threshold=1e-3),
    dict(freeze_criterion="argmax-stability"),
    dict(full_prefill=False, embedding_ema=0.0, cache_strategy="shared", cache_slots=1),
])
def test_every_knob_runs_and_a_seed_reproduces_it(model, knobs):
    config = GenerationConfig(sampler="parallel", num_steps=8, inner_recurrence=2, max_new_tokens=10, seed=4,
                              **knobs)
    first = generate(model, [3, 1, 4, 1, 5], config)
    assert len(first.tokens[0]) == 10 and first.wave_steps > 0
    assert generate(model, [3, 1, 4, 1, 5], config).tokens == first.tokens


def test_clear_errors(model):
    with pytest.raises(ValueError, match="Ouro"):
        ouro = RecurrentDepthLM(RDLMConfig.from_preset("ouro-tiny")).eval()
        generate(ouro, [1, 2], GenerationConfig(sampler="parallel", num_steps=4))
    with pytest.raises(ValueError, match="must fit in max_wavefront"):
        generate(model, list(range(1, 10)), GenerationConfig(sampler="parallel", num_steps=4, full_prefill=False,
                                                             max_wavefront=4))
    with pytest.raises(ValueError, match="sampler must be"):
        GenerationConfig(sampler="diffusion")
    with pytest.raises(ValueError, match="inner_recurrence"):
        GenerationConfig(sampler="parallel", num_steps=4, inner_recurrence=8)
    with pytest.raises(ValueError, match="freeze_criterion"):
        GenerationConfig(sampler="parallel", exit_criterion="kl")
    with pytest.raises(ValueError, match="unknown exit criterion"):
        GenerationConfig(sampler="parallel", freeze_criterion="latent_diff")


def test_cli_parallel_sampler_matches_the_api(capsys):
    from rdlm import build_model
    from rdlm.cli import main

    assert main(["generate", "--model", "tiny", "--prompt-ids", "1,2,3", "-r", "8", "--max-new-tokens", "6",
                 "--init-scale", "0", "--sampler", "parallel", "--inner-recurrence", "2", "--stats"]) == 0
    out, err = capsys.readouterr()
    torch.manual_seed(0)  # `tiny` as a preset is a fresh random model: rebuild the same one
    expected = generate(build_model("tiny"), [1, 2, 3], GenerationConfig(
        num_steps=8, max_new_tokens=6, init_scale=0.0, sampler="parallel", inner_recurrence=2))
    assert out.strip() == ",".join(map(str, [1, 2, 3] + expected.tokens[0]))
    assert "wavefront steps" in err


def test_a_batch_of_prompts_runs_a_wave_each_with_the_tokens_of_each_alone(model):
    """Each prompt's wave runs in its own row of the engine: the batch gives every prompt its tokens, iterations
    and wave steps alone (the waves' draws come from each prompt's own generator)."""
    prompts = [[5, 17, 99, 3], [42], [7, 7, 8, 9, 10, 11]]
    config = GenerationConfig(num_steps=6, max_new_tokens=8, sampler="parallel", inner_recurrence=2, headway=2,
                              temperature=0.7, seed=4)
    together = generate(model, prompts, config)
    alone = [generate(model, p, config) for p in prompts]
    assert together.tokens == [a.tokens[0] for a in alone]
    assert together.iterations == [a.iterations[0] for a in alone]
    assert together.wave_steps == sum(a.wave_steps for a in alone) and together.wave_steps > 3 * 7 // 2
