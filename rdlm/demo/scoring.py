"""Scoring the demo's task models: exact match of greedy decoding through `rdlm.inference.generate` (the
path a user runs), the strict teacher-forced score (`rdlm.inference.evaluate.score_targets`), accuracy
per split, difficulty and r, and the choices made on validation (best r, exit threshold)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rdlm.demo import tasks as T
from rdlm.demo.config import DemoConfig
from rdlm.inference.evaluate import score_targets
from rdlm.inference.generate import GenerationConfig, generate
from rdlm.model.lm import RecurrentDepthLM


@dataclass
class Decoded:
    """Greedy decoding of a list of examples through rdlm.inference.generate."""

    correct: list[bool]
    answer_steps: list[list[int]]  # per example: core iterations at each position that decoded an answer token
    decoded_steps: list[list[int]]  # ... at every decoded position (answer tokens and the end marker)

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct)

    @property
    def mean_answer_steps(self) -> float:
        return _mean([s for row in self.answer_steps for s in row])

    @property
    def mean_decoded_steps(self) -> float:
        return _mean([s for row in self.decoded_steps for s in row])


def _mean(values: Sequence[float]) -> float:
    return sum(values) / max(1, len(values))


def decode_answers(
    model: RecurrentDepthLM,
    examples: Sequence[T.Example],
    tokenizer: T.CharTokenizer,
    num_steps: int,
    batch_size: int = 100,
    seed: int = 0,
    exit_criterion: str | None = None,
    exit_threshold: float | None = None,
) -> Decoded:
    """Exact match of greedy decoding through `rdlm.inference.generate`, the path a user runs (temperature 0,
    Gaussian s_0 from `seed`, as the paper evaluates).

    `num_steps` is r for every token, or the cap with `exit_criterion` (per-token adaptive exits). The
    reply's first token, the fixed marker `tasks.REPLY`, comes from the prompt pass at r = num_steps;
    the answer tokens and the end marker are decoded one at a time, each with its own exit.
    """
    correct: list[bool] = []
    answer_steps: list[list[int]] = []
    decoded_steps: list[list[int]] = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        config = GenerationConfig(
            max_new_tokens=max(len(ex.reply) for ex in chunk) + 1,
            num_steps=num_steps,
            exit_criterion=exit_criterion,
            exit_threshold=exit_threshold,
            stop_tokens=(tokenizer.eos_id,),
            temperature=0.0,
            seed=seed,
        )
        result = generate(model, [tokenizer.encode(ex.prompt) for ex in chunk], config)
        for ex, tokens, steps in zip(chunk, result.tokens, result.iterations, strict=True):
            correct.append(T.exact_match(tokenizer.decode(tokens), ex.reply))
            decoded_steps.append(steps[1:])  # steps[0]: the prompt pass (the marker)
            answer_steps.append(steps[1 : 1 + len(ex.answer)])
    return Decoded(correct, answer_steps, decoded_steps)


@torch.inference_mode()
def answer_correct(
    model: RecurrentDepthLM,
    examples: Sequence[T.Example],
    tokenizer: T.CharTokenizer,
    num_steps: int,
    batch_size: int = 100,
    seed: int = 0,
) -> list[bool]:
    """The strict score per example at r = num_steps (the demo's secondary column).

    Teacher-forced: every supervised position must be the argmax, i.e. the reply and the end marker
    *and* every intermediate result of the trace (the value after each move, which the input never
    shows). This is stricter than greedy decoding, which only needs the reply: a model that reaches the
    right answer with a wrong intermediate value passes `decode_answers` and fails here.
    """
    model.eval()
    out: list[bool] = []
    for start in range(0, len(examples), batch_size):
        ids, labels = T.encode_batch(examples[start : start + batch_size], tokenizer, followups=False)
        generator = torch.Generator().manual_seed(seed + start)
        out += score_targets(model, ids, labels, num_steps, generator=generator).greedy.tolist()
    return out


def by_difficulty(correct: Sequence[bool], examples: Sequence[T.Example]) -> dict[int, float]:
    hits: dict[int, list[bool]] = {}
    for ok, ex in zip(correct, examples, strict=True):
        hits.setdefault(ex.difficulty, []).append(ok)
    return {d: sum(h) / len(h) for d, h in sorted(hits.items())}


def accuracy_table(
    model: RecurrentDepthLM,
    splits: dict[str, list[T.Example]],
    tokenizer: T.CharTokenizer,
    rs: Sequence[int],
    cfg: DemoConfig,
    label: str,
    progress: bool | None = None,
    strict: bool = True,
) -> dict[str, Any]:
    """{split: {"overall": {r: acc}, "by_difficulty": {d: {r: acc}}, "strict": {r: acc}}}: decoded
    exact match on every split; the strict score on test and harder (unless `strict` is False)."""
    from tqdm.auto import tqdm

    table: dict[str, Any] = {}
    jobs = [(name, r) for name in splits for r in rs]
    show = cfg.progress if progress is None else progress
    for name, r in tqdm(jobs, desc=f"evaluating the {label}", disable=not show, leave=False):
        examples = splits[name]
        decoded = decode_answers(model, examples, tokenizer, r, cfg.eval_batch_size, cfg.seed)
        entry = table.setdefault(name, {"overall": {}, "by_difficulty": {}, "strict": {}})
        entry["overall"][r] = decoded.accuracy
        for d, acc in by_difficulty(decoded.correct, examples).items():
            entry["by_difficulty"].setdefault(d, {})[r] = acc
        if strict and name in ("test", "harder"):
            ok = answer_correct(model, examples, tokenizer, r, cfg.eval_batch_size, cfg.seed)
            entry["strict"][r] = sum(ok) / len(ok)
    return table


def choose_best_r(validation: dict[int, float]) -> int:
    """The selection rule for "the best r": the highest validation accuracy, the smallest r on ties."""
    return max(validation, key=lambda r: (validation[r], -r))


def choose_exit_threshold(
    sweep: Sequence[dict[str, Any]], fixed_accuracy: float, tolerance: float, loose_first: bool = True
) -> dict[str, Any]:
    """The selection rule for the exit threshold: of the validation `sweep` rows ({"threshold",
    "accuracy", ...}), the loosest threshold whose accuracy is at least `fixed_accuracy - tolerance`;
    the strictest one if none is. `loose_first`: a larger threshold exits sooner (the heuristic criteria's
    scores); False where a smaller one does (a learned gate's cumulative exit probability)."""
    ordered = sorted(sweep, key=lambda row: -row["threshold"] if loose_first else row["threshold"])
    eligible = [row for row in ordered if within_tolerance(row["accuracy"], fixed_accuracy, tolerance)]
    return eligible[0] if eligible else ordered[-1]


def within_tolerance(accuracy: float, fixed_accuracy: float, tolerance: float) -> bool:
    """Whether an exit threshold's validation accuracy may be chosen: at most `tolerance` below fixed r."""
    return accuracy >= fixed_accuracy - tolerance


def answer_steps_by_difficulty(decoded: Decoded, examples: Sequence[T.Example]) -> dict[int, float]:
    """Iterations per decoded answer token, per difficulty (in increasing order)."""
    return {
        d: _mean(
            [s for steps, ex in zip(decoded.answer_steps, examples, strict=True) if ex.difficulty == d for s in steps]
        )
        for d in sorted({ex.difficulty for ex in examples})
    }


def adaptive_exits(
    model: RecurrentDepthLM,
    splits: dict[str, list[T.Example]],
    tokenizer: T.CharTokenizer,
    cfg: DemoConfig,
    fixed: dict[str, float],
) -> tuple[dict[str, Any], list[int]]:
    """Per-token adaptive exits through rdlm.inference.generate (paper section 6.1), threshold chosen on validation.

    Rule: of `cfg.exit_thresholds`, the loosest (fewest iterations) whose validation accuracy is at least
    the fixed-r validation accuracy minus `cfg.exit_tolerance`; the strictest if none is. The thresholds
    are tried loosest first and the sweep stops at the first one within tolerance, since no stricter one
    can be chosen. Test is then decoded once at that threshold. `fixed` is the accuracy at
    r = exit_max_steps per split. Returns the summary and the answer tokens' iterations on test (for the
    histogram).
    """
    sweep = []
    for threshold in sorted(cfg.exit_thresholds, reverse=True):
        d = decode_answers(
            model,
            splits["validation"],
            tokenizer,
            cfg.exit_max_steps,
            cfg.eval_batch_size,
            cfg.seed,
            cfg.exit_criterion,
            threshold,
        )
        sweep.append(
            {
                "threshold": threshold,
                "accuracy": d.accuracy,
                "answer_steps": d.mean_answer_steps,
                "decoded_steps": d.mean_decoded_steps,
            }
        )
        if within_tolerance(d.accuracy, fixed["validation"], cfg.exit_tolerance):
            break
    chosen = choose_exit_threshold(sweep, fixed["validation"], cfg.exit_tolerance)
    test = decode_answers(
        model,
        splits["test"],
        tokenizer,
        cfg.exit_max_steps,
        cfg.eval_batch_size,
        cfg.seed,
        cfg.exit_criterion,
        chosen["threshold"],
    )
    summary = {
        "criterion": cfg.exit_criterion,
        "max_steps": cfg.exit_max_steps,
        "tolerance": cfg.exit_tolerance,
        "validation_sweep": sweep,
        "threshold": chosen["threshold"],
        "validation_fixed_accuracy": fixed["validation"],
        "test_accuracy": test.accuracy,
        "test_fixed_accuracy": fixed["test"],
        "test_answer_steps": test.mean_answer_steps,
        "test_decoded_steps": test.mean_decoded_steps,
        "test_prompt_tokens": _mean([len(ex.prompt) for ex in splits["test"]]),
        "test_answer_steps_by_difficulty": answer_steps_by_difficulty(test, splits["test"]),
    }
    return summary, [s for row in test.answer_steps for s in row]
