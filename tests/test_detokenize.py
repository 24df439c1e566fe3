"""Streamed text decoded incrementally (rdlm.data.tokenizer.IncrementalDecoder, StreamDecoder; the server's
Completion): the same text, pieces, stop cuts and logprobs as decoding the whole completion on every token, which
these tests keep as the reference (`WholeCompletion`, `WholeStreamDecoder`), at a cost linear in its length."""

import random

import pytest

from rdlm.data.tokenizer import IncrementalDecoder, StreamDecoder, train_tokenizer
from rdlm.inference.server.openai_api import Completion
from rdlm.inference.events import BatchEvent
from rdlm.inference.params import GenerationConfig, cut_at_stop

TEXTS = ["the river runs. the bird sings ünïcödé 🐦 数字 ✓ ", "ünïcödé the river bird 🐦🐦 数字 42 + 17 = 59"] * 20
ALPHABET = list("the rivbdsng.ü ïcöé✓数字🐦42+=\n") + ["the ", "river ", "🐦🐦", "ünï", "<|end_text|>"]


@pytest.fixture(scope="module")
def tok():
    # a small vocabulary: the emoji and the CJK characters stay split over several byte tokens
    return train_tokenizer(TEXTS, vocab_size=300)


@pytest.fixture(scope="module")
def ascii_tok():
    # trained on ASCII only: every other character is one token per byte
    return train_tokenizer(["plain ascii text only, the bird sings"] * 10, vocab_size=280)


def random_tokens(tok, rng: random.Random, n: int) -> list[int]:
    """Token ids of a random text over ALPHABET (characters split across tokens, special tokens among them),
    with random ids (invalid UTF-8, bytes of a character out of order, special tokens) mixed in."""
    text = "".join(rng.choice(ALPHABET) for _ in range(n))
    ids = tok.encode(text)[:n]
    for _ in range(rng.randrange(0, max(n // 8, 1) + 1)):
        ids.insert(rng.randrange(len(ids) + 1), rng.randrange(tok.vocab_size))
    return ids


class WholeCompletion:
    """The server's Completion before incremental decoding: the text is the decode of all the tokens so far,
    cut at the first stop string in it, on every `delta`. Kept as the reference the new one must match."""

    def __init__(self, tokenizer, config: GenerationConfig) -> None:
        self.tokenizer, self.config = tokenizer, config
        self.tokens: list[int] = []
        self.finish_reason = None
        self.sent = 0

    def add(self, event: BatchEvent) -> None:
        self.tokens.append(event.token)
        if event.finish_reason is not None:
            self.finish_reason = "stop" if event.finish_reason != "length" else "length"

    @property
    def text(self) -> str:
        return cut_at_stop(self.tokenizer.decode(self.tokens, skip_special_tokens=True), self.config.stop_strings)

    def delta(self) -> str:
        text = self.text
        if self.finish_reason is None:
            hold = max((len(s) - 1 for s in self.config.stop_strings), default=0)
            safe = len(text) - hold
            if text[:safe].endswith("\ufffd"):
                safe -= 1
            text = text[:max(safe, self.sent)]
        new, self.sent = text[self.sent:], len(text)
        return new


class WholeStreamDecoder:
    """The CLI's StreamDecoder before incremental decoding (it decoded all the tokens on every push): the
    reference for the pieces the new one prints."""

    def __init__(self, decode, strip_leading: bool = False) -> None:
        self.decode, self.strip_leading = decode, strip_leading
        self.tokens: list[int] = []
        self.emitted = ""

    def _visible(self) -> str:
        text = self.decode(self.tokens)
        return text.lstrip() if self.strip_leading else text

    def push(self, token: int) -> str:
        self.tokens.append(int(token))
        text = self._visible().rstrip("\ufffd")
        if not text.startswith(self.emitted):
            return ""
        new, self.emitted = text[len(self.emitted):], text
        return new

    def finish(self) -> str:
        text = self._visible()
        new = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted += new
        return new


def engine_events(config: GenerationConfig, tokens: list[int], decode, logprobs: bool = False) -> list[BatchEvent]:
    """The events an engine gives for these tokens: each token's finish reason is the engine's own stop check
    (`GenerationConfig.finish_reason`, stop strings read through `decode`); they end at the first."""
    events = []
    for k, token in enumerate(tokens):
        reason = config.finish_reason(tokens[:k + 1], 0, decode)
        top = ((token, -0.5), ((token + 1) % 7, -1.5)) if logprobs else None
        events.append(BatchEvent(0, token, 1 + k % 3, reason, -0.25 * (k % 5) if logprobs else None, top))
        if reason is not None:
            break
    return events


# --------------------------------------------------------------------------------------------------
# (a) the incremental text is the one-shot decode

@pytest.mark.parametrize("skip", [True, False])
def test_the_incremental_text_is_the_whole_decode_after_every_token(tok, skip):
    """On random token sequences (characters split over tokens, special tokens, invalid UTF-8), after every
    token the decoder's text is the decode of all the tokens so far; the settled pieces are what `push`
    returned and never end in half a character."""
    decode = lambda ids: tok.decode(ids, skip_special_tokens=skip)  # noqa: E731
    rng = random.Random(55)
    split = special = 0
    for _ in range(300):
        ids = random_tokens(tok, rng, rng.randrange(1, 60))
        decoder, returned = IncrementalDecoder(decode), []
        for k, token in enumerate(ids):
            returned.append(decoder.push(token))
            assert decoder.text == decode(ids[:k + 1])
            assert decoder.length == len(decoder.text)
        assert "".join(returned) == "".join(decoder.pieces) and not any(p.endswith("\ufffd") for p in decoder.pieces)
        for start in (0, 1, decoder.settled // 2, decoder.settled, decoder.length - 1, decoder.length + 3):
            assert decoder.since(start) == decoder.text[max(start, 0):]
        split += any("\ufffd" in tok.decode([i]) for i in ids)
        special += any(i >= tok.vocab_size - 6 for i in ids)
    assert split > 100 and special > 30   # the premise: the cases that need the context are common


def test_a_decoder_that_drops_a_text_s_leading_space_reads_each_token_in_its_context():
    """A sentencepiece-style decoder (Metaspace) drops the leading space of the first token it decodes: the
    new tokens are decoded after the last settled piece's, so a token in the middle keeps its space."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    backend.train_from_iterator(["the river runs and the bird sings ünï"] * 20,
                                trainer=trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    ids = backend.encode("the bird runs").ids
    assert backend.decode(ids[1:]) == "bird runs" and backend.decode(ids) == "the bird runs"  # the premise
    rng = random.Random(1)
    for skip in (True, False):
        decode = lambda t, skip=skip: backend.decode(t, skip_special_tokens=skip)  # noqa: E731
        for _ in range(100):
            ids = [rng.randrange(backend.get_vocab_size()) for _ in range(rng.randrange(1, 30))]
            decoder = IncrementalDecoder(decode)
            for k, token in enumerate(ids):
                decoder.push(token)
                assert decoder.text == decode(ids[:k + 1])


def test_a_character_split_over_tokens_is_held_back_until_its_last_byte(ascii_tok):
    tok = ascii_tok
    ids = tok.encode("ok 🐦")
    assert [tok.decode([i]) for i in ids[-4:]] == ["\ufffd"] * 4   # the emoji is four byte tokens here
    decoder = IncrementalDecoder(lambda t: tok.decode(t, skip_special_tokens=True))
    pieces = [decoder.push(i) for i in ids]
    assert pieces[-4:] == ["", "", "", "🐦"] and decoder.pending == "" and decoder.text == "ok 🐦"
    partial = IncrementalDecoder(lambda t: tok.decode(t, skip_special_tokens=True))
    for i in ids[:-1]:
        partial.push(i)
    assert partial.text == "ok \ufffd" == tok.decode(ids[:-1]) and partial.pending == "\ufffd"


@pytest.mark.parametrize("strip", [False, True])
def test_the_printed_pieces_are_the_whole_decode_s_piece_by_piece(tok, strip):
    """The CLI's StreamDecoder prints, token by token, the same pieces as when it decoded every token's
    whole reply, and they join to the reply decoded at once."""
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    rng = random.Random(7)
    for _ in range(200):
        ids = random_tokens(tok, rng, rng.randrange(1, 50))
        if rng.random() < 0.3:
            ids = tok.encode(rng.choice(["  ", "\n ", " \u3000"])) + ids   # leading white space to strip
        new, old = StreamDecoder(decode, strip), WholeStreamDecoder(decode, strip)
        for token in ids:
            assert new.push(token) == old.push(token)
        assert new.finish() == old.finish()
        whole = decode(ids)
        assert new.emitted == old.emitted == (whole.lstrip() if strip else whole)


# --------------------------------------------------------------------------------------------------
# (b) the server's Completion: its text, streamed pieces, stop cuts and logprobs are the whole decode's

def stop_spanning_tokens(tok, ids: list[int], rng: random.Random) -> str | None:
    """A piece of the decoded text that spans a boundary between tokens, or None."""
    text = tok.decode(ids, skip_special_tokens=True)
    for _ in range(20):
        if len(text) < 2:
            return None
        k = rng.randrange(1, len(ids))
        at = len(tok.decode(ids[:k], skip_special_tokens=True).rstrip("\ufffd"))
        start, end = max(0, at - rng.randrange(1, 4)), at + rng.randrange(1, 4)
        stop = text[start:end]
        if len(stop) >= 2 and "\ufffd" not in stop:
            return stop
    return None


def stream_both(tok, config: GenerationConfig, events: list[BatchEvent], chat: bool = False):
    """Feed the events to the Completion and to the whole-decode reference, a delta (and streamed logprobs)
    after each as the server streams; both chunk lists, final texts and logprobs."""
    new, old = Completion(tok, config), WholeCompletion(tok, config)
    new_chunks, old_chunks, streamed = [], [], []
    for event in events:
        new.add(event)
        old.add(event)
        new_chunks.append(new.delta())
        old_chunks.append(old.delta())
        streamed.append(new.logprobs(chat, new_only=True))
    return new, old, new_chunks, old_chunks, streamed


def test_a_completion_cuts_where_the_whole_text_does_and_streams_the_same_chunks(tok):
    """Stop strings that span tokens (split characters, merges, special tokens between), several per
    request, with stop tokens: the text is cut where `cut_at_stop` cuts the whole decode, every streamed
    chunk is the one the whole-decode Completion streamed, and the engine's reason is kept."""
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    rng = random.Random(3)
    cut = reasons = 0
    for case in range(300):
        ids = random_tokens(tok, rng, rng.randrange(2, 60))
        stops = [s for s in (stop_spanning_tokens(tok, ids, rng) for _ in range(rng.randrange(0, 4))) if s]
        if case % 3 == 0:
            stops += ["🐦", "数字"][: rng.randrange(0, 3)]
        config = GenerationConfig(stop_strings=tuple(dict.fromkeys(stops)), stop_tokens=(tok.eos_id,),
                                  max_new_tokens=len(ids), logprobs=rng.choice([None, 0, 2]))
        events = engine_events(config, ids, decode, logprobs=config.logprobs is not None)
        new, old, new_chunks, old_chunks, _ = stream_both(tok, config, events)
        assert new_chunks == old_chunks
        assert new.text == old.text == cut_at_stop(decode([e.token for e in events]), config.stop_strings)
        assert new.finish_reason == old.finish_reason and "".join(new_chunks).startswith(new.text)
        cut += len(new.text) < len(decode([e.token for e in events]))
        reasons += events[-1].finish_reason == "stop_string"
        # the response as a whole, as the non-streaming path reads it
        again, _, _, _, _ = stream_both(tok, config, events)
        assert again.text == new.text
    assert cut > 50 and reasons > 50   # the premise: many completions end at a stop string


def test_a_stop_string_completed_by_the_token_that_ends_the_stream_is_cut(ascii_tok):
    """A stop string whose last character is the last byte of an emoji split over four tokens."""
    tok = ascii_tok
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    ids = tok.encode("the bird 🐦 sings")
    config = GenerationConfig(stop_strings=("d 🐦",), max_new_tokens=len(ids))
    events = engine_events(config, ids, decode)
    assert events[-1].finish_reason == "stop_string" and decode([events[-1].token]) == "\ufffd"
    new, old, new_chunks, old_chunks, _ = stream_both(tok, config, events)
    assert new.text == old.text == "the bir" and new_chunks == old_chunks
    assert new.finish_reason == "stop"


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_logprobs_and_text_offsets_are_unchanged(tok, chat):
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    ids = tok.encode("the river 🐦 runs ünïcödé") + [tok.eos_id]
    config = GenerationConfig(stop_strings=("runs ü",), stop_tokens=(tok.eos_id,), max_new_tokens=99, logprobs=2)
    events = engine_events(config, ids, decode, logprobs=True)
    _, _, new_chunks, old_chunks, streamed = stream_both(tok, config, events, chat)
    assert new_chunks == old_chunks
    whole = Completion(tok, config)
    for event in events:
        whole.add(event)
    out = whole.logprobs(chat)
    if chat:
        assert [entry for part in streamed for entry in part["content"]] == out["content"]
    else:
        offsets = [at for part in streamed for at in part["text_offset"]]
        assert offsets == out["text_offset"]
        assert offsets == [sum(len(tok.token_text(e.token)) for e in events[:k]) for k in range(len(events))]


# --------------------------------------------------------------------------------------------------
# (c) the cost of a long streamed completion is linear in its length

class Counting:
    """A decode function that counts the tokens it is asked to decode."""

    def __init__(self, decode) -> None:
        self.decode, self.tokens, self.calls = decode, 0, 0

    def __call__(self, ids, *args, **kwargs) -> str:
        self.tokens += len(ids)
        self.calls += 1
        return self.decode(ids, *args, **kwargs)


def long_completion(tok, n: int) -> list[int]:
    text = ("the river runs. the bird sings ünïcödé 🐦 数字 ✓ 42 + 17 = 59\n" * (n // 10))
    ids = tok.encode(text)[:n]
    assert len(ids) == n
    return ids


def test_a_long_streamed_completion_decodes_a_number_of_tokens_linear_in_its_length(tok, monkeypatch):
    """Streaming n = 2000 tokens through the server's Completion, with a delta after every token as the
    server sends them and two stop strings held back, asks the tokenizer to decode at most 8n tokens in all
    (the tokens since the last settled piece and that piece's, twice per token: about 3n). The whole-decode
    Completion it replaced decoded every token's whole completion: 1 + 2 + ... + n = n(n + 1)/2 tokens,
    about n^2/2 (2,001,000 here)."""
    n = 2000
    ids = long_completion(tok, n)
    config = GenerationConfig(stop_strings=("never said", "nor this"), max_new_tokens=n)
    events = [BatchEvent(0, token, 1, "length" if k == n - 1 else None) for k, token in enumerate(ids)]
    counts = {}
    for name, kind in (("new", Completion), ("whole", WholeCompletion)):
        counting = Counting(tok.decode)
        monkeypatch.setattr(tok, "decode", counting)
        completion = kind(tok, config)
        chunks = []
        for event in events:
            completion.add(event)
            chunks.append(completion.delta())
        monkeypatch.undo()
        assert "".join(chunks) == tok.decode(ids, skip_special_tokens=True)
        counts[name] = counting.tokens
    assert counts["new"] <= 8 * n
    assert counts["whole"] == n * (n + 1) // 2
    print(f"tokens decoded for n = {n}: whole-decode Completion {counts['whole']}, incremental {counts['new']}")


def test_a_long_printed_reply_decodes_a_number_of_tokens_linear_in_its_length(tok):
    """The CLI's StreamDecoder: at most 8n tokens decoded for a reply of n = 2000 tokens, where decoding the
    whole reply on every token took n(n + 1)/2."""
    n = 2000
    ids = long_completion(tok, n)
    counts = {}
    for name, kind in (("new", StreamDecoder), ("whole", WholeStreamDecoder)):
        counting = Counting(lambda t: tok.decode(t, skip_special_tokens=True))
        stream = kind(counting, strip_leading=True)
        text = "".join(stream.push(t) for t in ids) + stream.finish()
        assert text == tok.decode(ids, skip_special_tokens=True).lstrip()
        counts[name] = counting.tokens
    assert counts["new"] <= 8 * n and counts["whole"] == n * (n + 1) // 2 + n   # (+ n: its finish decoded all)
