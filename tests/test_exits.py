"""Exit criteria. The reference values come from the authors' exit evaluators run over 20 core iterations
of the huginn-tiny fixture (tests/fixtures/huginn-tiny/make_reference_outputs.py)."""

import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from rdlm.inference.exits.criteria import CRITERIA, ExitCriterion, make_exit_criterion
from rdlm.inference.exits.track import ExitTrack, iterate_with_exits
from tests.conftest import HUGINN_TINY

# Float comparisons with references computed on other machines (CI reruns them with other CPU kernels).
pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def reference():
    return load_file(HUGINN_TINY / "reference_outputs.safetensors")


def logits_pair(batch=3, vocab=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g), torch.randn(batch, vocab, generator=g)


def test_registry_has_the_criteria_of_the_paper():
    heuristic = {"kl", "entropy-diff", "latent-diff", "minp-kl", "argmax-stability", "cosine"}
    # plus the learned exit gate of a model that has one (Ouro; tests/test_families.py)
    assert set(CRITERIA) == heuristic | {"gate", "gate-exact"}
    assert {name for name, spec in CRITERIA.items() if spec.uses_gate} == {"gate", "gate-exact"}
    assert make_exit_criterion("kl").threshold == 5e-4
    assert make_exit_criterion("latent-diff").threshold == 0.03


def test_defaults_are_the_papers_else_the_reference_codes():
    # The paper's kl threshold is 5e-4; the reference code's default ("auto") is 1e-3.
    assert CRITERIA["kl"].threshold == 5e-4 and CRITERIA["kl"].reference_threshold == 1e-3
    assert make_exit_criterion("minp-kl").threshold == 1e-5
    assert make_exit_criterion("entropy-diff").threshold == 1e-3
    assert make_exit_criterion("cosine").threshold == 1e-3
    stable = make_exit_criterion("argmax-stability")
    assert (stable.threshold, stable.patience) == (5, 5)


def test_unknown_name_and_bad_options_give_clear_errors():
    with pytest.raises(ValueError, match="unknown exit criterion 'kll'.*did you mean 'kl'"):
        make_exit_criterion("kll")
    with pytest.raises(ValueError, match="takes no option 'min_p'"):
        make_exit_criterion("kl", min_p=0.2)
    with pytest.raises(ValueError, match="number of steps"):
        make_exit_criterion("argmax-stability", n=0)
    with pytest.raises(ValueError, match="threshold"):
        make_exit_criterion("kl", threshold="small")
    with pytest.raises(ValueError, match="needs prev_state"):
        make_exit_criterion("latent-diff")(torch.zeros(2, 4), torch.zeros(2, 4))


def test_kl_takes_the_previous_distribution_as_target():
    prev, cur = logits_pair()
    crit = make_exit_criterion("kl")
    log_prev, log_cur = F.log_softmax(prev, -1), F.log_softmax(cur, -1)
    kl_prev_cur = (log_prev.exp() * (log_prev - log_cur)).sum(-1)        # KL(p_{i-1} || p_i)
    kl_cur_prev = (log_cur.exp() * (log_cur - log_prev)).sum(-1)
    assert torch.allclose(crit.score(prev, cur), kl_prev_cur, atol=1e-6)
    assert not torch.allclose(crit.score(prev, cur), kl_cur_prev, atol=1e-3)
    near = prev.clone()
    near[0] += 1e-3 * torch.randn(16)   # row 0 barely moves; rows 1, 2 are unchanged; use cur for row 2
    near[2] = cur[2]
    out = crit(prev, near)
    assert out.dtype == torch.bool and out.tolist() == [True, True, False]


def test_entropy_diff_is_the_absolute_change_of_entropy():
    prev = torch.zeros(2, 8)                     # uniform: entropy log 8
    cur = torch.stack([torch.zeros(8), torch.tensor([5.0] + [0.0] * 7)])
    crit = make_exit_criterion("entropy-diff", threshold=0.01)
    score = crit.score(prev, cur)
    assert score[0] == 0
    p = F.softmax(cur[1], -1)
    h = -(p * p.log()).sum()
    assert math.isclose(score[1].item(), math.log(8) - h.item(), rel_tol=1e-5)
    assert torch.equal(score, crit.score(cur, prev))
    assert crit(prev, cur).tolist() == [True, False]


# ---- float32 round-off of the scores, for comparing them across CPUs
#
# Each score is a short float32 computation whose result can cancel: KL is the sum of p * (log p - log p')
# over the vocabulary, whose terms are much larger than the KL near convergence. Two correct float32
# implementations (ours and the reference's, or ours on two CPUs whose exp/log kernels differ by an ulp)
# differ by round-off relative to the *terms*, not to the result. Standard error analysis with
# u = 2^-24 (float32's unit round-off): a bound u * (4 M + log2(n) S), where
#   4 M        the element-wise work (softmax's exp, sum and division, the log or the product), at most
#              a few roundings of each term's magnitude, M = the sum of those magnitudes;
#   log2(n) S  the final reduction over n = V (or h) values, pairwise summed, S = sum of |its terms|.
# Per score, computed in float64 from the same inputs (p, p': the previous and this iteration's
# distribution, filtered for minp-kl; s, s': this and the previous state):
#   kl, minp-kl:   M = sum p' (|log p'| + |log p|),   S = sum p' |log p' - log p|
#   entropy-diff:  M = S = sum p |log p| + sum p' |log p'|
#   latent-diff:   M = S = (||s|| + ||s'||) / ||s||   (the difference, then a ratio of norms)
#   cosine:        M = S = 2                         (1 - cos, cos rounded relative to ||s|| ||s'||)
# Two implementations differ by at most twice the bound. Measured on this fixture with three kernel sets
# (ATEN_CPU_CAPABILITY=default, avx2, avx512): at most 1.3 u M from the float64 value.

U32 = 2.0 ** -24


def roundoff_bound(name, prev_logits, logits, prev_state, state):
    """Per-token bound on |score_float32 - score_exact| (see above), from float64 copies of the inputs."""
    if name in ("kl", "minp-kl", "entropy-diff"):
        log_prev, log_cur = F.log_softmax(prev_logits.double(), -1), F.log_softmax(logits.double(), -1)
        if name == "minp-kl":
            def filtered(log_p):
                p = log_p.exp()
                p = torch.where(p < 0.1 * p.amax(-1, keepdim=True), 1.0 / p.shape[-1], p)
                return (p / p.sum(-1, keepdim=True)).log()
            log_prev, log_cur = filtered(log_prev), filtered(log_cur)
        p_prev, p_cur = log_prev.exp(), log_cur.exp()
        if name == "entropy-diff":
            magnitude = terms = (p_prev * log_prev.abs()).sum(-1) + (p_cur * log_cur.abs()).sum(-1)
        else:
            magnitude = (p_prev * (log_prev.abs() + log_cur.abs())).sum(-1)
            terms = (p_prev * (log_prev - log_cur).abs()).sum(-1)
        n = logits.shape[-1]
    else:
        norm, prev_norm = state.double().norm(dim=-1), prev_state.double().norm(dim=-1)
        magnitude = terms = (norm + prev_norm) / norm if name == "latent-diff" else torch.full_like(norm, 2.0)
        n = state.shape[-1]
    return U32 * (4 * magnitude + math.log2(n) * terms)


@pytest.mark.parametrize("name", ["kl", "minp-kl", "entropy-diff", "latent-diff", "cosine"])
def test_scores_match_the_reference_exit_evaluators(reference, name):
    logits, states = reference["exit_logits"], reference["exit_states"]   # [T, N, V], [T + 1, N, H]
    expected = reference[f"exit_values_{name}"]                           # [T, N]
    crit = make_exit_criterion(name)
    # Iteration t (1-based t + 1) against the one before; the reference's first check compares with
    # its initial values (uniform, entropy 100, s_0), which only the state criteria share with us.
    first = 0 if crit.uses_state and not crit.uses_logits else 1
    for t in range(first, logits.shape[0]):
        inputs = (logits[t - 1] if t else logits[t], logits[t], states[t], states[t + 1])
        score = crit.score(*inputs) if t else crit.score(None, None, *inputs[2:])
        # Both are float32 computations of the same value: within twice the round-off bound (above).
        bound = 2 * roundoff_bound(name, *inputs)
        difference = (score.double() - expected[t].double()).abs()
        assert (difference <= bound).all(), (name, t + 1, (difference / bound).max().item())
        # The bound stays below the default threshold: the scores it allows still decide exits.
        assert (bound < crit.threshold).all()


@pytest.mark.parametrize("name, thresholds", [
    ("kl", [1e-2, 1e-3, 5e-4, 1e-5]), ("minp-kl", [1e-3, 1e-5]), ("entropy-diff", [1e-2, 1e-3, 1e-4]),
    ("latent-diff", [0.1, 0.03]), ("cosine", [1e-2, 1e-3]), ("argmax-stability", [1, 3, 5]),
])
def test_exit_decisions_match_the_reference_over_a_threshold_sweep(reference, name, thresholds):
    """The decision a score drives is compared exactly, except for a token whose reference score lies
    within float32 round-off (twice the bound above) of the threshold: there either side is correct."""
    logits, states = reference["exit_logits"], reference["exit_states"]
    expected = reference[f"exit_values_{name}"]
    compared = 0
    for threshold in thresholds:
        crit = make_exit_criterion(name, threshold)
        streak = None
        for t in range(1, logits.shape[0]):
            inputs = (logits[t - 1], logits[t], states[t], states[t + 1])
            exited, streak = crit.update(streak, *inputs)
            if name == "argmax-stability":   # the reference counts stable steps, exits at count >= threshold
                assert streak.tolist() == expected[t].long().tolist()
                ref_exit, decided = expected[t] >= threshold, torch.ones_like(exited)
            else:
                ref_exit = expected[t] < threshold
                decided = (expected[t].double() - threshold).abs() > 2 * roundoff_bound(name, *inputs)
            assert exited[decided].tolist() == ref_exit[decided].tolist(), (name, threshold, t)
            compared += int(decided.sum())
    assert compared >= 0.95 * len(thresholds) * (logits.shape[0] - 1) * logits.shape[1]


def test_argmax_stability_threshold_is_a_number_of_steps():
    crit = make_exit_criterion("argmax-stability", 3)
    assert (crit.threshold, crit.patience) == (3, 3)
    assert make_exit_criterion("argmax-stability", 3.0) == crit == make_exit_criterion("argmax-stability", n=3)
    with pytest.raises(ValueError, match="number of steps"):
        make_exit_criterion("argmax-stability", 2.5)
    with pytest.raises(ValueError, match="not both"):
        make_exit_criterion("argmax-stability", 3, n=4)
    with pytest.raises(ValueError, match="must equal patience"):
        ExitCriterion("argmax-stability", 0.5, 5)
    same = torch.tensor([[0.0, 1.0]])
    streak = None
    for step in range(3):
        exited, streak = crit.update(streak, same, same)
        assert exited.item() == (step == 2)


def test_latent_diff_and_cosine_on_constructed_states():
    prev = torch.tensor([[[3.0, 4.0], [1.0, 0.0]]])           # [batch 1, seq 2, hidden 2]
    cur = torch.tensor([[[3.0, 4.05], [0.0, 1.0]]])
    latent = make_exit_criterion("latent-diff")
    score = latent.score(prev_state=prev, state=cur)
    assert score.shape == (1, 2)
    assert math.isclose(score[0, 0].item(), 0.05 / math.hypot(3, 4.05), rel_tol=1e-5)
    assert math.isclose(score[0, 1].item(), math.sqrt(2), rel_tol=1e-5)
    assert latent(prev_state=prev, state=cur).tolist() == [[True, False]]
    cosine = make_exit_criterion("cosine")
    assert cosine(prev_state=prev, state=2 * prev).all()      # same direction: distance 0
    assert math.isclose(cosine.score(prev_state=prev, state=cur)[0, 1].item(), 1.0, abs_tol=1e-6)


def test_minp_kl_ignores_changes_in_the_filtered_tail():
    prev = torch.tensor([[10.0, 9.0, 0.0, -1.0, -2.0]])
    cur = torch.tensor([[10.0, 9.0, -3.0, 1.0, -4.0]])       # only the tail below min-p moves
    assert make_exit_criterion("minp-kl").score(prev, cur).item() < 1e-7
    assert make_exit_criterion("kl").score(prev, cur).item() > 1e-5
    moved_head = torch.tensor([[9.0, 10.0, 0.0, -1.0, -2.0]])
    assert not make_exit_criterion("minp-kl")(prev, moved_head).any()


def test_argmax_stability_needs_n_consecutive_agreeing_steps():
    crit = make_exit_criterion("argmax-stability", n=2)
    a = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    b = torch.tensor([[1.0, 0.0], [0.0, 1.0]])   # row 1 flips
    exited, streak = crit.update(None, a, a)
    assert exited.tolist() == [False, False] and streak.tolist() == [1, 1]
    exited, streak = crit.update(streak, a, b)
    assert exited.tolist() == [True, False] and streak.tolist() == [2, 0]


def test_update_with_patience_one_equals_the_plain_decision():
    prev, cur = logits_pair(batch=6)
    crit = make_exit_criterion("kl", threshold=0.5)
    exited, _ = crit.update(None, prev, cur)
    assert torch.equal(exited, crit(prev, cur))
    assert isinstance(crit, ExitCriterion) and crit.uses_logits and not crit.uses_state


# ---- the one per-token exit loop (iterate_with_exits)

def test_exit_loop_freezes_exited_tokens_or_lets_them_iterate():
    # Token 0 stops moving after iteration 1, token 1 never does; latent-diff passes at once for token 0.
    crit = make_exit_criterion("latent-diff", 0.01)

    def step(state, i, exited):
        return state + torch.tensor([[1.0 if i == 0 else 0.0], [1.0]]) * torch.ones(2, 3)

    for freeze in (True, False):
        state, track = iterate_with_exits(step, None, torch.ones(2, 3), ExitTrack.start(2, torch.device("cpu")),
                                          crit, 0, 6, 6, min_steps=2, freeze=freeze)
        assert track.iterations.tolist() == [2, 6] and track.exited.tolist() == [True, False]
        assert state[1].tolist() == [7.0] * 3
    # Split into chunks (as the engine and the analysis run it), the loop gives the same result.
    state, track = torch.ones(2, 3), ExitTrack.start(2, torch.device("cpu"))
    for first in range(0, 6, 4):
        state, track = iterate_with_exits(step, None, state, track, crit, first, min(4, 6 - first), 6)
    assert track.iterations.tolist() == [2, 6]


@pytest.mark.parametrize("name, threshold", [("latent-diff", 0.02), ("latent-diff", 0.2), ("cosine", 2e-3)])
def test_analysis_and_generation_agree_on_exit_steps(tiny_model, name, threshold):
    """Both run `iterate_with_exits`. The first decoded token after a prompt prefilled at full depth sees
    the prompt at the depth it is at itself (a slot per iteration), exactly as in the teacher-forced
    analysis of prompt + that token; a latent criterion does not read the coda, whose cache differs."""
    from rdlm.analysis.exit_steps import exit_steps
    from rdlm.inference.generate import GenerationConfig, generate

    crit = make_exit_criterion(name, threshold)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    config = GenerationConfig(max_new_tokens=2, num_steps=16, exit_criterion=crit, init_scale=0.0)
    result = generate(tiny_model, prompts, config)
    decoded, analysed = [], []
    for prompt, tokens, steps in zip(prompts, result.tokens, result.iterations):
        decoded.append(steps[1])  # iterations at the position of tokens[0], whose logits chose tokens[1]
        analysed.append(int(exit_steps(tiny_model, prompt + tokens[:1], crit, 16, init_scale=0.0)[-1]))
    assert decoded == analysed
    assert min(decoded) < 16 and len(set(decoded)) > 1  # tokens exit early, each at its own step
