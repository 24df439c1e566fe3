"""The demo's report: results.json, report.md and the plots (accuracy against r per split and difficulty,
exit steps, training curves; perplexity against r for the code variant)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rdlm.fileio import write_text

MODEL_LABELS = {
    "recurrent": "recurrent model",
    "twin": "parameter-matched twin (r=1)",
    "depth_matched": "depth-matched non-recurrent model",
}


def _save_figure(fig, path: Path) -> str:
    from rdlm.analysis.plots import save_figure  # matplotlib only when plotting

    return str(save_figure(fig, path))


def write_report(out: Path, results: dict[str, Any], exit_steps: list[int]) -> list[str]:
    """The plots and report.md; results.json is the caller's to write last, once everything else is there
    (a report directory with results.json is complete: benchmarks/demo_seeds.py reads it as done)."""
    files = plot_task(out, results, exit_steps)
    write_text(out / "report.md", markdown_report(results))
    files.append(str(out / "report.md"))
    return files


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _range(values: Sequence[int]) -> str:
    return f"{min(values)}-{max(values)}" if len(values) and min(values) != max(values) else f"{min(values)}"


def _machine(res: dict[str, Any]) -> str:
    machine = res.get("machine")
    if not machine:
        return ""
    per_model = res.get("timings", {}).get("per_model", {})
    each = "; ".join(
        f"{MODEL_LABELS.get(k, k)}: training {v['train']:.0f} s, scoring {v['score']:.0f} s"
        for k, v in per_model.items()
    )
    return (
        f" on {machine['cpu']} ({machine['cores']} cores; the models in {machine['workers']} processes side "
        f"by side{': ' + each if each else ''})"
    )


def _recipe(cfg: dict[str, Any]) -> str:
    """The optimizer and the order of the training rows, as the header states them."""
    optimizer = (
        f"Muon (lr {cfg['muon_lr']:g}) for the blocks' matrices and AdamW (lr {cfg['lr']:g}) for the rest"
        if cfg.get("optimizer", "adamw") == "muon"
        else f"AdamW (lr {cfg['lr']:g})"
    )
    fraction = cfg.get("curriculum_fraction", 0)
    order = (
        f"a curriculum from the {cfg['curriculum_start']} easiest difficulties to all of them over the "
        f"first {100 * fraction:.0f}% of the steps"
        if fraction
        else "shuffled rows"
    )
    return f"{optimizer}, {order}"


def markdown_report(res: dict[str, Any]) -> str:
    cfg, claims, task = res["config"], res["claims"], res["task"]
    rec, twin, deep = res["recurrent"], res.get("fixed_depth_twin"), res.get("depth_matched")
    rs = list(rec["test"]["overall"])
    params = res["parameters"]
    lp, lr, lc = cfg["layers"]
    lines = [
        f"# rdlm demo: {task['name']}",
        "",
        (
            f"{task['description']}. Recurrent model: layers ({lp},{lr},{lc}), h={cfg['hidden_size']}, "
            f"{params['recurrent'] / 1e6:.2f}M parameters, log-normal Poisson r with mean "
            f"{claims['train_mean_r']} (mean_recurrence {cfg['mean_recurrence']} + 1), backprop depth "
            f"{cfg['backprop_depth']}; {cfg['steps']} steps of {cfg['batch_size']}, {_recipe(cfg)}, "
            f"seed {cfg['seed']}, "
            f"{cfg['threads']} thread(s) per model. Total time {res.get('seconds', 0):.0f} s, CPU time "
            f"{res.get('cpu_seconds', 0):.0f} s{_machine(res)} (load average "
            f"{res.get('load_average', {}).get('start')} at the start, {res.get('load_average', {}).get('end')} "
            "at the end)."
        ),
        "",
        (
            "Baselines, trained on the same rows for the same steps at r=1: the parameter-matched twin "
            f"(layers ({lp},{lr},{lc}), {_params(params, 'twin')}) and the depth-matched model (layers "
            f"({lp},{lr * claims['train_mean_r']},{lc}): the core unrolled to the training mean, "
            f"{_params(params, 'depth_matched')})."
        ),
        "",
        "## Splits",
        "",
        "| split | examples | distinct prompts | difficulties | examples per difficulty |",
        "|---|---|---|---|---|",
    ]
    for name, info in res["splits"].items():
        per = ", ".join(f"{d}: {n}" for d, n in info["per_difficulty"].items())
        lines.append(
            f"| {name} | {info['examples']} | {info['distinct_prompts']} | "
            f"{_range([int(d) for d in info['per_difficulty']])} | {per} |"
        )
    lines += [
        "",
        (
            "Evaluation prompts are drawn first and reserved; training never contains one, and validation, "
            "test and harder share none."
        ),
        "",
        "## Selection (on validation only)",
        "",
        (
            f"- best r: {res['selection']['best_r']} -> **r={claims['best_r_on_validation']}** "
            f"(validation {_pct(claims['validation_at_best_r'])}%)."
        ),
        f"- exit threshold: {res['selection']['exit_threshold']} -> **{claims['exit_threshold']:g}**.",
        "",
        "## Exact match (%) of greedy decoding through rdlm.inference.generate, against r",
        "",
        "| split | " + " | ".join(f"r={r}" for r in rs) + " | twin (r=1) | depth-matched |",
        "|---" * (len(rs) + 3) + "|",
    ]
    for split in rec:
        row = [_pct(rec[split]["overall"][r]) for r in rs]
        lines.append(f"| {split} | " + " | ".join(row) + f" | {_baseline(twin, split)} | {_baseline(deep, split)} |")
    lines += [
        "",
        (
            "Secondary, labelled *strict*: teacher-forced, every intermediate value of the trace must be "
            "right too (stricter than decoding)."
        ),
        "",
        "| split (strict) | " + " | ".join(f"r={r}" for r in rs) + " | twin (r=1) | depth-matched |",
        "|---" * (len(rs) + 3) + "|",
    ]
    for split in ("test", "harder"):
        row = [_pct(rec[split]["strict"][r]) for r in rs]
        lines.append(
            f"| {split} | " + " | ".join(row) + f" | {_baseline(twin, split, 'strict')} | "
            f"{_baseline(deep, split, 'strict')} |"
        )
    lines += [
        "",
        "### By difficulty (decoded)",
        "",
        "| difficulty | " + " | ".join(f"r={r}" for r in rs) + " |",
        "|---" * (len(rs) + 1) + "|",
    ]
    for split in ("test", "harder"):
        for d, accs in rec[split]["by_difficulty"].items():
            lines.append(f"| {d} ({split}) | " + " | ".join(_pct(accs[r]) for r in rs) + " |")
    ex = res["adaptive_exits"]
    lines += [
        "",
        "## Adaptive exits through rdlm.inference.generate",
        "",
        (
            f"Criterion `{ex['criterion']}`, at most {ex['max_steps']} iterations per token. The reply marker "
            f"`=` comes from the prompt pass at r={ex['max_steps']}; every answer token is decoded with its own "
            "exit."
        ),
        "",
        "| threshold (validation) | accuracy | iterations per answer token | per decoded token |",
        "|---|---|---|---|",
    ]
    for row in ex["validation_sweep"]:
        mark = " (chosen)" if row["threshold"] == ex["threshold"] else ""
        lines.append(
            f"| {row['threshold']:g}{mark} | {_pct(row['accuracy'])} | {row['answer_steps']:.2f} | "
            f"{row['decoded_steps']:.2f} |"
        )
    lines += [
        "",
        f"Validation at fixed r={ex['max_steps']}: {_pct(ex['validation_fixed_accuracy'])}%. "
        f"Test at the chosen threshold: {_pct(ex['test_accuracy'])}% (fixed r={ex['max_steps']}: "
        f"{_pct(ex['test_fixed_accuracy'])}%), {ex['test_answer_steps']:.2f} iterations per answer token "
        f"({100 * ex['test_answer_steps'] / ex['max_steps']:.0f}% of r={ex['max_steps']}), "
        f"{ex['test_decoded_steps']:.2f} per decoded token. Iterations per answer token by difficulty: "
        + ", ".join(f"{d}: {s:.1f}" for d, s in ex["test_answer_steps_by_difficulty"].items())
        + ".",
        "",
        (
            f"What this does and does not show: the prompt ({ex['test_prompt_tokens']:.1f} tokens on average) "
            f"runs at the full r={ex['max_steps']} in the prompt pass, and that is where this task's sequential "
            "work happens (each move's value is computed at its own position). The decoded answer token reads "
            "it and converges in a few iterations, so exits save iterations on decoded tokens, not on the "
            "prompt; adaptive compute over the prompt pass is a separate feature of the decode engine."
        ),
        "",
        "## What the paper predicts, checked",
        "",
        "| claim | measured | margin | holds |",
        "|---|---|---|---|",
    ]
    for c in res["checks"]:
        lines.append(f"| {c['claim']} | {c['value']:.3f} | {c['margin']:+.3f} | {'yes' if c['holds'] else 'no'} |")
    lines += [
        "",
        "Numbers: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in claims.items()),
        "",
        "## Plots",
        "",
        "![accuracy vs r](accuracy_vs_r.png)",
        "",
        "![recurrent vs baselines](recurrent_vs_baselines.png)",
        "",
        "![training curves](training_curves.png)",
        "",
        "![exit steps](exit_histogram.png)",
        "",
    ]
    return "\n".join(lines)


def _params(params: dict[str, int], kind: str) -> str:
    return f"{params[kind] / 1e6:.2f}M parameters" if kind in params else "not trained"


def _baseline(table: dict[str, Any] | None, split: str, metric: str = "overall") -> str:
    if not table or split not in table or 1 not in table[split][metric]:
        return "-"
    return _pct(table[split][metric][1])


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def difficulty_bins(difficulties: Sequence[int], bins: int) -> list[list[int]]:
    """Contiguous groups of about equal size, so a plot shows a few readable lines, not one per difficulty."""
    ds = sorted(difficulties)
    bins = max(1, min(bins, len(ds)))
    return [ds[i * len(ds) // bins : (i + 1) * len(ds) // bins] for i in range(bins)]


def _binned(split: dict[str, Any], group: Sequence[int], counts: dict[int, int], r: int) -> float:
    """Accuracy of a group of difficulties, weighting each by its number of examples."""
    total = sum(counts[d] for d in group)
    return sum(split["by_difficulty"][d][r] * counts[d] for d in group) / total


def _finish_accuracy_plot(fig, ax, res: dict[str, Any], title: str, legend_size: int, path: Path) -> str:
    """What both accuracy-vs-r plots share: the training mean marked, the r axis, labels, the legend
    outside the axes; saved to `path`."""
    mean_r = res["claims"]["train_mean_r"]
    ax.axvline(mean_r, color="grey", lw=0.8, ls=":", label=f"training mean r={mean_r}")
    _r_axis(ax, res["config"]["eval_num_steps"])
    ax.set_ylabel("exact match of the decoded reply (%)")
    ax.set_title(title)
    ax.legend(fontsize=legend_size, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylim(-2, 102)
    fig.tight_layout()
    return _save_figure(fig, path)


def _r_axis(ax, rs: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(rs))
    ax.set_xticklabels([str(r) for r in sorted(rs)])
    ax.set_xlabel("iterations r (test time)")


def plot_task(out: Path, res: dict[str, Any], exit_steps: list[int]) -> list[str]:
    plt = _pyplot()
    rec, files = res["recurrent"], []
    claims = res["claims"]
    twin, deep = res.get("fixed_depth_twin"), res.get("depth_matched")
    unit = {"permutations": "moves", "variables": "hops", "addition": "digits"}.get(res["task"]["name"], "")

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colors = iter(plt.get_cmap("tab10").colors)
    for split, style, nbins in (("test", "-", 3), ("harder", "--", 2)):
        counts = {int(d): n for d, n in res["splits"][split]["per_difficulty"].items()}
        by_d = {int(d): accs for d, accs in rec[split]["by_difficulty"].items()}
        entry = {"by_difficulty": by_d}
        for group in difficulty_bins(list(by_d), nbins):
            rs = list(by_d[group[0]])
            ax.plot(
                rs,
                [100 * _binned(entry, group, counts, r) for r in rs],
                marker="o",
                ms=3,
                ls=style,
                color=next(colors),
                label=f"{split}, {_range(group)} {unit}",
            )
    files.append(
        _finish_accuracy_plot(
            fig, ax, res, "Recurrent model: accuracy vs r by difficulty", 8, out / "accuracy_vs_r.png"
        )
    )

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for split, color in (("test", "C0"), ("harder", "C1"), ("validation", "C7")):
        rs = list(rec[split]["overall"])
        ax.plot(
            rs,
            [100 * rec[split]["overall"][r] for r in rs],
            marker="o",
            ms=4,
            color=color,
            ls=":" if split == "validation" else "-",
            label=f"recurrent model, {split}",
        )
        for table, style, name in (
            (twin, "--", "parameter-matched twin (r=1)"),
            (deep, "-.", "depth-matched model (r=1)"),
        ):
            if table and split != "validation":
                ax.axhline(100 * table[split]["overall"][1], color=color, ls=style, lw=1.2, label=f"{name}, {split}")
    best = claims["best_r_on_validation"]
    ax.axvline(best, color="C2", lw=1, ls=":", label=f"best r on validation: {best}")
    files.append(
        _finish_accuracy_plot(
            fig, ax, res, "Recurrent depth vs non-recurrent baselines", 7, out / "recurrent_vs_baselines.png"
        )
    )

    files += plot_training(out, res["training"])

    ex = res["adaptive_exits"]
    top = ex["max_steps"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(exit_steps, bins=range(1, top + 2), color="C2", edgecolor="white", label="answer tokens, test")
    ax.set_xlabel("iterations before exit")
    ax.set_ylabel("answer tokens")
    ax.set_title(
        f"Adaptive exits through rdlm.inference.generate ({ex['criterion']} < {ex['threshold']:g}, chosen on "
        f"validation): mean {ex['test_answer_steps']:.1f} of {top}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
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
        smooth = [
            sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1])
            for i in range(len(losses))
        ]
        ax.plot(range(1, len(losses) + 1), smooth, label=MODEL_LABELS.get(name, name.replace("_", " ")))
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
