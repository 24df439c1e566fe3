"""Weight-only quantization per part of the loop (rdlm.model.quantize): the spec, the kernels' layouts, the
model's layers, and every path a quantized model takes (engine, CLI, server, eval, save and load)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rdlm import build_model, load_model, load_pretrained
from rdlm.inference.generate import EngineArgs, GenerationConfig, generate
from rdlm.model.huginn import CheckpointError, save_pretrained
from rdlm.model.int4 import _from_cpu_int4_layout, _to_cpu_int4_layout
from rdlm.model.quantize import QuantizationError, QuantizedLinear, QuantSpec, quantize, weight_bytes

# The int8/int4 kernels, their weight layouts and their crashes differ with the CPU's vector width: CI reruns
# these with the AVX2 and the portable kernels too.
pytestmark = pytest.mark.numerics

FIXTURES = Path(__file__).parent / "fixtures" / "families"
# One character per id of the family fixtures' 128-entry vocabulary (as tests/test_families_paths.py)
ALPHABET = "\x00\n" + "".join(map(chr, range(32, 127))) + "".join(map(chr, range(161, 192)))


def greedy(model, prompts, r=6, n=10, engine=None, **options):
    config = GenerationConfig(max_new_tokens=n, num_steps=r, temperature=0.0, seed=0, **options)
    return generate(model, prompts, config, engine=engine)


def logits(model, ids, r=6):
    torch.manual_seed(1)  # the same s_0 for every model compared
    with torch.no_grad():
        return model(ids, num_steps=r).logits


# ------------------------------------------------------------------------------------------------
# The spec


@pytest.mark.parametrize("text, expected", [
    ("int8", dict(prelude="int8", core="int8", coda="int8", head="int8")),
    ("w8a8,head=none", dict(prelude="w8a8", core="w8a8", coda="w8a8", head="none")),
    ("core=int4,prelude=int8", dict(prelude="int8", core="int4", coda="none", head="none")),
    ("int4,head=int8", dict(prelude="int4", core="int4", coda="int4", head="int8")),
    ("int4+head:int8", dict(prelude="int4", core="int4", coda="int4", head="int8")),
    (" core = int8 , coda=int4", dict(prelude="none", core="int8", coda="int4", head="none")),
])
def test_a_spec_names_each_part(text, expected):
    spec = QuantSpec.parse(text)
    assert {part: getattr(spec, part) for part in expected} == expected
    assert QuantSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


@pytest.mark.parametrize("text, group, fragment", [
    ("int5", 128, "unknown scheme 'int5'"),
    ("body=int8", 128, "unknown part 'body'"),
    ("int8,,core=int4", 128, "empty item"),
    ("", 128, "empty item"),
    ("int4", 48, "group size must be one of 32, 64, 128, 256"),
])
def test_a_bad_spec_is_named(text, group, fragment):
    with pytest.raises(QuantizationError, match=fragment):
        QuantSpec.parse(text, group)


# ------------------------------------------------------------------------------------------------
# Layers


@pytest.mark.parametrize("shape", [(32, 64), (96, 128), (64, 256)])
def test_the_cpu_int4_layout_is_undone_exactly(shape):
    q = torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(_from_cpu_int4_layout(_to_cpu_int4_layout(q), *shape), q.to(torch.uint8))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_layer_read_from_an_unaligned_buffer_computes(scheme):
    # safetensors hands out tensors anywhere in a file's buffer; PyTorch's AVX-512 int8 kernel crashed
    # (segmentation fault) on a weight not starting on a 64-byte boundary.
    layer = QuantizedLinear.from_weight(torch.randn(128, 64, generator=torch.Generator().manual_seed(0)), None,
                                        scheme, 32)
    stored = {}
    for key, tensor in layer.canonical().items():
        buffer = torch.empty(tensor.numel() * tensor.element_size() + 8, dtype=torch.uint8)
        stored[key] = buffer[8:].view(tensor.dtype).view(tensor.shape)  # 8 bytes past an aligned start
        stored[key].copy_(tensor)
    assert stored["qweight"].data_ptr() % 64 != 0
    reread = QuantizedLinear.from_canonical("layer", scheme, stored, None, 128, 64, 32, "cpu")
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(reread(x), layer(x))


@pytest.mark.parametrize("scheme, group", [("int8", 32), ("int4", 32), ("int4", 64), ("w8a8", 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_layer_computes_with_its_dequantized_weight(scheme, group, dtype):
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(128, 96, bias=True).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 128, generator=gen) * 0.05)
        linear.bias.copy_(torch.randn(96, generator=gen))
    layer = QuantizedLinear.from_linear(linear, scheme, group)
    w = linear.weight.float()
    deq = layer.weight.float()
    # Rounding to the grid moves each weight by at most half a step of its scale (the scales the kernel
    # holds: bfloat16 on the CPU, so a step may be 2^-8 larger than computed).
    if scheme != "int4":
        step = w.abs().amax(1, keepdim=True) / 127
    else:
        grouped = w.reshape(96, -1, group)
        step = ((grouped.amax(-1) - grouped.amin(-1)) / 15).repeat_interleave(group, dim=1)
    assert ((deq - w).abs() <= step * (0.5 + 2 ** -7) + 1e-7).all()
    x = torch.randn(3, 5, 128, generator=gen).to(dtype)
    expected = x.float() @ deq.T + linear.bias.float()
    y = layer(x)
    assert y.shape == (3, 5, 96) and y.dtype == dtype
    # The CPU kernels take bfloat16 activations (half a unit in the last place, 2^-9, per product), w8a8
    # int8 ones per tensor (7 bits: half a step of max|x| / 63); a bfloat16 output rounds once more.
    magnitude = x.float().abs() @ deq.abs().T
    if scheme == "w8a8":
        bound = (x.float().abs().amax() / 63 / 2) * deq.abs().sum(1) + 2 ** -8 * expected.abs()
    else:
        bound = 2 ** -8 * magnitude + 2 ** -8 * expected.abs() + 1e-5
    assert ((y.float() - expected).abs() <= bound).all()


def test_int8_holds_a_byte_per_weight_and_int4_half_a_byte_plus_its_group_scales():
    linear = torch.nn.Linear(256, 256, bias=False)
    n = linear.weight.numel()
    # + a scale per row (bfloat16 on the CPU)
    assert QuantizedLinear.from_linear(linear, "int8", 128).nbytes() == n + 256 * 2
    # + a scale and a zero point per group of 128
    assert QuantizedLinear.from_linear(linear, "int4", 128).nbytes() == n // 2 + 256 * 2 * 2 * 2


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_layer_off_the_cpu_dequantizes_in_the_matmul(scheme):
    # The path other devices take (CUDA: fused by torch.compile), on a layer built in the portable layout
    # (as off the CPU): x W^T with the dequantized weight, the CPU kernel's result up to its bfloat16 inputs.
    linear = torch.nn.Linear(64, 32, bias=False)
    cpu = QuantizedLinear.from_linear(linear, scheme, 32)
    parts = cpu.canonical()
    portable = QuantizedLinear(scheme, 64, 32, 32, parts["qweight"], parts["scales"], parts.get("zeros"), None)
    if scheme == "int4":  # what __init__ holds off the CPU
        del portable.scales_and_zeros
        portable.qweight = parts["qweight"]
        portable.register_buffer("scales", parts["scales"], persistent=False)
        portable.register_buffer("zeros", parts["zeros"], persistent=False)
    x = torch.randn(4, 64)
    torch.testing.assert_close(portable.dequantized_matmul(x), x @ cpu.weight.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(portable.dequantized_matmul(x), cpu(x), rtol=2e-2, atol=2e-2)
    portable.on_cpu = False  # as if built on a GPU: CPU input is refused, naming the fix
    with pytest.raises(RuntimeError, match="quantize the model on the device it runs on"):
        portable(x)


# ------------------------------------------------------------------------------------------------
# Models


def test_only_the_named_parts_are_quantized(tiny_model):
    quantize(tiny_model, "core=int4,prelude=int8", group_size=32)
    kinds = {name: (m.scheme if isinstance(m, QuantizedLinear) else type(m).__name__)
             for name, m in tiny_model.named_modules() if name.count(".") == 3 or name in ("adapter", "lm_head")}
    assert kinds["prelude.0.attn.qkv"] == "int8" and kinds["core.1.mlp.out"] == "int4" and kinds["adapter"] == "int4"
    assert kinds["coda.0.attn.qkv"] == "Linear" and tiny_model.lm_head is None  # the tied head stays the embedding
    assert str(tiny_model.quantization) == "prelude=int8,core=int4,coda=none,head=none (group 32)"


def test_int8_logits_stay_near_and_int4_shrinks_the_weights(tiny_model):
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    reference = logits(tiny_model, ids)
    int8 = quantize(build_model("tiny", seed=0).eval(), "int8")
    int4 = quantize(build_model("tiny", seed=0).eval(), "int4", group_size=32)
    assert (logits(int8, ids) - reference).abs().max() < 0.05 * reference.abs().max()
    assert weight_bytes(int4) < weight_bytes(int8) < 0.5 * weight_bytes(tiny_model)


def test_a_layer_int4_cannot_hold_gets_int8(tiny_model):
    quantize(tiny_model, "int4", group_size=128)
    # h = 64 and 160 MLP columns are no multiple of the group; the adapter's 2h = 128 input columns are
    assert tiny_model.quantized_layers.pop("adapter") == "int4"
    assert set(tiny_model.quantized_layers.values()) == {"int8"}


def test_quantizing_twice_is_refused(tiny_model, tmp_path):
    quantize(tiny_model, "int8")
    with pytest.raises(QuantizationError, match="quantized already"):
        quantize(tiny_model, "int4")


@pytest.mark.parametrize("spec", ["int8", "int4,head=int8", "core=int4,prelude=int8,coda=none,head=none",
                                  "w8a8,core=int8"])
def test_a_saved_quantized_model_reloads_to_the_same_tokens(tiny_model, tmp_path, spec):
    quantize(tiny_model, spec, group_size=32)
    before = greedy(tiny_model, [[1, 2, 3], [4, 5]])
    save_pretrained(tiny_model, tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["rdlm_quantization"] == tiny_model.quantization.to_json()
    reloaded = load_model(str(tmp_path / "q"))
    assert reloaded.quantization == tiny_model.quantization
    assert reloaded.quantized_layers == tiny_model.quantized_layers
    after = greedy(reloaded, [[1, 2, 3], [4, 5]])
    assert after.tokens == before.tokens and after.iterations == before.iterations
    # the file holds the integer weights, not float copies
    stored = load_file(tmp_path / "q" / "model.safetensors")
    assert stored["transformer.core_block.0.attn.Wqkv.qweight"].dtype in (torch.int8, torch.uint8)
    assert "transformer.core_block.0.attn.Wqkv.weight" not in stored


def test_a_retrofitted_model_with_an_untied_head_and_adapter_bias_round_trips(tmp_path):
    model = quantize(load_pretrained(FIXTURES / "retrofit-llama-tiny"), "int4,head=int8", group_size=32)
    assert model.adapter.bias is not None and model.quantized_layers["lm_head"] == "int8"
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    save_pretrained(model, tmp_path / "q")
    torch.testing.assert_close(logits(load_pretrained(tmp_path / "q"), ids), logits(model, ids), rtol=0, atol=0)


def test_an_ouro_model_quantizes_at_load_but_is_not_saved_quantized(tmp_path):
    model = load_model(str(FIXTURES / "ouro-tiny"), quantize="int8")
    assert model.quantized_layers and greedy(model, [[1, 2, 3]], exit_criterion="gate").tokens[0]
    with pytest.raises(CheckpointError, match="Ouro's layout cannot be saved"):
        save_pretrained(model, tmp_path / "q")
    assert not (tmp_path / "q").exists()


@pytest.fixture
def saved(tmp_path, tiny_model) -> Path:
    quantize(tiny_model, "int4,head=int8", group_size=32)
    return save_pretrained(tiny_model, tmp_path / "q")


def _edit(path: Path, change) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file({k: t.contiguous() for k, t in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("change, fragment", [
    (lambda t: t.update({"transformer.core_block.0.mlp.fc.scales": t["transformer.core_block.0.mlp.fc.scales"][:, :1]}),
     r"core.0.mlp.fc.scales has shape \[320, 1\], expected \[320, 2\]"),
    (lambda t: t.pop("transformer.coda.0.attn.proj.zeros"), "an int4 weight needs coda.0.attn.out.zeros"),
    (lambda t: t.update({"lm_head.scales": -t["lm_head.scales"]}), "lm_head.scales holds values <= 0"),
    (lambda t: t.update({"lm_head.scales": t["lm_head.scales"].to(torch.int32)}), "lm_head.scales has dtype"),
    (lambda t: t.update({"transformer.adapter.qweight": t["transformer.adapter.qweight"].to(torch.int16)}),
     "adapter.qweight has dtype torch.int16"),
    (lambda t: t.update({"transformer.prelude.0.attn.Wqkv.scales": t["transformer.prelude.0.attn.Wqkv.scales"]
                         * float("nan")}), "non-finite"),
])
def test_a_bad_scale_or_weight_tensor_is_refused_in_one_line(saved, change, fragment):
    _edit(saved, change)
    with pytest.raises(CheckpointError, match=fragment) as err:
        load_pretrained(saved)
    assert "\n" not in str(err.value)


def test_a_config_that_disagrees_with_the_tensors_is_refused(saved):
    config = json.loads((saved / "config.json").read_text())
    config["rdlm_quantization"]["coda"] = "none"  # the coda's tensors are quantized all the same
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="coda.0"):
        load_pretrained(saved)
    config["rdlm_quantization"] = {"core": "int9"}
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unknown scheme 'int9'"):
        load_pretrained(saved)


def test_a_saved_quantized_model_keeps_its_quantization_and_refuses_another_and_training(saved):
    from rdlm.model.config import ConfigError
    from rdlm.train.build import resolve_model

    assert load_model(str(saved), quantize="int4,head=int8", group_size=32).quantization.head == "int8"
    with pytest.raises(QuantizationError, match="would quantize it twice"):
        load_model(str(saved), quantize="int8")
    with pytest.raises(ConfigError, match="cannot be trained"):
        resolve_model(str(saved))


# ------------------------------------------------------------------------------------------------
# Every path


def run_cli(capsys, *args):
    from rdlm.cli import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_generate_convert_and_eval_take_quantize(tmp_path, capsys):
    src = tmp_path / "model"
    shutil.copytree(FIXTURES / "retrofit-llama-tiny", src)
    expected = greedy(load_model(str(src), quantize="int8"), [[1, 2, 3]], r=4, n=6).tokens[0]
    code, out, err = run_cli(capsys, "generate", "--model", str(src), "--prompt-ids", "1,2,3", "-r", "4",
                             "--max-new-tokens", "6", "--quantize", "int8")
    assert code == 0 and out.strip() == ",".join(map(str, [1, 2, 3] + expected)), err
    code, _, err = run_cli(capsys, "convert", str(src), str(tmp_path / "q"), "--quantize", "int8")
    assert code == 0, err
    code, out, _ = run_cli(capsys, "generate", "--model", str(tmp_path / "q"), "--prompt-ids", "1,2,3", "-r", "4",
                           "--max-new-tokens", "6")
    assert out.strip() == ",".join(map(str, [1, 2, 3] + expected))
    # perplexity of the quantized model is measured, and near the float model's
    from rdlm.demo.tasks import CharTokenizer

    alphabet = ALPHABET
    CharTokenizer(alphabet).to_tokenizer().save(str(src / "tokenizer.json"))
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat. " * 8)
    results = {}
    for name, extra in (("float", ()), ("int8", ("--quantize", "int8"))):
        code, _, err = run_cli(capsys, "eval", "--model", str(src), "--text", str(text), "--num-steps", "1,4",
                               "--seq-len", "32", "--out", str(tmp_path / name), *extra)
        assert code == 0, err
        results[name] = json.loads((tmp_path / name / "results.json").read_text())
    ppl = [r[0]["values"] for r in (results["float"], results["int8"])]
    assert all(abs(q / f - 1) < 0.05 for f, q in zip(*ppl)) and ppl[0] != ppl[1]


def test_a_bad_quantize_flag_is_one_line(capsys):
    from rdlm.cli import main

    with pytest.raises(SystemExit) as exit:  # a usage error, before any model is loaded
        main(["generate", "--model", "tiny", "--prompt-ids", "1,2", "--quantize", "core=fp8"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "unknown scheme 'fp8'" in err and "Traceback" not in err


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "engine-process"])
def test_the_server_serves_a_quantized_model(tmp_path, engine_process):
    pytest.importorskip("openai")
    from rdlm.demo.tasks import CharTokenizer
    from test_serve import LiveServer

    model = quantize(load_pretrained(FIXTURES / "retrofit-llama-tiny"), "int4,head=int8", group_size=32)
    alphabet = ALPHABET
    save_pretrained(model, tmp_path / "q")
    CharTokenizer(alphabet).to_tokenizer().save(str(tmp_path / "q" / "tokenizer.json"))
    with LiveServer(tmp_path / "q", engine_process=engine_process) as live:
        assert live.model.quantization == model.quantization
        reply = live.client().completions.create(model="tiny", prompt="the cat", max_tokens=8, temperature=0)
        text, _ = live.expected(live.tokenizer.encode("the cat", add_bos=True), stop_tokens=(live.tokenizer.eos_id,))
    assert reply.choices[0].text == text


def test_a_saved_quantized_model_loads_through_transformers_as_saved(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    import rdlm.integrations.hf  # noqa: F401  (registers the model type)

    model = quantize(load_pretrained(FIXTURES / "retrofit-llama-tiny"), "int4,core=int8", group_size=32)
    save_pretrained(model, tmp_path / "q")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    layers = [m for m in hf.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == len(model.quantized_layers)
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    with torch.no_grad():
        through_hf = hf(ids, num_steps=6).logits
    torch.testing.assert_close(through_hf, logits(model, ids), rtol=0, atol=0)


@pytest.mark.parametrize("spec", ["int8", "int4,core=int8", "w8a8"])
def test_the_engines_static_step_gives_the_eager_tokens_with_quantized_weights(tiny_model, spec):
    # the static decode step (the one CUDA graphs capture) runs the quantized layers as the eager path does,
    # with per-row exits deciding at different iterations
    quantize(tiny_model, spec, group_size=32)
    prompts = [[5, 17, 99, 3, 42, 7], [250, 11]]
    options = dict(r=12, n=8, exit_criterion="kl", exit_threshold=3e-3)
    eager = greedy(tiny_model, prompts, engine=EngineArgs(compile=False), **options)
    static = greedy(tiny_model, prompts, engine=EngineArgs(compile=True), **options)
    assert static.tokens == eager.tokens and static.iterations == eager.iterations
    assert len({s for row in eager.iterations for s in row[1:]}) > 1
