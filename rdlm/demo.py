"""`rdlm demo`: the paper's central result on a laptop CPU (Geiping et al. 2025, sections 5-6, Table 4).

1. Train a small recurrent-depth model on an embedded reasoning task (rdlm.tasks) with the log-normal
   Poisson objective and truncated backprop, through the training API (rdlm.train).
2. Train its fixed-depth twin: the same architecture and parameter count, r = 1 always, on the same
   training rows (paper Table 4's non-recurrent baseline).
3. Evaluate exact-match accuracy at r = 1, 2, 4, ..., 64 on an in-distribution test split and on a
   harder split (more hops / digits than training saw), per difficulty.
4. Evaluate per-token adaptive exits (KL criterion, rdlm.exits): mean iterations per token vs accuracy.
5. Write a report directory: results.json, report.md, PNG plots, and the trained model (Huginn layout).

`--task code` instead trains on the embedded stdlib corpus (rdlm.corpus) and reports validation
perplexity against r.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from rdlm import tasks as T
from rdlm.config import RDLMConfig
from rdlm.exits import make_exit_criterion
from rdlm.fileio import write_json, write_text
from rdlm.huginn import save_pretrained
from rdlm.model import RecurrentDepthLM

EVAL_NUM_STEPS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class DemoConfig:
    task: str = "permutations"            # a family of rdlm.tasks, or "code"
    seed: int = 0
    out_dir: str = "demo-report"
    # Model: (l_P, l_R, l_C), width. Small enough to train in minutes on two CPU cores.
    # A one-layer core: each iteration advances the state by about one move, so r visibly buys depth.
    layers: tuple[int, int, int] = (1, 1, 1)
    hidden_size: int = 128
    num_heads: int = 4
    mean_recurrence: int = 8
    backprop_depth: int = 4
    # Training budget (the same for the recurrent model and its twin).
    steps: int = 700
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 30
    # Evaluation.
    eval_examples: int = 300
    eval_num_steps: tuple[int, ...] = EVAL_NUM_STEPS
    exit_criterion: str = "kl"
    # Tighter than the paper's 5e-4: there this small model loses a point or more of accuracy.
    exit_threshold: float = 1e-5
    exit_max_steps: int = 32              # adaptive exits are compared with this fixed r
    eval_batch_size: int = 100
    train_twin: bool = True
    threads: int | None = None
    progress: bool = True
    # Code task only.
    code_vocab_size: int = 1024
    code_chars: int = 1_000_000
    code_seq_len: int = 128

    def __post_init__(self) -> None:
        if self.task != "code":
            T.get_task(self.task)  # raises, naming the task
        for name in ("steps", "batch_size", "hidden_size", "num_heads", "mean_recurrence", "backprop_depth",
                     "eval_examples", "exit_max_steps", "eval_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if len(self.layers) != 3:
            raise ValueError(f"layers must be (prelude, core, coda), got {self.layers!r}")
        if not self.eval_num_steps or any(r < 1 for r in self.eval_num_steps):
            raise ValueError(f"eval_num_steps must be positive iteration counts, got {self.eval_num_steps}")
        make_exit_criterion(self.exit_criterion, self.exit_threshold)  # raises, naming the criterion


@dataclass
class DemoResult:
    out_dir: Path
    results: dict[str, Any]
    model: RecurrentDepthLM
    twin: RecurrentDepthLM | None = None
    files: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# Models and training

def model_config(cfg: DemoConfig, vocab_size: int, context_length: int, fixed_depth: bool = False) -> RDLMConfig:
    """The demo model; the twin differs only in training r = 1 (same parameters, paper Table 4)."""
    lp, lr, lc = cfg.layers
    recurrence = dict(mean_recurrence=1, backprop_depth=1, recurrence_sampler="fixed") if fixed_depth else dict(
        mean_recurrence=cfg.mean_recurrence, backprop_depth=cfg.backprop_depth,
        recurrence_sampler="lognormal-poisson")
    return RDLMConfig(prelude_layers=lp, core_layers=lr, coda_layers=lc, hidden_size=cfg.hidden_size,
                      num_heads=cfg.num_heads, intermediate_size=2 * cfg.hidden_size, vocab_size=vocab_size,
                      context_length=context_length, name="demo-fixed-depth" if fixed_depth else "demo",
                      **recurrence)


def train_model(cfg: DemoConfig, config: RDLMConfig, rows, label: str) -> tuple[RecurrentDepthLM, dict]:
    """Train through rdlm.train (log-normal Poisson r, truncated backprop, AdamW, clipping)."""
    from rdlm.train import TrainConfig, train

    torch.manual_seed(cfg.seed)
    model = RecurrentDepthLM(config)
    losses: list[float] = []
    records: list[dict] = []

    def keep(record: dict) -> None:
        if record.get("kind") == "train":
            records.append({"step": record["step"], "loss": record["loss"], "num_steps": record["num_steps"]})

    if cfg.progress:
        print(f"rdlm demo: training the {label} ({model.num_parameters() / 1e6:.2f}M parameters, "
              f"{cfg.steps} steps of {cfg.batch_size})", flush=True)
    tc = TrainConfig(model=config.name, seed=cfg.seed, steps=cfg.steps, micro_batch_size=cfg.batch_size,
                     lr=cfg.lr, warmup_steps=min(cfg.warmup_steps, cfg.steps - 1), weight_decay=0.01,
                     ema_decay=None, precision="fp32", device="cpu", threads=cfg.threads or torch.get_num_threads(),
                     progress=cfg.progress, tensorboard=False, out_dir=None)
    result = train(tc, model=model, train_data=rows, step_hooks=[keep])
    losses = [r["loss"] for r in records]
    return result.model.eval(), {"losses": losses, "num_steps": [r["num_steps"] for r in records],
                                 "seconds": result.seconds}


def task_rows(examples: Sequence[T.Example], tokenizer: T.CharTokenizer):
    """MemoryRows of prompt + answers, loss on the answer tokens only."""
    from rdlm.data import MemoryRows

    encoded = [T.encode_example(ex, tokenizer) for ex in examples]
    width = max(len(ids) for ids, _, _ in encoded)
    tokens = torch.full((len(encoded), width), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.bool)
    targets = tokens.clone()
    for i, (ids, target, target_ids) in enumerate(encoded):
        tokens[i, :len(ids)] = torch.tensor(ids)
        mask[i, :len(ids)] = torch.tensor(target)
        targets[i, :len(ids)] = torch.tensor(target_ids)
    return MemoryRows(tokens, mask, targets)


# --------------------------------------------------------------------------------------------------
# Evaluation

@torch.inference_mode()
def answer_correct(model: RecurrentDepthLM, examples: Sequence[T.Example], tokenizer: T.CharTokenizer,
                   num_steps: int, batch_size: int = 100, seed: int = 0) -> list[bool]:
    """Exact match per example at r = num_steps.

    The answer is scored with teacher forcing: every answer token (and the end marker) must be the argmax.
    For exact match this equals greedy decoding: while all argmaxes agree, greedy sees the same prefix.
    s_0 is Gaussian as in training (SPEC section 4), from a fixed seed so runs are reproducible.
    """
    model.eval()
    out: list[bool] = []
    for start in range(0, len(examples), batch_size):
        ids, labels = T.encode_batch(examples[start:start + batch_size], tokenizer, followups=False)
        generator = torch.Generator().manual_seed(seed + start)
        logits = model(ids, num_steps=num_steps, generator=generator).logits
        targets = labels != -100
        out += ((logits.argmax(-1) == labels) | ~targets).all(dim=1).tolist()
    return out


@torch.inference_mode()
def adaptive_exit_eval(model: RecurrentDepthLM, examples: Sequence[T.Example], tokenizer: T.CharTokenizer,
                       criterion_name: str = "kl", threshold: float = 5e-4, max_steps: int = 32,
                       batch_size: int = 100, seed: int = 0) -> dict[str, Any]:
    """Per-token adaptive compute (paper section 6.1): each token stops iterating once the criterion
    says its next-token distribution has converged; its latent state is frozen from then on, and the
    other tokens keep attending to it. Returns accuracy, mean iterations per token and the exit steps.
    """
    criterion = make_exit_criterion(criterion_name, threshold)
    correct: list[bool] = []
    exit_steps: list[int] = []        # every real token (prompt and answer)
    answer_exit_steps: list[int] = []  # tokens that predict an answer token
    for start in range(0, len(examples), batch_size):
        ids, labels = T.encode_batch(examples[start:start + batch_size], tokenizer, followups=False)
        real = ids != tokenizer.pad_id
        generator = torch.Generator().manual_seed(seed + start)
        rope = model.rope(torch.arange(ids.shape[1]))
        embedded = model.embed(ids, rope)
        state = model.init_state(embedded, 1.0, generator)
        active = torch.ones(ids.shape, dtype=torch.bool)
        steps = torch.zeros(ids.shape, dtype=torch.long)
        streak, prev = None, None
        for i in range(max_steps):
            new = model.step(state, embedded, i, rope)
            state = torch.where(active.unsqueeze(-1), new, state)
            steps += active.long()
            logits = model.readout(state, rope)
            if prev is not None:
                exited, streak = criterion.update(streak, prev, logits)
                active &= ~exited
            prev = logits
            if not active[real].any():
                break
        targets = labels != -100
        correct += ((prev.argmax(-1) == labels) | ~targets).all(dim=1).tolist()
        exit_steps += steps[real].tolist()
        answer_exit_steps += steps[targets].tolist()
    return {"criterion": criterion_name, "threshold": threshold, "max_steps": max_steps,
            "accuracy": sum(correct) / len(correct),
            "mean_steps_per_token": sum(exit_steps) / len(exit_steps),
            "mean_steps_per_answer_token": sum(answer_exit_steps) / len(answer_exit_steps),
            "exit_steps": exit_steps}


def accuracy_table(model: RecurrentDepthLM, splits: dict[str, list[T.Example]], tokenizer: T.CharTokenizer,
                   rs: Sequence[int], cfg: DemoConfig, label: str) -> dict[str, Any]:
    """{split: {"overall": {r: acc}, "by_difficulty": {d: {r: acc}}}}."""
    from tqdm.auto import tqdm

    table: dict[str, Any] = {}
    jobs = [(name, r) for name in splits for r in rs]
    for name, r in tqdm(jobs, desc=f"evaluating {label}", disable=not cfg.progress, leave=False):
        examples = splits[name]
        ok = answer_correct(model, examples, tokenizer, r, cfg.eval_batch_size, cfg.seed)
        entry = table.setdefault(name, {"overall": {}, "by_difficulty": {}})
        entry["overall"][r] = sum(ok) / len(ok)
        for d in sorted({ex.difficulty for ex in examples}):
            hits = [o for o, ex in zip(ok, examples) if ex.difficulty == d]
            entry["by_difficulty"].setdefault(d, {})[r] = sum(hits) / len(hits)
    return table


# --------------------------------------------------------------------------------------------------
# The demo

def run_demo(cfg: DemoConfig) -> DemoResult:
    if cfg.task == "code":
        return run_code_demo(cfg)
    start = time.perf_counter()
    family = T.get_task(cfg.task)
    tokenizer = T.CharTokenizer()
    train_examples = T.generate(family, cfg.steps * cfg.batch_size, cfg.seed, "train")
    splits = {"test": T.test_split(family, cfg.eval_examples, cfg.seed, "test", exclude=train_examples),
              "harder": T.test_split(family, cfg.eval_examples, cfg.seed, "harder", exclude=train_examples)}
    rows = task_rows(train_examples, tokenizer)
    longest = max(rows.row_length, *(len(ex.prompt) + len(ex.answer) + 1 for s in splits.values() for ex in s))
    context = 1 << max(6, math.ceil(math.log2(longest + 1)))

    model, history = train_model(cfg, model_config(cfg, tokenizer.vocab_size, context), rows, "recurrent model")
    rs = sorted(set(cfg.eval_num_steps))
    table = accuracy_table(model, splits, tokenizer, rs, cfg, "recurrent model")
    twin = twin_history = twin_table = None
    if cfg.train_twin:
        twin, twin_history = train_model(cfg, model_config(cfg, tokenizer.vocab_size, context, True), rows,
                                         "fixed-depth twin")
        twin_table = accuracy_table(twin, splits, tokenizer, [1], cfg, "fixed-depth twin")
    exits = adaptive_exit_eval(model, splits["test"], tokenizer, cfg.exit_criterion, cfg.exit_threshold,
                               cfg.exit_max_steps, cfg.eval_batch_size, cfg.seed)
    fixed_acc = (table["test"]["overall"].get(cfg.exit_max_steps)
                 if cfg.exit_max_steps in rs else
                 sum(answer_correct(model, splits["test"], tokenizer, cfg.exit_max_steps)) / len(splits["test"]))

    results = summarize(cfg, family, model, table, twin_table, exits, fixed_acc, history, twin_history)
    results["seconds"] = round(time.perf_counter() - start, 1)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = write_report(out, results, exits["exit_steps"])
    model_dir = out / "model"
    save_pretrained(model, model_dir)
    write_json(model_dir / "task_tokenizer.json",
               {"type": "char", "alphabet": tokenizer.alphabet, "pad_id": tokenizer.pad_id,
                "eos_id": tokenizer.eos_id, "task": cfg.task})
    files.append(str(model_dir))
    return DemoResult(out, results, model, twin, files)


def summarize(cfg, family, model, table, twin_table, exits, fixed_acc, history, twin_history) -> dict[str, Any]:
    test, harder = table["test"]["overall"], table["harder"]["overall"]
    best_r = max(test, key=lambda r: (test[r], -r))
    mean_r = cfg.mean_recurrence
    nearest_mean = min(test, key=lambda r: (abs(r - mean_r), r))
    claims = {
        "best_r": best_r,
        "best_accuracy": test[best_r],
        "accuracy_r1": test[min(test)],
        "harder_at_train_mean_r": harder[nearest_mean],
        "harder_at_max_r": harder[max(harder)],
        "train_mean_r_evaluated": nearest_mean,
    }
    if twin_table is not None:
        claims["fixed_depth_twin_accuracy"] = twin_table["test"]["overall"][1]
        claims["recurrent_minus_twin"] = test[best_r] - claims["fixed_depth_twin_accuracy"]
        claims["fixed_depth_twin_harder"] = twin_table["harder"]["overall"][1]
    claims["exit_steps_fraction"] = exits["mean_steps_per_token"] / cfg.exit_max_steps
    claims["exit_accuracy_drop"] = fixed_acc - exits["accuracy"]
    checks = {
        "best_accuracy >= 0.90": claims["best_accuracy"] >= 0.90,
        "accuracy_r1 <= best/2": 0 < claims["best_accuracy"] and claims["accuracy_r1"] <= claims["best_accuracy"] / 2,
        "harder: r=max >= r=mean + 0.10": claims["harder_at_max_r"] >= claims["harder_at_train_mean_r"] + 0.10,
        "recurrent >= twin + 0.20": claims.get("recurrent_minus_twin", -1) >= 0.20,
        "exits: <= 60% steps, <= 1 point lost": claims["exit_steps_fraction"] <= 0.60
        and claims["exit_accuracy_drop"] <= 0.01,
    }
    return {
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()},
        "task": {"name": family.name, "description": family.description,
                 "train_difficulties": list(family.train_difficulties),
                 "harder_difficulties": list(family.harder_difficulties)},
        "parameters": model.num_parameters(),
        "recurrent": table, "fixed_depth_twin": twin_table,
        "adaptive_exits": {k: v for k, v in exits.items() if k != "exit_steps"} | {"fixed_accuracy": fixed_acc},
        "training": {"recurrent": history, "fixed_depth_twin": twin_history},
        "claims": claims, "checks": checks,
    }


# --------------------------------------------------------------------------------------------------
# The code corpus variant: validation perplexity against r.

def run_code_demo(cfg: DemoConfig) -> DemoResult:
    from rdlm.corpus import stdlib_documents, train_code_tokenizer
    from rdlm.data import MemoryRows

    start = time.perf_counter()
    tokenizer = train_code_tokenizer(cfg.code_vocab_size, cfg.code_chars)

    def rows_of(split: str, max_chars: int) -> Tensor:
        ids: list[int] = []
        for doc in stdlib_documents(split, max_chars=max_chars):
            ids += tokenizer.encode(doc, add_bos=True)
        n = len(ids) // (cfg.code_seq_len + 1)
        if n == 0:
            raise ValueError(f"the {split} corpus is too small for one row of {cfg.code_seq_len + 1} tokens")
        return torch.tensor(ids[:n * (cfg.code_seq_len + 1)]).view(n, cfg.code_seq_len + 1)

    train_rows = rows_of("train", cfg.code_chars)
    val_rows = rows_of("val", max(cfg.code_chars // 10, 50_000))[:cfg.eval_examples]
    config = model_config(cfg, tokenizer.vocab_size, cfg.code_seq_len)
    model, history = train_model(cfg, config, MemoryRows(train_rows), "recurrent model on code")
    ppl: dict[int, float] = {}
    with torch.inference_mode():
        for r in cfg.eval_num_steps:
            total, count = 0.0, 0
            for b in range(0, len(val_rows), cfg.eval_batch_size):
                batch = val_rows[b:b + cfg.eval_batch_size]
                g = torch.Generator().manual_seed(cfg.seed + b)
                logits = model(batch[:, :-1], num_steps=r, generator=g).logits
                total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
                count += batch[:, 1:].numel()
            ppl[r] = math.exp(total / count)
    results = {"config": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()},
               "task": {"name": "code", "description": "Python standard library source, byte-level BPE"},
               "parameters": model.num_parameters(), "validation_perplexity": ppl,
               "training": {"recurrent": history}, "seconds": round(time.perf_counter() - start, 1)}
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results)
    lines = ["# rdlm demo: code", "", "| r | validation perplexity |", "|---|---|"]
    lines += [f"| {r} | {p:.2f} |" for r, p in ppl.items()]
    write_text(out / "report.md", "\n".join(lines) + "\n")
    files = [str(out / "results.json"), str(out / "report.md")]
    files += plot_code(out, ppl, history)
    save_pretrained(model, out / "model")
    tokenizer.save(out / "model")
    return DemoResult(out, results, model, None, files + [str(out / "model")])


# --------------------------------------------------------------------------------------------------
# Report

def _save_figure(fig, path: Path) -> str:
    from rdlm.analysis.plots import save_figure  # matplotlib only when plotting

    return str(save_figure(fig, path))


def write_report(out: Path, results: dict[str, Any], exit_steps: list[int]) -> list[str]:
    write_json(out / "results.json", results)
    files = [str(out / "results.json")]
    files += plot_task(out, results, exit_steps)
    write_text(out / "report.md", markdown_report(results))
    files.append(str(out / "report.md"))
    return files


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def markdown_report(res: dict[str, Any]) -> str:
    cfg, claims = res["config"], res["claims"]
    task = res["task"]
    rec = res["recurrent"]
    rs = list(rec["test"]["overall"])
    lines = [f"# rdlm demo: {task['name']}", "",
             f"{task['description']}. Training difficulties {task['train_difficulties']}, harder split "
             f"{task['harder_difficulties']}. Model {tuple(cfg['layers'])} layers, h={cfg['hidden_size']}, "
             f"{res['parameters'] / 1e6:.2f}M parameters, mean r={cfg['mean_recurrence']}, backprop depth "
             f"{cfg['backprop_depth']}, {cfg['steps']} steps of {cfg['batch_size']}, seed {cfg['seed']}. "
             f"Total time {res.get('seconds', 0):.0f} s.", "",
             "## Exact-match accuracy (%) against the number of iterations r", "",
             "| split | " + " | ".join(f"r={r}" for r in rs) + " | fixed-depth twin |",
             "|---" * (len(rs) + 2) + "|"]
    twin = res.get("fixed_depth_twin")
    for split in rec:
        row = [_pct(rec[split]["overall"][r]) for r in rs]
        lines.append(f"| {split} | " + " | ".join(row) + f" | {_pct(twin[split]['overall'][1]) if twin else '-'} |")
    lines += ["", "### By difficulty", "", "| difficulty | " + " | ".join(f"r={r}" for r in rs) + " |",
              "|---" * (len(rs) + 1) + "|"]
    for split in rec:
        for d, accs in rec[split]["by_difficulty"].items():
            lines.append(f"| {d} ({split}) | " + " | ".join(_pct(accs[r]) for r in rs) + " |")
    ex = res["adaptive_exits"]
    lines += ["", "## Adaptive exits", "",
              f"Criterion `{ex['criterion']}` < {ex['threshold']:g}, at most {ex['max_steps']} iterations: "
              f"{ex['mean_steps_per_token']:.2f} iterations per token on average "
              f"({100 * ex['mean_steps_per_token'] / ex['max_steps']:.0f}% of fixed r={ex['max_steps']}), "
              f"{ex['mean_steps_per_answer_token']:.2f} on answer tokens; accuracy {_pct(ex['accuracy'])}% vs "
              f"{_pct(ex['fixed_accuracy'])}% at fixed r={ex['max_steps']}.", "",
              "## What the paper predicts, checked", "", "| claim | holds |", "|---|---|"]
    for name, ok in res["checks"].items():
        lines.append(f"| {name} | {'yes' if ok else 'no'} |")
    lines += ["", "Numbers: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in claims.items()), "",
              "## Plots", "", "![accuracy vs r](accuracy_vs_r.png)", "",
              "![recurrent vs fixed depth](recurrent_vs_fixed.png)", "",
              "![training curves](training_curves.png)", "", "![exit steps](exit_histogram.png)", ""]
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_task(out: Path, res: dict[str, Any], exit_steps: list[int]) -> list[str]:
    plt = _pyplot()
    rec, twin = res["recurrent"], res.get("fixed_depth_twin")
    files = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    cmap = plt.get_cmap("viridis")
    diffs = sorted({int(d) for split in rec for d in rec[split]["by_difficulty"]})
    for split in rec:
        for d, accs in rec[split]["by_difficulty"].items():
            rs = list(accs)
            ax.plot(rs, [100 * accs[r] for r in rs], marker="o", ms=3,
                    color=cmap(diffs.index(int(d)) / max(1, len(diffs) - 1)),
                    ls="-" if split == "test" else "--", label=f"{d}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("iterations r (test time)")
    ax.set_ylabel("exact match (%)")
    ax.set_title("Accuracy vs r per difficulty (solid: trained range, dashed: harder)")
    ax.axvline(res["config"]["mean_recurrence"], color="grey", lw=0.8, ls=":")
    ax.legend(title="difficulty", fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylim(-2, 102)
    fig.tight_layout()
    files.append(_save_figure(fig, out / "accuracy_vs_r.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for split, color in zip(rec, ("C0", "C1")):
        rs = list(rec[split]["overall"])
        ax.plot(rs, [100 * rec[split]["overall"][r] for r in rs], marker="o", color=color,
                label=f"recurrent, {split}")
        if twin:
            ax.axhline(100 * twin[split]["overall"][1], color=color, ls="--",
                       label=f"fixed-depth twin (r=1), {split}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("iterations r (test time)")
    ax.set_ylabel("exact match (%)")
    ax.set_title("Recurrent depth vs a fixed-depth model of the same size")
    ax.legend(fontsize=8)
    ax.set_ylim(-2, 102)
    fig.tight_layout()
    files.append(_save_figure(fig, out / "recurrent_vs_fixed.png"))

    files += plot_training(out, res["training"])

    fig, ax = plt.subplots(figsize=(7, 4))
    top = res["adaptive_exits"]["max_steps"]
    ax.hist(exit_steps, bins=range(1, top + 2), color="C2", edgecolor="white")
    ax.set_xlabel("iterations before exit")
    ax.set_ylabel("tokens")
    ex = res["adaptive_exits"]
    ax.set_title(f"Adaptive exits ({ex['criterion']} < {ex['threshold']:g}): "
                 f"mean {ex['mean_steps_per_token']:.1f} of {top} iterations")
    fig.tight_layout()
    files.append(_save_figure(fig, out / "exit_histogram.png"))
    return files


def plot_training(out: Path, training: dict[str, Any]) -> list[str]:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, hist in training.items():
        if not hist:
            continue
        losses = hist["losses"]
        window = max(1, len(losses) // 30)
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(range(1, len(losses) + 1), smooth, label=name.replace("_", " "))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (answer tokens)")
    ax.set_yscale("log")
    ax.set_title("Training curves")
    ax.legend()
    fig.tight_layout()
    return [_save_figure(fig, out / "training_curves.png")]


def plot_code(out: Path, ppl: dict[int, float], history: dict[str, Any]) -> list[str]:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    rs = list(ppl)
    ax.plot(rs, [ppl[r] for r in rs], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("iterations r")
    ax.set_ylabel("validation perplexity")
    ax.set_title("Code (Python stdlib): perplexity vs r")
    fig.tight_layout()
    return [_save_figure(fig, out / "perplexity_vs_r.png")] + plot_training(out, {"recurrent": history})
