"""`rdlm chat` keeps the conversation going when it outgrows the model's context (rdlm/cli/chat.py)."""

import io

import pytest

from rdlm.cli import main
from rdlm.data.tokenizer import Tokenizer
from tests.hf_helpers import tiny_model_dir

CONTEXT = 256  # the tiny preset's


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("cli-chat") / "model")


def chat(monkeypatch, capsys, model_dir, lines: list[str], *flags) -> tuple[int, list, list[str]]:
    """(exit status, (prompt, max_new_tokens) of each reply asked of the model, stderr's lines); the model
    replies with nothing, so that the prompts depend on the user's lines alone."""
    asked = []
    monkeypatch.setattr("rdlm.cli.chat.generate",
                        lambda model, prompts, config, **kw: asked.append((prompts[0], config.max_new_tokens)))
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    code = main(["chat", "--model", str(model_dir), *flags])
    return code, asked, capsys.readouterr().err.strip().splitlines()


def template(tok, texts: list[str]) -> list[int]:
    messages = []
    for text in texts:
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
    return tok.apply_chat_template(messages[:-1], add_generation_prompt=True)


def test_the_oldest_exchanges_are_dropped_and_a_message_too_long_is_not_sent(model_dir, monkeypatch, capsys):
    tok = Tokenizer.from_dir(model_dir)
    lines = [f"The capital of France is Paris. Two plus two is four, line {i}." for i in range(8)]
    long = "ravens " * 300
    code, asked, err = chat(monkeypatch, capsys, model_dir, [*lines, long, "hello"], "--max-new-tokens", "4")
    assert code == 0 and len(asked) == len(lines) + 1  # every line answered but the long one
    assert all(len(prompt) + new <= CONTEXT and new == 4 for prompt, new in asked)
    notes = [line for line in err if "dropped the oldest" in line]
    assert notes and notes[0] == ("rdlm chat: note: dropped the oldest 1 exchange(s) of the conversation so that it "
                                  "fits the model's context of 256 tokens with room for a reply")
    too_long = len(tok.apply_chat_template([{"role": "user", "content": long}], add_generation_prompt=True))
    assert (f"rdlm chat: message not sent: it makes a prompt of {too_long} tokens, and the model's context is 256; "
            "the conversation goes on") in err
    # The last prompt is the newest exchanges that fit, ending with "hello": the long message left no trace.
    kept = [*lines, "hello"]
    while len(template(tok, kept)) + 4 > CONTEXT:
        kept = kept[1:]
    assert asked[-1][0] == template(tok, kept) and len(kept) > 2
    assert sum(int(note.split("oldest ")[1].split()[0]) for note in notes) == len(lines) + 1 - len(kept)


def test_a_reply_gets_the_room_the_context_leaves(model_dir, monkeypatch, capsys):
    tok = Tokenizer.from_dir(model_dir)
    code, asked, err = chat(monkeypatch, capsys, model_dir, ["hello"], "--max-new-tokens", "1000")
    prompt = template(tok, ["hello"])
    assert code == 0 and asked == [(prompt, CONTEXT - len(prompt))] and err == []
