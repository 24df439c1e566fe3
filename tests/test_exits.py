import math

import pytest
import torch
import torch.nn.functional as F

from rdlm.exits import CRITERIA, ExitCriterion, make_exit_criterion


def logits_pair(batch=3, vocab=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g), torch.randn(batch, vocab, generator=g)


def test_registry_has_the_criteria_of_the_paper():
    assert set(CRITERIA) == {"kl", "entropy-diff", "latent-diff", "minp-kl", "argmax-stability", "cosine"}
    assert make_exit_criterion("kl").threshold == 5e-4
    assert make_exit_criterion("latent-diff").threshold == 0.03


def test_unknown_name_and_bad_options_give_clear_errors():
    with pytest.raises(ValueError, match="unknown exit criterion 'kll'.*did you mean 'kl'"):
        make_exit_criterion("kll")
    with pytest.raises(ValueError, match="takes no option 'min_p'"):
        make_exit_criterion("kl", min_p=0.2)
    with pytest.raises(ValueError, match="patience"):
        make_exit_criterion("argmax-stability", n=0)
    with pytest.raises(ValueError, match="threshold"):
        make_exit_criterion("kl", threshold="small")
    with pytest.raises(ValueError, match="needs prev_state"):
        make_exit_criterion("latent-diff")(torch.zeros(2, 4), torch.zeros(2, 4))


def test_kl_matches_torch_kl_div_and_fires_only_on_close_distributions():
    prev, cur = logits_pair()
    crit = make_exit_criterion("kl")
    expected = F.kl_div(F.log_softmax(prev, -1), F.log_softmax(cur, -1), log_target=True,
                        reduction="none").sum(-1)
    assert torch.allclose(crit.score(prev, cur), expected, atol=1e-6)
    near = prev.clone()
    near[0] += 1e-3 * torch.randn(16)   # row 0 barely moves; rows 1, 2 are unchanged; use cur for row 2
    near[2] = cur[2]
    out = crit(prev, near)
    assert out.dtype == torch.bool and out.tolist() == [True, True, False]


def test_entropy_diff_is_relative_change_of_entropy():
    prev = torch.zeros(2, 8)                     # uniform: entropy log 8
    cur = torch.stack([torch.zeros(8), torch.tensor([5.0] + [0.0] * 7)])
    crit = make_exit_criterion("entropy-diff", threshold=0.01)
    score = crit.score(prev, cur)
    assert score[0] == 0
    p = F.softmax(cur[1], -1)
    h = -(p * p.log()).sum()
    assert math.isclose(score[1].item(), (math.log(8) - h.item()) / math.log(8), rel_tol=1e-5)
    assert crit(prev, cur).tolist() == [True, False]


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
