"""The eager linear layers' GEMM on the CPU (rdlm.inference.execution.cpu_linear): oneDNN's product equals ATen's within
float32 round-off, the choice follows the measurement or the setting, the model's layers are patched only during a
call and never with gradients, and the engine's tokens do not depend on which kernel ran."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rdlm import RDLMConfig, RecurrentDepthLM
from rdlm.inference.execution import cpu_linear
from rdlm.inference.generate import EngineArgs, GenerationConfig, generate
from rdlm.model.lora import LoraSpec, add_lora, lora_layers

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this PyTorch has no oneDNN")

PROMPTS = [[5, 9, 2, 7, 1, 3], [11, 4], [8, 8, 6, 2, 9], [3, 1], [7, 7, 7, 2]]


def tiny(seed: int = 0) -> RecurrentDepthLM:
    torch.manual_seed(seed)
    return RecurrentDepthLM(RDLMConfig.from_preset("tiny")).eval()


def roundoff_bound(x: torch.Tensor, weight: torch.Tensor) -> float:
    """Two float32 sums of the same K products in different orders differ by at most ~K * eps * sum |x_k w_k|; the
    largest such sum over the outputs bounds every element."""
    k = x.shape[-1]
    return k * torch.finfo(torch.float32).eps * (x.abs().reshape(-1, k) @ weight.abs().T).max().item()


@pytest.fixture
def counted(monkeypatch):
    """The products oneDNN ran: (rows, the weight's storage)."""
    calls = []
    real = cpu_linear.onednn_product

    def onednn(x2, weight, bias):
        calls.append((x2.shape[0], weight.data_ptr()))
        return real(x2, weight, bias)

    monkeypatch.setattr(cpu_linear, "onednn_product", onednn)
    return calls


@pytest.fixture
def fresh_decisions(monkeypatch):
    monkeypatch.setattr(cpu_linear, "_decisions", {})


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [5, 32, 60])
def test_onednn_gives_atens_product_within_float32_roundoff(bias, rows, counted):
    torch.manual_seed(0)
    layer = nn.Linear(48, 80, bias=bias)
    x = torch.randn(rows, 1, 96)[..., ::2]  # three dimensions, not contiguous
    with torch.no_grad():
        out = cpu_linear._forward(layer, "onednn", x)
        reference = F.linear(x, layer.weight, layer.bias)
    assert out.shape == reference.shape == (rows, 1, 80)
    assert (out - reference).abs().max().item() <= roundoff_bound(x, layer.weight) + 1e-7
    assert counted == [(64 if rows == 60 else rows, layer.weight.data_ptr())]  # above 32 rows, padded to a multiple


def test_the_setting_is_checked_and_read(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV, "mkl")
    with pytest.raises(ValueError, match="RDLM_CPU_LINEAR='mkl' is not one of auto, aten, onednn"):
        cpu_linear.mode()
    monkeypatch.setenv(cpu_linear.ENV, " ONEDNN ")
    assert cpu_linear.mode() == "onednn"
    monkeypatch.delenv(cpu_linear.ENV)
    assert cpu_linear.mode() == "auto"
    weight = torch.randn(16, 8)
    assert not cpu_linear.use_onednn(weight, None, 1, "onednn")  # one row: ATen's matrix-vector product, always
    assert cpu_linear.use_onednn(weight, None, 2, "onednn")
    assert not cpu_linear.use_onednn(weight, None, 64, "aten")


@pytest.mark.parametrize(("aten", "onednn", "chosen"), [(1.0, 0.5, True), (1.0, 0.9, True), (1.0, 0.95, False)])
def test_auto_keeps_onednn_only_where_it_measured_faster_once_per_shape_and_size(
    aten, onednn, chosen, monkeypatch, fresh_decisions
):
    measured = []

    def measure(weight, bias, rows):
        measured.append((tuple(weight.shape), bias is not None, rows))
        return aten, onednn

    monkeypatch.setattr(cpu_linear, "measure", measure)
    weight, bias = torch.randn(32, 16), torch.randn(32)
    assert cpu_linear.use_onednn(weight, None, 5) is chosen
    assert cpu_linear.use_onednn(weight, None, 8) is chosen  # the same bucket (5..8 rows): measured once, at 8 rows
    assert measured == [((32, 16), False, 8)]
    cpu_linear.use_onednn(weight, bias, 8)  # another key: with a bias
    cpu_linear.use_onednn(weight, None, 9)  # another bucket: 16 rows
    cpu_linear.use_onednn(weight.T.contiguous(), None, 8)  # another shape
    assert measured[1:] == [((32, 16), True, 8), ((32, 16), False, 16), ((16, 32), False, 8)]
    assert cpu_linear.use_onednn(weight, None, 64) is chosen
    assert cpu_linear.use_onednn(weight, None, 1000) is chosen  # above 64 rows: the 64-row decision, not measured again
    assert measured[-1] == ((32, 16), False, 64) and len(measured) == 5
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        cpu_linear.use_onednn(weight, None, 8)  # another thread count measures again
    finally:
        torch.set_num_threads(threads)
    assert len(measured) == 6


def test_the_measurement_times_both_kernels_on_the_weights_shape_or_a_slice_of_a_large_one(monkeypatch):
    aten, onednn = cpu_linear.measure(torch.randn(64, 32), None, 16)
    assert 0 < aten < 1 and 0 < onednn < 1
    shapes = []
    real = cpu_linear.onednn_product
    monkeypatch.setattr(cpu_linear, "onednn_product", lambda x2, w, b: shapes.append((x2.shape, w.shape)) or real(x2, w, b))
    monkeypatch.setattr(cpu_linear, "SLOW_CALL", 0.0)  # every product "slow": one round of one call
    cpu_linear.measure(torch.randn(5000, 8), torch.randn(5000), 4)
    assert shapes == [((4, 8), (4096, 8))] * 2  # its kernel built once, then timed once, on the first 4096 outputs


def test_layers_are_patched_only_during_a_call_and_an_error_restores_them(counted, monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV, "onednn")
    model = tiny()
    linears = cpu_linear.OneDnnLinears(model)
    assert linears.layers and all(type(layer) is nn.Linear for layer in linears.layers)
    layer = model.core[0].attn.qkv
    x = torch.randn(4, 1, model.config.hidden_size)
    with torch.no_grad():
        with linears.over(1):  # one row: nothing to patch
            assert "forward" not in layer.__dict__
        with linears.over(4):
            assert "forward" in layer.__dict__ and "head" in model.__dict__  # the tied head's product too
            layer(x)
        assert counted == [(4, layer.weight.data_ptr())]
        with pytest.raises(RuntimeError, match="in the call"), linears.over(4):
            raise RuntimeError("in the call")
    assert not any("forward" in m.__dict__ for m in linears.layers) and "head" not in model.__dict__


def test_a_tied_head_runs_on_onednn_within_roundoff_and_other_heads_are_left_alone(counted, monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV, "onednn")
    model = tiny()
    assert model.lm_head is None
    x = torch.randn(40, 1, model.config.hidden_size)
    with torch.no_grad():
        reference = model.head(x)
        with cpu_linear.OneDnnLinears(model).over(40):
            logits = model.head(x)
    assert counted == [(64, model.embedding.weight.data_ptr())]  # 40 rows, padded to a multiple of 32
    assert logits.dtype == torch.float32 and logits.shape == reference.shape == (40, 1, model.config.vocab_size)
    assert (logits - reference).abs().max().item() <= roundoff_bound(x, model.embedding.weight)
    # an untied head is one of the layers; a quantized copy of a tied head (rdlm.model.quantize) is no nn.Linear
    untied = RecurrentDepthLM(RDLMConfig.from_preset("tiny", tie_embeddings=False))
    linears = cpu_linear.OneDnnLinears(untied)
    assert linears.head_model is None and untied.lm_head in linears.layers
    quantized = tiny()
    quantized.lm_head = nn.Identity()  # (stands for any module that is not a plain nn.Linear)
    assert cpu_linear.OneDnnLinears(quantized).head_model is None


def test_gradients_take_atens_path(counted, monkeypatch):
    """mkldnn's linear has no backward here: a call that records gradients (for the weights or for the input) keeps
    the layer's own product."""
    monkeypatch.setenv(cpu_linear.ENV, "onednn")
    model = tiny()
    linears = cpu_linear.OneDnnLinears(model)
    layer = model.core[0].attn.qkv
    x = torch.randn(4, model.config.hidden_size, requires_grad=True)
    with linears.over(4):
        layer(x).sum().backward()
    assert counted == [] and layer.weight.grad is not None
    layer.requires_grad_(False)  # a gradient for the input only (an analysis of the latent states, say)
    x.grad = None
    with linears.over(4):
        layer(x).sum().backward()
    assert counted == [] and x.grad is not None
    with torch.no_grad(), linears.over(4):
        layer(x)
    assert len(counted) == 1  # without gradients, oneDNN


def test_the_aten_setting_patches_nothing(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV, "aten")
    assert cpu_linear.OneDnnLinears(tiny()).layers == []


@pytest.mark.parametrize("config", [
    GenerationConfig(num_steps=6, max_new_tokens=8, seed=2),
    GenerationConfig(num_steps=6, max_new_tokens=8, exit_criterion="kl", exit_threshold=1e-3, seed=2),
])
def test_the_engines_tokens_do_not_depend_on_the_kernel(config, counted, monkeypatch):
    model = tiny(1)
    runs = {}
    for setting in ("aten", "onednn"):
        monkeypatch.setenv(cpu_linear.ENV, setting)
        out = generate(model, PROMPTS, config, engine=EngineArgs(compile=False))
        runs[setting] = (out.tokens, out.iterations)
        assert bool(counted) is (setting == "onednn")  # the prompts' chunks and the batch's steps went to oneDNN
    assert model.embedding.weight.data_ptr() in {weight for _, weight in counted}  # the tied head's products too
    assert runs["onednn"] == runs["aten"]
    assert not any("forward" in m.__dict__ or "head" in m.__dict__ for m in model.modules())  # nothing left patched


def test_lora_layers_run_their_base_on_onednn_with_the_same_tokens(counted, monkeypatch):
    model = add_lora(tiny(2), LoraSpec(rank=4, parts=("core",)))
    torch.manual_seed(3)
    for _, layer in lora_layers(model):
        for weights in (layer.lora_A, layer.lora_B):
            for module in weights.values():
                nn.init.normal_(module.weight, std=0.2)  # an adapter that changes the tokens (B starts at zero)
    config = GenerationConfig(num_steps=6, max_new_tokens=6)
    runs = {}
    for setting in ("aten", "onednn"):
        monkeypatch.setenv(cpu_linear.ENV, setting)
        runs[setting] = generate(model, PROMPTS, config, engine=EngineArgs(compile=False)).tokens
    assert runs["onednn"] == runs["aten"]
    bases = {layer.base_layer.weight.data_ptr() for _, layer in lora_layers(model)}
    assert bases and bases <= {weight for _, weight in counted}  # every adapted layer's base ran on oneDNN


def test_a_batchs_warm_up_measures_every_layer_shape_before_the_first_request(monkeypatch, fresh_decisions):
    from rdlm.inference.batching import ContinuousBatch

    measured = []
    monkeypatch.setattr(cpu_linear, "measure", lambda weight, bias, rows: measured.append(rows) or (1.0, 0.5))
    monkeypatch.delenv(cpu_linear.ENV, raising=False)
    model = tiny()
    batch = ContinuousBatch(model, max_batch=4, max_length=64, compile=False)
    batch.warm_up()
    layers = batch.calls.linears.layers
    shapes = {(layer.weight.shape[1], layer.weight.shape[0], layer.bias is not None) for layer in layers}
    shapes.add((model.config.hidden_size, model.config.vocab_size, False))  # the tied head
    buckets = [2, 4, 8, 16, 32, 64]
    threads = torch.get_num_threads()
    assert set(cpu_linear._decisions) == {(*shape, threads, b) for shape in shapes for b in buckets}
    assert len(measured) == len(shapes) * len(buckets)  # each once, however many layers share a shape
    batch.add([5, 9, 2], GenerationConfig(num_steps=4, max_new_tokens=3))
    while batch.busy:
        batch.step()
    assert len(measured) == len(shapes) * len(buckets)  # the requests measured nothing more


def test_a_call_patches_only_the_products_measured_faster_on_onednn(monkeypatch, fresh_decisions):
    """Where ATen wins a product, its layer is left as it is (no wrapper's cost in the call); a call patches only what
    was measured faster for its number of rows, here the tied head at 2-8 rows and nothing at 64."""
    monkeypatch.delenv(cpu_linear.ENV, raising=False)
    model = tiny()
    vocab = model.config.vocab_size

    def measure(weight, bias, rows):
        return (1.0, 0.5) if weight.shape[0] == vocab and rows <= 8 else (1.0, 2.0)

    monkeypatch.setattr(cpu_linear, "measure", measure)
    linears = cpu_linear.OneDnnLinears(model)
    for rows, head_patched in ((5, True), (64, False)):
        with linears.over(rows):
            assert ("head" in model.__dict__) is head_patched
            assert not any("forward" in layer.__dict__ for layer in linears.layers)
    assert linears.chosen(3) == [linears.patches[-1]]
