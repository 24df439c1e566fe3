import math

import pytest
import torch
from safetensors.torch import load_file

from rdlm import RDLMConfig, RecurrentDepthLM, load_pretrained
from rdlm.model.layers import causal_mask

torch.set_grad_enabled(True)


def ids_for(model, batch=2, seq=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)


# ---------------------------------------------------------------------------------------------------
# Conformance with the reference implementation

@pytest.mark.numerics
@pytest.mark.parametrize("r", [1, 4, 16])
def test_reproduces_reference_logits(huginn_tiny_dir, r):
    model = load_pretrained(huginn_tiny_dir)
    expected = load_file(huginn_tiny_dir / "expected_outputs.safetensors")
    ids = expected["input_ids"]
    with torch.no_grad():
        zero = model(ids, num_steps=r, init_scale=0.0).logits
        given = model(ids, num_steps=r, initial_state=expected["input_states"]).logits
    assert (zero - expected[f"logits_zero_state_r{r}"]).abs().max() < 1e-4
    assert (given - expected[f"logits_given_state_r{r}"]).abs().max() < 1e-4


@pytest.mark.numerics
def test_reference_logits_in_bfloat16_stay_close(huginn_tiny_dir):
    model = load_pretrained(huginn_tiny_dir, dtype=torch.bfloat16)
    expected = load_file(huginn_tiny_dir / "expected_outputs.safetensors")
    with torch.no_grad():
        logits = model(expected["input_ids"], num_steps=4, init_scale=0.0).logits
    assert logits.dtype == torch.float32
    ref = expected["logits_zero_state_r4"]
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    assert (logits - ref).abs().max() < 0.25 * ref.abs().max()


# ---------------------------------------------------------------------------------------------------
# Behaviour

@pytest.mark.parametrize("init_scale", [0.0, 1.0])
def test_causal_changing_a_token_changes_no_earlier_logits(tiny_model, init_scale):
    ids = ids_for(tiny_model, batch=1, seq=12)
    changed = ids.clone()
    t = 7
    changed[0, t] = (ids[0, t] + 1) % tiny_model.config.vocab_size
    with torch.no_grad():
        a = tiny_model(ids, num_steps=6, init_scale=init_scale,
                       generator=torch.Generator().manual_seed(1)).logits
        b = tiny_model(changed, num_steps=6, init_scale=init_scale,
                       generator=torch.Generator().manual_seed(1)).logits
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_more_iterations_change_the_output(tiny_model):
    ids = ids_for(tiny_model)
    with torch.no_grad():
        logits = [tiny_model(ids, num_steps=r, init_scale=0.0).logits for r in (1, 2, 8)]
    assert not torch.allclose(logits[0], logits[1])
    assert not torch.allclose(logits[1], logits[2])


def test_zero_state_is_deterministic_and_random_state_is_seeded(tiny_model):
    ids = ids_for(tiny_model)
    with torch.no_grad():
        a = tiny_model(ids, num_steps=3, init_scale=0.0, return_trajectory=True)
        b = tiny_model(ids, num_steps=3, init_scale=0.0)
        r1 = tiny_model(ids, num_steps=3, generator=torch.Generator().manual_seed(5)).logits
        r2 = tiny_model(ids, num_steps=3, generator=torch.Generator().manual_seed(5)).logits
        r3 = tiny_model(ids, num_steps=3, generator=torch.Generator().manual_seed(6)).logits
    assert torch.equal(a.trajectory[0], torch.zeros_like(a.trajectory[0]))
    assert torch.equal(a.logits, b.logits)
    assert torch.equal(r1, r2)
    assert not torch.equal(r1, r3)


def test_state_config_zero_overrides_the_scale():
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny", state_init="zero"))
    out = model(ids_for(model), num_steps=1, init_scale=1.0, return_trajectory=True)
    assert torch.count_nonzero(out.trajectory[0]) == 0


def test_trajectory_and_state_are_returned(tiny_model):
    with torch.no_grad():
        out = tiny_model(ids_for(tiny_model, seq=5), num_steps=4, return_state=True,
                         return_trajectory=True)
    assert len(out.trajectory) == 5
    assert torch.equal(out.state, out.trajectory[-1])
    assert out.state.shape == (2, 5, 64)
    assert out.num_steps == (0, 4)


def test_only_the_last_k_iterations_build_a_graph():
    torch.manual_seed(0)
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny")).train()
    grad_modes = []
    model.core[0].register_forward_hook(lambda m, i, o: grad_modes.append(o.requires_grad))
    out = model(ids_for(model), num_steps=(5, 3), labels=ids_for(model, seed=1))
    assert out.num_steps == (5, 3)
    assert grad_modes == [False] * 5 + [True] * 3
    out.loss.backward()
    # The prelude still gets gradient: e enters every iteration that keeps its graph.
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_truncated_gradient_equals_detaching_the_state_by_hand():
    torch.manual_seed(0)
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny")).train()
    ids, labels = ids_for(model), ids_for(model, seed=1)
    model(ids, num_steps=(4, 2), labels=labels, init_scale=0.0).loss.backward()
    auto = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    rope = model.rope(torch.arange(ids.shape[1]))
    e = model.embed(ids, rope)
    s = torch.zeros_like(e)
    for i in range(4):
        s = model.step(s, e, i, rope).detach()
    for i in range(4, 6):
        s = model.step(s, e, i, rope)
    torch.nn.functional.cross_entropy(model.readout(s, rope).flatten(0, 1), labels.flatten()).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, auto[name], msg=name)


def test_training_mode_draws_r_from_the_sampler():
    torch.manual_seed(0)
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny", mean_recurrence=6, backprop_depth=2)).train()
    draws = [model.resolve_num_steps(None, torch.Generator().manual_seed(s)) for s in range(200)]
    assert all(k == min(2, n + k) for n, k in draws)
    assert len({n + k for n, k in draws}) > 3  # r varies
    assert 4 < sum(n + k for n, k in draws) / len(draws) < 8.5  # mean near mean_recurrence (+1 offset)
    assert model.eval().resolve_num_steps(None) == (0, 6)


def test_activation_checkpointing_gives_the_same_gradients():
    ids = ids_for(RecurrentDepthLM(RDLMConfig.from_preset("tiny")))
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = RecurrentDepthLM(RDLMConfig.from_preset("tiny", activation_checkpointing=ckpt)).train()
        model(ids, num_steps=(1, 3), labels=ids, init_scale=0.0).loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("bad", [0, (0, 0), (-1, 2), (1, 2, 3), "four"])
def test_invalid_num_steps_is_an_error(tiny_model, bad):
    with pytest.raises(ValueError, match="num_steps"):
        tiny_model(ids_for(tiny_model), num_steps=bad)


def test_sequence_beyond_the_context_is_an_error(tiny_model):
    ids = torch.zeros(1, tiny_model.config.context_length + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="context length"):
        tiny_model(ids, num_steps=1)


def test_wrong_initial_state_shape_is_an_error(tiny_model):
    with pytest.raises(ValueError, match="initial_state"):
        tiny_model(ids_for(tiny_model), num_steps=1, initial_state=torch.zeros(1, 2, 3))


@pytest.mark.parametrize("switch", [dict(norm_scheme="prenorm"), dict(injection="add"),
                                    dict(qk_bias=False), dict(tie_embeddings=False),
                                    dict(prelude_layers=0, coda_layers=0)])
def test_ablation_switches_build_and_train(switch):
    torch.manual_seed(0)
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny", **switch)).train()
    ids = ids_for(model)
    out = model(ids, num_steps=(1, 2), labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(p.grad is not None for p in model.parameters())
    if "injection" in switch:
        assert model.adapter is None
    if switch.get("norm_scheme") == "prenorm":
        assert not hasattr(model.core[0], "norm_2")


def test_fixed_depth_baseline_is_r_equal_one():
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny", mean_recurrence=1, recurrence_sampler="fixed"))
    model.train()
    assert {model.resolve_num_steps(None) for _ in range(20)} == {(0, 1)}


# ---------------------------------------------------------------------------------------------------
# Initialization and size

def test_init_std_matches_takase():
    torch.manual_seed(0)
    config = RDLMConfig.from_preset("small")
    model = RecurrentDepthLM(config)
    h, depth = config.hidden_size, config.effective_depth
    trunc = 0.98664  # std of a normal truncated at 3 sigma, relative to the untruncated one
    std, out_std = math.sqrt(2 / (5 * h)), math.sqrt(1 / (5 * h * depth))
    for name, param in model.named_parameters():
        if name.endswith(("attn.out.weight", "mlp.out.weight")):
            assert param.std().item() == pytest.approx(out_std * trunc, rel=0.03), name
            assert param.abs().max() <= 3 * out_std + 1e-7, name
        elif name.endswith("qk_bias"):
            assert torch.count_nonzero(param) == 0
        elif param.ndim == 1:
            assert torch.equal(param, torch.ones_like(param)), name
        else:
            assert param.std().item() == pytest.approx(std * trunc, rel=0.03), name
            assert param.abs().max() <= 3 * std + 1e-7, name
    e = torch.zeros(4, 256, h)
    s0 = model.init_state(e, generator=torch.Generator().manual_seed(0))
    assert s0.std().item() == pytest.approx(math.sqrt(2 / 5) * trunc, rel=0.02)  # variance 2/5 overall


def test_huginn_preset_has_about_3_5_billion_parameters_on_meta():
    with torch.device("meta"):
        model = RecurrentDepthLM(RDLMConfig.from_preset("huginn-0125"))
    groups = model.parameter_groups()
    assert next(model.parameters()).is_meta
    assert 3.4e9 < sum(groups.values()) < 3.7e9
    assert 1.5e9 < groups["prelude"] + groups["coda"] < 1.7e9  # "about 1.5B in prelude+coda"
    assert 1.5e9 < groups["core"] < 1.7e9                      # "1.5B in the core"
    assert 0.3e9 < groups["embedding"] < 0.5e9                 # the tied embedding


def test_tiny_and_small_presets_have_their_intended_sizes():
    sizes = {}
    for name in ("tiny", "small"):
        with torch.device("meta"):
            sizes[name] = RecurrentDepthLM(RDLMConfig.from_preset(name)).num_parameters()
    assert sizes["tiny"] < 1_000_000
    assert 2_000_000 < sizes["small"] < 10_000_000


# ---------------------------------------------------------------------------------------------------
# KV-cache hook

class AppendCache:
    """The simplest cache: one growing tensor per (group, layer, iteration)."""

    def __init__(self):
        self.store = {}
        self.keys_seen = []

    def update(self, key, k, v):
        self.keys_seen.append(key)
        if key in self.store:
            k0, v0 = self.store[key]
            k, v = torch.cat([k0, k], dim=2), torch.cat([v0, v], dim=2)
        self.store[key] = (k, v)
        return k, v


def test_cache_hook_gives_the_logits_of_a_full_recompute(tiny_model):
    ids = ids_for(tiny_model, batch=2, seq=9)
    cache = AppendCache()
    with torch.no_grad():
        full = tiny_model(ids, num_steps=3, init_scale=0.0).logits
        first = tiny_model(ids[:, :6], num_steps=3, init_scale=0.0, cache=cache).logits
        rest = tiny_model(ids[:, 6:], num_steps=3, init_scale=0.0, cache=cache, position_offset=6).logits
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, atol=1e-5, rtol=1e-5)
    expected_keys = {("prelude", 0, -1), ("coda", 0, -1)} | {("core", j, i) for j in range(2) for i in range(3)}
    assert set(cache.keys_seen) == expected_keys


def test_causal_mask_aligns_queries_with_the_last_keys():
    mask = causal_mask(2, 4)
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_eager_attention_gives_the_sdpa_logits(tiny_model):
    ids = torch.randint(0, 512, (2, 9))
    with torch.no_grad():
        fused = tiny_model(ids, num_steps=3, init_scale=0.0).logits
        tiny_model.set_attention("eager")
        plain = tiny_model(ids, num_steps=3, init_scale=0.0).logits
        padded = tiny_model(ids, num_steps=3, init_scale=0.0, attention_mask=causal_mask(9, 9)).logits
    torch.testing.assert_close(plain, fused, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded, fused, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="attention implementation"):
        tiny_model.set_attention("flash_attention_2")


def test_forward_compiles_as_one_graph(tiny_model):
    # backend="eager" traces with dynamo (graph breaks, guards) without inductor's code generation.
    torch._dynamo.reset()
    compiled = torch.compile(tiny_model, fullgraph=True, backend="eager")
    ids = torch.randint(0, 512, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids, num_steps=3, init_scale=0.0).logits,
                                   tiny_model(ids, num_steps=3, init_scale=0.0).logits)
        noisy = compiled(ids, num_steps=3, positions=torch.arange(7)).logits  # random s_0, given positions
    assert noisy.shape == (2, 7, 512) and noisy.isfinite().all()
    with pytest.raises(Exception, match="beyond the context length"):  # found while tracing, before running
        compiled(ids, num_steps=1, position_offset=250)


def test_a_compiled_step_is_not_recompiled_when_r_changes(tiny_model):
    from torch._dynamo.utils import counters

    ids = torch.randint(0, 512, (1, 5))
    torch._dynamo.reset()
    counters.clear()
    tiny_model.compile_step(fullgraph=True, backend="eager")
    with torch.no_grad():
        tiny_model(ids, num_steps=2)
        graphs = counters["stats"]["unique_graphs"]
        for r in (5, 1, 9):
            tiny_model(ids, num_steps=r)
    assert graphs >= 1 and counters["stats"]["unique_graphs"] == graphs
    # Compiling forward unrolls the loop: a new graph for each r.
    torch._dynamo.reset()
    counters.clear()
    model = RecurrentDepthLM(tiny_model.config).eval()
    whole = torch.compile(model, backend="eager")
    with torch.no_grad():
        whole(ids, num_steps=2)
        whole(ids, num_steps=3)
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.slow
def test_inductor_compiles_the_step_once_for_every_r(tiny_model):
    ids = torch.randint(0, 512, (1, 5))
    eager = {r: tiny_model(ids, num_steps=r, init_scale=0.0).logits for r in (2, 6)}
    torch._dynamo.reset()
    tiny_model.compile_step(fullgraph=True)
    with torch.no_grad():
        for r in (2, 6):
            torch.testing.assert_close(tiny_model(ids, num_steps=r, init_scale=0.0).logits, eager[r],
                                       atol=1e-4, rtol=1e-4)
