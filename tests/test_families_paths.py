"""Every path on every family: `rdlm generate`, the server (the official openai client), transformers'
`generate`, evaluation and training run on a retrofitted and an Ouro checkpoint, and the learned gate's
saved iterations show in `--stats` and in the server's `usage.latent_iterations`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rdlm import load_pretrained
from rdlm.demo.tasks import CharTokenizer
from rdlm.inference.generate import GenerationConfig, generate

FIXTURES = Path(__file__).parent / "fixtures" / "families"


@pytest.fixture(scope="module")
def with_text(tmp_path_factory) -> dict[str, Path]:
    """The fixtures with a character tokenizer (their vocabulary has 128 entries)."""
    from rdlm.demo.tasks import EOS, PAD

    # One character per id of the 128-entry vocabulary, so every generated id is text.
    alphabet = PAD + EOS + "".join(map(chr, range(32, 127))) + "".join(map(chr, range(161, 192)))
    tokenizer = CharTokenizer(alphabet).to_tokenizer()
    out = {}
    for name in ("retrofit-llama-tiny", "ouro-tiny"):
        target = tmp_path_factory.mktemp(name) / "model"
        shutil.copytree(FIXTURES / name, target)
        tokenizer.save(str(target / "tokenizer.json"))
        out[name] = target
    return out


class Run:
    def __init__(self, capsys, args: tuple[str, ...]) -> None:
        from rdlm.cli import main

        try:
            self.returncode = main(list(args)) or 0
        except SystemExit as exit:
            self.returncode = exit.code if isinstance(exit.code, int) else 1
        captured = capsys.readouterr()
        self.stdout, self.stderr = captured.out, captured.err


@pytest.mark.parametrize("name", ["retrofit-llama-tiny", "ouro-tiny"])
def test_rdlm_generate_writes_text(with_text, name, capsys):
    run = Run(capsys, ("generate", "--model", str(with_text[name]), "--prompt", "the cat", "--max-new-tokens", "6",
               "--num-steps", "4", "--no-stream"))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().startswith("the cat") and len(run.stdout.strip()) > len("the cat")


def test_the_gate_saves_iterations_in_the_stats(with_text, capsys):
    run = Run(capsys, ("generate", "--model", str(with_text["ouro-tiny"]), "--prompt", "the cat", "--max-new-tokens",
               "12", "--num-steps", "4", "--exit-criterion", "gate", "--stats", "--no-stream"))
    assert run.returncode == 0, run.stderr
    mean = float(run.stderr.split("iterations per token mean ")[1].split()[0])
    assert 1 <= mean < 4
    run = Run(capsys, ("generate", "--model", str(with_text["retrofit-llama-tiny"]), "--prompt", "a", "--exit-criterion",
               "gate"))
    assert run.returncode != 0 and "needs a model with a learned exit gate" in run.stderr


def test_transformers_generate_equals_rdlm_on_both_families(with_text):
    pytest.importorskip("transformers")
    import rdlm.integrations.hf  # noqa: F401  registers the families
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    for name, options in (("retrofit-llama-tiny", {}), ("ouro-tiny", {}), ("ouro-tiny", {"exit_criterion": "gate"})):
        model = AutoModelForCausalLM.from_pretrained(with_text[name])
        # (the families ship their base model's tokenizer, not Huginn's: a plain fast tokenizer here)
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(with_text[name] / "tokenizer.json"))
        ids = tokenizer("the dog", return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=6, do_sample=False, num_steps=4, **options)
        expected = generate(load_pretrained(with_text[name]), [ids[0].tolist()],
                            GenerationConfig(max_new_tokens=6, num_steps=4, **options))
        assert out[0, ids.shape[1]:].tolist() == expected.tokens[0], (name, options)
        assert tokenizer.decode(out[0, ids.shape[1]:])  # text comes out


def test_the_server_reports_the_gates_saved_iterations(with_text):
    pytest.importorskip("openai")
    from test_serve import LiveServer

    with LiveServer(with_text["ouro-tiny"]) as live:
        client = live.client()
        full = client.completions.create(model="tiny", prompt="the cat", max_tokens=8, temperature=0)
        gated = client.completions.create(model="tiny", prompt="the cat", max_tokens=8, temperature=0,
                                          extra_body={"exit_criterion": "gate"})
        ids = live.tokenizer.encode("the cat", add_bos=True)
        text, steps = live.expected(ids, exit_criterion="gate", stop_tokens=(live.tokenizer.eos_id,))
    assert gated.choices[0].text == text
    assert gated.usage.model_extra["latent_iterations"] == sum(steps)
    assert gated.usage.model_extra["latent_iterations"] < full.usage.model_extra["latent_iterations"]


@pytest.mark.parametrize("name", [pytest.param("retrofit-llama-tiny", marks=pytest.mark.slow), "ouro-tiny"])
def test_rdlm_eval_text_and_analyze_run(with_text, name, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat. " * 8)
    run = Run(capsys, ("eval", "--model", str(with_text[name]), "--text", str(text),
               "--num-steps", "1,4", "--seq-len", "32", "--out", str(tmp_path / "eval")))
    assert run.returncode == 0, run.stderr
    criterion = "gate" if name == "ouro-tiny" else "kl"
    run = Run(capsys, ("analyze", "--model", str(with_text[name]), "--prompt", "the cat sat", "--num-steps", "4",
               "--exit-criterion", criterion, "--out", str(tmp_path / "analysis")))
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "analysis" / "report.html").is_file() and (tmp_path / "analysis" / "exit_steps.png").is_file()


def test_a_family_model_trains_and_its_loss_falls():
    """Randomized-depth training (rdlm's objective) on an Ouro-shaped and a retrofitted-shaped model."""
    from rdlm.model.lm import RecurrentDepthLM

    for path in (FIXTURES / "ouro-tiny", FIXTURES / "retrofit-llama-tiny"):
        model = load_pretrained(path).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 128, (4, 16), generator=g)
        labels = torch.cat([ids[:, 1:], torch.full((4, 1), -100)], dim=1)
        losses = []
        for _ in range(8):
            loss = model(ids, labels=labels, return_logits=False, generator=g).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0] - 0.1, (path.name, losses)
        assert isinstance(model, RecurrentDepthLM)
