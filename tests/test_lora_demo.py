"""`rdlm demo --experiment lora` (rdlm.demo.lora_demo): the shifted task, the claims' arithmetic, what each arm
trains, a tiny end-to-end run (fast); the defaults on a confirmation seed (slow, docs/experiments.md)."""

import json
import random

import pytest
import torch

from rdlm.cli import main
from rdlm.demo import tasks as T
from rdlm.demo.config import DemoConfig
from rdlm.demo.lora_demo import ARMS, BOUNDS, LoraSettings, claims_and_checks, run_lora_experiment

TINY = dict(batch_size=8, hidden_size=32, num_heads=2, eval_examples=12, eval_num_steps=(1, 2), warmup_steps=1,
            workers=1, progress=False)


def test_the_shifted_task_follows_its_own_moves_and_the_base_task_is_unchanged():
    family = T.get_task("permutations-shifted")
    rng = random.Random(0)
    for moves in (1, 5, 24):
        ex = family.make(rng, moves)
        value = int(ex.prompt[0])
        for i, move in enumerate(ex.prompt[2:-1]):
            value = T.SHIFTED_MOVES[move][value]
            assert ex.trace[i] == (i + 2, str(value))
        assert ex.answer == str(value) and set(ex.prompt[2:-1]) <= set("abcde")
    # Two new rules beside the old ones: neither is one of the base task's permutations.
    new = {m: p for m, p in T.SHIFTED_MOVES.items() if m not in T.MOVES}
    assert set(new) == {"d", "e"} and not set(new.values()) & set(T.MOVES.values())
    assert all(T.SHIFTED_MOVES[m] == p for m, p in T.MOVES.items())
    # The base task's examples are those it always drew (the table is a default argument now).
    assert T.permutations_example(random.Random(3), 6) == T.get_task("permutations").make(random.Random(3), 6)
    # (the example and its answer as the code before the variant drew them)
    assert T.permutations_example(random.Random(3), 6) == T.Example("1:ccabcb?", "3", 6, trace=(
        (2, "1"), (3, "1"), (4, "2"), (5, "2"), (6, "3"), (7, "3")))
    splits = T.make_splits("permutations-shifted", 0, 40, seed=0)
    assert [min(ex.difficulty for ex in splits["harder"]), max(ex.difficulty for ex in splits["test"])] == [21, 20]


def _tables(**models):
    """{model: {split: {"overall": {r: acc}}}} from {model: {split: (acc at r=4, acc at r=32)}}."""
    return {m: {s: {"overall": {4: a, 32: b}} for s, (a, b) in splits.items()} for m, splits in models.items()}


def test_lora_claims_arithmetic():
    tables = _tables(
        base=dict(test=(0.2, 0.3), harder=(0.2, 0.2), base_test=(0.9, 1.0)),
        lora_random=dict(test=(0.8, 0.85), harder=(0.4, 0.5), base_test=(0.8, 0.9)),
        lora_fixed=dict(test=(0.9, 0.9), harder=(0.5, 0.55), base_test=(0.7, 0.5)),
        full_random=dict(test=(0.9, 0.9), harder=(0.5, 0.7), base_test=(0.5, 0.6)),
    )
    claims, checks = claims_and_checks(tables, 4)
    assert [c["value"] for c in checks] == pytest.approx([0.3, 0.05, 0.1, -0.05, 0.05, 0.1])
    assert [c["bound"] for c in checks] == [BOUNDS["variant_is_new"], BOUNDS["test_gain"], BOUNDS["harder_gain"],
                                            -BOUNDS["lora_vs_full"], BOUNDS["fixed_gain"], BOUNDS["forgetting"]]
    assert [c["op"] for c in checks] == ["<=", ">=", ">=", ">=", "<=", "<="]
    assert all(c["holds"] for c in checks)  # every value exactly at its bound (in floating point, near it)
    assert claims["forgetting"] == pytest.approx({"lora_random": 0.1, "lora_fixed": 0.5, "full_random": 0.4})
    tables["lora_random"]["harder"]["overall"][32] = 0.45
    tables["lora_fixed"]["harder"]["overall"][32] = 0.6
    _, checks = claims_and_checks(tables, 4)
    assert [c["holds"] for c in checks] == [True, True, False, True, False, True]


def test_tiny_lora_experiment_trains_only_the_adapters(tmp_path):
    cfg = DemoConfig(out_dir=str(tmp_path), **TINY)
    result = run_lora_experiment(cfg, LoraSettings(base_steps=4, steps=3, rank=4))
    res = json.loads((tmp_path / "results.json").read_text())
    for name in ("report.md", "lora.png", "model/config.json", "model/tokenizer.json",
                 "adapter/adapter_config.json", "adapter/adapter_model.safetensors", "adapter/rdlm_adapter.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    # Every claim is in the results and in the report's table, with its mark.
    assert len(res["checks"]) == len(BOUNDS)
    report = (tmp_path / "report.md").read_text()
    for check in res["checks"]:
        assert isinstance(check["holds"], bool)
        assert f"| {check['claim']} |" in report and f"| {'yes' if check['holds'] else 'NO'} |" in report
    # Every model scored at the sweep's r, the fixed depth and r=32, on the three splits.
    for kind in ("base", *ARMS):
        assert set(res["accuracy"][kind]) == {"test", "harder", "base_test"}
        assert set(res["accuracy"][kind]["test"]["overall"]) == {"1", "2", "4", "32"}
    # The LoRA arms leave every base weight as it was, bit for bit, and train their adapters; the full
    # fine-tune moves the base. Compared on the weights themselves (the results' flag is a digest of them).
    base = result.models["base"].state_dict()
    for kind, (lora, _) in ARMS.items():
        state = result.models[kind].state_dict()
        plain = {k.replace(".base_layer", ""): v for k, v in state.items() if ".lora_" not in k}
        assert plain.keys() == base.keys()
        unchanged = all(torch.equal(plain[k], base[k]) for k in base)
        assert unchanged == lora == res["arms"][kind]["base_weights_unchanged"], kind
        adapters = {k: v for k, v in state.items() if ".lora_" in k}
        assert bool(adapters) == lora
        if lora:
            assert any(v.abs().sum() > 0 for k, v in adapters.items() if ".lora_B." in k)  # B starts at zero
            assert res["arms"][kind]["trainable_parameters"] == sum(v.numel() for v in adapters.values())
        else:
            assert res["arms"][kind]["trainable_parameters"] == result.models["base"].num_parameters()
    assert set(res["training"]["lora_fixed"]["num_steps"]) == {4}  # the fixed arm: r = 4 at every step
    assert set(res["training"]["lora_random"]["num_steps"]) == set(res["training"]["full_random"]["num_steps"])
    assert res["training"]["lora_random"]["num_steps"] == res["training"]["full_random"]["num_steps"]
    assert res["steps"] == {"base": 4, "adaptation": 3}


@pytest.mark.parametrize("argv, message", [
    (["--experiment", "lora", "--steps", "4"], "--steps would have no effect: it is an option of --experiment "
                                               "main and gate"),  # lora: --base-steps, --adapt-steps
    (["--experiment", "gate", "--lora-rank", "4"], "--lora-rank would have no effect: it is an option of "
                                                   "--experiment lora"),
    (["--experiment", "lora", "--lora-rank", "0"], "lora rank"),
    (["--experiment", "lora", "--fixed-r", "0"], "fixed_r must be a positive integer"),
    (["--experiment", "lora", "--adapt-steps", "0"], "steps must be a positive integer"),
    (["--experiment", "lora", "--task", "variables"], "runs on the permutations task"),
])
def test_bad_lora_options_are_refused_before_any_work(argv, message, tmp_path, capsys):
    code = main(["demo", *argv, "--out", str(tmp_path / "out"), "--quiet"])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "results.json").exists()


@pytest.mark.slow
def test_lora_keeps_the_test_time_scaling_on_a_confirmation_seed(tmp_path):
    """The defaults on seed 1, a seed that chose nothing (docs/experiments.md#fine-tuning-with-lora). Every
    claim holds but one, as on the design seed (written before the confirmation runs): LoRA at a fixed
    r = 4 kept a gain above its depth (harder split, seed 0: 17.7% at r = 4 -> 83.0% at r = 32), where its
    claim said it would lose it; that claim stays in the report, marked failed."""
    cfg = DemoConfig(seed=1, out_dir=str(tmp_path), progress=False, eval_num_steps=(1, 2, 4, 8, 16, 32))
    result = run_lora_experiment(cfg)
    failed = [c["claim"] for c in result.results["checks"] if not c["holds"]]
    assert failed == ["LoRA at fixed r=4: variant harder at r=32 minus r=4 <= 0.05"], failed
    assert all(arm["base_weights_unchanged"] == kind.startswith("lora") for kind, arm in result.results["arms"].items())
    assert result.results["seconds"] < 900
