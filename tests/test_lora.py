"""LoRA and QLoRA (rdlm.model.lora, rdlm train --lora, rdlm lora merge): only the adapters train, the files
are PEFT's and load through transformers, a merge gives base + adapter on every family, and every adapter,
base or destination that does not fit is refused by name with nothing written."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rdlm import RDLMConfig, RecurrentDepthLM, load_pretrained, save_pretrained
from rdlm.cli import main as cli
from rdlm.model import lora, lora_files
from rdlm.model.config import ConfigError
from rdlm.model.convert import merge_lora
from rdlm.model.quantize import QuantizedLinear, quantize
from rdlm.train import TrainConfig, Trainer, train

FAMILIES = Path(__file__).parent / "fixtures" / "families"


def randomize(model: RecurrentDepthLM, name: str = lora.DEFAULT_NAME, seed: int = 0) -> None:
    """Give adapter `name` a non-zero B (a fresh one is zero: no effect), so that it changes the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora.lora_layers(model):
            if name in layer.lora_B:
                weight = layer.lora_B[name].weight
                weight.copy_(torch.randn(weight.shape, generator=g) * 0.05)


def logits(model: RecurrentDepthLM, ids: torch.Tensor, r: int = 4) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, num_steps=r, init_scale=0).logits


@pytest.fixture
def base_dir(tmp_path) -> Path:
    torch.manual_seed(0)
    return save_pretrained(RecurrentDepthLM(RDLMConfig.from_preset("tiny")), tmp_path / "base")


@pytest.fixture
def adapter_dir(base_dir, tmp_path) -> Path:
    model = lora.add_lora(load_pretrained(base_dir), lora.LoraSpec(rank=4))
    randomize(model)
    return lora_files.save_adapter(model, tmp_path / "adapter", base_source=str(base_dir))


def ids_for(model: RecurrentDepthLM, n: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, n), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------
# Training


def rows(vocab: int, n: int = 16, length: int = 17, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


def small_run(**changes) -> TrainConfig:
    values = dict(steps=4, micro_batch_size=4, lr=1e-2, warmup_steps=0, progress=False, tensorboard=False,
                  eval_num_steps=(1, 2), mean_recurrence=3, backprop_depth=2, ema_decay=None, threads=1)
    return TrainConfig(**(values | changes))


def test_only_the_adapters_get_gradients_optimizer_state_and_updates(tiny_model):
    before = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    trainer = Trainer(small_run(lora=True, lora_rank=4), model=tiny_model, train_data=rows(256))
    result = trainer.fit()
    model = result.model
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A.default." in n or ".lora_B.default." in n for n in trained)
    assert set(trainer.names) == trained
    for name, param in model.named_parameters():
        if name in trained:
            continue
        original = name.replace(".base_layer", "")
        assert torch.equal(param, before[original]), f"the frozen {original} changed"
    moved = [n for n in trained if ".lora_B." in n and model.get_parameter(n).abs().sum() > 0]
    assert moved, "training left every lora_B at zero"
    state_params = {id(p) for p in trainer.optimizer.state}
    assert state_params == {id(p) for p in model.parameters() if p.requires_grad}
    count, total = lora.trainable_parameters(model)
    assert 0 < count < total / 5


def test_the_default_parts_are_every_block_projection_and_the_adapter(tiny_model):
    lora.add_lora(tiny_model, lora.LoraSpec(rank=2))
    adapted = [name for name, _ in lora.lora_layers(tiny_model)]
    config = tiny_model.config
    blocks = config.prelude_layers + config.core_layers + config.coda_layers
    assert len(adapted) == 4 * blocks + 1  # qkv, attention out, MLP in and out per block; the core's adapter
    assert "adapter" in adapted and not any(n.startswith("lm_head") for n in adapted)


def test_a_lora_run_on_ouro_adapts_its_core_by_default():
    """Ouro has no prelude, coda or adapter layer: the default parts are the ones it has, its core."""
    torch.manual_seed(0)
    ouro = RecurrentDepthLM(RDLMConfig.from_preset("ouro-tiny"))
    result = train(small_run(lora=True, lora_rank=2, steps=2), model=ouro, train_data=rows(512))
    adapted = [name for name, _ in lora.lora_layers(result.model)]
    assert adapted and all(name.startswith("core.") for name in adapted)
    assert result.model.lora_specs["default"].parts == ("core",)


def test_a_fresh_adapter_changes_nothing_and_a_trained_one_does(tiny_model):
    ids = ids_for(tiny_model)
    reference = logits(tiny_model, ids)
    lora.add_lora(tiny_model, lora.LoraSpec(rank=4))
    assert torch.equal(logits(tiny_model, ids), reference)
    randomize(tiny_model)
    assert (logits(tiny_model, ids) - reference).abs().max() > 1e-3
    lora.set_adapter(tiny_model, None)
    assert torch.equal(logits(tiny_model, ids), reference)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_qlora_trains_adapters_over_a_quantized_base_and_lowers_the_loss(scheme):
    torch.manual_seed(0)
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny", vocab_size=64, hidden_size=128, num_heads=4))
    data = rows(64, n=8, seed=3)
    config = small_run(lora=True, lora_rank=8, quantize=scheme, steps=12, micro_batch_size=8)
    result = train(config, model=model, train_data=data)
    quantized = [m for m in result.model.modules() if isinstance(m, QuantizedLinear)]
    assert quantized and {m.scheme for m in quantized} <= {scheme, "int8"}
    assert result.losses[-1] < result.losses[0] - 0.05, result.losses
    assert all(not b.requires_grad for b in result.model.buffers())
    assert all(".lora_" in n for n, p in result.model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("scheme", ["int8", "int4", "w8a8"])
def test_a_quantized_layers_rows_dequantize_as_its_whole_weight(scheme):
    """The backward pass reads the weight a block of rows at a time (rdlm.model.quantize_grad.BACKWARD_ROWS);
    with a last block shorter than the others, the blocks are exactly the whole weight's rows."""
    from rdlm.model.quantize_grad import BACKWARD_ROWS, weight_rows

    torch.manual_seed(0)
    out = BACKWARD_ROWS + 64
    layer = QuantizedLinear.from_linear(torch.nn.Linear(128, out, bias=False), scheme, 64)
    rows = [weight_rows(layer, s, min(s + BACKWARD_ROWS, out)) for s in range(0, out, BACKWARD_ROWS)]
    assert torch.equal(torch.cat(rows), layer.weight)


@pytest.mark.parametrize("scheme", ["int8", "int4", "w8a8"])
def test_a_quantized_layer_passes_the_dequantized_weights_gradient_to_its_input(scheme):
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64, bias=False)
    layer = QuantizedLinear.from_linear(linear, scheme, 32)
    x = torch.randn(5, 128, requires_grad=True)
    layer(x).pow(2).sum().backward()
    weight = layer.weight.detach()
    y = x.detach().requires_grad_()
    (y @ weight.T).pow(2).sum().backward()
    # the forward ran on the kernel (bf16 activations on the CPU): the gradients agree to bf16's precision
    torch.testing.assert_close(x.grad, y.grad, rtol=0.05, atol=0.05 * y.grad.abs().max().item())


def test_the_cli_trains_resumes_and_merges_an_adapter(base_dir, tmp_path):
    shards = _shards(tmp_path)
    args = ["train", "--model", str(base_dir), "--lora", "--lora-rank", "4", "--data", str(shards),
            "--micro-batch-size", "4", "--warmup-steps", "0", "--lr", "0.01", "--no-progress", "--no-tensorboard",
            "--threads", "1", "--eval-num-steps", "1,2", "--eval-rows", "4", "--checkpoint-every", "2",
            "--curriculum", "linear", "--mean-recurrence", "4"]
    assert cli([*args, "--out-dir", str(tmp_path / "straight"), "--steps", "4"]) == 0
    assert cli([*args, "--out-dir", str(tmp_path / "split"), "--steps", "2"]) == 0
    assert cli(["train", "--out-dir", str(tmp_path / "split"), "--resume", "--steps", "4", "--no-progress"]) == 0
    step = tmp_path / "straight" / "checkpoints" / "step-000004"
    assert sorted(p.name for p in (step / "adapter").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "rdlm_adapter.json", "tokenizer.json"]
    straight = load_file(step / "adapter" / lora_files.ADAPTER_WEIGHTS)
    split = load_file(tmp_path / "split" / "checkpoints" / "step-000004" / "adapter" / lora_files.ADAPTER_WEIGHTS)
    assert straight.keys() == split.keys()
    for key in straight:
        assert torch.equal(straight[key], split[key]), key
    assert not (step / "model").exists()  # the base is not copied into every checkpoint

    # merge: the run's adapter, its recorded base; the merged model's logits are base + adapter's
    assert cli(["lora", "merge", str(tmp_path / "straight"), "--out", str(tmp_path / "merged")]) == 0
    merged = load_pretrained(tmp_path / "merged")
    with_adapter = lora_files.load_adapter(load_pretrained(base_dir), tmp_path / "straight")
    ids = ids_for(merged)
    torch.testing.assert_close(logits(merged, ids), logits(with_adapter, ids), rtol=0, atol=1e-5)
    assert (logits(merged, ids) - logits(load_pretrained(base_dir), ids)).abs().max() > 1e-4


def _shards(tmp_path: Path) -> Path:
    from rdlm.data.prepare import prepare
    from tests.hf_helpers import CORPUS, write_tokenizer

    tokenizer_dir = write_tokenizer(tmp_path / "tok")
    from rdlm.data.tokenizer import Tokenizer

    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    prepare([tmp_path / "corpus.jsonl"], Tokenizer.load(tokenizer_dir), tmp_path / "shards", context_length=16,
            val_fraction=0.1)
    return tmp_path / "shards"


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(lora_rank=0), "lora rank must be an integer >= 1"),
        (dict(lora_parts="core,wings"), "unknown part 'wings'"),
        (dict(lora_parts="head"), "ties its head to the embedding"),
        (dict(lora_dropout=1.0), "lora dropout must be in [0, 1)"),
        (dict(strategy="fsdp"), "lora runs data-parallel with ddp"),
    ],
)
def test_bad_lora_settings_are_refused_by_name(tiny_model, changes, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Trainer(small_run(lora=True, **changes), model=tiny_model, train_data=rows(256))


def test_quantize_without_lora_and_lora_flags_without_lora_are_refused(capsys, base_dir):
    with pytest.raises(ConfigError, match="a quantized base trains only through adapters"):
        small_run(quantize="int4")
    assert cli(["train", "--model", str(base_dir), "--lora-rank", "4", "--out-dir", "none", "--data", "x"]) == 2
    assert "it applies with --lora" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Files


def test_peft_loads_the_adapter_on_the_transformers_model(base_dir, adapter_dir):
    from peft import PeftModel

    from rdlm.integrations.hf import RavenForCausalLM

    ours = lora_files.load_adapter(load_pretrained(base_dir), adapter_dir)
    ids = ids_for(ours)
    peft_model = PeftModel.from_pretrained(RavenForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=ids, num_steps=4, init_scale=0).logits
    torch.testing.assert_close(theirs, logits(ours, ids), rtol=0, atol=1e-6)
    assert (theirs - logits(load_pretrained(base_dir), ids)).abs().max() > 1e-3  # the adapter was applied
    config = json.loads((adapter_dir / lora_files.ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["base_model_name_or_path"] == str(base_dir)


def test_an_adapter_saved_by_peft_loads_in_rdlm(base_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    from rdlm.integrations.hf import RavenForCausalLM

    hf = RavenForCausalLM.from_pretrained(base_dir)
    peft_model = get_peft_model(hf, LoraConfig(r=2, lora_alpha=4, target_modules=["qkv", "fc"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.05)
    peft_model.save_pretrained(tmp_path / "theirs")
    ids = ids_for(hf.model)
    with torch.no_grad():
        theirs = peft_model(input_ids=ids, num_steps=4, init_scale=0).logits
    ours = lora_files.load_adapter(load_pretrained(base_dir), tmp_path / "theirs")
    torch.testing.assert_close(logits(ours, ids), theirs, rtol=0, atol=1e-6)


FAMILY_DIRS = ["huginn-tiny", *(f"families/{n}" for n in ("ouro-tiny", "retrofit-llama-tiny", "retrofit-olmo-tiny"))]


@pytest.mark.parametrize("family", FAMILY_DIRS)
def test_merged_logits_equal_base_plus_adapter_on_every_family(family, tmp_path):
    source = Path(__file__).parent / "fixtures" / family
    base = load_pretrained(source, dtype=torch.float32)
    parts = [*lora.default_parts(base), *(["head"] if base.lm_head is not None else [])]
    model = lora.add_lora(base, lora.LoraSpec(rank=3, alpha=6, parts=tuple(parts)))
    randomize(model)
    adapter = lora_files.save_adapter(model, tmp_path / "adapter", base_source=str(source))
    out, notes = merge_lora(adapter, tmp_path / "merged", dtype="fp32")
    assert notes == []
    merged = load_pretrained(out)
    ids = ids_for(merged, seed=4)
    reference = logits(model, ids)
    assert (reference - logits(load_pretrained(source, dtype=torch.float32), ids)).abs().max() > 1e-3
    # one matmul's float32 round-off: the merged W + s B A against W x + s B (A x)
    torch.testing.assert_close(logits(merged, ids), reference, rtol=0, atol=2e-5 * reference.abs().max().item())
    written = {p.name for p in out.iterdir()}
    assert written >= {"config.json"} and not any(n.startswith("adapter") for n in written)


# ------------------------------------------------------------------------------------------------
# Refusals


def test_an_adapter_for_another_base_is_refused_by_fingerprint_and_by_shape(adapter_dir, tmp_path):
    torch.manual_seed(1)
    other = RecurrentDepthLM(RDLMConfig.from_preset("tiny"))
    with pytest.raises(lora.LoraError, match="trained on another base"):
        lora_files.load_adapter(other, adapter_dir)
    lora_files.load_adapter(other, adapter_dir, any_base=True)  # the user's choice: same shapes, other weights
    wider = RecurrentDepthLM(RDLMConfig.from_preset("tiny", hidden_size=128, num_heads=4))
    with pytest.raises(lora.LoraError, match="other shapes: hidden_size 64"):
        lora_files.load_adapter(wider, adapter_dir, any_base=True)


def test_a_merge_into_another_or_quantized_or_missing_base_writes_nothing(base_dir, adapter_dir, tmp_path):
    out = tmp_path / "out"
    torch.manual_seed(1)
    other = save_pretrained(RecurrentDepthLM(RDLMConfig.from_preset("tiny")), tmp_path / "other")
    with pytest.raises(lora.LoraError, match="trained on another base"):
        merge_lora(adapter_dir, out, other)
    quantized = save_pretrained(quantize(load_pretrained(base_dir), "int8"), tmp_path / "quantized")
    with pytest.raises(ValueError, match=r"saved quantized \(int8\): merging would round"):
        merge_lora(adapter_dir, out, quantized)
    moved = tmp_path / "moved"
    shutil.move(base_dir, moved)
    with pytest.raises(FileNotFoundError, match="the base that .* records is missing"):
        merge_lora(adapter_dir, out)
    assert not out.exists()
    assert cli(["lora", "merge", str(adapter_dir), "--base", str(moved), "--out", str(out)]) == 0


def test_merging_into_quantized_layers_in_memory_is_refused(base_dir, adapter_dir):
    model = lora_files.load_adapter(quantize(load_pretrained(base_dir), "int8"), adapter_dir)
    with pytest.raises(lora.LoraError, match="it is quantized .* rounded into its integer weights"):
        lora.merge_adapter(model)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / lora_files.ADAPTER_CONFIG).write_text("{"), "not valid JSON"),
        (lambda d: (d / lora_files.ADAPTER_WEIGHTS).write_bytes(b"\x00" * 64), "not a readable safetensors file"),
        (lambda d: (d / lora_files.ADAPTER_WEIGHTS).unlink(), "adapter_model.safetensors is missing"),
        (lambda d: _drop_tensor(d, ".lora_B."), "has no lora_B weight"),
        (lambda d: _edit_config(d, r=8), "do not make a rank-8 update"),
        (lambda d: _edit_config(d, peft_type="IA3"), "rdlm reads LoRA adapters"),
        (lambda d: _edit_config(d, use_dora=True), "use_dora=True is not supported"),
        (lambda d: _rename_tensor(d, "core.0.attn.qkv", "core.9.attn.qkv"), "adapts core.9.attn.qkv, which"),
    ],
)
def test_a_damaged_adapter_is_refused_by_name(base_dir, adapter_dir, damage, message):
    damage(adapter_dir)
    with pytest.raises(lora.LoraError, match=re.escape(message)):
        lora_files.load_adapter(load_pretrained(base_dir), adapter_dir)


def _edit_config(directory: Path, **changes) -> None:
    path = directory / lora_files.ADAPTER_CONFIG
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def _drop_tensor(directory: Path, marker: str) -> None:
    tensors = load_file(directory / lora_files.ADAPTER_WEIGHTS)
    victim = next(k for k in tensors if marker in k)
    save_file({k: v for k, v in tensors.items() if k != victim}, directory / lora_files.ADAPTER_WEIGHTS)


def _rename_tensor(directory: Path, old: str, new: str) -> None:
    tensors = load_file(directory / lora_files.ADAPTER_WEIGHTS)
    save_file({k.replace(old, new): v for k, v in tensors.items()}, directory / lora_files.ADAPTER_WEIGHTS)
    info = json.loads((directory / lora_files.RDLM_ADAPTER).read_text())
    info["base"]["shapes"] = None  # (a layer the model lacks, not a shape difference)
    (directory / lora_files.RDLM_ADAPTER).write_text(json.dumps(info))


def test_a_part_the_model_does_not_have_is_refused(tiny_model):
    with pytest.raises(lora.LoraError, match="ties its head"):
        lora.add_lora(tiny_model, lora.LoraSpec(parts=("head",)))
    ouro = RecurrentDepthLM(RDLMConfig.from_preset("ouro-tiny"))
    with pytest.raises(lora.LoraError, match="with no adapter layer"):
        lora.add_lora(ouro, lora.LoraSpec(parts=("core", "adapter")))
    with pytest.raises(lora.LoraError, match="unknown part 'mlp'"):
        lora.LoraSpec(parts=("mlp",))
