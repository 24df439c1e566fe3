import math

import pytest
import torch

from rdlm import RDLMConfig, RecurrentDepthLM
from rdlm.model.config import ConfigError
from rdlm.data.shards import DataError, MemoryRows
from rdlm.train import TrainConfig, TrainingError, train
from rdlm.train.checkpoint import latest_checkpoint, load_checkpoint
from rdlm.model.flops import flops_per_token
from rdlm.train.monitor import collapse_signatures, read_log, token_correlation
from rdlm.train.optim import EMA, AdamW
from rdlm.train.schedule import Schedule

FAST = dict(progress=False, tensorboard=False, threads=1, warmup_steps=2)


def tiny(**overrides) -> RecurrentDepthLM:
    torch.manual_seed(0)
    return RecurrentDepthLM(RDLMConfig.from_preset("tiny", context_length=64, **overrides))


def counting_rows(n: int = 64, length: int = 17, vocab: int = 32) -> torch.Tensor:
    """Rows of counting sequences mod `vocab`: a learnable next-token task."""
    starts = torch.arange(n).unsqueeze(1)
    return (starts + torch.arange(length)) % vocab


# ------------------------------------------------------------------------------------------------
# Truncated backpropagation (docs/architecture.md#truncated-backprop)

def test_gradients_flow_only_through_the_last_k_iterations():
    model = tiny().train()
    seen = []
    model.core[0].register_forward_hook(lambda mod, args, out: seen.append(out.requires_grad))
    ids = torch.randint(0, 512, (2, 16))
    out = model(ids, num_steps=(7, 3))
    assert seen == [False] * 7 + [True] * 3
    out.logits.sum().backward()
    # The prelude still learns: e enters every iteration with a graph.
    assert model.prelude[0].attn.qkv.weight.grad.abs().sum() > 0
    assert model.adapter.weight.grad.abs().sum() > 0


def count_saved_tensor_bytes(model, num_steps) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, num_steps=num_steps).logits.sum()
    return total


def test_activation_memory_does_not_grow_with_r():
    model = tiny().train()
    short = count_saved_tensor_bytes(model, (2, 4))
    long = count_saved_tensor_bytes(model, (28, 4))
    assert short == long
    # ... while full backprop through all 32 iterations saves far more.
    assert count_saved_tensor_bytes(model, (0, 32)) > 4 * short


# ------------------------------------------------------------------------------------------------
# Optimizer, schedule, EMA

def test_adamw_matches_torch_when_options_are_off():
    torch.manual_seed(0)
    a = torch.nn.Linear(8, 8, bias=False)
    b = torch.nn.Linear(8, 8, bias=False)
    b.load_state_dict(a.state_dict())
    ours = AdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    for _ in range(5):
        x = torch.randn(4, 8)
        for model, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    torch.testing.assert_close(a.weight, b.weight, rtol=1e-5, atol=1e-6)


def test_atan2_update_is_bounded_and_epsilon_free():
    p = torch.nn.Parameter(torch.zeros(1000))
    opt = AdamW([p], lr=1.0, weight_decay=0.0, atan2=True, eps=0.0)
    p.grad = torch.full((1000,), 1e-12)  # a tiny gradient: the atan2 update is still 1, no eps to swamp it
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((1000,), -1.0))  # atan2(m, |m|) * 4/pi = 1
    p.grad = torch.randn(1000) * 1e6
    opt.step()
    assert torch.isfinite(p).all()


def test_update_clipping_caps_update_rms():
    p = torch.nn.Parameter(torch.zeros(100))
    opt = AdamW([p], lr=1.0, weight_decay=0.0, update_clip=0.5)
    p.grad = torch.ones(100)
    opt.step()  # the first Adam update is sign(g): RMS 1, clipped to 0.5
    torch.testing.assert_close(p.detach(), torch.full((100,), -0.5))


def test_weight_decay_spares_norms_and_qk_bias():
    model = tiny()
    opt = AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    norm_before = model.final_norm.weight.clone()
    matrix_before = model.core[0].mlp.fc.weight.clone()
    opt.step()
    torch.testing.assert_close(model.final_norm.weight, norm_before)
    torch.testing.assert_close(model.core[0].mlp.fc.weight, matrix_before * (1 - 0.1 * 0.5))


def test_schedule_warmup_constant_cooldown():
    s = Schedule(lr=1.0, warmup_steps=4, total_steps=20, cooldown_steps=5, min_lr_ratio=0.1)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(10) == 1.0 and s(14) == 1.0
    assert s(15) < 1.0 and s(19) == pytest.approx(0.1)
    assert Schedule(lr=2.0)(100) == 2.0


def test_ema_tracks_weights():
    model = torch.nn.Linear(2, 2, bias=False)
    ema = EMA(model, 0.5)
    with torch.no_grad():
        model.weight.add_(2.0)
    ema.update()
    target = torch.nn.Linear(2, 2, bias=False)
    ema.copy_to(target)
    torch.testing.assert_close(target.weight, model.weight - 1.0)


# ------------------------------------------------------------------------------------------------
# The Python API

def test_training_on_rows_learns_and_reports(tmp_path):
    records = []
    hook_calls = []
    rows = counting_rows()
    result = train(TrainConfig(steps=30, micro_batch_size=8, lr=3e-3, out_dir=str(tmp_path), eval_every=15,
                               eval_num_steps=(1, 4), eval_rows=16, **FAST),
                   model=tiny(), train_data=rows, val_data=rows[:16],
                   eval_hooks=[lambda m, step: hook_calls.append(step) or {"custom": 1.0}],
                   step_hooks=[records.append])
    assert len(result.losses) == 30 and result.losses[-1] < result.losses[0] - 1.0
    assert all(len(r) == 1 and r[0] >= 1 for r in result.num_steps)
    assert hook_calls == [15, 30]
    assert result.evals[-1]["custom"] == 1.0
    assert {"val_ppl_r1", "val_ppl_r4", "token_correlation", "state_rel_change"} <= set(result.evals[-1])
    train_records = [r for r in records if r["kind"] == "train"]
    assert {"loss", "tokens_per_s", "grad_norm", "num_steps", "lr"} <= set(train_records[0])
    assert [r["loss"] for r in read_log(tmp_path / "log.jsonl")] == result.losses
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.name == "step-000030" and (ckpt / "ema" / "model.safetensors").is_file()
    reloaded = tiny()
    load_checkpoint(ckpt, reloaded, None, [n for n, _ in reloaded.named_parameters()])
    torch.testing.assert_close(reloaded.state_dict(), result.model.state_dict())


def test_prompt_response_loss_is_on_responses_only():
    pairs = [([1, 2, 3], [4, 5]), ([6, 7], [8, 9, 10])]
    rows = MemoryRows.from_pairs(pairs, pad_id=0, length=6)
    from rdlm.data.shards import make_batch

    batch = make_batch(*rows.rows([0, 1]))
    # Labels are row[1:]: targets only where the *target* token is a response token.
    assert batch.labels.tolist() == [[-100, -100, 4, 5, -100], [-100, 8, 9, 10, -100]]
    assert batch.num_targets == 5
    # Training runs on such rows, and the loss excludes prompts: a model fed only prompts learns nothing.
    result = train(TrainConfig(steps=3, micro_batch_size=2, **FAST), model=tiny(), train_data=rows)
    assert all(math.isfinite(x) for x in result.losses)


def test_sampler_choice_and_fixed_recurrence():
    rows = counting_rows(16)
    result = train(TrainConfig(steps=4, micro_batch_size=4, recurrence_sampler="fixed", mean_recurrence=3,
                               **FAST), model=tiny(), train_data=rows)
    assert result.num_steps == [[3]] * 4
    result = train(TrainConfig(steps=3, micro_batch_size=2, accumulation=2, **FAST), model=tiny(),
                   train_data=rows)
    assert all(len(r) == 2 for r in result.num_steps)  # one r per micro-batch


# ------------------------------------------------------------------------------------------------
# Bad input, caught before training

def test_bad_input_is_named(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset 'tinyy'"):
        train(TrainConfig(model="tinyy", **FAST), train_data=counting_rows())
    with pytest.raises(ConfigError, match="unknown config key 'hidden'"):
        TrainConfig(model_overrides={"hidden": 3})
    with pytest.raises(ConfigError, match="unknown config key 'stepz'"):
        TrainConfig.from_dict({"stepz": 3})
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="is empty"):
        train(TrainConfig(data=str(tmp_path / "empty"), **FAST))
    with pytest.raises(DataError, match="token id 600, out of range .* 512"):
        train(TrainConfig(**FAST), model=tiny(), train_data=torch.full((4, 8), 600))
    with pytest.raises(DataError, match="no training data"):
        train(TrainConfig(**FAST), model=tiny())


def test_non_finite_losses_are_skipped_then_stop_the_run(tmp_path):
    model = tiny()
    rows = counting_rows(16)
    real_coda = model.coda_output  # what the training loss reads (the logits are never built)
    poisoned = {2, 3}  # 1-based steps whose loss is NaN

    def coda_output(*args, **kwargs):
        hidden = real_coda(*args, **kwargs)
        return hidden * float("nan") if len(calls) in poisoned else hidden

    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    model.coda_output = coda_output
    result = train(TrainConfig(steps=6, micro_batch_size=4, **FAST), model=model, train_data=rows)
    assert result.bad_steps == 2
    assert [math.isnan(x) for x in result.losses] == [False, True, True, False, False, False]
    assert all(torch.isfinite(p).all() for p in model.parameters())

    poisoned.update(range(3, 100))
    calls.clear()
    with pytest.raises(TrainingError, match="3 non-finite losses in a row .* last checkpoint with finite weights .*step-000002"):
        train(TrainConfig(steps=10, micro_batch_size=4, max_bad_steps=3, checkpoint_every=2,
                          out_dir=str(tmp_path), **FAST), model=model, train_data=rows)
    assert latest_checkpoint(tmp_path).name == "step-000002"


# ------------------------------------------------------------------------------------------------
# Monitoring

def test_collapse_signatures():
    same = torch.randn(1, 1, 32).expand(2, 10, 32)
    assert token_correlation(same) == pytest.approx(1.0, abs=1e-5)
    assert abs(token_correlation(torch.randn(2, 50, 256))) < 0.05
    msgs = collapse_signatures({"token_correlation": 0.99, "val_ppl_r1": 10.0, "val_ppl_r32": 10.02}, (1, 32))
    assert any("collapse" in m for m in msgs) and any("ignores the recurrent state" in m for m in msgs)
    assert collapse_signatures({"token_correlation": 0.3, "val_ppl_r1": 30.0, "val_ppl_r32": 12.0}, (1, 32)) == []


def test_flops_grow_with_r_but_backward_only_with_k():
    model = tiny()
    f = lambda n, k: flops_per_token(model, 64, n, k)  # noqa: E731
    assert f(4, 4) > f(0, 4)
    # Adding no-grad iterations costs one forward each; adding grad iterations costs three.
    assert (f(0, 5) - f(0, 4)) == pytest.approx(3 * (f(1, 4) - f(0, 4)))


def test_finetune_from_a_huginn_layout_directory(huginn_tiny_dir, tmp_path):
    from rdlm.model.huginn import load_pretrained

    base = load_pretrained(huginn_tiny_dir, dtype=torch.float32)
    vocab = base.config.vocab_size
    pairs = [([1, 2, 3, i % 7 + 4], [20 + i % 5, 30]) for i in range(16)]
    result = train(TrainConfig(model=str(huginn_tiny_dir), steps=12, micro_batch_size=8, lr=3e-3,
                               out_dir=str(tmp_path), **FAST),
                   train_data=MemoryRows.from_pairs(pairs, pad_id=vocab - 1))
    assert result.model.config.hidden_size == base.config.hidden_size
    assert result.losses[-1] < result.losses[0]
    tuned = load_pretrained(latest_checkpoint(tmp_path) / "model")
    assert not torch.equal(tuned.embedding.weight, base.embedding.weight)


# ------------------------------------------------------------------------------------------------
# Scale: FSDP2 on one process (the code path of a big model with CPU offload), fused optimizer skip

def test_fsdp_on_one_process_with_activation_checkpointing_matches_plain_training(tmp_path):
    rows = counting_rows(32, length=17, vocab=64)

    def small():
        torch.manual_seed(0)
        return RecurrentDepthLM(RDLMConfig.from_preset("small", context_length=32, mean_recurrence=4,
                                                       backprop_depth=2, activation_checkpointing=True))

    common = dict(steps=4, micro_batch_size=4, precision="fp32", **FAST)
    plain = train(TrainConfig(**common), model=small(), train_data=rows)
    sharded = train(TrainConfig(strategy="fsdp", out_dir=str(tmp_path), **common), model=small(), train_data=rows)
    assert sharded.losses == pytest.approx(plain.losses, rel=1e-5)
    assert (latest_checkpoint(tmp_path) / "dcp").is_dir()  # FSDP writes a sharded checkpoint
    ema = sharded.ema_model.state_dict()
    for name, value in plain.ema_model.state_dict().items():
        torch.testing.assert_close(ema[name], value, rtol=1e-4, atol=1e-6)


def test_fused_adamw_skips_a_flagged_step_without_a_host_sync():
    p = torch.nn.Parameter(torch.ones(4, 4))
    opt = AdamW([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.ones(4, 4)
    opt.step(found_inf=torch.tensor(True))
    assert torch.equal(p.detach(), torch.ones(4, 4)) and opt.state[p]["step"].item() == 0
    opt.step(found_inf=torch.tensor(False))
    assert not torch.equal(p.detach(), torch.ones(4, 4)) and opt.state[p]["step"].item() == 1


def test_strategy_options_are_checked():
    with pytest.raises(ConfigError, match="strategy must be one of"):
        TrainConfig(strategy="zero3")
    with pytest.raises(ConfigError, match="cpu_offload needs strategy fsdp"):
        TrainConfig(strategy="ddp", cpu_offload=True)


# ------------------------------------------------------------------------------------------------
# Zero, NaN and infinity at the boundary; divergence; damaged and finished runs

@pytest.mark.parametrize("field, value", [
    ("mean_recurrence", 0), ("backprop_depth", 0), ("threads", 0), ("mean_recurrence", -1),
    ("lr", float("nan")), ("lr", float("inf")), ("lr", -1e-3), ("eps", float("nan")),
    ("weight_decay", float("inf")), ("betas", (float("nan"), 0.95)), ("grad_clip", float("inf")),
    ("ema_decay", float("nan")), ("recurrence_sigma", float("nan")), ("update_clip", float("nan")),
    ("min_lr_ratio", 2.0), ("peak_flops", float("inf")),
])
def test_zero_and_non_finite_numbers_are_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**{field: value})


@pytest.mark.parametrize("flag, value", [("--lr", "nan"), ("--lr", "inf"), ("--backprop-depth", "0"),
                                         ("--mean-recurrence", "0"), ("--threads", "0"),
                                         ("--device", "cuda:99" if torch.cuda.is_available() else "cuda")])
def test_the_command_line_names_a_bad_number_in_one_line(tmp_path, capsys, flag, value):
    from rdlm.cli import main

    code = main(["train", "--model", "tiny", "--data", str(tmp_path / "shards"), "--out-dir", str(tmp_path / "run"),
                 "--steps", "1", flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and flag.lstrip("-").replace("-", "_") in err[0].replace("-", "_"), err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_diverged_run_names_the_last_checkpoint_with_finite_weights(tmp_path):
    model = tiny()

    def poison(record):
        if record["kind"] == "train" and record["step"] == 3:
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))

    with pytest.raises(TrainingError, match="not finite at step 6.*last checkpoint with finite weights .*step-000002"):
        train(TrainConfig(steps=6, micro_batch_size=4, checkpoint_every=2, out_dir=str(tmp_path), **FAST),
              model=model, train_data=counting_rows(16), step_hooks=[poison])
    import json

    flags = {p.name: json.loads((p / "trainer.json").read_text())["finite_weights"]
             for p in sorted((tmp_path / "checkpoints").iterdir())}
    assert flags == {"step-000002": True, "step-000004": False, "step-000006": False}


def _damage_optimizer_truncated(step):
    data = (step / "optimizer.safetensors").read_bytes()
    (step / "optimizer.safetensors").write_bytes(data[: len(data) // 2])


def _damage_optimizer_missing_keys(step):
    from safetensors.torch import load_file, save_file

    tensors = load_file(step / "optimizer.safetensors")
    save_file(dict(list(tensors.items())[:3]) | {"nonexistent.weight/exp_avg": torch.zeros(1)},
              step / "optimizer.safetensors")


def _damage_rng(step):
    from safetensors.torch import save_file

    save_file({"torch": torch.zeros(3, dtype=torch.uint8)}, step / "rng.safetensors")


def _damage_hidden_size(step):
    from rdlm.model.huginn import save_pretrained

    save_pretrained(RecurrentDepthLM(RDLMConfig.from_preset("tiny", hidden_size=32, num_heads=2,
                                                             context_length=64)), step / "model")


def _damage_trainer_json(step):
    (step / "trainer.json").write_text('{"step": 4, "optimizer_groups"')


@pytest.mark.parametrize("damage", [_damage_optimizer_truncated, _damage_optimizer_missing_keys, _damage_rng,
                                    _damage_hidden_size, _damage_trainer_json])
def test_resuming_falls_back_to_the_newest_intact_checkpoint_and_says_so(tmp_path, capsys, damage):
    config = dict(micro_batch_size=4, checkpoint_every=2, out_dir=str(tmp_path), ema_decay=None, **FAST)
    reference = train(TrainConfig(steps=6, **config), model=tiny(), train_data=counting_rows(16))
    import shutil

    shutil.rmtree(tmp_path / "checkpoints" / "step-000006")
    damage(tmp_path / "checkpoints" / "step-000004")
    capsys.readouterr()
    result = train(TrainConfig(steps=6, resume=True, **config), model=tiny(), train_data=counting_rows(16))
    err = capsys.readouterr().err
    assert "step-000004 cannot be resumed from" in err and "step-000002, the newest intact checkpoint" in err
    assert result.losses == reference.losses  # steps 3..6 redone from step 2, exactly


def test_resuming_says_where_and_a_changed_global_batch_names_the_accumulation_that_keeps_it(tmp_path, capsys):
    config = dict(checkpoint_every=2, out_dir=str(tmp_path), ema_decay=None, **FAST)
    train(TrainConfig(steps=2, micro_batch_size=4, accumulation=2, **config), model=tiny(),
          train_data=counting_rows(16))
    capsys.readouterr()
    train(TrainConfig(steps=4, micro_batch_size=4, accumulation=2, resume=True, **config), model=tiny(),
          train_data=counting_rows(16))
    err = capsys.readouterr().err
    assert "rdlm train: resumed from" in err and "step-000002 at step 2 of 4" in err
    # The global batch of 8 rows was 4 x 2 on one worker; with micro-batches of 2, accumulation 4 keeps it.
    with pytest.raises(ConfigError, match=r"global batch of 8 rows.*--accumulation 4 keeps it"):
        train(TrainConfig(steps=6, micro_batch_size=2, accumulation=1, resume=True, **config), model=tiny(),
              train_data=counting_rows(16))
    with pytest.raises(ConfigError, match=r"8 rows is not a multiple of 1 worker\(s\) x micro-batch 3"):
        train(TrainConfig(steps=6, micro_batch_size=3, accumulation=1, resume=True, **config), model=tiny(),
              train_data=counting_rows(16))


def test_resuming_a_finished_run_changes_nothing(tmp_path):
    rows = counting_rows(16)
    config = dict(steps=3, micro_batch_size=4, out_dir=str(tmp_path), eval_rows=4, eval_num_steps=(1, 2), **FAST)
    first = train(TrainConfig(**config), model=tiny(), train_data=rows, val_data=rows[:4])
    trainer_json = first.checkpoint / "trainer.json"
    before, mtime = trainer_json.read_text(), trainer_json.stat().st_mtime_ns
    log = (tmp_path / "log.jsonl").read_text()
    again = train(TrainConfig(resume=True, **config), model=tiny(), train_data=rows, val_data=rows[:4])
    assert len(again.evals) == len(first.evals) == 1
    assert trainer_json.read_text() == before and trainer_json.stat().st_mtime_ns == mtime
    assert (tmp_path / "log.jsonl").read_text() == log


def test_a_sharded_checkpoint_naming_files_outside_itself_is_refused(tmp_path):
    import dataclasses
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    from rdlm.model.huginn import CheckpointError
    from rdlm.train.checkpoint import load_weights

    rows = counting_rows(16, length=9, vocab=64)
    torch.manual_seed(0)
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny", context_length=16))
    train(TrainConfig(strategy="fsdp", out_dir=str(tmp_path), steps=1, micro_batch_size=4, precision="fp32",
                      **FAST), model=model, train_data=rows)
    step = latest_checkpoint(tmp_path)
    metadata = FileSystemReader(step / "dcp").read_metadata()
    metadata.storage_data = {k: dataclasses.replace(v, relative_path="../outside.distcp")
                             for k, v in metadata.storage_data.items()}
    with open(step / "dcp" / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    with pytest.raises(CheckpointError, match="'../outside.distcp' points outside the checkpoint directory"):
        load_weights(step)


@pytest.mark.parametrize("override", ["vocab_size=1024", "hidden_size=128", "num_heads=8"])
def test_set_cannot_change_the_shapes_of_a_loaded_model(tmp_path, capsys, override):
    from rdlm.cli import main
    from tests.hf_helpers import tiny_model_dir

    model_dir = tiny_model_dir(tmp_path / "model")
    code = main(["train", "--model", str(model_dir), "--data", str(tmp_path / "none"), "--set", override,
                 "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"--set {override}: {model_dir} holds weights of other shapes" in err
