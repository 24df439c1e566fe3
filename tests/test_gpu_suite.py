"""benchmarks/gpu_suite.py: the smoke run (the CPU, tiny shapes) writes its report with a status for every
part and every exact correctness claim holding, and the suite's time-boxing stops or skips a part that
does not fit its budget instead of stalling."""

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import torch

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = module   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(suite, tmp_path_factory):
    out = tmp_path_factory.mktemp("suite")
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    try:
        report = suite.main(["--smoke", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    return out, report, time.perf_counter() - t0


@pytest.mark.slow  # the suite's smoke run on the CPU (half a minute)
def test_the_smoke_run_writes_json_and_markdown_with_a_status_for_every_part(smoke):
    out, report, _ = smoke
    written = json.loads((out / "gpu_suite.json").read_text())
    assert written["parts"] == json.loads(json.dumps(report["parts"], default=str))
    names = [p["name"] for p in written["parts"]]
    assert names == ["correctness", "decode_speed", "serving_batch", "train_memory", "train_mfu"]
    statuses = {p["name"]: p["status"] for p in written["parts"]}
    # On the CPU everything runs but what needs CUDA (max_memory_allocated), which is skipped, not failed.
    assert statuses["train_memory"] == "skipped" and "needs CUDA" in written["parts"][3]["reason"]
    assert all(status == "ok" for name, status in statuses.items() if name != "train_memory"), written["parts"]
    table = (out / "gpu_suite.md").read_text()
    for name in names:
        assert f"| {name} |" in table


@pytest.mark.slow  # the suite's smoke run on the CPU (half a minute)
def test_every_correctness_case_that_claims_exactness_matches(smoke):
    _, report, _ = smoke
    cases = report["parts"][0]["figures"]["cases"]
    names = {c["case"] for c in cases}
    assert {"fixed r = 4", "speculative (draft 2 x 3)", "int4 weights", "ouro-tiny gate"} <= names
    assert {c["dtype"] for c in cases} == {"fp32", "bf16"}
    assert any(c["case"].startswith("exit argmax-stability") for c in cases)
    bad = [c for c in cases if c["exact_claim"] and not c["match"]]
    assert not bad, bad


@pytest.mark.slow  # the suite's smoke run on the CPU (half a minute)
def test_the_measurements_are_measured(smoke):
    _, report, _ = smoke
    parts = {p["name"]: p["figures"] for p in report["parts"]}
    assert all(row["decode_tok_s"] > 0 and row["roofline_tok_s"] > 0 for row in parts["decode_speed"]["cases"])
    assert [row["step"] for row in parts["serving_batch"]["cases"]] == ["eager", "static"]
    assert all(row["served_over_offline"] > 0 for row in parts["serving_batch"]["cases"])
    assert parts["train_mfu"]["cases"][0]["tokens_per_s"] > 0


def test_a_part_past_its_budget_is_stopped_and_the_suite_goes_on(suite):
    ran = []

    def stalls(ctx, figures):
        figures["before"] = 1
        time.sleep(30)

    def spins(ctx, figures):  # a part that checks its deadline between cases
        while True:
            ctx.check()
            time.sleep(0.01)

    def fails(ctx, figures):
        raise ValueError("broken")

    def fine(ctx, figures):
        ran.append(True)
        figures["cases"] = [{"x": 1.5}]

    parts = [suite.Part("stalls", stalls, 0.3), suite.Part("spins", spins, 0.2), suite.Part("fails", fails, 1),
             suite.Part("fine", fine, 1), suite.Part("too big", fine, 100), suite.Part("gpu", fine, 1, needs_cuda=True)]
    t0 = time.perf_counter()
    context = suite.Context(torch.device("cpu"), smoke=True)
    report = suite.run_suite(parts, context, budget_s=10, progress=lambda line: None)
    assert time.perf_counter() - t0 < 20  # not the stalled part's 30 s (8.6 s seen on a loaded 2-core machine)
    records = {p["name"]: p for p in report["parts"]}
    assert records["stalls"]["status"] == "overrun" and records["stalls"]["figures"] == {"before": 1}
    assert records["stalls"]["seconds"] < 10  # its 0.3 s budget, not the 30 s it sleeps (2.5 s seen under load)
    assert records["spins"]["status"] == "overrun"
    assert records["fails"]["status"] == "failed" and "ValueError: broken" in records["fails"]["reason"]
    assert records["fine"]["status"] == "ok" and ran == [True]
    assert records["too big"]["status"] == "skipped" and "does not fit" in records["too big"]["reason"]
    assert records["gpu"]["status"] == "skipped" and records["gpu"]["reason"] == "needs CUDA"
    assert "| 1.5 |" in suite.markdown(report)


def test_bad_arguments_are_clear_errors(suite, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    for argv in (["--smoke", "--out", str(tmp_path), "--budget-s", "-1"],
                 ["--smoke", "--out", str(tmp_path), "--parts", "nope"],
                 ["--smoke", "--out", str(tmp_path / "file" / "below")]):
        with pytest.raises(SystemExit):
            suite.main(argv)
    err = capsys.readouterr().err
    assert "positive number of seconds" in err and "unknown part(s) nope" in err and "cannot create" in err


def test_the_comparison_names_the_first_mismatch(suite):
    """The correctness rows can fail: a fast run that differs (here: at another r) is no match, and the row
    says where the runs part."""
    import gpu_suite_parts as parts
    from rdlm.inference.generate import GenerationConfig

    model = parts.tiny_model("tiny", torch.float32, torch.device("cpu"))
    rows = []
    eager = GenerationConfig(num_steps=4, max_new_tokens=4)
    parts.compare(rows, "same", "fp32", model, [[5, 6, 7]], eager, eager, fast_engine=parts.STATIC)
    parts.compare(rows, "other r", "fp32", model, [[5, 6, 7]], eager, GenerationConfig(num_steps=3, max_new_tokens=4))
    assert rows[0]["match"] and rows[0]["first_mismatch"] == ""
    assert not rows[1]["match"] and not rows[1]["steps_equal"]
    first = rows[1]["first_mismatch"]
    assert first.startswith("row 0 token 0: eager ") and "(4 steps) vs fast" in first and "(3 steps)" in first
