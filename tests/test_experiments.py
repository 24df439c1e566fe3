"""The demo's experiments (rdlm.demo.retrofit_demo, rdlm.demo.gate_demo): the FLOP accounting that matches
the control to the retrofitted model, the Llama round trip, the claims' arithmetic and tiny end-to-end runs
(fast); every claim on two seeds with the defaults (slow)."""

import json

import pytest
import torch

from rdlm.cli import main
from rdlm.demo import tasks as T
from rdlm.demo.config import DemoConfig
from rdlm.demo.experiment import check_rows, phase_rows
from rdlm.demo.gate_demo import BOUNDS as GATE_BOUNDS
from rdlm.demo.gate_demo import GateSettings, claims_and_checks as gate_claims, run_gate_experiment
from rdlm.demo.jobs import train_model
from rdlm.demo.retrofit_demo import BOUNDS as RETROFIT_BOUNDS
from rdlm.demo.retrofit_demo import (RetrofitSettings, claims_and_checks as retrofit_claims, control_rows,
                                     llama_config, matched_steps, planned_flops, run_retrofit_experiment)
from rdlm.model.lm import RecurrentDepthLM
from rdlm.model.retrofit import load_llama, retrofit, save_as_llama
from rdlm.train.schedule import RecurrenceCurriculum

TINY = dict(steps=6, batch_size=8, hidden_size=32, num_heads=2, eval_examples=12, eval_num_steps=(1, 2, 4),
            exit_max_steps=4, exit_thresholds=(1e-2, 1e-4), warmup_steps=2, progress=False)


def _tiny_rows(cfg: DemoConfig, steps: int, phase: int = 1):
    return phase_rows(T.get_task("permutations"), cfg, steps, phase, set(), T.CharTokenizer())


def test_planned_flops_are_what_the_trainer_counts():
    """The control's budget is planned before training: it must equal the retrofitted model's FLOPs as the
    trainer counts them, step by step (trimmed rows, r drawn around the curriculum's mean)."""
    cfg = DemoConfig(**TINY)
    rows = _tiny_rows(cfg, cfg.steps)
    config = llama_config(cfg, RetrofitSettings(), T.CharTokenizer().vocab_size, 64).replace(
        prelude_layers=1, core_layers=1, coda_layers=1, injection="concat", state_init="random",
        mean_recurrence=3, backprop_depth=2, recurrence_sampler="lognormal-poisson", recurrence_sigma=1.0)
    model = RecurrentDepthLM(config)
    ramp = RecurrenceCurriculum(3, cfg.steps, "1-sqrt", 1, 0.5)
    planned = planned_flops(model, rows, cfg.steps, cfg.batch_size, cfg.seed, ramp)
    _, history = train_model(cfg, config, rows, "x", start=model.state_dict(), curriculum="1-sqrt",
                             curriculum_fraction=0.5, curriculum_start=1)
    assert history["flops_per_step"] == planned
    assert len(set(planned)) > 1  # the steps differ (the r drawn, the rows' widths): the plan is not trivial


def test_the_control_gets_the_fewest_steps_that_reach_the_budget():
    assert matched_steps(10.0, [4.0, 4.0, 4.0]) == 3
    assert matched_steps(8.0, [4.0, 4.0, 4.0]) == 2
    assert matched_steps(13.0, [4.0, 4.0, 4.0]) is None
    cfg = DemoConfig(**TINY)
    model = RecurrentDepthLM(llama_config(cfg, RetrofitSettings(), T.CharTokenizer().vocab_size, 64))
    budget = 3.3 * sum(planned_flops(model, _tiny_rows(cfg, 4, 2), 4, cfg.batch_size, cfg.seed)) / 4
    rows, steps = control_rows(T.get_task("permutations"), cfg, model, budget, 1, set(), T.CharTokenizer())
    per_step = planned_flops(model, rows, steps, cfg.batch_size, cfg.seed)
    assert len(rows) == steps * cfg.batch_size
    assert sum(per_step) >= budget > sum(per_step[:-1])


def test_the_pretrained_llama_round_trips_and_its_retrofit_starts_as_the_llama(tmp_path):
    cfg = DemoConfig(**TINY)
    tokenizer = T.CharTokenizer()
    llama, _ = train_model(cfg, llama_config(cfg, RetrofitSettings(), tokenizer.vocab_size, 64),
                           _tiny_rows(cfg, cfg.steps, 0), "llama")
    save_as_llama(llama, tmp_path / "llama")
    tokenizer.to_tokenizer().save(tmp_path / "llama")
    assert json.loads((tmp_path / "llama" / "config.json").read_text())["model_type"] == "llama"
    ids = torch.tensor([tokenizer.encode("3:abcab?=")])
    with torch.no_grad():
        expected = llama(ids, num_steps=1).logits
        assert torch.equal(load_llama(tmp_path / "llama")(ids, num_steps=1).logits, expected)
        # No layer dropped and the adapter [0 | I]: at r = 1 the retrofitted model is the Llama.
        retrofitted = retrofit(tmp_path / "llama", tmp_path / "retro", [0], [1], [2], adapter_init="identity")
        torch.testing.assert_close(retrofitted(ids, num_steps=1).logits, expected, rtol=1e-5, atol=1e-5)


def test_the_default_split_follows_the_source_depth():
    """docs/retrofit.md's rule for a small model: the first layer, the ones between, the last; none dropped."""
    assert (RetrofitSettings().prelude, RetrofitSettings().core, RetrofitSettings().coda) == ((0,), (1,), (2,))
    five = RetrofitSettings(source_layers=5)
    assert (five.prelude, five.core, five.coda) == ((0,), (1, 2, 3), (4,))
    given = RetrofitSettings(source_layers=6, prelude=(0,), core=(3, 4), coda=(5,))  # 1 and 2 dropped
    assert given.core == (3, 4)
    with pytest.raises(ValueError, match="together, or none of them"):
        RetrofitSettings(source_layers=5, core=(1, 2))


def _table(**splits):
    return {name: {"overall": dict(values)} for name, values in splits.items()}


def test_retrofit_claims_arithmetic():
    retro = _table(test={1: 0.5, 5: 0.9, 8: 0.95}, harder={1: 0.2, 5: 0.5, 8: 0.6},
                   harder_validation={1: 0.2, 5: 0.5, 8: 0.7})
    control = _table(test={1: 0.9}, harder={1: 0.45})
    claims, checks = retrofit_claims({"retrofitted": retro, "control": control}, 5)
    assert claims["r_chosen_on_harder_validation"] == 8  # chosen on harder validation, not on harder itself
    assert [c["value"] for c in checks] == pytest.approx([0.0, 0.15, 0.4])
    assert [c["bound"] for c in checks] == [RETROFIT_BOUNDS[k] for k in ("test_vs_control", "harder_vs_control",
                                                                        "harder_gain")]
    assert all(c["holds"] for c in checks)  # 0.6 - 0.45 is not exactly 0.15 in floating point: still holds
    control = _table(test={1: 0.91}, harder={1: 0.46})
    _, checks = retrofit_claims({"retrofitted": retro, "control": control}, 5)
    assert [c["holds"] for c in checks] == [False, False, True]
    assert checks[0]["margin"] == pytest.approx(-0.01)


def test_gate_claims_arithmetic():
    gate = {"threshold": 0.3, "fixed_accuracy": {"test": 0.95, "harder": 0.5},
            "test": {"accuracy": 0.93, "answer_steps": 4.8, "answer_steps_by_difficulty": {2: 2.0, 20: 6.0}},
            "harder": {"accuracy": 0.5, "answer_steps": 3.0}}
    claims, checks = gate_claims(gate, 8, 2)
    assert [c["value"] for c in checks] == pytest.approx([1.5, 0.02, 0.4])
    assert [c["op"] for c in checks] == [">=", "<=", ">="]
    assert [c["bound"] for c in checks] == [GATE_BOUNDS[k] for k in ("harder_over_shortest", "accuracy_drop",
                                                                     "loops_saved")]
    assert all(c["holds"] for c in checks)
    gate["test"]["accuracy"] = 0.92
    gate["test"]["answer_steps"] = 5.0
    _, checks = gate_claims(gate, 8, 2)
    assert [c["holds"] for c in checks] == [True, False, False]
    with pytest.raises(ValueError, match="comparison"):
        check_rows([("x", 1.0, 0.0, "==")])


@pytest.mark.slow  # an experiment's training runs
def test_tiny_retrofit_experiment_writes_its_report(tmp_path, capsys):
    argv = ["demo", "--experiment", "retrofit", "--out", str(tmp_path), "--batch-size", "8",
            "--hidden-size", "32", "--num-heads", "2", "--eval-examples", "12", "--num-steps", "1,2,4",
            "--pretrain-steps", "4", "--retrofit-steps", "5", "--warmup-steps", "1", "--quiet"]
    assert main(argv) == 0
    assert "report:" in capsys.readouterr().out
    res = json.loads((tmp_path / "results.json").read_text())
    for name in ("report.md", "retrofit.png", "llama/config.json", "llama/tokenizer.json", "model/config.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert res["steps"] == {"pretraining": 4, "retrofitted": 5, "control": res["steps"]["control"]}
    assert res["steps"]["control"] > 5  # a Llama step costs less than a step of the recurrent model
    flops = res["flops"]
    assert flops["retrofitted"] == flops["retrofitted_planned"]
    per_step = res["training"]["control"]["flops_per_step"]
    assert flops["control"] >= flops["retrofitted"] > flops["control"] - per_step[-1]
    assert set(res["retrofitted"]["test"]["overall"]) == {"1", "2", "4", "5"}  # the training mean r = 5 too
    assert set(res["retrofitted"]) == {"validation", "test", "harder", "harder_validation"}
    assert len(res["checks"]) == 3 and "| claim |" in (tmp_path / "report.md").read_text()


@pytest.mark.slow  # an experiment's training runs
def test_tiny_gate_experiment_compares_the_gate_with_kl_exits(tmp_path):
    cfg = DemoConfig(out_dir=str(tmp_path), **TINY)
    result = run_gate_experiment(cfg, GateSettings(loops=3, thresholds=(0.2, 0.5, 0.9)))
    res = json.loads((tmp_path / "results.json").read_text())
    for name in ("report.md", "gate.png", "model/config.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    gate, kl = res["gate"], res["kl"]
    assert [row["threshold"] for row in gate["validation_sweep"]] == [0.2, 0.5, 0.9]  # loosest first
    assert [row["threshold"] for row in kl["validation_sweep"]] == [1e-2, 1e-4]
    assert gate["max_steps"] == 3 and kl["max_steps"] == 4
    for sweep in (gate, kl):
        for split in ("test", "harder"):
            assert 1 <= sweep[split]["answer_steps"] <= sweep["max_steps"]
    assert result.models["looped"].config.exit_gate and result.models["looped"].config.family == "ouro"
    assert set(res["training"]) == {"looped", "recurrent"}
    assert set(res["training"]["looped"]["num_steps"]) == {3}  # Ouro's objective: a fixed number of loops


@pytest.mark.parametrize("argv, message", [
    (["--experiment", "retrofit", "--task", "variables"], "runs on the permutations task"),
    (["--experiment", "retrofit", "--split", "0/1"], "prelude/core/coda"),
    (["--experiment", "retrofit", "--split", "0/0/1"], "named twice"),
    (["--experiment", "retrofit", "--pretrain-steps", "0"], "pretrain_steps must be a positive integer"),
    (["--experiment", "retrofit", "--source-layers", "2"], "at least 3 for the default split"),
    (["--experiment", "retrofit", "--source-layers", "3", "--split", "0/1/3"], "out of range"),
    (["--experiment", "retrofit", "--split", "2/1/0"], "layer 1 comes after layer 2"),  # the source's order
    (["--experiment", "gate", "--split", "0/1/2"], "--split would have no effect: it is an option of --experiment "
                                                   "retrofit"),
    (["--experiment", "retrofit", "--steps", "4"], "--steps would have no effect: it is an option of --experiment "
                                                   "main and gate"),  # retrofit: --pretrain-steps, --retrofit-steps
    (["--experiment", "gate", "--loops", "0"], "loops must be a positive integer"),
    (["--experiment", "gate", "--gate-thresholds", "0,0.5"], "gate thresholds must be in (0, 1]"),
    (["--experiment", "nope"], "invalid choice"),
])
def test_bad_experiment_options_are_refused_before_any_work(argv, message, tmp_path, capsys):
    try:
        code = main(["demo", *argv, "--out", str(tmp_path / "out"), "--quiet"])
    except SystemExit as exit:  # argparse's own refusals (a bad value for the option's type or choices)
        code = exit.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "results.json").exists()


# ---------------------------------------------------------------------------------------------------
# The claims with the defaults, on two seeds that did not choose the design (docs/demo.md).

@pytest.mark.slow
@pytest.mark.parametrize("seed", [200, 201])
def test_retrofitting_pays_on_the_demo_task(seed, tmp_path):
    result = run_retrofit_experiment(DemoConfig(seed=seed, out_dir=str(tmp_path), progress=False))
    failed = [c["claim"] for c in result.results["checks"] if not c["holds"]]
    assert not failed, failed
    assert result.results["seconds"] < 600


@pytest.mark.slow
@pytest.mark.parametrize("seed", [200, 201])
def test_the_gate_spends_depth_where_it_is_needed(seed, tmp_path):
    result = run_gate_experiment(DemoConfig(seed=seed, out_dir=str(tmp_path), progress=False))
    failed = [c["claim"] for c in result.results["checks"] if not c["holds"]]
    assert not failed, failed
    assert result.results["seconds"] < 600


@pytest.mark.slow  # several experiment runs
def test_demo_seeds_tabulates_an_experiment_with_its_own_columns(tmp_path):
    """benchmarks/demo_seeds.py -- --experiment gate: the gate's columns, its ratio claim's margin as a ratio;
    reports of two different experiments under one --out are refused."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "demo_seeds.py"
    tiny = ["--experiment", "gate", "--steps", "3", "--batch-size", "8", "--hidden-size", "32", "--num-heads", "2",
            "--eval-examples", "12", "--num-steps", "1,2", "--exit-max-steps", "2", "--exit-thresholds", "0.01",
            "--loops", "2", "--gate-thresholds", "0.5"]
    run = subprocess.run([sys.executable, str(script), "--seeds", "3", "--out", str(tmp_path), "--", *tiny],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    table = (tmp_path / "seeds.md").read_text()
    assert "| seed | gate threshold | test: exits / all loops |" in table
    results = json.loads((tmp_path / "seed-3" / "results.json").read_text())
    ratio = results["checks"][0]
    assert ratio["unit"] == "ratio" and f"{ratio['margin']:+.2f}x (3)" in table
    (tmp_path / "seed-4").mkdir()
    (tmp_path / "seed-4" / "results.json").write_text(json.dumps(dict(results, experiment="retrofit")))
    mixed = subprocess.run([sys.executable, str(script), "--seeds", "3-4", "--out", str(tmp_path), "--no-run"],
                           capture_output=True, text=True, timeout=60)
    assert mixed.returncode == 1 and "different experiments (gate, retrofit)" in mixed.stderr
