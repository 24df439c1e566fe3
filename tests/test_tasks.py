"""rdlm.demo.tasks and rdlm.data.corpus: generated tasks, splits, text format, scorer; the embedded code corpus."""

import random
import re
import time

import pytest

from rdlm.demo import tasks as T


def resolve(prompt: str) -> str:
    """An independent solver: follow the assignments from the queried variable to a digit."""
    *statements, query = prompt.split(";")
    table = dict(s.split("=") for s in statements)
    name, hops = query.rstrip("?"), 0
    while not name.isdigit():
        name, hops = table[name], hops + 1
    return name, hops


@pytest.mark.parametrize("hops", [1, 3, 8, 12])
def test_variable_answers_follow_exactly_the_requested_number_of_hops(hops):
    rng = random.Random(hops)
    for _ in range(50):
        ex = T.variables_example(rng, hops)
        answer, followed = resolve(ex.prompt)
        assert ex.answer == answer and followed == hops and ex.difficulty == hops
        # Every other chain is asked about in the follow-ups, with its own correct value.
        context = ex.prompt[:-3]  # without ";X?"
        for query, value in ex.followups:
            assert resolve(context + query)[0] == value


def apply_moves(prompt: str) -> list[int]:
    """An independent solver for the permutation task: the value after each move, as cycles."""
    start, word = re.fullmatch(r"([0-4]):([abc]+)\?", prompt).groups()
    cycles = {"a": [(0, 1, 2, 3, 4)], "b": [(0, 1)], "c": [(2, 3, 4)]}
    value, values = int(start), []
    for move in word:
        for cycle in cycles[move]:
            if value in cycle:
                value = cycle[(cycle.index(value) + 1) % len(cycle)]
                break
        values.append(value)
    return values


@pytest.mark.parametrize("moves", [1, 2, 7, 24])
def test_permutation_answers_and_traces_follow_every_move(moves):
    rng = random.Random(moves)
    for _ in range(50):
        ex = T.permutations_example(rng, moves)
        values = apply_moves(ex.prompt)
        assert ex.difficulty == moves and ex.answer == str(values[-1])
        # The trace gives the value after each move, at that move's position in the prompt.
        assert [c for _, c in ex.trace] == [str(v) for v in values]
        assert [ex.prompt[i] for i, _ in ex.trace] == list(ex.prompt[2:-1])


def test_trace_targets_reach_the_labels_but_never_the_input():
    ex = T.Example(prompt="3:ab?", answer="0", difficulty=2, trace=((2, "4"), (3, "0")))
    tok = T.CharTokenizer()
    ids, labels = T.encode_batch([ex], tok)
    assert tok.decode(ids[0].tolist()) == "3:ab?=0"
    # Position of "a" predicts its result 4, of "b" the result 0, "?" the reply marker, the marker the
    # answer 0, the answer the end.
    expected = [-100, -100, tok.encode("4")[0], tok.encode("0")[0], tok.encode("=")[0], tok.encode("0")[0],
                tok.eos_id]
    assert labels[0].tolist() == expected


def test_addition_answers_are_reversed_sums():
    rng = random.Random(0)
    for digits in (1, 3, 7):
        ex = T.addition_example(rng, digits)
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)\?", ex.prompt).groups())
        assert len(str(a)) == digits and ex.answer[::-1] == str(a + b)


def test_generation_is_deterministic_and_splits_differ():
    first = T.generate("variables", 20, seed=3)
    assert first == T.generate("variables", 20, seed=3)
    assert first != T.generate("variables", 20, seed=4)
    harder = T.generate("variables", 50, seed=3, split="harder")
    assert min(ex.difficulty for ex in harder) > max(T.TASKS["variables"].train_difficulties)


@pytest.mark.parametrize("task", ["permutations", "addition", "variables"])
def test_splits_are_disjoint_and_evaluation_splits_hold_every_difficulty(task):
    family = T.TASKS[task]
    splits = T.make_splits(task, n_train=3000, n_eval=300, seed=0)
    prompts = {name: {ex.prompt for ex in examples} for name, examples in splits.items()}
    names = list(prompts)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not prompts[a] & prompts[b], (a, b)
    # Exactly the requested counts, every named difficulty in equal numbers (300 / 11 -> 28 or 27).
    assert len(splits["train"]) == 3000
    for name, difficulties in (("validation", family.train_difficulties), ("test", family.train_difficulties),
                               ("harder", family.harder_difficulties)):
        info = T.describe_split(splits[name])
        assert info["examples"] == 300 and list(info["per_difficulty"]) == list(difficulties)
        counts = list(info["per_difficulty"].values())
        assert max(counts) - min(counts) <= 1
        assert info["difficulty_range"] == [min(difficulties), max(difficulties)]


def test_a_split_that_cannot_avoid_the_reserved_prompts_says_why():
    reserved = {f"{a}+{b}?" for a in range(10) for b in range(10)}  # every 1-digit sum
    with pytest.raises(ValueError, match="difficulty 1.*too few distinct prompts"):
        T.generate("addition", 5, seed=0, difficulties=[1], exclude=reserved)


def test_generation_is_never_the_bottleneck():
    start = time.perf_counter()
    T.generate("variables", 10_000, seed=0)
    assert time.perf_counter() - start < 5


def test_exact_match_scorer():
    ex = [T.Example("a=1;a?", "1", 1), T.Example("1+2?", "3", 1)]
    assert ex[0].reply == "=1"
    assert T.exact_match("=1\nrest", "=1") and not T.exact_match("=12", "=1") and not T.exact_match("1", "=1")
    assert T.accuracy(["=1", "=4"], ex) == 0.5
    with pytest.raises(ValueError, match="predictions"):
        T.accuracy(["1"], ex)


def test_encode_batch_puts_the_loss_on_answers_only():
    tok = T.CharTokenizer()
    ex = T.Example("a=7;a?", "7", 1, followups=((";b?", "2"),))
    ids, labels = T.encode_batch([ex], tok)
    text = tok.decode(ids[0].tolist())
    assert text == "a=7;a?=7;b?=2"
    targets = [(i, tok.decode([int(t)])) for i, t in enumerate(labels[0].tolist()) if t != -100]
    # label t is the token at t + 1: the two replies (marker and answer) and the end marker.
    assert targets == [(5, "="), (6, "7"), (10, "="), (11, "2"), (12, "\n")]
    ids, labels = T.encode_batch([ex], tok, followups=False)
    assert tok.decode(ids[0].tolist()) == "a=7;a?=7"


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown task"):
        T.get_task("chess")
    with pytest.raises(ValueError, match="hops"):
        T.variables_example(random.Random(0), 0)
    with pytest.raises(ValueError, match="names"):
        T.variables_example(random.Random(0), 40, distractors=5)
    with pytest.raises(ValueError, match="not in the task alphabet"):
        T.CharTokenizer().encode("a=é")


def test_stdlib_corpus_is_split_by_document_and_tokenizes_losslessly():
    from rdlm.data.corpus import stdlib_documents, train_code_tokenizer

    train = list(stdlib_documents("train", max_chars=200_000))
    val = list(stdlib_documents("val", max_chars=50_000))
    assert sum(map(len, train)) == 200_000 and val
    assert not set(train) & set(val)
    tok = train_code_tokenizer(vocab_size=400, max_chars=100_000)
    text = val[0][:2000]
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text.encode())  # BPE merges compress code


def test_a_curriculum_takes_in_harder_difficulties_in_order_then_all():
    allowed = T.curriculum(range(2, 21), 1000, ramp=0.5, start=3)
    assert list(allowed(0)) == [2, 3, 4]
    widths = [len(allowed(i)) for i in range(1000)]
    assert widths == sorted(widths)                              # never narrower again
    assert widths[499] == 19 and set(widths[500:]) == {19}       # all 19 difficulties from half-way on
    assert sorted(set(widths)) == list(range(3, 20))             # one more at a time
    assert list(T.curriculum(range(2, 21), 1000, ramp=0.0, start=3)(0)) == list(range(2, 21))
    for ramp, start, message in [(1.5, 3, "ramp"), (-0.1, 3, "ramp"), (0.5, 0, "start with 1 to 19"),
                                 (0.5, 20, "start with 1 to 19")]:
        with pytest.raises(ValueError, match=message):
            T.curriculum(range(2, 21), 1000, ramp, start)


def test_curriculum_splits_order_training_easiest_first_and_leave_evaluation_alone():
    plain = T.make_splits("permutations", 2000, 40, seed=3)
    ramped = T.make_splits("permutations", 2000, 40, seed=3, ramp=0.5, start=3)
    for split in T.EVAL_SPLITS:                                  # the same prompts to score on
        assert [ex.prompt for ex in ramped[split]] == [ex.prompt for ex in plain[split]]
    reserved = {ex.prompt for split in T.EVAL_SPLITS for ex in ramped[split]}
    train = ramped["train"]
    assert not reserved & {ex.prompt for ex in train}
    assert max(ex.difficulty for ex in train[:50]) == 4          # the first rows: 2-4 moves only
    firsts = [min(i for i, ex in enumerate(train) if ex.difficulty == d) for d in range(5, 21)]
    assert firsts == sorted(firsts) and firsts[-1] < 1000        # longer words come in later, all by half-way
    assert {ex.difficulty for ex in train[1000:]} == set(range(2, 21))
