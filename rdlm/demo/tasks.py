"""Embedded reasoning tasks for the demo: generated in-process from a seed, no download.

Each task family turns (seed, difficulty) into `Example(prompt, answer)` text pairs, with a train/test
split and an exact-match scorer. The families are chosen so that *depth* matters: the answer cannot be
read off the prompt in one step, so a recurrent-depth model should answer harder instances when it
iterates longer (paper section 5, Figures 1 and 10).

- `permutations` (the default): state tracking. A start value 0-4 and a word of moves `a`, `b`, `c`,
  each a fixed permutation of {0..4}; the answer is the value after all moves: `1:cab?` -> `=2`. The
  moves generate the symmetric group S5, whose word problem no fixed-depth transformer can solve for
  long words (it is not solvable, so there is no shallow parallel shortcut): the work grows with the
  word, one move after another, which is exactly what extra core iterations buy. Training also
  supervises the value after every move (`Example.trace`), which the input never shows, so each
  position has to compute it from the previous one. Difficulty = the number of moves. Training sees 2-20
  moves; the harder split holds words of 21-24 moves, longer than any trained on, which need more
  iterations than the training mean gives.
- `permutations-shifted`: the same task with two more moves, `d` and `e`, each another permutation of
  {0..4} (`SHIFTED_MOVES`), in words that mix them with `a`, `b`, `c`: rules a model trained on
  `permutations` never saw (the new task of `rdlm demo --experiment lora`).
- `variables`: multi-hop variable resolution. Several chains `a=3;b=a;c=b;` are shuffled together and
  one chain's last variable is queried (`c?` -> `=3`). The difficulty is the number of hops of the queried chain.
  Each hop is one pointer lookup, which one core iteration can learn to do.
- `addition`: multi-digit addition `123+989?` -> `=2111`, with the number of digits as difficulty. The
  answer is written least-significant digit first, so each answer token depends on a carry chain.

Every prompt ends with `?` and the model's reply is `=`, the answer, then the end marker. The `=` is
fixed, so it is what the prompt pass predicts; every token that carries the answer is then *decoded*,
one at a time, which is where `rdlm.inference.generate` applies per-token adaptive exits (paper section 6.1).

Splits (`make_splits`): validation, test and harder are drawn first and their prompts are reserved;
training draws around them. So every evaluation split holds its named difficulties in equal numbers,
no evaluation prompt is ever a training prompt, and the three evaluation splits share no prompt.

Text is plain ASCII over a small fixed alphabet (`ALPHABET`), so a character-level tokenizer
(`CharTokenizer`) with a few dozen symbols covers every task.
"""

from __future__ import annotations

import functools
import random
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# Everything a task prompt or answer may contain. Index 0 is padding, 1 marks the end of an answer.
PAD, EOS = "\0", "\n"
ALPHABET = PAD + EOS + string.digits + string.ascii_letters + "=;?+: "
REPLY = "="  # the first token of every reply, before the answer (see the module docstring)


@dataclass(frozen=True)
class Example:
    prompt: str  # what the model reads
    answer: str  # what it must produce (exact match), without the end marker
    difficulty: int  # hops or digits
    # Further (prompt, answer) turns about the same context, used only as extra training signal:
    # the variables task asks for every chain, so one sequence carries several supervised answers.
    followups: tuple[tuple[str, str], ...] = ()
    # Intermediate results supervised in training only: (i, c) means that after reading prompt[:i + 1]
    # the model should output c. They never appear in the input.
    trace: tuple[tuple[int, str], ...] = ()

    @property
    def reply(self) -> str:
        """What greedy decoding must produce before the end marker: the reply marker, then the answer."""
        return REPLY + self.answer


class CharTokenizer:
    """One token per character of `ALPHABET`. Tiny vocabulary, so tiny models train fast."""

    def __init__(self, alphabet: str = ALPHABET) -> None:
        self.alphabet = alphabet
        self.index = {c: i for i, c in enumerate(alphabet)}
        self.pad_id, self.eos_id = self.index[PAD], self.index[EOS]

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.index[c] for c in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the task alphabet") from None

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.alphabet[i] for i in ids)

    def to_tokenizer(self):
        """The same ids as an rdlm `Tokenizer` over a `tokenizers` model, which `save` writes as the
        tokenizer.json that `rdlm generate --prompt`, `chat`, `serve` and `analyze` read: one token per
        character, the padding and the end marker as rdlm's <|pad|> and <|end_text|> (so generation stops
        at the end of an answer). No BOS and no chat tokens: task prompts start with no marker."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        from rdlm.data.tokenizer import EOS as END_TEXT
        from rdlm.data.tokenizer import PAD as PAD_TOKEN
        from rdlm.data.tokenizer import Tokenizer

        special = {self.pad_id: PAD_TOKEN, self.eos_id: END_TEXT}
        vocab = {special.get(i, c): i for i, c in enumerate(self.alphabet)}
        backend = HFTokenizer(models.WordLevel(vocab))  # no unknown token: other characters are refused
        backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        backend.decoder = decoders.Fuse()
        backend.add_special_tokens([AddedToken(PAD_TOKEN, special=True), AddedToken(END_TEXT, special=True)])
        return Tokenizer(backend, "the demo task's characters")


# --------------------------------------------------------------------------------------------------
# Task families. Each generator takes a random.Random and a difficulty and returns one Example.

VARIABLE_NAMES = string.ascii_letters  # 52 single-character names


def variables_example(rng: random.Random, hops: int, distractors: int = 3, distractor_hops: int = 4) -> Example:
    """`hops` pointer lookups: a chain of `hops` assignments, shuffled with distractor chains."""
    if hops < 1:
        raise ValueError(f"hops must be >= 1, got {hops}")
    lengths = [hops] + [rng.randint(1, distractor_hops) for _ in range(distractors)]
    if sum(lengths) > len(VARIABLE_NAMES):
        raise ValueError(
            f"{sum(lengths)} variables needed, only {len(VARIABLE_NAMES)} names exist; "
            f"lower hops ({hops}) or distractors ({distractors})"
        )
    names = rng.sample(VARIABLE_NAMES, sum(lengths))
    values = rng.sample(string.digits, len(lengths))  # distinct values: a guess from the wrong chain fails
    statements, start = [], 0
    for length, value in zip(lengths, values, strict=True):
        chain = names[start : start + length]
        start += length
        statements.append(f"{chain[0]}={value};")
        statements += [f"{chain[i]}={chain[i - 1]};" for i in range(1, length)]
    rng.shuffle(statements)
    ends = [names[sum(lengths[: i + 1]) - 1] for i in range(len(lengths))]
    # The other chains are asked about too, in random order, after the main question (training signal).
    others = list(range(1, len(lengths)))
    rng.shuffle(others)
    followups = tuple((f";{ends[i]}?", values[i]) for i in others)
    return Example(prompt="".join(statements) + f"{ends[0]}?", answer=values[0], difficulty=hops, followups=followups)


# Three fixed moves on {0..4}: a 5-cycle, a swap and a 3-cycle. The first two alone generate S5.
MOVES = {"a": (1, 2, 3, 4, 0), "b": (1, 0, 2, 3, 4), "c": (0, 1, 3, 4, 2)}
# The shifted variant's moves: the old ones and two new, the 5-cycle 0->1->3->2->4 (no power of `a`) and the
# swap of 2 and 4. With new letters the old words keep their meaning, so what an adaptation forgot of them
# can be measured. (A first design replaced all three moves by new ones, `d`, `e`, `f`: in 400 steps on the
# design seed no arm learned it beyond 71% and every arm forgot the old task to chance; docs/experiments.md.)
SHIFTED_MOVES = {**MOVES, "d": (1, 3, 4, 2, 0), "e": (0, 1, 4, 3, 2)}


def permutations_example(rng: random.Random, moves: int, table: Mapping[str, Sequence[int]] | None = None) -> Example:
    """A start value and `moves` moves of `table` (default `MOVES`); the answer is the value after the
    last move."""
    if moves < 1:
        raise ValueError(f"moves must be >= 1, got {moves}")
    rules: Mapping[str, Sequence[int]] = MOVES if table is None else table
    names = "".join(rules)
    value = rng.randrange(5)
    prompt, trace = f"{value}:", []
    for _ in range(moves):
        move = rng.choice(names)
        value = rules[move][value]
        prompt += move
        trace.append((len(prompt) - 1, str(value)))
    return Example(prompt=prompt + "?", answer=str(value), difficulty=moves, trace=tuple(trace))


def addition_example(rng: random.Random, digits: int) -> Example:
    """`digits`-digit addition; the sum is written least-significant digit first (carries flow forward)."""
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    low = 10 ** (digits - 1) if digits > 1 else 0
    a, b = rng.randint(low, 10**digits - 1), rng.randint(low, 10**digits - 1)
    return Example(prompt=f"{a}+{b}?", answer=str(a + b)[::-1], difficulty=digits)


@dataclass(frozen=True)
class TaskFamily:
    name: str
    make: Callable[[random.Random, int], Example]
    train_difficulties: tuple[int, ...]  # what training sees (and the in-distribution test)
    harder_difficulties: tuple[int, ...]  # the harder test split: beyond anything trained on
    description: str


TASKS: dict[str, TaskFamily] = {
    # The demo's model does three to four moves per iteration, so words longer than any trained on (up to a
    # fifth longer) need more iterations than its training mean r = 5.
    "permutations": TaskFamily(
        "permutations",
        permutations_example,
        tuple(range(2, 21)),
        tuple(range(21, 25)),
        "state tracking over S5; difficulty = moves",
    ),
    "permutations-shifted": TaskFamily(
        "permutations-shifted",
        functools.partial(permutations_example, table=SHIFTED_MOVES),
        tuple(range(2, 21)),
        tuple(range(21, 25)),
        "state tracking over S5 with two more moves (d, e); difficulty = moves",
    ),
    "variables": TaskFamily(
        "variables",
        variables_example,
        tuple(range(1, 7)),
        tuple(range(7, 13)),
        "multi-hop variable resolution; difficulty = hops",
    ),
    "addition": TaskFamily(
        "addition",
        addition_example,
        tuple(range(1, 6)),
        tuple(range(6, 9)),
        "multi-digit addition, answer reversed; difficulty = digits",
    ),
}


def get_task(name: str) -> TaskFamily:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; available: {', '.join(sorted(TASKS))}")
    return TASKS[name]


# --------------------------------------------------------------------------------------------------
# Splits. Each split draws from its own seed stream. Evaluation splits are drawn first and reserve their
# prompts: training rejects them, so a score is never a memory of a training example, and no difficulty
# is missing from an evaluation split because training happened to cover all its prompts.

SPLIT_OFFSETS = {
    "train": 0,
    "test": 1_000_003,
    "harder": 2_000_003,
    "validation": 3_000_003,
    "harder_validation": 4_000_003,
}
EVAL_SPLITS = ("validation", "test", "harder")
MAX_TRIES = 1000  # draws per example before a split gives up on avoiding the reserved prompts


def generate(
    task: str | TaskFamily,
    n: int,
    seed: int,
    split: str = "train",
    difficulties: Sequence[int] | Callable[[int], Sequence[int]] | None = None,
    exclude: Iterable[str] = (),
    stratified: bool = False,
) -> list[Example]:
    """`n` examples of a split, none of whose prompts is in `exclude` (a set of prompts).

    Difficulties come from `difficulties` (default: the split's range, `harder_difficulties` for
    "harder"), or from `difficulties(i)` for example `i` (a curriculum, see `curriculum`): drawn
    uniformly per example, or with `stratified` in equal numbers (the first ones get one more when `n`
    does not divide). A reserved prompt is redrawn at the same difficulty, so the mix of difficulties
    never depends on what is reserved; a difficulty with too few free prompts raises.
    """
    family = get_task(task) if isinstance(task, str) else task
    if split not in SPLIT_OFFSETS:
        raise ValueError(f"unknown split {split!r}; available: {', '.join(SPLIT_OFFSETS)}")
    if difficulties is None:
        difficulties = family.harder_difficulties if split.startswith("harder") else family.train_difficulties
    allowed = difficulties if callable(difficulties) else (lambda i, fixed=list(difficulties): fixed)
    if stratified and callable(difficulties):
        raise ValueError("a stratified split has one range of difficulties, not a curriculum")
    exclude = exclude if isinstance(exclude, (set, frozenset)) else set(exclude)
    rng = random.Random(seed + SPLIT_OFFSETS[split])
    examples = []
    for i in range(n):
        choices = allowed(i)
        if not choices:
            raise ValueError("difficulties must not be empty")
        d = choices[i % len(choices)] if stratified else rng.choice(choices)
        for _ in range(MAX_TRIES):
            ex = family.make(rng, d)
            if ex.prompt not in exclude:
                break
        else:
            raise ValueError(
                f"the {split} split of {family.name} cannot draw difficulty {d} outside the "
                f"{len(exclude)} prompts reserved by other splits ({MAX_TRIES} tries): this "
                f"difficulty has too few distinct prompts; use fewer evaluation examples or "
                f"drop difficulty {d}"
            )
        examples.append(ex)
    return examples


def curriculum(difficulties: Sequence[int], n: int, ramp: float, start: int) -> Callable[[int], Sequence[int]]:
    """The difficulties example `i` of `n` training examples may draw, easiest first: the `start`
    easiest at first, one more at even intervals over the first `ramp` fraction of the examples, then
    all of them (`ramp` 0: all of them from the start). Training takes the examples in order, so the
    longest words come in as it goes on."""
    difficulties = sorted(difficulties)
    if not 0 <= ramp <= 1:
        raise ValueError(f"the curriculum's ramp must be a fraction in [0, 1], got {ramp!r}")
    if not 1 <= start <= len(difficulties):
        raise ValueError(f"the curriculum must start with 1 to {len(difficulties)} difficulties, got {start!r}")
    ramped = max(1, round(ramp * n))
    extra = len(difficulties) - start

    def allowed(i: int) -> Sequence[int]:
        if ramp == 0 or i >= ramped:
            return difficulties
        return difficulties[: min(len(difficulties), start + (extra + 1) * i // ramped)]

    return allowed


def make_splits(
    task: str | TaskFamily,
    n_train: int,
    n_eval: int,
    seed: int,
    ramp: float = 0.0,
    start: int = 1,
    harder_validation: bool = False,
) -> dict[str, list[Example]]:
    """Validation, test, harder (`n_eval` each, difficulties in equal numbers) and train (`n_train`;
    with `ramp` > 0, in the order of `curriculum(ramp, start)`); with `harder_validation`, a validation
    split of the harder difficulties too (drawn after the others, so they do not change).

    Validation and test are the same distribution (the training difficulties); harder is beyond them.
    Each evaluation split avoids the prompts of those drawn before it, and training avoids all of them.
    """
    family = get_task(task) if isinstance(task, str) else task
    reserved: set[str] = set()
    splits: dict[str, list[Example]] = {}
    for split in EVAL_SPLITS + (("harder_validation",) if harder_validation else ()):
        splits[split] = generate(family, n_eval, seed, split, exclude=reserved, stratified=True)
        reserved |= {ex.prompt for ex in splits[split]}
    order = curriculum(family.train_difficulties, n_train, ramp, start) if ramp > 0 else None
    splits["train"] = generate(family, n_train, seed, "train", difficulties=order, exclude=reserved)
    return splits


def describe_split(examples: Sequence[Example]) -> dict[str, Any]:
    """What a split holds: size, distinct prompts, difficulty range and the count per difficulty."""
    counts: dict[int, int] = {}
    for ex in examples:
        counts[ex.difficulty] = counts.get(ex.difficulty, 0) + 1
    return {
        "examples": len(examples),
        "distinct_prompts": len({ex.prompt for ex in examples}),
        "difficulty_range": [min(counts), max(counts)] if counts else [],
        "per_difficulty": dict(sorted(counts.items())),
    }


def exact_match(prediction: str, reply: str) -> bool:
    """The scorer: the generated text up to the end marker must equal the reply (`Example.reply`,
    the marker and the answer) exactly."""
    return prediction.split(EOS, 1)[0] == reply


def accuracy(predictions: Sequence[str], examples: Sequence[Example]) -> float:
    if len(predictions) != len(examples):
        raise ValueError(f"{len(predictions)} predictions for {len(examples)} examples")
    if not examples:
        raise ValueError("no examples to score")
    return sum(exact_match(p, ex.reply) for p, ex in zip(predictions, examples, strict=True)) / len(examples)


# --------------------------------------------------------------------------------------------------
# Tensors for training: prompt + answer + end marker, loss on the answer tokens only.


def encode_example(
    example: Example, tokenizer: CharTokenizer, followups: bool = True
) -> tuple[list[int], list[bool], list[int]]:
    """Token ids of prompt + reply (+ follow-up turns) + end marker, which positions are targets, and
    the target ids: the ids themselves, except where the trace supervises an intermediate result.
    A reply is `REPLY` then the answer."""
    ids, target = tokenizer.encode(example.prompt), [False] * len(example.prompt)
    turns = [("", example.answer)] + (list(example.followups) if followups else [])
    for prompt, answer in turns:
        ids += tokenizer.encode(prompt)
        target += [False] * len(prompt)
        ids += tokenizer.encode(REPLY + answer)
        target += [True] * (len(REPLY) + len(answer))
    ids, target = ids + [tokenizer.eos_id], target + [True]
    targets = list(ids)
    for index, result in example.trace:  # position `index` predicts what stands at index + 1
        targets[index + 1], target[index + 1] = tokenizer.encode(result)[0], True
    return ids, target, targets


def encode_batch(
    examples: Sequence[Example], tokenizer: CharTokenizer, followups: bool = True
) -> tuple[Tensor, Tensor]:
    """Right-padded (input_ids, labels) for next-token training, labels already shifted.

    labels[t] is the token at t+1 where that token is part of an answer (or the end marker), else -100:
    the loss is on answers only.
    """
    rows = [encode_example(ex, tokenizer, followups) for ex in examples]
    width = max(len(ids) for ids, _, _ in rows) - 1
    input_ids = torch.full((len(rows), width), tokenizer.pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (ids, target, targets) in enumerate(rows):
        input_ids[i, : len(ids) - 1] = torch.tensor(ids[:-1])
        labels[i, : len(ids) - 1] = torch.where(torch.tensor(target[1:]), torch.tensor(targets[1:]), -100)
    return input_ids, labels
