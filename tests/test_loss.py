import pytest
import torch
import torch.nn.functional as F

from rdlm import RDLMConfig, RecurrentDepthLM
from rdlm.model.loss import linear_cross_entropy


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_chunked_cross_entropy_matches_logits_and_gradients(reduction):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7), generator=g)
    labels[0, :3] = -100
    ref = F.cross_entropy((hidden @ weight.t()).flatten(0, 1), labels.flatten(), ignore_index=-100,
                          reduction=reduction)
    ref_grads = torch.autograd.grad(ref * 2.5, (hidden, weight))
    ours = linear_cross_entropy(hidden, weight, labels, reduction, chunk_tokens=4)  # 21 tokens: ragged chunks
    grads = torch.autograd.grad(ours * 2.5, (hidden, weight))
    torch.testing.assert_close(ours, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_model_loss_without_logits_matches_the_logits_path():
    torch.manual_seed(0)
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny", context_length=32)).train()
    ids = torch.randint(0, 512, (2, 12))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    full = model(ids, num_steps=(2, 2), labels=labels, init_scale=0)
    full.loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    lean = model(ids, num_steps=(2, 2), labels=labels, init_scale=0, return_logits=False)
    assert lean.logits is None
    lean.loss.backward()
    torch.testing.assert_close(lean.loss, full.loss)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], msg=n)
