import pytest
import torch

from rdlm import RDLMConfig, RecurrentDepthLM
from rdlm.inference.generate import GenerationConfig, generate


@pytest.fixture(scope="module")
def model() -> RecurrentDepthLM:
    torch.manual_seed(1)
    return RecurrentDepthLM(RDLMConfig.from_preset("tiny")).eval()


@pytest.mark.parametrize("draft_steps,draft_length,init_scale", [(1, 3, 1.0), (3, 4, 1.0), (2, 2, 0.0)])
def test_speculative_greedy_equals_plain_greedy(model, draft_steps, draft_length, init_scale):
    prompt = [7, 300, 21, 9, 8]
    plain = generate(model, prompt, GenerationConfig(num_steps=6, max_new_tokens=15, init_scale=init_scale,
                                                     seed=2))
    spec = generate(model, prompt, GenerationConfig(num_steps=6, max_new_tokens=15, init_scale=init_scale,
                                                    seed=2, draft_steps=draft_steps,
                                                    draft_length=draft_length))
    assert spec.tokens == plain.tokens and spec.iterations == plain.iterations
    assert spec.drafted >= draft_length and 0 <= spec.accepted <= spec.drafted
    assert 0.0 <= spec.acceptance_rate <= 1.0


def test_acceptance_accounting_bounds_the_tokens_emitted(model):
    # A round that accepts a of L drafts emits min(a + 1, L) tokens, so the tokens after the first are
    # at most accepted + rounds.
    spec = generate(model, [1, 2, 3], GenerationConfig(num_steps=8, max_new_tokens=20, draft_steps=7,
                                                       draft_length=3))
    rounds = spec.drafted // 3
    assert spec.accepted <= spec.drafted and rounds >= 1
    assert len(spec.tokens[0]) - 1 <= spec.accepted + rounds


def test_speculative_decoding_stops_at_stop_tokens(model):
    plain = generate(model, [4, 5, 6], GenerationConfig(num_steps=5, max_new_tokens=12))
    stop = plain.tokens[0][5]
    spec = generate(model, [4, 5, 6], GenerationConfig(num_steps=5, max_new_tokens=12, draft_steps=2,
                                                       stop_tokens=(stop,)))
    assert spec.tokens[0] == plain.tokens[0][:plain.tokens[0].index(stop) + 1]


def test_speculative_arguments_are_checked(model):
    with pytest.raises(ValueError, match="smaller than num_steps"):
        GenerationConfig(num_steps=4, draft_steps=4)
    with pytest.raises(ValueError, match="greedy"):
        GenerationConfig(num_steps=4, draft_steps=2, temperature=0.7)


def test_a_batch_of_prompts_decodes_speculatively_each_as_plain_greedy(model):
    """Each prompt runs its own rounds in its row of the batch: its tokens are plain greedy decoding's."""
    prompts = [[1, 2], [3, 4, 5, 6], [7]]
    plain = generate(model, prompts, GenerationConfig(num_steps=4, max_new_tokens=9))
    spec = generate(model, prompts, GenerationConfig(num_steps=4, max_new_tokens=9, draft_steps=2, draft_length=3))
    assert spec.tokens == plain.tokens and spec.drafted >= 3 * 3


@pytest.mark.numerics
@pytest.mark.slow  # many decodes in bfloat16 (CPU bfloat16 is slow)
def test_in_bfloat16_speculative_decoding_differs_from_plain_greedy_only_at_near_ties(huginn_tiny_bf16_dir):
    # The batched verification rounds differently from one-token decoding in bfloat16, so a top-2 tie
    # within a few units in the last place may go the other way; anything larger would be a bug.
    from rdlm import load_pretrained

    model = load_pretrained(huginn_tiny_bf16_dir, dtype=torch.bfloat16)
    identical = 0
    for seed in range(6):
        prompt = torch.randint(0, model.config.vocab_size, (6,), generator=torch.Generator().manual_seed(seed))
        prompt = prompt.tolist()
        common = dict(num_steps=8, max_new_tokens=24, init_scale=0.0)
        plain = generate(model, prompt, GenerationConfig(**common)).tokens[0]
        spec = generate(model, prompt, GenerationConfig(draft_steps=2, draft_length=4, **common)).tokens[0]
        if spec == plain:
            identical += 1
            continue
        k = next(i for i, (a, b) in enumerate(zip(plain, spec)) if a != b)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + plain[:k]]), num_steps=8, init_scale=0.0).logits[0, -1].float()
        top = logits.topk(2).values
        ulp = 2.0 ** (torch.floor(torch.log2(top[0].abs())) - 7)  # bfloat16 has 8 significant bits
        assert top[0] - top[1] <= 4 * ulp, f"seed {seed}: diverged at token {k} with a top-2 gap of {top[0] - top[1]}"
    assert identical >= 1
