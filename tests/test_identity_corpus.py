"""The bit-identity corpus of generation cases (benchmarks/identity_corpus.py), short: its cases are many and
named once, a subset of every kind records the same lines twice, and `compare` finds a changed field or a
missing case. The full record (all 358 cases, over ten minutes on a 2-core AMD EPYC) is the script's `record`."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "identity_corpus.py"
# One case of each kind (a substring may match a few more).
SUBSET = ["generate/huginn-tiny-bf16/exit-kl", "generate/ouro-tiny/exit-gate-exact", "batch/tiny/cancel-running",
          "served/tiny-tok/completion-logprobs2-stream", "error/tiny/nan-weights", "logits/ouro-tiny/gate-exit-t0.9",
          "analysis/ouro-tiny"]


@pytest.fixture(scope="module")
def corpus():
    spec = importlib.util.spec_from_file_location("identity_corpus", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def only(names: list[str]) -> list[str]:
    return [arg for name in names for arg in ("--only", name)]


def test_the_corpus_names_at_least_150_cases_once_over_every_model_and_feature(corpus, capsys):
    from rdlm.inference.exits.criteria import CRITERIA

    assert corpus.main(["--list"]) == 0
    names = capsys.readouterr().out.split()
    assert len(names) >= 150 and len(names) == len(set(names))
    assert {name.split("/")[0] for name in names} == {"generate", "batch", "served", "hf", "logits", "analysis",
                                                      "error"}
    for model in ("tiny", "huginn-tiny", "huginn-tiny-bf16", "retrofit-llama-tiny", "ouro-tiny"):
        assert any(name.startswith(f"generate/{model}/") for name in names), model
    for criterion in CRITERIA:
        assert any(name.endswith(f"exit-{criterion}") for name in names), criterion
    for feature in ("speculative", "parallel", "continuous-cot", "shared-k", "static-step", "depth-", "stop-string"):
        assert any(feature in name for name in names), feature


@pytest.mark.slow  # records a subset twice
def test_a_subset_records_the_same_twice_and_compare_finds_a_change(corpus, tmp_path, capsys):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run([sys.executable, str(SCRIPT), "record", str(first), *only(SUBSET)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert corpus.main(["record", str(second), *only(SUBSET)]) == 0    # the second run in this process
    lines = first.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert {r["kind"] for r in records} == {"generate", "batch", "served", "error", "logits", "analysis"}
    assert all(("error" in r["result"]) == (r["kind"] == "error") for r in records)
    capsys.readouterr()
    assert corpus.main(["compare", str(first), str(second)]) == 0
    assert capsys.readouterr().out.strip().endswith(f"{len(lines)} cases, {len(lines)} identical")

    changed = [json.loads(line) for line in lines]
    target = next(r for r in changed if r["kind"] == "generate")
    target["result"]["tokens"][0][1] += 1
    altered = tmp_path / "c.jsonl"
    altered.write_text("\n".join(json.dumps(r) for r in changed[:-1]) + "\n")   # and the last case missing
    assert corpus.main(["compare", str(first), str(altered)]) == 1
    out = capsys.readouterr().out
    assert f"{target['name']}: result.tokens[0][1]: " in out
    assert f"{changed[-1]['name']}: missing in {altered}" in out
    assert out.strip().endswith(f"{len(lines)} cases, {len(lines) - 2} identical")
