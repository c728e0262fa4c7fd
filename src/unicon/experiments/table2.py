"""``unicon experiment table2``: the CocoCon paper's Table 2 comparison, K vs M (vs hinge), across seeds.

From one pretrained checkpoint, every (method, seed) pair runs ``unicon train`` with the same
``init_from``, data, steps and γ draws (the seed fixes both the data order and the draws, and is
shared by the methods), then its last epoch-end CocoCon evaluation is read from the run's
``metrics.jsonl``. The methods are the paper's rows:

* ``K``       -- "+ Cont. Pretrain": ``experiment=shapes_consistency_control`` (``loss.type=none``, λ = 0);
* ``M``       -- soft-rank Spearman (Eq. 3) as ``experiment=shapes_consistency`` configures it, with
  the settings chosen on the validation split (sigmoid soft ranks, ``loss.direction=toward_gold_strict``,
  the gold candidate's place alone at λ = 4: the ``spearman_gold`` loss group; the files say why);
* ``M_paper`` -- Eq. 3 as the paper writes it: torchsort's soft ranks, both tasks moving, one λ;
* ``hinge``   -- "+ Hinge Loss": ``experiment=shapes_consistency loss=hinge``.

Extra ``key=value`` overrides after ``--`` go to every run (e.g. ``init_from=...``,
``trainer.limit_train_batches=50``). Each finished run is recorded in ``<out>/runs/<method>-seed<s>.json``
and skipped when the command is run again with the same arguments (its run name aside), so an
interrupted experiment resumes; a record made with other arguments is refused (naming the file),
never mixed in.

The runs are named ``<out>-<hash>_<method>_seed<s>`` (:func:`run_prefix`: the basename of ``--out``
and a hash of its resolved path), so two experiments never share a run folder. They train with
``overwrite=true`` (an interrupted run starts again), but only into a folder the experiment created:
before its first training, ``<out>/runs/<method>-seed<s>.claim`` records the run folder, and a run
folder that exists without that claim (another run's) is refused, never deleted.

Reported per method (mean ± sample std over seeds): C_1...C_5, ρ and acc@1 per task (VQA,
localization, T2I), their mean C_1, how much each task's training-batch ρ rose from the first to the
last epoch (:func:`training_rho`), the caption ranking accuracy (caption acc@1: the gold caption
scored above the hardest contrast), the generative task accuracies, and -- when the runs set
``eval.cococon.probe_words`` (a knowledge-gap world) -- the probed concept's caption acc@1 and mean C_1. For a method X against K,
the paired difference d_s = X_s − K_s per seed has the 95 % interval

    mean(d) ± t_{0.975, n−1} · sd(d) / √n        (Student t, n seeds; undefined for n < 2).

Writes ``<out>/table2.json`` (every run and the summary), ``<out>/table2.md`` and ``<out>/table2.png``
(C_1 and accuracy per task and method, with ±std error bars).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from unicon import jsonsafe
from unicon.data.jsonl import read_json, read_jsonl
from unicon.errors import UserError

METHODS: dict[str, list[str]] = {
    "K": ["experiment=shapes_consistency_control"],
    "M": ["experiment=shapes_consistency"],
    "M_paper": ["experiment=shapes_consistency", "loss=spearman", "loss.soft_rank=torchsort",
                "loss.direction=mutual"],
    "hinge": ["experiment=shapes_consistency", "loss=hinge"],
}
TASKS = ("vqa", "localization", "t2i")
TASK_LABELS = {"vqa": "VQA", "localization": "Loc", "t2i": "T2I"}
MAX_K = 5
#: generative accuracy reported for each task (``cococon/generative/<key>``)
GENERATIVE = {"vqa": "vqa_accuracy", "localization": "localization_acc@0.5", "t2i": "t2i_scene_match"}


def run_metrics(metrics_file: Path) -> dict[str, float]:
    """The last row of ``metrics.jsonl`` holding CocoCon results (the final epoch-end evaluation)."""
    last = None
    for _, row in read_jsonl(metrics_file, what="metrics file"):
        if any(k.startswith("cococon/") and k.endswith("/C_1") for k in row):
            last = row
    if last is None:
        raise UserError(f"{metrics_file}: no CocoCon evaluation was logged (is eval.cococon.enabled true?)")
    return {k: v for k, v in last.items() if k.startswith("cococon/")}


def training_rho(metrics_file: Path) -> dict[str, float]:
    """Each task's training-batch ρ (``train/rho/<task>/epoch_mean``, the epoch means of the hard-rank
    Spearman ρ between captioning and the task on the consistency steps' rows) at the first and the
    last epoch of the run: ``{"<task>/first", "<task>/last", "<task>/rise"}`` (rise = last − first)."""
    by_epoch: dict[str, dict[Any, float]] = {}  # the epoch's last logged running mean = its mean
    for _, row in read_jsonl(metrics_file, what="metrics file"):
        for t in TASKS:
            value = row.get(f"train/rho/{t}/epoch_mean")
            if isinstance(value, (int, float)) and math.isfinite(value):
                by_epoch.setdefault(t, {})[row.get("epoch", len(by_epoch.get(t, {})))] = float(value)
    out: dict[str, float] = {}
    for t, epochs in by_epoch.items():
        values = list(epochs.values())
        out.update({f"{t}/first": values[0], f"{t}/last": values[-1], f"{t}/rise": values[-1] - values[0]})
    return out


def summarize_run(flat: dict[str, float], train_rho: dict[str, float] | None = None) -> dict[str, float]:
    """The Table-2 columns of one run from its flat ``cococon/...`` metrics and its
    :func:`training_rho` (``train_rho/<task>/rise``); NaN where absent."""
    def number(source: dict | None, key: str) -> float:  # absent, or null in a strict-JSON record: NaN
        value = (source or {}).get(key)
        return math.nan if value is None else float(value)

    get = lambda key: number(flat, key)  # noqa: E731
    out: dict[str, float] = {f"train_rho/{t}/rise": number(train_rho, f"{t}/rise") for t in TASKS}
    for t in TASKS:
        for k in range(1, MAX_K + 1):
            out[f"{t}/C_{k}"] = get(f"cococon/{t}/C_{k}")
        out[f"{t}/rho"] = get(f"cococon/{t}/rho")
        out[f"{t}/acc@1"] = get(f"cococon/{t}/acc@1")
        out[f"{t}/generative"] = get(f"cococon/generative/{GENERATIVE[t]}")
    c1 = [out[f"{t}/C_1"] for t in TASKS if not math.isnan(out[f"{t}/C_1"])]
    out["mean/C_1"] = float(np.mean(c1)) if c1 else math.nan
    out["caption/acc@1"] = get("cococon/caption/acc@1")
    if "cococon/probe/num_samples" in flat:  # eval.cococon.probe_words: the knowledge-gap concept
        out["probe/caption/acc@1"] = get("cococon/probe/caption/acc@1")
        probe_c1 = [get(f"cococon/probe/{t}/C_1") for t in TASKS]
        probe_c1 = [v for v in probe_c1 if not math.isnan(v)]
        out["probe/mean/C_1"] = float(np.mean(probe_c1)) if probe_c1 else math.nan
    for word in probe_words(flat):  # each probed concept on its own
        out[f"probe/{word}/caption/acc@1"] = get(f"cococon/probe/{word}/caption/acc@1")
        for t in TASKS:
            out[f"probe/{word}/{t}/C_1"] = get(f"cococon/probe/{word}/{t}/C_1")
            out[f"probe/{word}/{t}/acc@1"] = get(f"cococon/probe/{word}/{t}/acc@1")
    return out


def probe_words(flat: dict[str, Any]) -> list[str]:
    """The concepts probed one by one (``cococon/probe/<word>/num_samples``), in logged order."""
    return [k.split("/")[2] for k in flat if k.startswith("cococon/probe/") and k.count("/") == 3
            and k.endswith("/num_samples")]


def paired_interval(diffs: Sequence[float], level: float = 0.95) -> dict[str, float]:
    """Mean of paired differences and its Student-t interval (see the module docstring)."""
    from scipy import stats

    d = np.asarray([x for x in diffs if not math.isnan(x)], dtype=float)
    n = int(d.size)
    if n == 0:
        return {"mean": math.nan, "low": math.nan, "high": math.nan, "n": 0}
    mean = float(d.mean())
    if n < 2:
        return {"mean": mean, "low": math.nan, "high": math.nan, "n": n}
    half = float(stats.t.ppf((1 + level) / 2, n - 1) * d.std(ddof=1) / math.sqrt(n))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n}


def _mean_std(values: Sequence[float]) -> dict[str, float]:
    """Mean and sample std (ddof 1) of the non-NaN values; NaN where too few are left."""
    v = np.asarray([x for x in values if not math.isnan(x)], dtype=float)
    return {"mean": float(v.mean()) if v.size else math.nan,
            "std": float(v.std(ddof=1)) if v.size > 1 else math.nan, "n": int(v.size)}


def summarize(runs: dict[str, dict[int, dict[str, float]]]) -> dict[str, Any]:
    """Per-method mean/std over seeds and paired differences against K (seeds both methods ran)."""
    summary: dict[str, Any] = {"methods": {}, "paired_vs_K": {}}
    for method, by_seed in runs.items():
        cols = sorted({c for r in by_seed.values() for c in r})
        summary["methods"][method] = {c: _mean_std([r.get(c, math.nan) for r in by_seed.values()]) for c in cols}
    base = runs.get("K", {})
    for method, by_seed in runs.items():
        if method == "K":
            continue
        seeds = sorted(set(by_seed) & set(base))
        cols = sorted({c for s in seeds for c in by_seed[s]})
        summary["paired_vs_K"][method] = {
            c: paired_interval([by_seed[s].get(c, math.nan) - base[s].get(c, math.nan) for s in seeds]) for c in cols
        }
    return summary


def _fmt(stat: dict[str, float], digits: int) -> str:
    if math.isnan(stat["mean"]):
        return "–"
    std = "" if math.isnan(stat["std"]) else f" ± {stat['std']:.{digits}f}"
    return f"{stat['mean']:.{digits}f}{std}"


def _fmt_diff(stat: dict[str, float], digits: int) -> str:
    if math.isnan(stat["mean"]):
        return "–"
    if math.isnan(stat["low"]):
        return f"{stat['mean']:+.{digits}f}"
    return f"{stat['mean']:+.{digits}f} [{stat['low']:+.{digits}f}, {stat['high']:+.{digits}f}]"


def markdown(summary: dict[str, Any], seeds: Sequence[int], overrides: Sequence[str]) -> str:
    cols = [("mean/C_1", "mean C₁", 1)]
    for t in TASKS:
        cols += [(f"{t}/C_1", f"{TASK_LABELS[t]} C₁", 1), (f"{t}/rho", f"{TASK_LABELS[t]} ρ", 3),
                 (f"{t}/acc@1", f"{TASK_LABELS[t]} acc@1", 1), (f"{t}/generative", f"{TASK_LABELS[t]} gen. acc", 1)]
    cols.append(("caption/acc@1", "caption acc@1", 1))
    if any("probe/caption/acc@1" in s for s in summary["methods"].values()):
        cols += [("probe/caption/acc@1", "probe caption acc@1", 1), ("probe/mean/C_1", "probe mean C₁", 1)]
    lines = [
        "# CocoCon Table 2 on this setup: " + " vs ".join(summary["methods"]),
        "",
        f"Seeds {list(seeds)}; common overrides: `{' '.join(overrides) or '(none)'}`. "
        "Mean ± std over seeds; C₁, acc in %. Paired differences against K: mean [95% t-interval].",
        "",
        "| method | " + " | ".join(label for _, label, _ in cols) + " |",
        "| --- | " + " | ".join("---:" for _ in cols) + " |",
    ]
    for method, stats_ in summary["methods"].items():
        cells = [_fmt(stats_.get(c, {"mean": math.nan, "std": math.nan}), d) for c, _, d in cols]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    for method, diffs in summary["paired_vs_K"].items():
        cells = [_fmt_diff(diffs.get(c, {"mean": math.nan, "low": math.nan}), d) for c, _, d in cols]
        lines.append(f"| {method} − K | " + " | ".join(cells) + " |")
    lines += ["", "Training-batch ρ per task (captioning vs the task, hard ranks, on the consistency steps' "
              "rows): last epoch's mean − first epoch's mean; for K from a gradient-free scoring of the same "
              "rows.", "",
              "| method | " + " | ".join(f"{TASK_LABELS[t]} train ρ rise" for t in TASKS) + " |",
              "| --- | " + " | ".join("---:" for _ in TASKS) + " |"]
    for method, stats_ in summary["methods"].items():
        cells = [_fmt(stats_.get(f"train_rho/{t}/rise", {"mean": math.nan, "std": math.nan}), 3) for t in TASKS]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    for method, diffs in summary["paired_vs_K"].items():
        cells = [_fmt_diff(diffs.get(f"train_rho/{t}/rise", {"mean": math.nan, "low": math.nan}), 3) for t in TASKS]
        lines.append(f"| {method} − K | " + " | ".join(cells) + " |")
    words = sorted({c.split("/")[1] for s in summary["methods"].values() for c in s
                    if c.startswith("probe/") and c.endswith("/caption/acc@1") and c.count("/") == 3})
    if words:
        probe_cols = [("caption/acc@1", "caption acc@1")] + [
            (f"{t}/{m}", f"{TASK_LABELS[t]} {label}") for t in TASKS for m, label in (("C_1", "C₁"), ("acc@1", "acc@1"))]
        lines += ["", "Probed concepts (the samples whose gold answer names the concept; a knowledge-gap world "
                  "hides each from one task's training rows):", "",
                  "| concept | method | " + " | ".join(label for _, label in probe_cols) + " |",
                  "| --- | --- | " + " | ".join("---:" for _ in probe_cols) + " |"]
        for word in words:
            for method, stats_ in summary["methods"].items():
                cells = [_fmt(stats_.get(f"probe/{word}/{c}", {"mean": math.nan, "std": math.nan}), 1) for c, _ in probe_cols]
                lines.append(f"| {word} | {method} | " + " | ".join(cells) + " |")
            for method, diffs in summary["paired_vs_K"].items():
                cells = [_fmt_diff(diffs.get(f"probe/{word}/{c}", {"mean": math.nan, "low": math.nan}), 1)
                         for c, _ in probe_cols]
                lines.append(f"| {word} | {method} − K | " + " | ".join(cells) + " |")
    lines += ["", "C_k per task (mean over seeds):", "",
              "| method | task | " + " | ".join(f"C_{k}" for k in range(1, MAX_K + 1)) + " |",
              "| --- | --- | " + " | ".join("---:" for _ in range(MAX_K)) + " |"]
    for method, stats_ in summary["methods"].items():
        for t in TASKS:
            cells = [_fmt(stats_.get(f"{t}/C_{k}", {"mean": math.nan, "std": math.nan}), 1) for k in range(1, MAX_K + 1)]
            lines.append(f"| {method} | {TASK_LABELS[t]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> None:
    """Two panels: C_1 and acc@1 per task, one bar per method, ±std error bars (a matplotlib
    ``Figure`` saved directly: no pyplot state, the caller's backend left alone)."""
    from matplotlib.figure import Figure

    methods = list(summary["methods"])
    fig = Figure(figsize=(10, 3.6))
    axes = fig.subplots(1, 2)
    width = 0.8 / max(len(methods), 1)
    x = np.arange(len(TASKS))
    for ax, (metric, title) in zip(axes, (("C_1", "C₁ (%)"), ("acc@1", "task acc@1 (%)"))):
        for i, method in enumerate(methods):
            stats_ = summary["methods"][method]
            means = [stats_.get(f"{t}/{metric}", {}).get("mean", math.nan) for t in TASKS]
            stds = [np.nan_to_num(stats_.get(f"{t}/{metric}", {}).get("std", math.nan)) for t in TASKS]
            ax.bar(x + (i - (len(methods) - 1) / 2) * width, means, width, yerr=stds, capsize=3, label=method)
        ax.set_xticks(x, [TASK_LABELS[t] for t in TASKS])
        ax.set_title(title)
        ax.set_ylim(0, 115)  # headroom above 100 for the legend
    axes[0].legend(loc="upper center", ncol=len(methods), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_prefix(out: Path) -> str:
    """The start of the experiment's run names: the basename of ``out`` and a hash of its resolved
    path (``a/exp`` and ``b/exp`` give different names)."""
    resolved = Path(out).resolve()
    return f"{resolved.name}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:8]}"


def _training_args(args: Sequence[str]) -> list[str]:
    """A run's arguments without its ``name=`` and W&B group, which do not change what it trains."""
    return [a for a in args if not a.startswith(("name=", "logger.group="))]


def claim_run_folder(run_dir: Path, claim: Path) -> None:
    """Make ``run_dir`` this experiment's before it trains there with ``overwrite=true``: a folder
    that does not exist yet is claimed (``claim`` records its resolved path), one that ``claim``
    already names is the experiment's own (an interrupted run); any other existing folder is refused."""
    target = str(Path(run_dir).resolve())
    mine = claim.is_file() and claim.read_text().strip() == target
    if run_dir.exists() and not mine:
        raise UserError(f"run folder {run_dir} exists and was not created by this experiment (no {claim}); "
                        "table2 does not overwrite it: move it away or give another --out")
    claim.write_text(target + "\n")


def run_experiment(out: Path, seeds: Sequence[int], methods: Sequence[str], overrides: Sequence[str],
                   train_fn=None) -> dict[str, Any]:
    """Train (or reuse) every (method, seed) run, then write table2.json / .md / .png under ``out``."""
    # lazy: pulls in torch, not needed by unicon experiment table2 --help or a table of finished runs
    from unicon.training.run import compose_run, train_from_overrides

    train_fn = train_fn or train_from_overrides
    out = Path(out)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise UserError(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    if not seeds:
        raise UserError("give at least one seed (--seeds 0 1 2)")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    try:
        (out / "runs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create the folder ({e.strerror})") from None
    prefix = run_prefix(out)
    # W&B groups the experiment's runs, unless the overrides name a group
    group = [] if any(o.startswith("logger.group=") for o in overrides) else [f"logger.group={prefix}"]
    runs: dict[str, dict[int, dict[str, float]]] = {m: {} for m in methods}
    records = []
    for seed in seeds:
        for method in methods:
            record_file = out / "runs" / f"{method}-seed{seed}.json"
            name = f"{prefix}_{method}_seed{seed}"
            args = [*METHODS[method], f"seed={seed}", f"name={name}", *group, "overwrite=true", *overrides]
            if record_file.is_file():
                record = read_json(record_file, what="table2 run record")
                if _training_args(record.get("args", [])) != _training_args(args):
                    raise UserError(f"{record_file} was trained with other arguments ({' '.join(record.get('args', []))}); "
                                    f"delete it to retrain, or give another --out")
            else:
                cfg = compose_run(args, announce=False)
                claim_run_folder(Path(cfg.output_dir) / cfg.name, out / "runs" / f"{method}-seed{seed}.claim")
                print(f"[table2] {method} seed {seed}: unicon train {' '.join(args)}", flush=True)
                result = train_fn(args)
                flat = run_metrics(Path(result["run_dir"]) / "metrics.jsonl")
                record = {"method": method, "seed": seed, "args": args, "run_dir": result["run_dir"],
                          "global_step": result.get("global_step"), "cococon": flat,
                          "train_rho": training_rho(Path(result["run_dir"]) / "metrics.jsonl")}
                record_file.write_text(jsonsafe.dumps(record, indent=2) + "\n")
            runs[method][seed] = summarize_run(record["cococon"], record.get("train_rho"))
            records.append(record)
    summary = summarize(runs)
    # strict JSON: a statistic that cannot be computed (one seed's interval, an absent column) is null
    (out / "table2.json").write_text(jsonsafe.dumps(
        {"seeds": list(seeds), "methods": list(methods), "overrides": list(overrides), "runs": records,
         "summary": summary}, indent=2, default=lambda v: None) + "\n")
    (out / "table2.md").write_text(markdown(summary, seeds, overrides))
    plot(summary, out / "table2.png")
    return summary


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="unicon experiment table2",
        description="CocoCon Table 2 rows K (continued pretraining), M (soft-rank Spearman), M_paper and hinge, "
                    "from one checkpoint across seeds, with paired 95% intervals against K.",
        epilog="example: unicon experiment table2 --seeds 0 1 2 --out results/table2 -- "
               "init_from=checkpoints/shapes_base",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="seeds; each one is shared by every method (data order and gamma draws)")
    p.add_argument("--methods", nargs="+", default=["K", "M", "M_paper"], choices=list(METHODS),
                   help="rows to run (K is the baseline of the paired differences)")
    p.add_argument("--out", type=Path, default=Path("results/table2"),
                   help="folder for runs/<method>-seed<s>.json and table2.json/.md/.png (finished runs are reused)")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run (after --)")
    args = p.parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise UserError(f"override {bad[0]!r} is not key=value")
    summary = run_experiment(args.out, args.seeds, args.methods, args.overrides)
    print(json.dumps({m: {k: v for k, v in d.items() if k == "mean/C_1"} for m, d in summary["paired_vs_K"].items()}))
    print(f"wrote {args.out / 'table2.md'}, {args.out / 'table2.json'}, {args.out / 'table2.png'}")
    return 0
