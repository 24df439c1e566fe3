"""The tokenizer: byte-level BPE with Huginn's special tokens and chat format
(docs/checkpoint-format.md#tokenizer, docs/architecture.md#data).

A thin wrapper over a Hugging Face `tokenizers.Tokenizer` stored as `tokenizer.json`, the file a
Huginn-layout model directory carries. Special tokens are always looked up by name, never by id:
Huginn-0125 keeps them at 65504.., a tokenizer trained here puts them right after the BPE vocabulary.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import cast

from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from rdlm.checks import check_int
from rdlm.fileio import write_text

TOKENIZER_FILE = "tokenizer.json"
_PLAIN_LOCK = threading.Lock()  # Tokenizer._backend: makes the plain-text copy once

BOS = "<|begin_text|>"
EOS = "<|end_text|>"
BEGIN_HEADER = "<|begin_header|>"
END_HEADER = "<|end_header|>"
END_TURN = "<|end_turn|>"
PAD = "<|pad|>"
# In Huginn-0125's order, which gives ids 65504..65509 there.
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, BEGIN_HEADER, END_HEADER, END_TURN, PAD)

# The chat format, written once as the Jinja template Hugging Face tokenizers carry
# (tokenizer_config.json's "chat_template"); `format_chat` renders this same template, so rdlm's chat,
# server and lm-eval prompts and a transformers tokenizer's are one text. BOS, then per turn
# "<|begin_header|>ROLE<|end_header|>\n\nTEXT<|end_turn|>" with the content trimmed, as the reference
# template does; the assistant is named "Huginn".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|begin_header|>' + ('Huginn' if message['role'] == 'assistant' else message['role'])"
    " + '<|end_header|>\\n\\n' + message['content'] | trim + '<|end_turn|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|begin_header|>Huginn<|end_header|>\\n\\n' }}{% endif %}"
)


@functools.cache
def _compiled_chat_template():
    # Sandboxed and with the block settings transformers renders chat templates with.
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)


def format_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
    """The chat as prompt text (CHAT_TEMPLATE): messages are mappings with "role" and "content"."""
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(f"message {i} must be a mapping with 'role' and 'content', got {message!r}")
        turns.append({"role": str(message["role"]), "content": str(message["content"])})
    return _compiled_chat_template().render(messages=turns, bos_token=BOS, add_generation_prompt=add_generation_prompt)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table, which `tokenizers`' ByteLevel
    uses): printable Latin-1 bytes stand for themselves, the others for chr(256 + n) in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_level_alphabet()


class TokenizerError(ValueError):
    """A tokenizer file is missing, unreadable, or lacks a token rdlm needs; the message names it."""


class Tokenizer:
    """Encode/decode text and format chats. Wraps a `tokenizers.Tokenizer`."""

    def __init__(self, backend: HFTokenizer, source: str = "<memory>") -> None:
        self.backend = backend
        self.source = source
        # End of text and padding are what every path needs. A tokenizer without BOS (a task model's,
        # such as `rdlm demo`'s) starts texts with no marker; one without the header tokens has no chat
        # format, and the chat paths say so.
        missing = [t for t in (EOS, PAD) if backend.token_to_id(t) is None]
        if missing:
            raise TokenizerError(f"{source}: tokenizer lacks the special token(s) {', '.join(missing)}")
        self.bos_id = self._id(BOS)
        self.eos_id = cast(int, self._id(EOS))  # EOS and PAD are there (checked above)
        self.begin_header_id = self._id(BEGIN_HEADER)
        self.end_header_id = self._id(END_HEADER)
        self.end_turn_id = self._id(END_TURN)
        self.pad_id = cast(int, self._id(PAD))
        chat = (self.begin_header_id, self.end_header_id, self.end_turn_id)
        if self.end_turn_id is not None and self.bos_id is None:
            raise TokenizerError(f"{source}: tokenizer has the chat tokens but no {BOS}, which starts a chat")
        if any(i is None for i in chat) and any(i is not None for i in chat):
            raise TokenizerError(
                f"{source}: tokenizer has some chat tokens but not all of {BEGIN_HEADER}, {END_HEADER}, {END_TURN}"
            )
        # One past the largest id: the embedding rows a model needs (ids may have gaps, as Huginn's do).
        self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        self._plain: HFTokenizer | None = None

    def _id(self, token: str) -> int | None:
        found = self.backend.token_to_id(token)
        return None if found is None else int(found)

    @property
    def has_chat(self) -> bool:
        """Whether this tokenizer has the chat format's tokens (docs/checkpoint-format.md#tokenizer)."""
        return self.end_turn_id is not None

    # ----------------------------------------------------------------------------------------------
    # Files

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"tokenizer file {path} does not exist")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
            raise TokenizerError(f"{path}: not a readable tokenizer.json ({err})") from err
        return cls(backend, str(path))

    @staticmethod
    def check_file(path: str | os.PathLike, error: type[Exception] = TokenizerError) -> Path:
        """`path` when the tokenizers library reads it; else `error` naming it. Any tokenizer.json, not only
        one with rdlm's special tokens: a command that copies a source's tokenizer (retrofit, convert)
        checks it first, so that no output looks complete with a tokenizer nothing can read."""
        try:
            HFTokenizer.from_file(str(path))
        except Exception as err:  # noqa: BLE001 (tokenizers raises a bare Exception on malformed JSON)
            raise error(f"{path}: not a readable tokenizer.json ({err})") from None
        return Path(path)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> Tokenizer:
        return cls.from_file(Path(model_dir) / TOKENIZER_FILE)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """A tokenizer.json file, or a directory holding one."""
        return cls.from_dir(path) if Path(path).is_dir() else cls.from_file(path)

    def save(self, path: str | os.PathLike) -> Path:
        """Write tokenizer.json (into `path` if it is a directory or has no suffix), atomically."""
        path = Path(path)
        if path.is_dir() or path.suffix != ".json":
            path.mkdir(parents=True, exist_ok=True)
            path = path / TOKENIZER_FILE
        return write_text(path, self.backend.to_str(pretty=True))

    # ----------------------------------------------------------------------------------------------
    # Text

    def _backend(self, special: bool) -> HFTokenizer:
        """The backend that reads special-token text as control tokens (`special`), or a copy that reads
        it as plain text (tokenizers' `encode_special_tokens`), made once: a flag toggled on the shared
        backend would race between threads encoding at once."""
        if special:
            return self.backend
        with _PLAIN_LOCK:
            if self._plain is None:
                plain = HFTokenizer.from_str(self.backend.to_str())
                plain.encode_special_tokens = True
                self._plain = plain
        return self._plain

    def encode(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        """Token ids of `text`; `add_bos` puts BOS first (where the tokenizer has one). With `special`
        False, text such as "<|end_turn|>" is encoded as the characters it is, never as the control
        token: what user content and training data need, so that no text can forge a turn."""
        try:
            ids = self._backend(special).encode(text, add_special_tokens=False).ids
        except Exception as err:  # tokenizers raises a bare Exception (e.g. a character with no token)
            raise TokenizerError(
                f"{self.source} cannot encode {text[:60]!r}: {err} (a character outside its vocabulary?)"
            ) from err
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False, special: bool = True) -> list[list[int]]:
        try:
            encodings = self._backend(special).encode_batch(list(texts), add_special_tokens=False)
        except Exception as err:
            raise TokenizerError(f"{self.source} cannot encode a text of the batch: {err}") from err
        bos = [self.bos_id] if add_bos and self.bos_id is not None else []
        return [[*bos, *e.ids] for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for. A byte-level BPE token may hold part of a character, which
        `decode([token])` turns into U+FFFD; its vocabulary entry maps back to the exact bytes. An id the
        tokenizer does not have stands for none."""
        piece = self.backend.id_to_token(int(token))
        if piece is None:  # an id past the tokenizer's vocabulary (a model's padded embedding rows): no text,
            return b""  # as `decode` gives it none
        if type(self.backend.decoder).__name__ == "ByteLevel" and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return self.decode([token]).encode()

    def token_text(self, token: int) -> str:
        """One token as text: its characters, or for a token that holds part of a character its bytes
        written as `bytes:\\xe2\\x9c` (vLLM's form), so that two tokens never read the same."""
        data = self.token_bytes(token)
        try:
            return data.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def __len__(self) -> int:
        return self.vocab_size

    # ----------------------------------------------------------------------------------------------
    # Chat (docs/checkpoint-format.md#tokenizer): the module's `format_chat` (CHAT_TEMPLATE), as text or
    # token ids.

    @staticmethod
    def format_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        return format_chat(messages, add_generation_prompt)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """The chat's token ids. The template's own markers become control tokens; the messages' text
        never does ("<|end_turn|><|begin_header|>system" in a message is plain text). A chat with no
        such text gets the ids its rendered text has."""
        if not self.has_chat:
            raise TokenizerError(
                f"{self.source}: this tokenizer has no chat tokens ({BEGIN_HEADER}, "
                f"{END_HEADER}, {END_TURN}): the model was not made for chats"
            )
        # Render with a random marker in place of each message's (trimmed) text, then encode: every
        # special token outside the markers is the template's and becomes its id; each stretch between two
        # of them, messages' text included, is encoded as plain text, as the tokenizer would encode that
        # stretch within the whole (it splits at special tokens first).
        nonce = secrets.token_hex(8)
        marked, texts = [], []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or "content" not in message:
                raise ValueError(f"message {i} must be a mapping with 'role' and 'content', got {message!r}")
            texts.append(str(message["content"]).strip())
            marked.append({**message, "content": f"\x00{nonce}:{i}\x00"})
        rendered = format_chat(marked, add_generation_prompt)
        ids: list[int] = []
        for piece in re.split(f"({'|'.join(map(re.escape, SPECIAL_TOKENS))})", rendered):
            if piece in SPECIAL_TOKENS and (special := self._id(piece)) is not None:
                ids.append(special)
            elif piece:
                text = re.sub(f"\x00{nonce}:(\\d+)\x00", lambda m: texts[int(m.group(1))], piece)
                ids += self.encode(text, special=False)
        return ids


MAX_VOCAB_SIZE = 2**24


class IncrementalDecoder:
    """The text of a token stream, decoded as its tokens arrive at a cost linear in the stream's length.

    `decode` (token ids to text, such as `Tokenizer.decode` with special tokens skipped) is never given the
    whole stream. Each `push` decodes the tokens not settled yet after the tokens of the last settled piece,
    which are context: the text after the context's own text is the new tokens' text, read as a decode of the
    whole stream reads it (a decoder that treats a text's first token apart, as one that drops its leading
    space does, sees them in the middle). That text is settled once it is not empty and does not end in
    U+FFFD, the decoding of a character whose bytes are still arriving (byte-level BPE splits a character over
    several tokens); until then it is `pending` and may change.

    So after every push, `text` (the settled pieces, then the pending text) equals `decode(all tokens)` for a
    decoder whose text of a token does not change with the tokens after it, beyond completing a character:
    byte-level BPE's, which rdlm's tokenizers and Huginn's are. With a decoder that rewrites the context's text
    when a token follows, the new text waits until the two agree again. The stream's tokens are not kept:
    only the context's and the unsettled ones.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.pieces: list[str] = []  # the settled text, piece by piece
        self.settled = 0  # ... its characters
        self.pending = ""  # the text of the unsettled tokens (its end may still change)
        self._window: list[int] = []  # the context's tokens, then the unsettled ones
        self._start = 0  # where the unsettled tokens begin in the window
        self._context = ""  # decode(the context's tokens)

    def push(self, token: int) -> str:
        """Take the stream's next token; returns the text it settles ("" while the text may still change)."""
        self._window.append(int(token))
        text = self.decode(self._window)
        if not text.startswith(self._context):
            return ""
        self.pending = text[len(self._context) :]
        if not self.pending or self.pending.endswith("\ufffd"):
            return ""
        piece, self.pending = self.pending, ""
        self.pieces.append(piece)
        self.settled += len(piece)
        # The tokens just settled are the next context.
        self._window = self._window[self._start :]
        self._start = len(self._window)
        self._context = self.decode(self._window)
        return piece

    @property
    def length(self) -> int:
        """The characters of `text`."""
        return self.settled + len(self.pending)

    @property
    def text(self) -> str:
        """The stream's text so far: the settled pieces joined, then the pending text."""
        return "".join(self.pieces) + self.pending

    def since(self, start: int) -> str:
        """`text[start:]`, read from the end: it costs the characters after `start`, not the whole text."""
        start = max(start, 0)
        if start >= self.settled:
            return self.pending[start - self.settled :]
        parts, at = [self.pending], self.settled
        for piece in reversed(self.pieces):
            parts.append(piece)
            at -= len(piece)
            if at <= start:
                break
        return "".join(reversed(parts))[start - at :]


class StreamDecoder:
    """The text of a token stream as its tokens arrive, for printing replies while they are generated.

    Joined, the pieces `push` and `finish` return equal `decode(all tokens)` (special tokens skipped), with
    leading white space removed when `strip_leading` (a reply printed after "Huginn> "). Each piece is the
    part of the whole decode that is settled: not an incomplete UTF-8 character (decoded as U+FFFD until
    its last byte arrives), and never text that a later token could change. So a merge across the token
    boundary, or a special token dropped from the middle of the reply, reads the same streamed as at once.
    The text is decoded incrementally (`IncrementalDecoder`): a reply of n tokens costs O(n), not O(n^2).
    """

    def __init__(self, decode: Callable[[list[int]], str], strip_leading: bool = False) -> None:
        self.decoder = IncrementalDecoder(decode)
        self.strip_leading = strip_leading
        self._lead: int | None = 0 if not strip_leading else None  # the leading white space's characters
        self._shown = 0  # where the printed text ends in the decoder's text
        self._pieces: list[str] = []

    @property
    def emitted(self) -> str:
        """The text printed so far."""
        return "".join(self._pieces)

    def _start(self) -> int:
        """Where the printed text starts in the decoder's text: after its leading white space when
        `strip_leading`; while the settled text is all white space, that of the pending text counts too."""
        if self._lead is not None:
            return self._lead
        pending = self.decoder.pending
        return self.decoder.settled + len(pending) - len(pending.lstrip())

    def _emit(self, end: int) -> str:
        start = max(self._start(), self._shown)
        if end <= start:
            return ""
        new = self.decoder.since(start)[: end - start]
        self._shown = end
        self._pieces.append(new)
        return new

    def push(self, token: int) -> str:
        settled = self.decoder.settled
        piece = self.decoder.push(token)
        if self._lead is None and piece.lstrip():
            self._lead = settled + len(piece) - len(piece.lstrip())
        # hold back a character whose bytes are still arriving
        return self._emit(self.decoder.settled + len(self.decoder.pending.rstrip("\ufffd")))

    def finish(self) -> str:
        """The rest of the text, once the stream has ended (a held-back incomplete character included)."""
        return self._emit(self.decoder.length)


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, min_frequency: int = 2, show_progress: bool = False
) -> Tokenizer:
    """Train a byte-level BPE tokenizer whose last ids are SPECIAL_TOKENS (as in Huginn-0125).

    vocab_size counts the special tokens. A small corpus may yield fewer merges; the result's
    `vocab_size` says what was reached.
    """
    if vocab_size > MAX_VOCAB_SIZE:  # the tokenizers library aborts the process on sizes it cannot hold
        raise ValueError(
            f"--vocab-size {vocab_size} is above the most this library trains, {MAX_VOCAB_SIZE} "
            "(the largest language-model vocabularies have about 2**18 tokens)"
        )
    check_int("min_frequency", min_frequency, 0)  # (the library overflows on others)
    base = vocab_size - len(SPECIAL_TOKENS)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if base < len(alphabet):
        raise ValueError(
            f"vocab_size must be at least {len(alphabet) + len(SPECIAL_TOKENS)} "
            f"(256 byte tokens + {len(SPECIAL_TOKENS)} special tokens), got {vocab_size}"
        )
    backend = HFTokenizer(models.BPE())
    # No prefix space: byte-level BPE is then lossless, decode(encode(text)) == text.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=base,
        min_frequency=min_frequency,
        initial_alphabet=alphabet,
        show_progress=show_progress,
        special_tokens=[],
    )
    backend.train_from_iterator(texts, trainer=trainer)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return Tokenizer(backend, "<trained>")
