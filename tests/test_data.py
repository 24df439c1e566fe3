import json

import numpy as np
import pytest
import torch

from rdlm.data.prepare import Packer, pack_documents, prepare, read_documents
from rdlm.data.shards import (IGNORE_INDEX, Batches, DataError, MemoryRows, TokenShards, load_prompt_response,
                              make_batch)
from rdlm.data.tokenizer import train_tokenizer

DOCS = [f"document number {i}: " + " ".join(["alpha beta gamma"] * (i % 7 + 1)) for i in range(200)]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(DOCS, vocab_size=300)


def test_truncating_packing_starts_documents_with_bos_and_drops_tails():
    bos = 99
    docs = [[bos, 1, 2, 3], [bos, 4, 5, 6, 7, 8], [bos, 9], [bos, 10, 11]]
    rows = [r.tolist() for r in pack_documents(docs, 5, "truncate")]
    # Row 1: doc 1 (4 tokens) + the first token of doc 2; the rest of doc 2 is dropped, never a row start.
    # Row 2: doc 3 + doc 4 (5 tokens exactly). Nothing is left over.
    assert rows == [[bos, 1, 2, 3, bos], [bos, 9, bos, 10, 11]]
    assert [r.tolist() for r in pack_documents([[bos, 1, 2]], 5, "truncate")] == []  # an orphan partial row


def test_stream_packing_keeps_every_token_and_every_transition_once():
    bos = 99
    docs = [[bos, 1, 2, 3], [bos, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [bos, 14], [bos, 15, 16]]
    packer = Packer(5)
    rows = [r.tolist() for doc in docs for r in packer.add(doc)]
    stream = [t for doc in docs for t in doc]
    # Consecutive rows share one token (the last of a row is the first of the next), so each
    # (context, next token) transition of the stream is trained exactly once, across document boundaries.
    assert rows[0] == stream[:5] and all(a[-1] == b[0] for a, b in zip(rows, rows[1:]))
    pairs = [(r[i], r[i + 1]) for r in rows for i in range(4)]
    assert pairs == list(zip(stream, stream[1:]))[:len(pairs)]
    assert len(pairs) == len(stream) - 1 - (len(stream) - 1) % 4   # only the final partial row is left out
    assert packer.tokens == len(stream) == 20
    assert packer.kept_tokens == 17 and packer.dropped_tokens == 3   # 4 rows of 4 new tokens + the first


def test_prepare_keeps_nearly_all_of_a_corpus_of_long_documents_and_says_so(tok, tmp_path, capsys):
    """Documents much longer than the context: truncation keeps one row of each, streaming keeps all."""
    from rdlm.cli import main

    long_docs = [" ".join(DOCS[i:i + 12]) for i in range(0, len(DOCS) - 12, 12)]
    src = tmp_path / "long.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in long_docs))
    total = sum(len(tok.encode(d, add_bos=True)) for d in long_docs)
    kept = {}
    for packing in ("stream", "truncate"):
        meta = prepare([src], tok, tmp_path / packing, context_length=15, val_fraction=0.0, packing=packing)
        counts = meta["tokens"]["train"]
        assert counts["total"] == total and counts["kept"] + counts["dropped"] == total
        assert json.loads((tmp_path / packing / "meta.json").read_text())["tokens"] == meta["tokens"]
        kept[packing] = counts["kept"]
        rows, _ = TokenShards(tmp_path / packing, "train").rows(np.arange(meta["rows"]["train"]))
        assert rows.shape[1] == 16 and len(set(rows.flatten().tolist())) > 1
    assert kept["stream"] > total - 16 and kept["truncate"] < total / 2
    assert main(["data", "prepare", str(src), "--tokenizer", str(tmp_path / "stream" / "tokenizer.json"),
                 "--out", str(tmp_path / "cli"), "--context-length", "15", "--val-fraction", "0"]) == 0
    assert f"train: kept {kept['stream']:,} of {total:,} tokens" in capsys.readouterr().err


def test_prepare_writes_memmapped_shards_with_a_validation_split(tok, tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    meta = prepare([src], tok, tmp_path / "out", context_length=31, val_fraction=0.2, rows_per_shard=20)
    assert meta["documents"] == 200 and meta["val_documents"] > 10 and meta["train_documents"] > 100
    train = TokenShards(tmp_path / "out", "train")
    val = TokenShards(tmp_path / "out", "val")
    assert len(train.arrays) > 1  # several shards
    assert isinstance(train.arrays[0], np.memmap)
    rows, mask = train.rows(np.arange(len(train)))
    assert rows.shape == (len(train), 32) and mask is None
    assert rows[0, 0] == tok.bos_id  # the stream starts with a document; documents continue across rows
    assert int((rows[:, 1:] == tok.bos_id).sum()) >= meta["train_documents"] - 1
    truncated = prepare([src], tok, tmp_path / "trunc", context_length=31, val_fraction=0.2, packing="truncate")
    starts = TokenShards(tmp_path / "trunc", "train").rows(np.arange(truncated["rows"]["train"]))[0][:, 0]
    assert (starts == tok.bos_id).all()  # truncating: every row starts a document
    assert int(rows.max()) == meta["max_token_id"] < tok.vocab_size
    assert len(val) == meta["rows"]["val"]
    # Deterministic: preparing again gives identical shards and split.
    again = prepare([src], tok, tmp_path / "again", context_length=31, val_fraction=0.2, rows_per_shard=20)
    assert again["rows"] == meta["rows"]
    assert torch.equal(TokenShards(tmp_path / "again").rows(np.arange(len(train)))[0], rows)


def test_read_documents_formats_and_errors(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\n\ntwo")
    assert list(read_documents([tmp_path / "a.txt"])) == ["one\n\n\ntwo"]
    assert list(read_documents([tmp_path / "a.txt"], separator="\n\n\n")) == ["one", "two"]
    (tmp_path / "b.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match="b.jsonl:1: no field 'text'"):
        list(read_documents([tmp_path / "b.jsonl"]))
    with pytest.raises(DataError, match="does not exist"):
        list(read_documents([tmp_path / "missing.txt"]))


def test_prepare_rejects_too_little_text(tok, tmp_path):
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(DataError, match="no complete training row"):
        prepare([tmp_path / "short.txt"], tok, tmp_path / "out", context_length=64)


def test_batches_are_deterministic_and_split_across_workers():
    rows = MemoryRows(torch.arange(40 * 3).view(40, 3))
    single = Batches(rows, micro_batch_size=4, world_size=1, seed=5)
    pair = [Batches(rows, micro_batch_size=2, world_size=2, seed=5) for _ in range(2)]
    for step in range(25):  # crosses epoch boundaries
        whole = single.get(step, 0).input_ids
        halves = torch.cat([pair[rank].get(step, 0, rank).input_ids for rank in range(2)])
        assert torch.equal(whole, halves)
    seen = torch.cat([single.get(s, 0).input_ids[:, 0] for s in range(10)])
    assert sorted(seen.tolist()) == list(range(0, 120, 3))  # one epoch visits every row once
    assert not torch.equal(single.get(0, 0).input_ids, single.get(10, 0).input_ids)  # reshuffled


def test_prompt_response_jsonl(tok, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": "2+2?", "response": "4"}) + "\n" +
                    json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    rows = load_prompt_response(path, tok)
    tokens, mask = rows.rows(np.arange(2))
    first = tokens[0][mask[0]].tolist()
    assert tok.decode(first) == "4<|end_turn|>"
    assert tokens[0, 0] == tok.bos_id
    assert not mask[0, : len(tok.apply_chat_template([{"role": "user", "content": "2+2?"}]))].any()
    path.write_text('{"question": 1}\n')
    with pytest.raises(DataError, match="chat.jsonl:1: expected keys"):
        load_prompt_response(path, tok)


def test_data_text_never_becomes_a_control_token(tok, tmp_path):
    """Training text that spells a control token ("<|end_turn|>" in a reply, in a prompt or in a document)
    is trained on as text: only the format's own markers are control tokens."""
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": "say <|end_turn|>", "response": "a<|end_turn|>b"}) + "\n")
    tokens, mask = load_prompt_response(path, tok).rows(np.arange(1))
    ids = tokens[0][tokens[0] != tok.pad_id].tolist()
    assert ids.count(tok.end_turn_id) == 2   # the prompt turn's end and the reply's end, nothing from the text
    assert tok.decode(tokens[0][mask[0]].tolist()) == "a<|end_turn|>b<|end_turn|>"
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d + " <|end_text|><|begin_text|>"}) + "\n" for d in DOCS))
    meta = prepare([src], tok, tmp_path / "out", context_length=31, val_fraction=0.2)
    rows = TokenShards(tmp_path / "out", "train").rows(np.arange(meta["rows"]["train"]))[0]
    # one BOS per document, none from the text (rows overlap by one token: count each position once)
    assert int((rows[:, :-1] == tok.bos_id).sum()) <= meta["train_documents"]
    assert int((rows == tok.eos_id).sum()) == 0



def test_memory_rows_targets_replace_the_next_token_as_labels():
    tokens = torch.tensor([[1, 2, 3, 4]])
    targets = torch.tensor([[1, 9, 3, 8]])
    mask = torch.tensor([[False, True, False, True]])
    batch = make_batch(*MemoryRows(tokens, mask, targets).rows(np.arange(1)))
    assert batch.input_ids.tolist() == [[1, 2, 3]]
    assert batch.labels.tolist() == [[9, IGNORE_INDEX, 8]]
    assert MemoryRows(tokens, mask, targets).max_token_id() == 9
    with pytest.raises(DataError, match="targets has shape"):
        MemoryRows(tokens, mask, targets[:, :2])


@pytest.mark.parametrize("context_length", [0, -3])
def test_prepare_refuses_a_context_length_below_one(tmp_path, context_length):
    from rdlm.data.prepare import prepare

    with pytest.raises(DataError, match="context_length must be an integer >= 1"):
        prepare([tmp_path / "x.txt"], None, tmp_path / "out", context_length)


def test_non_utf8_text_is_refused_naming_the_file(tmp_path):
    from rdlm.data.prepare import read_documents

    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin1"))
    with pytest.raises(DataError, match="latin1.txt: not valid UTF-8 at byte 3"):
        list(read_documents([tmp_path / "latin1.txt"]))


@pytest.mark.parametrize("line, field", [('{"prompt": "hi", "response": null}', "'response'"),
                                         ('{"prompt": {"a": 1}, "response": "x"}', "'prompt'"),
                                         ('{"prompt": 3, "response": "x"}', "'prompt'"),
                                         ('{"messages": [{"role": "assistant"}]}', "'messages\\[0\\]'"),
                                         ('{"messages": ["hi"]}', "'messages\\[0\\]'"),
                                         ('{"messages": {}}', "'messages'")])
def test_fine_tuning_lines_are_validated_naming_file_line_and_field(tmp_path, line, field):
    path = tmp_path / "ft.jsonl"
    path.write_text("\n" + line + "\n")  # validated before the tokenizer is ever asked
    with pytest.raises(DataError, match=f"ft.jsonl:2: field {field}"):
        load_prompt_response(path, object())


@pytest.fixture(scope="module")
def shard_workspace(tmp_path_factory):
    from rdlm.cli import main
    from tests.hf_helpers import CORPUS, tiny_model_dir

    root = tmp_path_factory.mktemp("meta")
    tiny_model_dir(root / "model")
    (root / "text.txt").write_text("\n".join(CORPUS * 4))
    assert main(["data", "prepare", str(root / "text.txt"), "--tokenizer", str(root / "model"), "--out",
                 str(root / "shards"), "--context-length", "16", "--val-fraction", "0"]) == 0
    return root


def _set(key, value):
    return lambda meta: meta.__setitem__(key, value)


def _shard_file(name):
    return lambda meta: meta["splits"]["train"][0].__setitem__("file", name)


@pytest.mark.parametrize("edit,message", [
    (_set("max_token_id", 100000), "meta.json: max_token_id 100000 is not below vocab_size"),
    (_set("max_token_id", 3), "holds token id .* above max_token_id 3 in meta.json"),
    (_set("max_token_id", "x"), "meta.json: 'max_token_id' must be an integer >= 0, got 'x'"),
    (lambda meta: meta.pop("splits"), "meta.json: no 'splits'"),
    (_set("splits", {"train": "train-00000.npy"}), r"meta.json: splits\['train'\] must be a list"),
    (_shard_file("../outside.npy"), "meta.json: file name '../outside.npy' points outside the data directory"),
    (_shard_file("/etc/passwd"), "meta.json: file name '/etc/passwd' points outside the data directory"),
    (_set("vocab_size", 1000), "data holds token id .*out of range for the model's vocabulary of 512"),
], ids=["max-above-vocab", "max-below-shards", "max-not-int", "no-splits", "split-not-list", "dotdot",
        "absolute", "vocab-above-model"])
def test_a_damaged_meta_json_is_one_line_naming_the_file(shard_workspace, tmp_path, capsys, edit, message):
    import re
    import shutil

    from rdlm.cli import main

    shards = tmp_path / "shards"
    shutil.copytree(shard_workspace / "shards", shards)
    meta = json.loads((shards / "meta.json").read_text())
    edit(meta)
    if meta.get("vocab_size") == 1000:
        meta["max_token_id"] = 900
    (shards / "meta.json").write_text(json.dumps(meta))
    code = main(["train", "--model", str(shard_workspace / "model"), "--data", str(shards), "--steps", "1",
                 "--out-dir", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and re.search(message, err), err
    assert err.strip().count("\n") == 0 or all("error" not in line for line in err.strip().splitlines()[:-1])


@pytest.mark.parametrize("rows", [0, -1])
def test_prepare_refuses_fewer_than_one_row_per_shard(tmp_path, rows):
    from rdlm.data.prepare import prepare

    with pytest.raises(DataError, match="--rows-per-shard must be an integer >= 1"):
        prepare([tmp_path / "x.txt"], None, tmp_path / "out", 16, rows_per_shard=rows)


def test_non_utf8_jsonl_is_refused_naming_the_file_and_line(tmp_path):
    from rdlm.fileio import read_jsonl

    (tmp_path / "x.jsonl").write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match="x.jsonl:2: not valid UTF-8"):
        list(read_jsonl(tmp_path / "x.jsonl", DataError))


def test_trimmed_rows_end_at_the_last_supervised_column_and_train_the_same():
    from rdlm.data.shards import make_batch
    from rdlm.model.config import RDLMConfig
    from rdlm.model.lm import RecurrentDepthLM

    tokens = torch.zeros(4, 10, dtype=torch.long)
    mask = torch.zeros(4, 10, dtype=torch.bool)
    for i, length in enumerate((3, 5, 4, 9)):
        tokens[i, :length] = torch.arange(1, length + 1)
        mask[i, 1:length] = True
    full, trimmed = MemoryRows(tokens, mask), MemoryRows(tokens, mask, trim=True)
    assert trimmed.rows(np.array([0, 2]))[0].shape == (2, 4)     # rows of 3 and 4 tokens: 4 columns
    assert trimmed.rows(np.array([3]))[0].shape == (1, 9)
    model = RecurrentDepthLM(RDLMConfig.from_preset("tiny")).eval()
    index = np.array([0, 1, 2])
    a, b = make_batch(*full.rows(index)), make_batch(*trimmed.rows(index))
    assert b.input_ids.shape[1] == 4 and a.num_targets == b.num_targets
    with torch.no_grad():  # causal: the padding after the last label changes no loss
        la = model(a.input_ids, num_steps=2, labels=a.labels, init_scale=0.0).loss
        lb = model(b.input_ids, num_steps=2, labels=b.labels, init_scale=0.0).loss
    torch.testing.assert_close(la, lb)
    with pytest.raises(DataError, match="trim needs a loss mask"):
        MemoryRows(tokens, trim=True)
    in_order = Batches(full, 2, shuffle=False)
    assert in_order.indices(in_order.positions(1, 0, 0)).tolist() == [2, 3]
